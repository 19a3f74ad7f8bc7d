"""verl 0.9.x: cost of kl-adapters' KL term against verl's own (low_var_kl), on verl's real functions.

Four measurements, each native vs kl-adapters, alternating call by call (ABBA) so that drift in machine load hits both;
the median per configuration, their ratio and the median per-round ratio are reported:
  loss        ppo_loss forward + backward on fixed log-probs (no model): where the adapter adds work, worst case
              (kl_loss_type=low_var_kl vs kl_loss_type=kl_adapters:sequence, token-mean; the reduced preset's
              statistics from the batch itself, as when ppo_loss is called outside an actor update)
  update      one actor update's loss work as TrainingWorker.train_mini_batch does it: verl's make_iterator splits
              the worker's batch into shuffled micro-batches, ppo_loss forward + backward on each (kl-adapters: the
              rows tagged, the batch's statistics computed once and sliced per micro-batch)
  step        tiny Llama forward + ppo_loss + backward (one actor micro-batch step)
  reward      apply_kl_penalty + GRPO advantages in the TaskRunner (algorithm.kl_penalty=kl vs kl_adapters:reward)
Deterministic inputs (fixed seeds and shapes), torch threads fixed (--threads).
Writes bench/results/verl_overhead_<device>.json.
Usage: .venvs/verl/bin/python bench/verl_overhead.py [--device cpu|cuda] [--repeats 30] [--threads 1]
Last run (2026-11-23, CPU, `nice -n 10 .venvs/verl/bin/python bench/verl_overhead.py`, load average ~19 from other
jobs: upper bounds, to be re-measured on a quiet machine): medians native / kl-adapters, ms: loss 25.6 / 36.5,
update 71.9 / 102.1, step 537 / 912 (noise-dominated: ppo_loss alone at the step's shape is 1.06 / 2.03 ms),
reward 26.8 / 145.8.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("KL_ADAPTERS", None)
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from timing import alternating, compare, write_result  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import ray_trainer  # noqa: E402
from verl.trainer.ppo.core_algos import FixedKLController  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.utils import losses  # noqa: E402

NATIVE, ADAPTER = "native", "kl_adapters"


def ragged(batch: int, prompt: int, response: int, gen: torch.Generator):
    lengths = torch.randint(response // 4, response + 1, (batch,), generator=gen)
    response_mask = (torch.arange(response)[None] < lengths[:, None]).long()
    attention_mask = torch.cat([torch.ones(batch, prompt, dtype=torch.long), response_mask], 1)
    return response_mask, attention_mask


def ppo_inputs(batch: int, prompt: int, response: int, device: str, seed: int = 0):
    """A TensorDict as the engine hands ppo_loss, and a flat leaf of log-probs in its no-padding layout."""
    gen = torch.Generator().manual_seed(seed)
    response_mask, attention_mask = ragged(batch, prompt, response, gen)
    n_real = int(attention_mask.sum())
    flat = (-torch.rand(n_real, generator=gen) * 3).to(device).requires_grad_(True)

    def near(x):
        return (x + 0.2 * torch.randn(x.shape, generator=gen)) * response_mask

    base = -torch.rand(batch, response, generator=gen) * 3 * response_mask
    data = tu.get_tensordict(
        {"prompts": torch.zeros(batch, prompt, dtype=torch.long),
         "responses": torch.zeros(batch, response, dtype=torch.long),
         "attention_mask": attention_mask, "response_mask": response_mask, "old_log_probs": near(base),
         "ref_log_prob": near(base), "advantages": torch.randn(batch, 1, generator=gen) * response_mask},
        non_tensor_dict={"dp_size": 1, "batch_num_tokens": int(response_mask.sum()), "global_batch_size": batch})
    return data.to(device), flat


def actor_config(kl_loss_type: str) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=8, ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=8,
                       use_kl_loss=True, kl_loss_type=kl_loss_type, kl_loss_coef=0.001, loss_agg_mode="token-mean")


def loss_fn(config, data, flat):
    def run():
        flat.grad = None
        loss, _ = losses.ppo_loss(config, {"log_probs": flat}, data)
        loss.backward()
    return run


def update_fn(config, data, micro: int):
    """make_iterator over the batch (shuffled micro-batches of `micro` rows), ppo_loss forward + backward on each."""
    leaves = {}

    def run():
        for part in tu.make_iterator(data.clone(), mini_batch_size=micro, epochs=1, seed=0,
                                     dataloader_kwargs={"shuffle": True}):
            n_real = int(part["attention_mask"].sum())
            flat = leaves.setdefault(n_real, -torch.rand(n_real, device=part.device).requires_grad_(True))
            loss, _ = losses.ppo_loss(config, {"log_probs": flat}, part)
            loss.backward()
    return run


def step_fn(config, model, ids, attention_mask, data):
    def run():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1].float()
        lp = torch.gather(logits.log_softmax(-1), 2, ids[:, 1:, None]).squeeze(-1)
        flat = torch.nn.functional.pad(lp, (0, 1))[attention_mask.bool()]
        loss, _ = losses.ppo_loss(config, {"log_probs": flat}, data)
        loss.backward()
    return run


def reward_fn(kl_penalty: str, batch: int, response: int, device: str):
    gen = torch.Generator().manual_seed(2)
    response_mask, _ = ragged(batch, 1, response, gen)
    old = -torch.rand(batch, response, generator=gen) * 3 * response_mask
    ref = (old + 0.2 * torch.randn(batch, response, generator=gen)) * response_mask
    scores = torch.rand(batch, 1, generator=gen) * response_mask
    uids = np.array([f"p{i // 8}" for i in range(batch)], dtype=object)
    tensors = {k: v.to(device) for k, v in {"response_mask": response_mask, "token_level_scores": scores,
                                              "old_log_probs": old, "ref_log_prob": ref}.items()}

    def run():
        data = DataProto.from_dict(tensors=dict(tensors), non_tensors={"uid": uids})
        data, _ = ray_trainer.apply_kl_penalty(data, kl_ctrl=FixedKLController(0.001), kl_penalty=kl_penalty)
        ray_trainer.compute_advantage(data, adv_estimator="grpo", num_repeat=8, config=AlgoConfig())
    return run


def interleaved(fns: dict, repeats: int, sync) -> dict:
    """Native vs kl-adapters, alternating call by call (ABBA, bench/timing.py): medians, ratio, every timing."""
    return compare(alternating(fns, repeats=repeats, warmup=3, sync=sync), NATIVE, ADAPTER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (fixed for reproducibility)")
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    sync = torch.cuda.synchronize if a.device == "cuda" else None
    configs = {NATIVE: actor_config("low_var_kl"), ADAPTER: actor_config("kl_adapters:sequence")}
    result = {"threads": a.threads, "repeats": a.repeats, "kl_loss_coef": 0.001, "loss_agg_mode": "token-mean"}

    shape = {"batch": 64, "prompt": 16, "response": 512}
    data, flat = ppo_inputs(**shape, device=a.device)
    result["loss"] = {"shape": shape, **interleaved({n: loss_fn(c, data, flat) for n, c in configs.items()},
                                                    a.repeats, sync)}

    update_shape = {"batch": 64, "prompt": 16, "response": 512, "micro_batch": 8}
    data, _ = ppo_inputs(update_shape["batch"], update_shape["prompt"], update_shape["response"], device=a.device)
    result["update"] = {"shape": update_shape, **interleaved(
        {n: update_fn(c, data, update_shape["micro_batch"]) for n, c in configs.items()}, a.repeats, sync)}

    from transformers import LlamaConfig, LlamaForCausalLM

    model_shape = {"hidden": 128, "layers": 2, "vocab": 512}
    step_shape = {"batch": 16, "prompt": 16, "response": 128}
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=model_shape["vocab"], hidden_size=model_shape["hidden"], intermediate_size=2 * model_shape["hidden"],
        num_hidden_layers=model_shape["layers"], num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, attn_implementation="eager")).float().to(a.device)
    data, _ = ppo_inputs(**step_shape, device=a.device, seed=1)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model_shape["vocab"], (step_shape["batch"], step_shape["prompt"] + step_shape["response"]),
                        generator=gen).to(a.device)
    result["step"] = {"model": f"random Llama {model_shape}", "shape": step_shape, **interleaved(
        {n: step_fn(c, model, ids, data["attention_mask"], data) for n, c in configs.items()}, a.repeats, sync)}

    reward_shape = {"batch": 256, "response": 1024}
    result["reward"] = {"shape": reward_shape, **interleaved(
        {NATIVE: reward_fn("kl", **reward_shape, device=a.device),
         ADAPTER: reward_fn("kl_adapters:reward", **reward_shape, device=a.device)}, a.repeats, sync)}
    path = write_result(f"verl_overhead_{a.device}", result)
    print(path.read_text())


if __name__ == "__main__":
    main()
