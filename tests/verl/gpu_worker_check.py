"""verl's actor update on one GPU (NCCL, world size 1) through verl's TrainingWorker + FSDP2 engine, with a 63M-
parameter random Llama (12 layers, hidden 768, built from a config). Run as a script by test_gpu.py; prints one JSON
line "RESULT{...}" (and --result FILE). Reuses engine_check.py's worker, batch and oracle (imported with --device cuda).

--dtype float32|bfloat16 is the FSDP engine's compute dtype (master weights stay float32). Measured:
- kl_rel_error: one SGD step (lr 1 = the gradient) with kl_loss_type=kl_adapters:<preset> vs the oracle (verl's
  ppo_loss without KL + kl_surrogate with verl's token count, the batch's statistics with the task advantages and
  the end-of-sequence probabilities of a separate float64 forward), relative to the KL part of the step;
  kept_eos_error: max |pi(EOS)| difference between what compute_log_prob's forward kept and that separate forward;
- flag_off_equal: 5 AdamW steps with the flag off (patched ppo_loss, kl_loss_type=low_var_kl) and with verl's own
  ppo_loss: the final weights are bit-identical;
- kl_history: with zero advantages (the KL term is the whole loss), a policy started away from the reference, 20 AdamW
  steps with the flag on: mean |log pi - log pi_ref| over the response tokens after each step (it must fall), and
  verl's / kl-adapters' metrics of every step.
"""

import argparse
import json
import os
import sys
import tempfile
from functools import partial

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
parser = argparse.ArgumentParser()
parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda", help="cpu: a dry run of this script (gloo)")
parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
parser.add_argument("--preset", default="sequence")
parser.add_argument("--kl-steps", type=int, default=20)
parser.add_argument("--result", help="also write the result JSON to this file")
args = parser.parse_args()
sys.argv = [sys.argv[0], "--device", args.device, "--preset", args.preset]  # engine_check reads its flags at import

import engine_check as ec  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from verl.workers.config import FSDPEngineConfig  # noqa: E402
from verl_cases import VOCAB, perturbed  # noqa: E402

MODEL = dict(hidden_size=768, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=6)


def llama_63m(seed: int = 0):
    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=32, pad_token_id=0, tie_word_embeddings=False, **MODEL)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def engine_config(**kwargs):
    """engine_check's FSDP engine config with this run's compute dtype."""
    return FSDPEngineConfig(**{**kwargs, "dtype": args.dtype})


def gradient_identity(path: str, old, ref, adv) -> dict:
    """One SGD step flagged vs the oracle, as engine_check.main: the flagged loss is set before compute_log_prob's
    forward (as ActorRolloutRefWorker.init_model), so the update's statistics use the end-of-sequence probabilities
    that forward keeps; the oracle takes them from a separate float64 transformers forward (`separate_eos`)."""
    worker = ec.build_worker(path, "SGD", 1.0)
    flagged = partial(ec.losses.ppo_loss, config=ec.actor_config(f"kl_adapters:{args.preset}"))
    _, eos, kept_error = ec.primed_eos(worker, flagged, path)
    theta0 = ec.params(worker)
    ec.train(worker, flagged, old, ref, adv)
    step_flagged = theta0 - ec.params(worker)
    worker.reset()
    ec.train(worker, ec.oracle(ec.actor_config("low_var_kl", use_kl_loss=False), args.preset, old, ref, adv, eos),
             old, ref, adv)
    step_oracle = theta0 - ec.params(worker)
    worker.reset()
    ec.train(worker, partial(ec.losses.ppo_loss, config=ec.actor_config("low_var_kl", use_kl_loss=False)), old, ref,
             adv)
    step_task = theta0 - ec.params(worker)
    kl_part = step_oracle - step_task
    assert float(kl_part.norm() / step_task.norm()) > 0.05, "the KL part of the step is too small to test"
    return {"kl_rel_error": float((step_flagged - step_oracle).norm() / kl_part.norm()), "kept_eos_error": kept_error}


def flag_off_equal(path: str, old, ref, adv) -> bool:
    torch.use_deterministic_algorithms(True, warn_only=True)
    finals = []
    for loss in (ec.losses.ppo_loss.__kl_adapters_original__, ec.losses.ppo_loss):  # verl's own, then patched + off
        worker = ec.build_worker(path, "AdamW", 1e-4)
        for _ in range(5):
            ec.train(worker, partial(loss, config=ec.actor_config("low_var_kl")), old, ref, adv)
        finals.append(ec.params(worker))
    torch.use_deterministic_algorithms(False)
    return bool(torch.equal(*finals))


def kl_history(policy_path: str, ref) -> list[dict]:
    worker = ec.build_worker(policy_path, "AdamW", 1e-4)
    mask = ec.tokens["response_mask"].bool()
    zero_adv = torch.zeros(mask.shape)
    history = []
    for _ in range(args.kl_steps):
        old = ec.log_probs(worker)  # on-policy each step
        metrics = ec.train(worker, partial(ec.losses.ppo_loss, config=ec.actor_config(f"kl_adapters:{args.preset}")),
                           old, ref, zero_adv)
        gap = float((ec.log_probs(worker) - ref)[mask].abs().mean())
        logged = {k: float(torch.tensor(metrics[k], dtype=torch.float64).mean())  # verl logs a list per micro-batch
                  for k in ("loss", "grad_norm", "kl_loss", "kl_adapters/seq_kl") if k in metrics}
        history.append({"mean_abs_logp_gap": gap, **logged})
    return history


def main():
    if args.device == "cuda":
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    path, policy_path = tempfile.mkdtemp(prefix="llama63m_"), tempfile.mkdtemp(prefix="llama63m_moved_")
    ec.FSDPEngineConfig = engine_config
    for folder, model in ((path, llama_63m()), (policy_path, perturbed(llama_63m(), 0.05, seed=5))):
        ec.save_model(folder)  # the tokenizer (and engine_check's tiny model, replaced next)
        model.save_pretrained(folder)
    reference = ec.build_worker(path, "SGD", 1.0)
    mask = ec.tokens["response_mask"]
    gen = torch.Generator().manual_seed(1)
    current = ec.log_probs(reference)
    old = (current + 0.3 * torch.randn(current.shape, generator=gen)) * mask
    ref = (current + 0.5 * torch.randn(current.shape, generator=gen)) * mask
    adv = torch.randn(mask.shape[0], 1, generator=gen) * mask
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    result = {"dtype": args.dtype, "preset": args.preset, "device": device,
              "parameters": sum(p.numel() for p in llama_63m().parameters()),
              **gradient_identity(path, old, ref, adv),
              "flag_off_equal": flag_off_equal(path, old, ref, adv),
              "kl_history": kl_history(policy_path, current * mask)}
    print("RESULT" + json.dumps(result, default=float))
    if args.result:
        with open(args.result, "w") as f:
            json.dump(result, f, default=float)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
