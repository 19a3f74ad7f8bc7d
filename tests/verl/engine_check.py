"""verl's real actor update path -- TrainingWorker, FSDP2 engine, micro-batching, ppo_loss -- with the adapter's flag
in the actor config (``kl_loss_type=kl_adapters:sequence``), in one process (world size 1): gloo on CPU through the
test-only platform shim, or NCCL on CUDA. Run as a script by test_engine.py; prints one JSON line "RESULT{...}".

First, as verl's compute_log_prob does before an update, TrainingWorker.infer_batch with the actor's loss function set:
the end-of-sequence probabilities the adapter keeps from that forward (and those of the training forward, in
model_output) are compared with softmax(logits)[EOS] of a separate plain transformers forward.
Check: one SGD step (lr 1, no weight decay, no clipping) from the same initial weights, once with the patched
ppo_loss and once with engine_oracle.py's oracle loss (its docstring: the math), its EndOfSequence the separate
forward's pi(EOS); the parameter updates (= the gradients) must agree. Then a few AdamW steps with the flag, reporting
verl's and kl-adapters' metrics.

What this script shares with megatron_check.py is engine_oracle.py's; `batch`, `log_probs`, `train`, `oracle` and
`flag_off_is_upstream` here are its functions over this module's `tokens` and `batch`, read at each call (the scripts
that import this module -- dp_worker_verl.py, vlm_cases.py -- replace them).
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
from verl.workers.config import (  # noqa: E402
    FSDPActorConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    TrainingWorkerConfig,
)
from verl.workers.engine_workers import TrainingWorker  # noqa: E402
from verl.workers.utils import losses  # noqa: E402
from verl_cases import EOS_ID, R, VOCAB, make_tokens, tiny_llama  # noqa: E402

import engine_oracle  # noqa: E402
from engine_oracle import MICRO  # noqa: E402

# get_preset and verl_adapter: read from this module by dp_worker_verl.py
from kl_adapters import EndOfSequence, get_preset  # noqa: E402,F401
from kl_adapters.adapters import verl as verl_adapter  # noqa: E402,F401
from kl_adapters.adapters.verl import loss as verl_loss  # noqa: E402
from kl_adapters.adapters.verl.state import EOS_ROWS  # noqa: E402

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
    return engine_oracle.actor_config(FSDPActorConfig, kl_loss_type, use_kl_loss, strategy="fsdp2",
                                      use_dynamic_bsz=args.dynamic_bsz, ppo_max_token_len_per_gpu=MAX_TOKENS,
                                      use_torch_compile=False)


tokens = make_tokens(seed=0)


def batch(**extra):
    return engine_oracle.batch(tokens, **extra)


def log_probs(worker, no_lora_adapter=False):
    """compute_log_prob's forward (engine_oracle.log_probs); with no_lora_adapter, compute_ref_log_prob's pass through
    a LoRA actor (its adapter disabled: the base model)."""
    return engine_oracle.log_probs(batch, worker, no_lora_adapter=no_lora_adapter)


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


def train(worker, loss_fn, old, ref, adv):
    return engine_oracle.train(batch, worker, loss_fn, old, ref, adv)


def params(worker):
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().cpu().double()
                      for p in worker.engine.module.parameters()])


def oracle(config_without_kl, preset, old, ref, adv, eos):
    """engine_oracle.oracle over this batch's response mask."""
    return engine_oracle.oracle(config_without_kl, preset, tokens["response_mask"], old, ref, adv, eos)


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
    """engine_oracle.flag_off_is_upstream from the initial weights (`reset`), and the update moved them (last: it
    unpatches)."""
    same, updated = engine_oracle.flag_off_is_upstream(batch, worker, actor_config("low_var_kl"), lambda: reset(worker),
                                                       lambda: params(worker), old, ref, adv)
    return same and not torch.equal(updated, theta0)


def main():
    if args.device == "cuda":
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=0, world_size=1)
    path = tempfile.mkdtemp(prefix="tiny_llama_")
    save_model(path)
    worker = build_worker(path, "SGD", 1.0)
    flagged_loss, captured = engine_oracle.capturing(actor_config(f"kl_adapters:{args.preset}"))
    current, eos, kept_error = primed_eos(worker, flagged_loss, path)
    old, ref, adv = engine_oracle.behaviour(current, tokens["response_mask"])

    theta0 = params(worker)
    rows_in = []  # the leading size of each input_ids the model sees in the flagged update: 1 when packed
    hook = worker.engine.module.register_forward_pre_hook(
        lambda module, a, kw: rows_in.append(int(kw["input_ids"].shape[0])), with_kwargs=True)
    flagged = train(worker, flagged_loss, old, ref, adv)
    hook.remove()
    lora = lora_reference(worker, current) if args.lora else {}
    step_flagged = theta0 - params(worker)

    def restart():
        reset(worker)  # reload the initial weights
        assert torch.equal(params(worker), theta0)

    steps, reference = engine_oracle.oracle_updates(batch, worker, actor_config("low_var_kl", use_kl_loss=False),
                                                    args.preset, tokens["response_mask"], old, ref, adv, eos, restart,
                                                    lambda: theta0 - params(worker))

    adam = build_worker(path, "AdamW", 1e-2)
    history = []
    for _ in range(args.steps):
        m = train(adam, partial(losses.ppo_loss, config=actor_config(f"kl_adapters:{args.preset}")), old, ref, adv)
        history.append({k: m[k] for k in ("loss", "grad_norm", "kl_loss", "kl_adapters/seq_kl",
                                          "kl_adapters/grad_weight_gap", "kl_adapters/is_ess") if k in m})
    result = {
        "flag_off_equal": flag_off_is_upstream(worker, theta0, old, ref, adv),
        "kept_eos_error": kept_error,  # compute_log_prob's forward vs the separate one (None: nothing kept)
        **engine_oracle.update_errors(captured, eos, step_flagged, steps),
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
