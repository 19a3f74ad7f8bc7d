"""Builders shared by the verl suite (also imported inside Ray workers): a tiny random Llama built from a config (no
model hub), a ragged batch in the layout verl's engines hand to `ppo_loss`, and gradient helpers.

Log-probs come from the model itself, in the engines' no-padding layout ("log_probs" over every real token of
prompt + response), so `ppo_loss` runs its own `no_padding_2_padding` on them.
"""

from __future__ import annotations

import copy
import importlib.metadata

import torch
import torch.nn.functional as F

VOCAB, B, P, R = 64, 8, 4, 6
#: the tiny models' end-of-sequence id (LlamaConfig's eos_token_id; engine_check's tokenizer names it too)
EOS_ID = 2
#: verl/__init__ loads the ``verl.plugins`` entry points from 0.9.0 on; in verl 0.8.0 only KL_ADAPTERS or
#: ``actor_rollout_ref.model.external_lib=kl_adapters.adapters.verl_plugin`` bring the adapter into a process
LOADS_ENTRY_POINTS = importlib.metadata.version("verl") != "0.8.0"


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float().train()


@torch.no_grad()
def perturbed(model, scale: float, seed: int):
    """A copy of `model` with every weight moved by scale * N(0, 1) * mean|w| (a policy != the original)."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    for p in other.parameters():
        p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return other


def make_tokens(seed: int = 0, batch: int = B):
    """prompts [B, P], responses [B, R] (zero past each ragged length; a response shorter than R ends with EOS_ID, as
    a rollout's does), attention_mask [B, P + R], response_mask."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, VOCAB, (batch, P), generator=gen)
    lengths = torch.randint(1, R + 1, (batch,), generator=gen)
    lengths[0] = R  # at least one full-length response
    response_mask = (torch.arange(R)[None] < lengths[:, None]).long()
    responses = torch.randint(3, VOCAB, (batch, R), generator=gen) * response_mask
    last = (torch.arange(R)[None] == lengths[:, None] - 1) & (lengths[:, None] < R)
    responses = torch.where(last, EOS_ID, responses)
    attention_mask = torch.cat([torch.ones(batch, P, dtype=torch.long), response_mask], 1)
    return {"prompts": prompts, "responses": responses, "attention_mask": attention_mask,
            "response_mask": response_mask}


def flat_log_probs(model, tokens) -> torch.Tensor:
    """log p(x_{t+1} | x_<=t) over the real tokens, flattened: the engines' model_output["log_probs"]."""
    return flat_outputs(model, tokens)["log_probs"]


def flat_outputs(model, tokens) -> dict[str, torch.Tensor]:
    """One forward's model_output as the adapter's FSDP-engine hook makes it under a reduced preset: "log_probs" and,
    in the same flattened layout, pi(EOS_ID | x_<=t) (softmax of the logits, detached) and whether x_{t+1} is EOS_ID."""
    from kl_adapters.adapters.verl import EOS_PROB, IS_EOS

    ids = torch.cat([tokens["prompts"], tokens["responses"]], 1)
    attn = tokens["attention_mask"]
    log_pi = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float().log_softmax(-1)
    outputs = {"log_probs": log_pi.gather(2, ids[:, 1:, None]).squeeze(-1), EOS_PROB: log_pi[..., EOS_ID].detach().exp(),
               IS_EOS: ids[:, 1:] == EOS_ID}
    return {key: F.pad(x, (0, 1))[attn.bool()] for key, x in outputs.items()}


def padded(flat: torch.Tensor, tokens) -> torch.Tensor:
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(flat, tu.get_tensordict(
        {k: tokens[k] for k in ("prompts", "responses", "attention_mask")}))


def ppo_data(tokens, *, old_log_probs, ref_log_prob, advantages, rollout_is_weights=None, batch_num_tokens=None,
             global_batch_size=None, dp_size: int = 1):
    """The TensorDict verl's engine passes to ppo_loss (global batch info as non-tensor entries)."""
    from verl.utils import tensordict_utils as tu

    fields = {**tokens, "old_log_probs": old_log_probs, "ref_log_prob": ref_log_prob, "advantages": advantages}
    if rollout_is_weights is not None:
        fields["rollout_is_weights"] = rollout_is_weights
    mask = tokens["response_mask"]
    return tu.get_tensordict(fields, non_tensor_dict={
        "dp_size": dp_size,
        "batch_num_tokens": int(mask.sum()) if batch_num_tokens is None else batch_num_tokens,
        "global_batch_size": mask.shape[0] if global_batch_size is None else global_batch_size})


def actor_config(**overrides):
    from verl.workers.config import ActorConfig

    kwargs = dict(strategy="fsdp", rollout_n=4, ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=B,
                  use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.3, loss_agg_mode="token-mean")
    kwargs.update(overrides)
    return ActorConfig(**kwargs)


def flat_grad(loss: torch.Tensor, model) -> torch.Tensor:
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])


class Case:
    """One ppo_loss problem: a policy, a reference, a behaviour policy (off-policy unless on_policy) and one batch."""

    def __init__(self, *, seed: int = 0, on_policy: bool = False):
        self.model = tiny_llama(seed)
        self.tokens = make_tokens(seed)
        mask = self.tokens["response_mask"]
        with torch.no_grad():
            self.ref = padded(flat_log_probs(perturbed(self.model, 0.5, seed + 1), self.tokens), self.tokens)
            behaviour = self.model if on_policy else perturbed(self.model, 0.3, seed + 2)
            self.old = padded(flat_log_probs(behaviour, self.tokens), self.tokens)
        gen = torch.Generator().manual_seed(seed + 3)
        self.advantages = torch.randn(B, 1, generator=gen) * mask

    def log_probs(self):
        return flat_log_probs(self.model, self.tokens)

    def data(self, **kw):
        kw.setdefault("advantages", self.advantages)
        return ppo_data(self.tokens, old_log_probs=self.old, ref_log_prob=self.ref, **kw)

    def ppo_grad(self, config, *, eos: bool = False, uid=None, **data_kw):
        """Gradient of verl's ppo_loss (whatever is bound in verl.workers.utils.losses now), with its metrics.
        eos: model_output carries the end-of-sequence probabilities (`flat_outputs`); uid: verl's GRPO group column."""
        from verl.workers.utils import losses

        data = self.data(**data_kw)
        if uid is not None:
            data["uid"] = uid
        model_output = flat_outputs(self.model, self.tokens) if eos else {"log_probs": self.log_probs()}
        loss, metrics = losses.ppo_loss(config, model_output, data)
        return flat_grad(loss, self.model), loss.detach(), metrics

    def task(self, coef: float = 0.3, normalized: bool = True):
        """The task term the adapter hands the core on the loss path: the advantages, kl_loss_coef, and whether the
        driver's runtime_env says they are normalized (the default when it says nothing)."""
        from kl_adapters import TaskAdvantages

        return TaskAdvantages(self.advantages, coef, normalized=normalized)

    def eos(self):
        """EndOfSequence of the current policy on this batch, from the same forward as ppo_grad(eos=True), padded."""
        from kl_adapters import EndOfSequence
        from kl_adapters.adapters.verl import EOS_PROB, IS_EOS

        with torch.no_grad():
            outputs = flat_outputs(self.model, self.tokens)
        prob, is_eos = (padded(outputs[key].float(), self.tokens) for key in (EOS_PROB, IS_EOS))
        return EndOfSequence(prob, is_eos > 0.5, R)

    def reduced(self, preset: str, coef: float = 0.3) -> dict:
        """kl_surrogate's task for the presets with batch statistics ({} for the others): what ppo_loss alone passes."""
        from kl_adapters import get_preset

        return {"task": self.task(coef)} if get_preset(preset).uses_batch_statistics else {}

    def surrogate_grad(self, **kl_kwargs):
        """Gradient of kl_surrogate on the same padded tensors ppo_loss sees."""
        from kl_adapters import kl_surrogate

        lp = padded(self.log_probs(), self.tokens)
        mask = self.tokens["response_mask"].bool()
        return flat_grad(kl_surrogate(lp, self.ref, mask, old_logp=self.old, **kl_kwargs), self.model)


class LossWorker:
    """Body of a Ray actor (tests/verl/test_ray.py): in a fresh worker process, run verl's ppo_loss with the given
    kl_loss_type and report what was active there and how far the KL part of the gradient is from kl_surrogate."""

    def run(self, kl_loss_type: str, preset: str, coef: float = 0.3, *, external_lib: bool = False) -> dict:
        """external_lib: first import the plugin, as verl's workers do for ``model.external_lib``."""
        import os
        from pathlib import Path

        if external_lib:
            import kl_adapters.adapters.verl_plugin  # noqa: F401
        from verl.workers.utils import losses

        from kl_adapters import activation, per_sequence_beta

        case = Case(seed=0)
        flagged, _, metrics = case.ppo_grad(actor_config(kl_loss_type=kl_loss_type, kl_loss_coef=coef))
        task, _, _ = case.ppo_grad(actor_config(use_kl_loss=False))
        beta = per_sequence_beta(coef, case.tokens["response_mask"], "token-mean")
        kl = case.surrogate_grad(preset=preset, beta=beta, **case.reduced(preset, coef))
        return {"pid": os.getpid(), "active": str(activation.active()),
                "kl_adapters": str(Path(activation.__file__).resolve().parent),
                "patched": hasattr(losses.kl_penalty, "__kl_adapters_original__"),
                "kl_error": float((flagged - task - kl).norm() / kl.norm()),
                "metrics": sorted(k for k in metrics if k.startswith("kl_adapters/"))}
