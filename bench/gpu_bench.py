"""GPU benchmark of one framework: step time and peak GPU memory, kl-adapters (preset "sequence") vs the framework's own
KL term, interleaved call by call (ABBA, bench/timing.py), with the ratio of the medians. Goal (issue 13): step-time
ratio <= 1.005, peak-memory ratio <= 1.01; the `full` preset (TRL's step_full: its full-vocabulary
KL needs both models' logits, so it has no KL-term-alone row) <= 1.15 / 1.1.

  step      trl: GRPOTrainer.training_step (generation, rewards, reference and old log-probs, loss, backward) of a
            63M-parameter random Llama, trl_step_overhead.py's trainers; verl: 63M Llama forward + ppo_loss + backward
            (verl_overhead.py's step, low_var_kl vs kl_adapters:sequence); openrlhf: ActorPPOTrainer.training_step of an
            84M-parameter Llama (openrlhf_overhead.py's step, k3 loss vs --algo.kl.preset sequence)
  kl_term   the KL term alone at 8 x 4096 response tokens, forward + backward on log-prob leaves: kl_surrogate vs
            the k3 token-mean term (every env), with statistics from the batch, with the fit switched off (the floor
            of any fit: bench/kl_term_floor.py) and precomputed; verl's ppo_loss at that shape (low_var_kl vs
            kl_adapters:sequence); OpenRLHF's compute_approx_kl path (openrlhf_overhead.py's kl_term)
Peak memory: torch.cuda.max_memory_allocated over one call of each configuration, after a reset (median of 3 rounds).

On a GPU: writes bench/results/gpu_<framework>_<device>.json (write_result: command, environment, device, and the
kl-adapters commit measured: `commit`) and a copy to --out. Without CUDA: a tiny smoke configuration (2 repeats, small
shapes), written to --out only, never to results.
Usage: python bench/gpu_bench.py --framework trl|verl|openrlhf --out DIR [--repeats 30]
(scripts/gpu.sh run <framework> runs it on the device.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import types
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.pop("KL_ADAPTERS", None)
warnings.filterwarnings("ignore")
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from timing import alternating, compare, write_result  # noqa: E402

NATIVE, ADAPTER = "native", "kl_adapters_sequence"
#: (GPU, smoke) sizes
KL_SHAPE = {True: (8, 4096), False: (2, 64)}
LLAMA_63M = dict(hidden=768, layers=12, heads=12)


def peak_memory(fns: dict[str, Callable[[], object]], rounds: int = 3) -> dict | None:
    """Median over rounds of max_memory_allocated during one call of each configuration (bytes), and the ratio."""
    if not torch.cuda.is_available():
        return None
    peaks = {name: [] for name in fns}
    for i in range(rounds):
        for name in fns if i % 2 == 0 else list(fns)[::-1]:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            fns[name]()
            torch.cuda.synchronize()
            peaks[name].append(torch.cuda.max_memory_allocated())
    med = {name: statistics.median(p) for name, p in peaks.items()}
    return {"peak_bytes": med, "ratio": med[ADAPTER] / med[NATIVE], "rounds": peaks}


def measure(fns: dict, repeats: int, before=None) -> dict:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else None
    times = alternating(fns, repeats=repeats, warmup=3 if repeats > 2 else 1, sync=sync, before=before)
    if before is not None:
        for name in fns:  # the memory pass sets each configuration the same way
            before(name, 0)
    memory = peak_memory({name: (lambda n=name: (before and before(n, 0), fns[n]())) for name in fns})
    return {**compare(times, NATIVE, ADAPTER), "memory": memory}


def kl_term_core(device: str, gpu: bool, repeats: int) -> dict:
    """kl_surrogate(sequence) vs the k3 token-mean term, forward + backward on a [B, T] log-prob leaf ("kl_term",
    statistics from the batch); the same with the fit switched off ("kl_term_fit_off": the statistics' inputs without
    the fit, the floor any fit starts from, bench/kl_term_floor.py) and with statistics precomputed outside the timing
    ("kl_term_precomputed")."""
    from kl_term_floor import without_fit

    from kl_adapters import kl_statistics, kl_surrogate

    batch, length = KL_SHAPE[gpu]
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]).to(device)
    ref = (-3 * torch.rand(batch, length, generator=gen)).to(device)
    old = (ref + 0.2 * torch.randn(batch, length, generator=gen).to(device)) * mask
    logp = old.clone().requires_grad_(True)
    stats = kl_statistics(logp.detach(), ref, mask, old_logp=old)

    def k3():
        logp.grad = None
        d = (ref - logp) * mask
        ((d.exp() - d - 1) * mask).sum().div(mask.sum()).backward()

    def sequence(**kw):
        def run():
            logp.grad = None
            kl_surrogate(logp, ref, mask, preset="sequence", beta=1.0 / batch, old_logp=old, **kw).backward()
        return run

    info = {"shape": [batch, length], "native": "k3 token-mean"}
    return {"kl_term": {**info, **measure({NATIVE: k3, ADAPTER: sequence()}, repeats)},
            "kl_term_fit_off": {**info, **measure({NATIVE: k3, ADAPTER: without_fit(sequence())}, repeats)},
            "kl_term_precomputed": {**info, **measure({NATIVE: k3, ADAPTER: sequence(statistics=stats)}, repeats)}}


def trl_bench(device: str, gpu: bool, repeats: int) -> dict:
    import trl_step_overhead as bench

    from kl_adapters.tiny_models import save_tiny_model

    model_dir = str(save_tiny_model(tempfile.mkdtemp(), **(LLAMA_63M if gpu else {"hidden": 32})))
    native = bench.train_step_fn(bench.build(model_dir, None, device))
    model = "random Llama " + json.dumps(LLAMA_63M if gpu else {"hidden": 32})
    result = {}
    for key, preset in (("step", "sequence"), ("step_full", "full")):
        trainer = bench.build(model_dir, preset, device)
        steps = {NATIVE: native, ADAPTER: bench.train_step_fn(trainer)}
        result[key] = {"model": model, "preset": preset,
                       "what": "GRPOTrainer.training_step, 8 completions of at most 32 tokens, beta 0.04",
                       **measure(steps, repeats, before=lambda _config, i: torch.manual_seed(i)),
                       # what the steps generated (the same for both: each step seeded alike), as trl_step_overhead.py
                       "completion_mean_length": statistics.mean(trainer._metrics["train"]["completions/mean_length"])}
    return result


def verl_bench(device: str, gpu: bool, repeats: int) -> dict:
    import verl_overhead as bench
    from transformers import LlamaConfig, LlamaForCausalLM

    configs = {NATIVE: bench.actor_config("low_var_kl"), ADAPTER: bench.actor_config("kl_adapters:sequence")}
    size = LLAMA_63M if gpu else {"hidden": 32, "layers": 2, "heads": 4}
    config = LlamaConfig(vocab_size=512, hidden_size=size["hidden"], intermediate_size=2 * size["hidden"],
                         num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                         num_key_value_heads=size["heads"] // 2, max_position_embeddings=1024, attn_implementation="eager")
    model = LlamaForCausalLM(config).to(device)
    shape = {"batch": 16, "prompt": 16, "response": 256} if gpu else {"batch": 2, "prompt": 4, "response": 8}
    data, _ = bench.ppo_inputs(**shape, device=device, seed=1)
    ids = torch.randint(3, 512, (shape["batch"], shape["prompt"] + shape["response"]),
                        generator=torch.Generator().manual_seed(3)).to(device)
    batch, length = KL_SHAPE[gpu]
    kl_data, flat = bench.ppo_inputs(batch=batch, prompt=16, response=length, device=device)
    return {"step": {"model": "random Llama " + json.dumps(size), "shape": shape, **measure(
                {n: bench.step_fn(c, model, ids, data["attention_mask"], data) for n, c in configs.items()}, repeats)},
            "kl_term_verl_loss": {"shape": [batch, length], "what": "ppo_loss forward + backward, no model", **measure(
                {n: bench.loss_fn(c, kl_data, flat) for n, c in configs.items()}, repeats)}}


def openrlhf_bench(device: str, gpu: bool, repeats: int) -> dict:
    import openrlhf_overhead as bench

    batch, length = KL_SHAPE[gpu]
    opts = types.SimpleNamespace(hidden=2048 if gpu else 32, batch=8 if gpu else 2, response=256 if gpu else 8,
                                 device=device)
    if not gpu:
        for (owner, name), fn in bench.cuda_shims().items():
            setattr(owner, name, fn)
    elif not torch.distributed.is_initialized():  # ActorPPOTrainer's barrier (ppo_actor.py:106) needs a group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as folder:
        args, actor, tensors, old, base = bench.setup(opts, folder)
        step = bench.training_step_fn(args, actor, tensors, old, base, device)
        kl_opts = types.SimpleNamespace(**{**vars(opts), "batch": batch, "response": length})
        _, _, kl_tensors, kl_old, kl_base = bench.setup(kl_opts, folder + "/kl")
    kl_native, kl_patched = bench.kl_term_fn(kl_tensors, kl_old, kl_base)
    result = {"step": {"model": f"random Llama, hidden {opts.hidden}, 2 layers", "what": "training_step (SGD lr 0)",
                       **measure({NATIVE: step, ADAPTER: step}, repeats, before=bench.switch)},
              "kl_term_openrlhf": {"shape": [batch, length], **measure({NATIVE: kl_native, ADAPTER: kl_patched},
                                                                       repeats, before=bench.switch)}}
    import kl_adapters

    kl_adapters.disable()
    return result


BENCHES = {"trl": trl_bench, "verl": verl_bench, "openrlhf": openrlhf_bench}


def commit() -> str:
    """The kl-adapters commit measured: KL_ADAPTERS_COMMIT (scripts/gpu.sh sets it from the wheelhouse's COMMIT, since
    the device runs the installed wheel, not a checkout), else `git describe --always --dirty` here, else "unknown"."""
    if os.environ.get("KL_ADAPTERS_COMMIT"):
        return os.environ["KL_ADAPTERS_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", required=True, choices=sorted(BENCHES))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--repeats", type=int, default=30)
    a = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    repeats = a.repeats if gpu else 2
    torch.manual_seed(0)
    device_name = torch.cuda.get_device_name(0) if gpu else "cpu (smoke configuration)"
    result = {"commit": commit(), "framework": a.framework, "device": device_name, "repeats": repeats,
              **kl_term_core(device, gpu, repeats), **BENCHES[a.framework](device, gpu, repeats)}
    result["goal"] = {"step_time_ratio": 1.005, "peak_memory_ratio": 1.01, "full": {"step_time_ratio": 1.15,
                                                                                     "peak_memory_ratio": 1.1}}
    a.out.mkdir(parents=True, exist_ok=True)
    name = f"gpu_{a.framework}"
    if gpu:
        slug = re.sub(r"[^a-z0-9]+", "_", result["device"].lower()).strip("_")
        path = write_result(f"{name}_{slug}", result)
        (a.out / path.name).write_text(path.read_text())
    else:
        (a.out / f"{name}_smoke.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    for key, r in result.items():
        if isinstance(r, dict) and "ratio" in r:
            memory = r["memory"]["ratio"] if r["memory"] else None
            print(f"{key:20s} native {1e3 * r['median_s'][NATIVE]:9.3f} ms  kl-adapters "
                  f"{1e3 * r['median_s'][ADAPTER]:9.3f} ms  time ratio {r['ratio']:.4f}  memory ratio {memory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
