"""verl's real actor update path -- TrainingWorker, FSDP2 engine, micro-batching, ppo_loss -- with the adapter's flag
in the actor config (``kl_loss_type=kl_adapters:sequence``), in one process (world size 1): gloo on CPU through the
test-only platform shim, or NCCL on CUDA. Run as a script by test_engine.py; prints one JSON line "RESULT{...}".

Check: one SGD step (lr 1, no weight decay, no clipping) from the same initial weights, once with the patched
ppo_loss and once with an oracle loss = verl's ppo_loss without KL + kl_surrogate(beta = per_sequence_beta(coef, mask,
"token-mean", num_tokens=<verl's global token count>)) per micro-batch; the parameter updates (= the gradients) must
agree. Then a few AdamW steps with the flag, reporting verl's and kl-adapters' metrics.
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
from verl_cases import VOCAB, make_tokens, tiny_llama  # noqa: E402

from kl_adapters import get_preset, kl_statistics, kl_surrogate, per_sequence_beta  # noqa: E402

COEF, MINI, MICRO = 0.5, 8, 4


def save_model(path):
    tiny_llama(seed=0).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)


def build_worker(path, optimizer: str, lr: float):
    model = HFModelConfig(path=path, use_remove_padding=False, enable_gradient_checkpointing=False,
                          override_config={"attn_implementation": "eager"})
    engine = FSDPEngineConfig(strategy="fsdp2", param_offload=False, optimizer_offload=False, dtype="float32",
                              micro_batch_size_per_gpu=MICRO, infer_micro_batch_size_per_gpu=MICRO,
                              use_dynamic_bsz=False, max_token_len_per_gpu=1024, infer_max_token_len_per_gpu=1024,
                              use_torch_compile=False)
    optim = FSDPOptimizerConfig(optimizer=optimizer, lr=lr, weight_decay=0.0, clip_grad=1e9, total_training_steps=10)
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=engine,
                                                 optimizer_config=optim, checkpoint_config=CheckpointConfig()))
    worker.reset()
    return worker


def actor_config(kl_loss_type, use_kl_loss=True):
    return FSDPActorConfig(strategy="fsdp2", rollout_n=4, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=MICRO,
                           use_kl_loss=use_kl_loss, kl_loss_type=kl_loss_type, kl_loss_coef=COEF,
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


def log_probs(worker):
    td = batch()
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    return no_padding_2_padding(tu.get(worker.infer_batch(td), "log_probs"), td).float().cpu()


def train(worker, loss_fn, old, ref, adv):
    worker.set_loss_fn(loss_fn)
    td = batch(old_log_probs=old, ref_log_prob=ref, advantages=adv)
    tu.assign_non_tensor(td, global_batch_size=MINI, mini_batch_size=MINI, epochs=1, dp_size=1)
    return tu.get(worker.train_mini_batch(td), "metrics")


def params(worker):
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().cpu().double()
                      for p in worker.engine.module.parameters()])


def oracle(config_without_kl, preset, old, ref):
    """verl's ppo_loss without KL, plus kl_surrogate with verl's global token count (one micro-batch at a time) and,
    for the reduced presets, the rows' statistics of the whole batch: kl_statistics(old, ref, mask) of all B rows.
    Each micro-batch row is found in the batch by its behaviour log-probs (independently of the adapter's row tags)."""
    upstream = losses.ppo_loss.__kl_adapters_original__
    statistics = kl_statistics(old, ref, tokens["response_mask"].bool())

    def loss_fn(model_output, data, dp_group=None):
        loss, metrics = upstream(config_without_kl, model_output, data, dp_group)
        lp = no_padding_2_padding(model_output["log_probs"], data)
        td = data.select("response_mask", "old_log_probs", "ref_log_prob").to_padded_tensor()
        mask = td["response_mask"].bool()
        beta = per_sequence_beta(COEF, mask, "token-mean", num_tokens=data["batch_num_tokens"] / data["dp_size"])
        width = mask.shape[1]
        rows = (td["old_log_probs"][:, None].cpu() == old[None, :, :width]).all(-1).float().argmax(1)
        rows_statistics = statistics[rows]
        kl_kwargs = {} if not get_preset(preset).uses_batch_statistics else {
            "statistics": rows_statistics.with_width(width).to(lp.device)}
        return loss + kl_surrogate(lp, td["ref_log_prob"], mask, preset=preset, beta=beta,
                                   old_logp=td["old_log_probs"], **kl_kwargs), metrics

    return loss_fn


def main():
    if args.device == "cuda":
        torch.cuda.set_device(0)
    torch.distributed.init_process_group("gloo" if args.device == "cpu" else "nccl", rank=0, world_size=1)
    path = tempfile.mkdtemp(prefix="tiny_llama_")
    save_model(path)
    worker = build_worker(path, "SGD", 1.0)
    mask = tokens["response_mask"]
    gen = torch.Generator().manual_seed(1)
    current = log_probs(worker)
    old = (current + 0.3 * torch.randn(current.shape, generator=gen)) * mask  # a behaviour policy != pi_theta
    ref = (current + 0.5 * torch.randn(current.shape, generator=gen)) * mask
    adv = torch.randn(mask.shape[0], 1, generator=gen) * mask

    theta0 = params(worker)
    flagged = train(worker, partial(losses.ppo_loss, config=actor_config(f"kl_adapters:{args.preset}")), old, ref, adv)
    step_flagged = theta0 - params(worker)
    worker.reset()  # reload the initial weights
    assert torch.equal(params(worker), theta0)
    reference = train(worker, oracle(actor_config("low_var_kl", use_kl_loss=False), args.preset, old, ref),
                      old, ref, adv)
    step_oracle = theta0 - params(worker)
    worker.reset()
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
        "kl_rel_error": float((step_flagged - step_oracle).norm() / kl_part.norm()),
        "kl_vs_task": float(kl_part.norm() / step_task.norm()),
        "grad_norms": [flagged["grad_norm"], reference["grad_norm"]],
        "metric_keys": sorted(flagged),
        "history": history,
        "device": args.device,
    }
    print("RESULT" + json.dumps(result, default=float))


if __name__ == "__main__":
    sys.exit(main())
