"""Shared builders for the TRL suite: a tiny random Llama saved to disk, a char tokenizer, a dense reward, one batch.

Everything is local (no hub). The reference model of a full fine-tune is reloaded by TRL from the saved directory,
so the policy is perturbed after construction to make pi != pi_ref (otherwise every KL gradient is zero).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import tempfile  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# trl 1.15.0 computes every log-prob with its Triton kernels (trl/kernels/chunked_logprob.py; 1.14.x and 1.16.0 have a
# torch path). Without a GPU, Triton's interpreter runs those kernels on the CPU (envs/trl-1.15.0.txt installs triton);
# set before trl is imported, inert where Triton is not installed.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from datasets import Dataset  # noqa: E402

from kl_adapters.tiny_models import save_tiny_model  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)


def reward_a(completions, **kwargs):
    """Dense toy reward: the fraction of 'a' characters (plus a small length term so groups rarely tie)."""
    return [c.count("a") / max(len(c), 1) + 0.01 * len(c) for c in completions]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def dataset():
    return Dataset.from_dict({"prompt": [f"q{i}: say a" for i in range(64)]})


def grpo_args(config_cls=None, **overrides):
    """KLGRPOConfig (kl_preset="sequence" unless overridden), or `config_cls` (e.g. TRL's own GRPOConfig)."""
    from kl_adapters.adapters.trl import KLGRPOConfig

    kwargs = dict(output_dir=tempfile.mkdtemp(prefix="grpo_"), use_cpu=True, per_device_train_batch_size=4,
                  num_generations=4, max_completion_length=8, beta=0.1, learning_rate=1e-3, max_steps=2,
                  logging_steps=1, report_to="none", save_strategy="no", seed=0, gradient_checkpointing=False,
                  bf16=False)  # float32: identities hold to float tolerance (bf16 has its own test)
    if config_cls is None:
        config_cls, kwargs["kl_preset"] = KLGRPOConfig, "sequence"
    kwargs.update(overrides)
    return config_cls(**kwargs)


def logged(trainer, key):
    """Every value of `key` in the trainer's log history, in order."""
    return [r[key] for r in trainer.state.log_history if key in r]


def replayed_budget(betas, seq_kl, target, start):
    """kl_adapters.budget.KLBudget replayed over a run's logged per-step sequence KL: each logged beta must be the
    controller's value at its step; returns the replay (its beta is the next step's)."""
    from kl_adapters.budget import KLBudget

    replay = KLBudget(target, start)
    for beta, kl in zip(betas, seq_kl):
        assert beta == pytest.approx(replay.beta, rel=1e-6)
        replay.observe(kl, 1)
        replay.update()
    return replay


def make_trainer(model_dir, dataset, *, trainer_cls=None, args=None, peft_config=None, **overrides):
    from trl import GRPOTrainer

    trainer_cls = trainer_cls or GRPOTrainer
    return trainer_cls(model=model_dir, reward_funcs=reward_a, args=args or grpo_args(**overrides),
                       train_dataset=dataset, peft_config=peft_config)


@torch.no_grad()
def perturb(model, scale=0.3, seed=0, only_trainable=True):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad or not only_trainable:
            p.add_(scale * p.abs().mean().clamp(min=1e-2) * torch.randn(p.shape, generator=gen))


def one_batch(trainer):
    """The real prepared micro-batch TRL trains on: generation, rewards, advantages, ref log-probs."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # as Trainer.train() sets
    torch.manual_seed(0)
    generation_batch = next(iter(trainer.get_train_dataloader()))
    return trainer._prepare_inputs(generation_batch)


def policy_logps(trainer, batch):
    """log pi_theta of the completion tokens, with gradient, from TRL's own forward."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    return trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask,
                                                      batch["completion_ids"].size(1))[0]


def completion_logits(lm, batch, temperature):
    """[B, T, V] next-token logits / temperature of the completion tokens (the model's own, unfused forward)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    horizon = batch["completion_ids"].shape[1]
    return lm(input_ids=input_ids, attention_mask=attention_mask).logits[:, -horizon - 1:-1] / temperature


def eos_ids_by_hand(trainer):
    """The ids that end a completion, read from TRL's processing class and the model's generation config: trl >= 1.14.2
    stops at the tokenizer's eos and every generation-config eos id; 1.14.0 / 1.14.1 at the tokenizer's alone."""
    from importlib.metadata import version

    from packaging.version import Version

    ids = {trainer.processing_class.eos_token_id}
    config_ids = trainer.model.generation_config.eos_token_id
    if Version(version("trl")) >= Version("1.14.2") and config_ids is not None:
        ids |= {config_ids} if isinstance(config_ids, int) else set(config_ids)
    return sorted(ids)


def eos_by_hand(trainer, batch):
    """EndOfSequence of the trainer's current policy on the batch from a separate full-logits forward:
    softmax(logits / temperature) summed over the EOS ids (float64), y_t among them, horizon max_completion_length."""
    from kl_adapters import EndOfSequence

    ids = eos_ids_by_hand(trainer)
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        prob = torch.softmax(completion_logits(trainer.model, batch, trainer.temperature).double(), -1)[..., ids]
    is_eos = torch.isin(batch["completion_ids"], torch.tensor(ids, device=mask.device)) & mask
    return EndOfSequence(torch.where(mask, prob.sum(-1), 0.0).float(), is_eos, trainer.max_completion_length)


def groups_by_hand(batch):
    """[B] prompt ids of the batch's rows: rows with the same prompt tokens are one GRPO group (distinct prompts)."""
    return torch.unique(batch["prompt_ids"], dim=0, return_inverse=True)[1]


def same_groups(a, b):
    """Whether two [B] id tensors partition the rows alike (labels may differ)."""
    return torch.equal(a[:, None] == a[None, :], b[:, None] == b[None, :])


def statistics_inputs_by_hand(trainer, batch, preset, beta):
    """What the reduced presets' statistics are fitted with, from the batch by hand: TRL's advantages with its beta
    (normalized unless scale_rewards="none"), the prompt groups and the policy's EOS probabilities; {} for a preset
    without statistics."""
    from kl_adapters import TaskAdvantages
    from kl_adapters.presets import get_preset

    if not get_preset(preset).uses_batch_statistics:
        return {}
    task = TaskAdvantages(batch["advantages"], beta, normalized=trainer.args.scale_rewards != "none")
    return {"task": task, "group": groups_by_hand(batch), "eos": eos_by_hand(trainer, batch)}


def flat_grad(trainer, loss_fn):
    """Flattened parameter gradient of loss_fn() (a fresh backward)."""
    trainer.model.zero_grad(set_to_none=True)
    loss_fn().backward()
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
