"""Cost of the `full` preset (issue 16 item 5): step time and peak memory vs TRL's native KL path and vs `sequence`.

Two measurements, each configuration alternating with the others call by call (ABBA, bench/timing.py), ratio of the
medians against the native path:
  train_step  GRPOTrainer.training_step (generation, reward, reference pass, loss, backward; no optimizer step, so
              every trainer keeps its weights and, seeded alike each round, generates the same completions) of a tiny
              random Llama with a V-token vocabulary (a char tokenizer over V - 4 Unicode characters), three trainers:
              native (TRL's own k3 term, beta > 0), kl_preset="sequence", kl_preset="full".
  kl_term     the KL term alone on random hidden states [B, T, H] and output projections [V, H] of both models,
              forward + backward, both starting from the policy's sampled-token log-probs with their graph (the task
              loss computes them in either case): native = the reference's logits, log_softmax, its sampled tokens'
              log-probs, kl_surrogate("sequence"); full = full_kl_surrogate_from_hidden(..., logp=) as the TRL
              adapter calls it (chunked, one pass, no [B, T, V] of the reference).
Peak memory: each configuration in its own process, one warm-up call then one measured call (CPU: the highest
resident set size, /proc/self/statm polled every millisecond by a thread, minus the size before the call; glibc's
mmap threshold is fixed at 64 KiB in that process, so that tensors are mmap-backed and returned to the system when
freed; CUDA: torch.cuda.max_memory_allocated minus the allocated size).
Usage: .venvs/trl/bin/python bench/full_cost.py [--vocab 32000] [--completion 128] [--kl-tokens 8 128] [--kl-chunk 1024]
       [--repeats 8] [--device cpu|cuda] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

import torch  # noqa: E402
from timing import alternating, compare, write_result  # noqa: E402

from kl_adapters.full_vocab import CHUNK_SIZE  # noqa: E402

NATIVE, SEQUENCE, FULL = "native", "sequence", "full"


def vocab_chars(vocab: int) -> str:
    """vocab - 4 distinct single characters (specials take 4 ids), from U+4E00 on (no surrogates below U+D800)."""
    if not 5 <= vocab <= 0xD800 - 0x4E00:
        raise ValueError(f"vocab must be in [5, {0xD800 - 0x4E00}], got {vocab}")
    return "a" + "".join(chr(0x4E00 + i) for i in range(vocab - 5))


def build_trainer(model_dir: str, preset: str, completion: int, device: str):
    from datasets import Dataset
    from trl import GRPOTrainer

    from kl_adapters.adapters.trl import KLGRPOConfig

    args = KLGRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=device == "cpu", bf16=False, beta=0.04,
                        per_device_train_batch_size=8, num_generations=8, max_completion_length=completion,
                        logging_steps=1, report_to="none", save_strategy="no", seed=0, gradient_checkpointing=False,
                        kl_preset="off" if preset == NATIVE else preset, disable_tqdm=True)
    dataset = Dataset.from_dict({"prompt": [f"q{i}: say a" for i in range(512)]})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **k: [c.count("a") / 8 for c in completions],
                          args=args, train_dataset=dataset)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batches = iter(trainer.get_train_dataloader())

    def step():
        trainer.training_step(trainer.model, next(batches), None)
        trainer.model.zero_grad(set_to_none=True)  # after: a call's memory includes the gradients it makes

    return step


def kl_term_fn(config: str, batch: int, horizon: int, vocab: int, hidden: int, device: str, chunk_size: int):
    from kl_adapters import kl_surrogate
    from kl_adapters.full_vocab import full_kl_surrogate_from_hidden

    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(batch, horizon, hidden, device=device, generator=gen, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device, generator=gen) / hidden ** 0.5).requires_grad_()
    h_ref = (h.detach() + 0.1 * torch.randn(h.shape, device=device, generator=gen))
    w_ref = w.detach() + 0.1 * torch.randn(w.shape, device=device, generator=gen) / hidden ** 0.5
    tokens = torch.randint(0, vocab, (batch, horizon), device=device, generator=gen)
    mask = torch.ones(batch, horizon, device=device)

    def native(logp):
        with torch.no_grad():
            ref = torch.log_softmax(h_ref @ w_ref.t(), -1).gather(-1, tokens[..., None])[..., 0]
        return kl_surrogate(logp, ref, mask, preset="sequence")

    def full(logp):
        return full_kl_surrogate_from_hidden(h, w, h_ref, w_ref, tokens, mask, logp=logp, chunk_size=chunk_size)

    def run():
        logp = torch.log_softmax(h @ w.t(), -1).gather(-1, tokens[..., None])[..., 0]
        (full if config == FULL else native)(logp).backward()
        h.grad = w.grad = None  # after: a call's memory includes the gradients it makes

    return run


def make(kind: str, config: str, a: argparse.Namespace, model_dir: str | None):
    if kind == "train_step":
        return build_trainer(model_dir, config, a.completion, a.device)
    return kl_term_fn(config, *a.kl_tokens, a.vocab, a.kl_hidden, a.device, a.kl_chunk)


def peak_of_one_call(fn, device: str) -> float:
    """Bytes the call adds to the peak (see module docstring)."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - base)
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    base, peak, done = rss(), [0], threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    watcher = threading.Thread(target=poll)
    watcher.start()
    try:
        fn()
    finally:
        done.set()
        watcher.join()
    return float(max(peak[0], rss()) - base)


def model_directory(a: argparse.Namespace) -> str:
    from kl_adapters.tiny_models import save_tiny_model

    return str(save_tiny_model(tempfile.mkdtemp(), chars=vocab_chars(a.vocab), hidden=a.hidden,
                               max_positions=a.completion + 32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=64, help="tiny Llama hidden size (train_step)")
    parser.add_argument("--completion", type=int, default=128, help="max_completion_length (train_step)")
    parser.add_argument("--kl-tokens", type=int, nargs=2, default=[8, 128], metavar=("B", "T"))
    parser.add_argument("--kl-hidden", type=int, default=256)
    parser.add_argument("--kl-chunk", type=int, default=CHUNK_SIZE, help="chunk_size of full (kl_term)")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", choices=["train_step", "kl_term"], help="run one measurement")
    parser.add_argument("--note", default="", help="measurement conditions (e.g. other work running)")
    parser.add_argument("--memory-of", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(1)  # as the other benchmarks: reproducible, and fair on a shared machine
    if a.memory_of:  # child process: one configuration's peak
        kind, config = a.memory_of
        fn = make(kind, config, a, a.model_dir)
        print(json.dumps({"peak_bytes": peak_of_one_call(fn, a.device)}))
        return
    sync = torch.cuda.synchronize if a.device == "cuda" else None
    model_dir = model_directory(a)
    result = {"device": a.device, "threads": torch.get_num_threads(), "repeats": a.repeats, "note": a.note}
    kinds = {"train_step": (NATIVE, SEQUENCE, FULL), "kl_term": (NATIVE, FULL)}
    for kind in [a.only] if a.only else list(kinds):
        configs = kinds[kind]
        fns = {c: make(kind, c, a, model_dir) for c in configs}
        times = alternating(fns, repeats=a.repeats, warmup=1, sync=sync,
                            before=lambda _config, i: torch.manual_seed(i))
        entry = compare(times, NATIVE, FULL)
        if SEQUENCE in configs:
            entry["ratio_sequence"] = compare(times, NATIVE, SEQUENCE)["ratio"]
        del fns
        peaks = {}
        for c in configs:
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--memory-of", kind, c,
                                  "--model-dir", model_dir], check=True, capture_output=True, text=True,
                                 env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}).stdout
            peaks[c] = json.loads(out.strip().splitlines()[-1])["peak_bytes"]
        entry["peak_bytes"] = peaks
        entry["peak_ratio"] = {c: peaks[c] / peaks[NATIVE] for c in configs if c != NATIVE and peaks[NATIVE] > 0}
        result[kind] = entry
    result["train_step_setup"] = {"model": f"tiny Llama, hidden {a.hidden}, 2 layers, vocab {a.vocab}",
                                  "batch": f"8 sequences x {a.completion} completion tokens", "beta": 0.04}
    result["kl_term_setup"] = {"shape": f"{a.kl_tokens[0]} x {a.kl_tokens[1]} x {a.vocab}", "hidden": a.kl_hidden,
                               "chunk_size": a.kl_chunk}
    suffix = (f"_{a.only}" if a.only else "") + (f"_chunk{a.kl_chunk}" if a.kl_chunk != CHUNK_SIZE else "")
    path = write_result(f"full_cost_{a.device}{suffix}", result)
    print(path.read_text())


if __name__ == "__main__":
    main()
