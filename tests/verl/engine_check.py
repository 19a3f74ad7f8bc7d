"""verl's real actor update path -- TrainingWorker, FSDP2 engine, micro-batching, ppo_loss -- with the adapter's flag
in the actor config (``kl_loss_type=kl_adapters:sequence``), in one process (world size 1): gloo on CPU through the
test-only platform shim, or NCCL on CUDA. Run as a script by test_engine.py; prints one JSON line "RESULT{...}".

First, as verl's compute_log_prob does before an update, TrainingWorker.infer_batch with the actor's loss function set:
the end-of-sequence probabilities the adapter keeps from that forward (and those of the training forward, in
model_output) are compared with softmax(logits)[EOS] of a separate plain transformers forward.
Check: one SGD step (lr 1, no weight decay, no clipping) from the same initial weights, once with the patched
ppo_loss and once with an oracle loss = verl's ppo_loss without KL + kl_surrogate(beta = per_sequence_beta(coef, mask,
"token-mean", num_tokens=<verl's global token count>)) per micro-batch, for the reduced presets with statistics =
kl_statistics(old, ref, mask, task=TaskAdvantages(advantages, coef, normalized=True), eos=EndOfSequence(the separate
forward's pi(EOS), responses == EOS, R)) of the whole batch and each micro-batch's eos; the parameter updates (= the
gradients) must agree. Then a few AdamW steps with the flag, reporting verl's and kl-adapters' metrics.
"""

import argparse
import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
parser = argparse.ArgumentParser()
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--preset", default="sequence")
parser.add_argument("--remove-padding", action="store_true", help="actor_rollout_ref.model.use_remove_padding=True: "
                    "the engine packs each micro-batch into one row (transformers masks attention per sequence)")
parser.add_argument("--lora", action="store_true", help="actor_rollout_ref.model.lora_rank=4 (q_proj, v_proj): the "
                    "policy is the LoRA-wrapped model, the reference its adapter-disabled base (no_lora_adapter)")
parser.add_argument("--dynamic-bsz", action="store_true", help="actor.use_dynamic_bsz=True: micro-batches by a token "
                    "budget (max_token_len_per_gpu) instead of a row count")
args = parser.parse_args()
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(29500 + os.getpid() % 1000))
if args.device == "cpu":
    os.environ["VERL_PLATFORM"] = "cpu"

from functools import partial  # noqa: E402

import torch  # noqa: E402

if args.device == "cpu":
    import cpu_platform_shim  # noqa: E402,F401

from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import (  # noqa: E402
    FSDPActorConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    TrainingWorkerConfig,
)
from verl.workers.engine_workers import TrainingWorker  # noqa: E402
from verl.workers.utils import losses  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402
from verl_cases import EOS_ID, R, VOCAB, make_tokens, tiny_llama  # noqa: E402

from kl_adapters import (  # noqa: E402
    EndOfSequence,
    TaskAdvantages,
    get_preset,
    kl_statistics,
    kl_surrogate,
    per_sequence_beta,
)
from kl_adapters.adapters import verl as verl_adapter  # noqa: E402
from kl_adapters.adapters.verl import loss as verl_loss  # noqa: E402
from kl_adapters.adapters.verl.state import EOS_ROWS  # noqa: E402

COEF, MINI, MICRO = 0.5, 8, 4
#: token budget of a dynamic micro-batch: 1024 is all rows in one; with --dynamic-bsz a smaller one splits the batch
MAX_TOKENS = 24 if args.dynamic_bsz else 1024


def save_model(path):
    tiny_llama(seed=0).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)


def build_worker(path, optimizer: str, lr: float):
    lora = {"lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]} if args.lora else {}
    model = HFModelConfig(path=path, use_remove_padding=args.remove_padding, **lora,
                          enable_gradient_checkpointing=False,
                          override_config={"attn_implementation": "eager"})
    engine = FSDPEngineConfig(strategy="fsdp2", param_offload=False, optimizer_offload=False, dtype="float32",
                              micro_batch_size_per_gpu=MICRO, infer_micro_batch_size_per_gpu=MICRO,
                              use_dynamic_bsz=args.dynamic_bsz, max_token_len_per_gpu=MAX_TOKENS,
                              infer_max_token_len_per_gpu=MAX_TOKENS,
                              use_torch_compile=False,
                              # float32 compute (verl's default is bf16), so that the engine's log-probs and
                              # end-of-sequence probabilities match a separate float32 transformers forward to ~1e-6
                              mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"})
    optim = FSDPOptimizerConfig(optimizer=optimizer, lr=lr, weight_decay=0.0, clip_grad=1e9, total_training_steps=10)
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=engine,
                                                 optimizer_config=optim, checkpoint_config=CheckpointConfig()))
    reset(worker)
    return worker


def reset(worker):
    """worker.reset(): the initial weights again, and the same LoRA initialisation (its A matrices are random)."""
    torch.manual_seed(0)
    worker.reset()


def actor_config(kl_loss_type, use_kl_loss=True):
    return FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=MICRO,
                           use_kl_loss=use_kl_loss, kl_loss_type=kl_loss_type, kl_loss_coef=COEF,
                           use_dynamic_bsz=args.dynamic_bsz, ppo_max_token_len_per_gpu=MAX_TOKENS,
                           use_torch_compile=False)


tokens = make_tokens(seed=0)


def batch(**extra):
    t = tokens
    td = tu.get_tensordict({"prompts": t["prompts"], "responses": t["responses"],
                            "input_ids": torch.cat([t["prompts"], t["responses"]], 1),
                            "attention_mask": t["attention_mask"],
                            "position_ids": (t["attention_mask"].cumsum(1) - 1).clamp(min=0),
                            "response_mask": t["response_mask"], **extra})
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0)
    return td


def log_probs(worker, no_lora_adapter=False):
    """compute_log_prob's forward (TrainingWorker.infer_batch): the padded log-probs of the responses; with
    no_lora_adapter, compute_ref_log_prob's pass through a LoRA actor (its adapter disabled: the base model)."""
    td = batch()
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False, no_lora_adapter=no_lora_adapter)
    return no_padding_2_padding(tu.get(worker.infer_batch(td), "log_probs"), td).float().cpu()


def separate_eos(path):
    """pi(EOS | y_<t) at every response position from a plain transformers forward of the saved model, float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64, attn_implementation="eager")
    ids = torch.cat([tokens["prompts"], tokens["responses"]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=tokens["attention_mask"]).logits
    prob = logits.softmax(-1)[:, -R - 1:-1, EOS_ID]  # position P - 1 + t predicts response token t
    return (prob * tokens["response_mask"]).float(), (tokens["responses"] == EOS_ID) & tokens["response_mask"].bool()


def primed_eos(worker, loss_fn, path):
    """As ActorRolloutRefWorker.init_model: the flagged loss set before compute_log_prob's forward, which keeps pi(EOS)
    for the next update. Returns that forward's log-probs, the EndOfSequence of a separate float64 forward
    (`separate_eos`) and the largest |kept - separate| pi(EOS) (None: nothing kept)."""
    worker.set_loss_fn(loss_fn)
    log_probs(worker)
    eos_prob, is_eos = separate_eos(path)
    kept = verl_loss._stored_eos(batch(), R)  # what the update will find (emptied: filled again below)
    kept_error = None if kept is None else float((kept.prob.cpu() - eos_prob).abs().max())
    assert kept is None or torch.equal(kept.is_eos.cpu(), is_eos)
    return log_probs(worker), EndOfSequence(eos_prob, is_eos, R), kept_error


def capturing(config):
    """partial(ppo_loss, config=...) as verl's worker builds it, recording model_output's EOS_PROB per micro-batch."""
    captured = []

    def loss(config, model_output, data, dp_group=None):
        prob = no_padding_2_padding(model_output[verl_adapter.EOS_PROB], data).detach().cpu()
        captured.append((data[verl_loss._ROW].cpu(), prob))
        return losses.ppo_loss(config, model_output, data, dp_group)

    return partial(loss, config=config), captured


def train(worker, loss_fn, old, ref, adv):
    worker.set_loss_fn(loss_fn)
    td = batch(old_log_probs=old, ref_log_prob=ref, advantages=adv)
    tu.assign_non_tensor(td, global_batch_size=MINI, mini_batch_size=MINI, epochs=1, dp_size=1)
    output = worker.train_mini_batch(td)  # None where verl returns nothing: Ulysses ranks after a group's first
    return None if output is None else tu.get(output, "metrics")


def params(worker):
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().cpu().double()
                      for p in worker.engine.module.parameters()])


def oracle(config_without_kl, preset, old, ref, adv, eos):
    """verl's ppo_loss without KL, plus kl_surrogate with verl's global token count (one micro-batch at a time) and,
    for the reduced presets, the rows' statistics of the whole batch: kl_statistics(old, ref, mask, task, eos) of all
    B rows, and the rows' eos (the policy is the initial one at every micro-batch: one SGD step). eos None: statistics
    and loss without it. Each micro-batch row is found in the batch by its behaviour log-probs (independently of the
    adapter's row tags)."""
    upstream = losses.ppo_loss.__kl_adapters_original__
    reduced = get_preset(preset).uses_batch_statistics
    statistics = kl_statistics(old, ref, tokens["response_mask"].bool(), task=TaskAdvantages(adv, COEF, True),
                               eos=eos) if reduced else None

    def loss_fn(model_output, data, dp_group=None):
        loss, metrics = upstream(config_without_kl, model_output, data, dp_group)
        lp = no_padding_2_padding(model_output["log_probs"], data)
        td = data.select("response_mask", "old_log_probs", "ref_log_prob").to_padded_tensor()
        mask = td["response_mask"].bool()
        beta = per_sequence_beta(COEF, mask, "token-mean", num_tokens=data["batch_num_tokens"] / data["dp_size"])
        width = mask.shape[1]
        rows = (td["old_log_probs"][:, None].cpu() == old[None, :, :width]).all(-1).float().argmax(1)
        kl_kwargs = {} if not reduced else {
            "statistics": statistics[rows].with_width(width).to(lp.device),
            "eos": None if eos is None else EndOfSequence(eos.prob[rows, :width].to(lp.device),
                                                          eos.is_eos[rows, :width].to(lp.device), R)}
        return loss + kl_surrogate(lp, td["ref_log_prob"], mask, preset=preset, beta=beta,
                                   old_logp=td["old_log_probs"], **kl_kwargs), metrics

    return loss_fn


def lora_reference(worker, initial):
    """After an update of the LoRA actor (its B matrices start at 0, so `initial` = its first log-probs = the base
    model's): compute_ref_log_prob's pass through the actor (no_lora_adapter) still gives the base model's log-probs
    while the policy's moved, and it leaves the pi(EOS) rows kept from the actor's own pass untouched."""
    policy = log_probs(worker)
    kept = dict(EOS_ROWS.rows)
    reference = log_probs(worker, no_lora_adapter=True)
    same_rows = kept.keys() == EOS_ROWS.rows.keys() and all(
        all(torch.equal(a, b) for a, b in zip(kept[k], EOS_ROWS.rows[k])) for k in kept)
    return {"lora_reference_error": float((reference - initial).abs().max()),
            "lora_policy_moved": float((policy - initial).abs().max()),
            "lora_kept_eos_rows": len(kept) if same_rows else -1}


def flag_off_is_upstream(worker, theta0, old, ref, adv) -> bool:
    """With verl's own kl_loss_type, compute_log_prob's outputs (every key and value) and one update's weights are
    the same as with the adapter unpatched (last: it unpatches)."""
    native = partial(losses.ppo_loss, config=actor_config("low_var_kl"))
    outputs, weights = [], []
    for patched in (True, False):
        if not patched:
            verl_adapter.unpatch()
        reset(worker)
        worker.set_loss_fn(native)
        td = batch()
        tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
        out = worker.infer_batch(td)
        outputs.append({k: out[k].values() for k in out.keys() if k != "metrics"})
        train(worker, native, old, ref, adv)
        weights.append(params(worker))
    same_outputs = outputs[0].keys() == outputs[1].keys() and all(
        torch.equal(outputs[0][k], outputs[1][k]) for k in outputs[0])
    return same_outputs and torch.equal(*weights) and not torch.equal(weights[0], theta0)


def main():
    if args.device == "cuda":
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=0, world_size=1)
    path = tempfile.mkdtemp(prefix="tiny_llama_")
    save_model(path)
    worker = build_worker(path, "SGD", 1.0)
    mask = tokens["response_mask"]
    gen = torch.Generator().manual_seed(1)
    flagged_loss, captured = capturing(actor_config(f"kl_adapters:{args.preset}"))
    current, eos, kept_error = primed_eos(worker, flagged_loss, path)
    old = (current + 0.3 * torch.randn(current.shape, generator=gen)) * mask  # a behaviour policy != pi_theta
    ref = (current + 0.5 * torch.randn(current.shape, generator=gen)) * mask
    adv = torch.randn(mask.shape[0], 1, generator=gen) * mask

    theta0 = params(worker)
    rows_in = []  # the leading size of each input_ids the model sees in the flagged update: 1 when packed
    hook = worker.engine.module.register_forward_pre_hook(
        lambda module, a, kw: rows_in.append(int(kw["input_ids"].shape[0])), with_kwargs=True)
    flagged = train(worker, flagged_loss, old, ref, adv)
    hook.remove()
    lora = lora_reference(worker, current) if args.lora else {}
    step_flagged = theta0 - params(worker)
    training_eos = torch.zeros_like(eos.prob)
    for rows, prob in captured:  # the first update's micro-batches, at the initial weights
        training_eos[rows, :prob.shape[1]] = prob
    steps, metrics = {}, {}
    for name, loss_eos in (("oracle", eos), ("oracle_without_eos", None)):
        reset(worker)  # reload the initial weights
        assert torch.equal(params(worker), theta0)
        metrics[name] = train(worker, oracle(actor_config("low_var_kl", use_kl_loss=False), args.preset, old, ref,
                                             adv, loss_eos), old, ref, adv)
        steps[name] = theta0 - params(worker)
    reference, step_oracle = metrics["oracle"], steps["oracle"]
    reset(worker)
    train(worker, partial(losses.ppo_loss, config=actor_config("low_var_kl", use_kl_loss=False)),
                      old, ref, adv)
    step_task = theta0 - params(worker)

    adam = build_worker(path, "AdamW", 1e-2)
    history = []
    for _ in range(args.steps):
        m = train(adam, partial(losses.ppo_loss, config=actor_config(f"kl_adapters:{args.preset}")), old, ref, adv)
        history.append({k: m[k] for k in ("loss", "grad_norm", "kl_loss", "kl_adapters/seq_kl",
                                          "kl_adapters/grad_weight_gap", "kl_adapters/is_ess") if k in m})
    kl_part = step_oracle - step_task
    result = {
        "flag_off_equal": flag_off_is_upstream(worker, theta0, old, ref, adv),
        "kept_eos_error": kept_error,  # compute_log_prob's forward vs the separate one (None: nothing kept)
        "training_eos_error": float((training_eos - eos.prob).abs().max()),
        "eos_effect": float((steps["oracle_without_eos"] - step_oracle).norm() / kl_part.norm()),
        "kl_rel_error": float((step_flagged - step_oracle).norm() / kl_part.norm()),
        "kl_vs_task": float(kl_part.norm() / step_task.norm()),
        "grad_norms": [flagged["grad_norm"], reference["grad_norm"]],
        "metric_keys": sorted(flagged),
        "history": history,
        "device": args.device,
        "model_input_rows": rows_in,  # one entry per micro-batch of the flagged update
        "micro_batch_rows": [len(rows) for rows, _ in captured],
        **lora,
    }
    print("RESULT" + json.dumps(result, default=float))


if __name__ == "__main__":
    sys.exit(main())
