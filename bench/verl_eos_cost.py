"""What reading pi(EOS | y_<t) costs in verl's actor forward (the termination control variate's input, issue 20).

Usage: .venvs/verl/bin/python bench/verl_eos_cost.py [--repeats 15] [--out bench/results/verl_eos_cost.txt]

The adapter computes it beside the FSDP engine's logprobs_from_logits call, from the same logits, with two gathers
per token (`kl_adapters.adapters.verl.end_of_sequence_probabilities`). Timed, interleaved, median over repeats, for
[tokens, vocab] logits as the engine hands them (float32; bf16 with verl's fallback path, no flash-attn on CPU): verl's
own logprobs_from_logits, and the added end_of_sequence_probabilities on its output (what a reduced preset's forward
runs besides; the backward pass is untouched: the probabilities are detached). Also the per-row keys the
compute_log_prob pass stores them under (`_row_keys`: a digest of each row's token ids), per micro-batch of rows.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

SHAPES = ((4096, 32000, "float32"), (1024, 151936, "float32"), (4096, 32000, "bfloat16"))


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch
    from verl.workers.engine.fsdp import transformer_impl

    from kl_adapters.adapters import verl as verl_adapter

    verl_log_probs = getattr(transformer_impl.logprobs_from_logits, "__kl_adapters_original__",
                             transformer_impl.logprobs_from_logits)
    lines = [f"$ {' '.join([os.path.relpath(sys.executable), *sys.argv])}",
             f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
             f"threads; median of {args.repeats} interleaved repeats", "",
             f"{'tokens x vocab':>18} {'dtype':>9} {'verl (ms)':>10} {'eos (ms)':>9} {'(verl + eos) / verl':>20}"]
    gen = torch.Generator().manual_seed(0)
    for tokens, vocab, dtype in SHAPES:
        logits = torch.randn(tokens, vocab, generator=gen).to(getattr(torch, dtype))
        labels = torch.randint(0, vocab, (tokens,), generator=gen)
        with torch.no_grad():
            log_probs = verl_log_probs(logits, labels)
        base, extra = [], []
        for _ in range(args.repeats):
            with torch.no_grad():
                base += timed(lambda: verl_log_probs(logits, labels), 1)
            extra += timed(lambda: verl_adapter.end_of_sequence_probabilities(logits, labels, log_probs, (2,)), 1)
        base, extra = statistics.median(base), statistics.median(extra)
        lines.append(f"{tokens:>8} x {vocab:<7} {dtype:>9} {1e3 * base:>10.2f} {1e3 * extra:>9.3f} "
                     f"{(base + extra) / base:>20.4f}")
    ids = torch.randint(0, 32000, (64 * 4096,), generator=gen)
    nested = torch.nested.nested_tensor_from_jagged(ids, torch.arange(0, 64 * 4096 + 1, 4096))
    keys = statistics.median(timed(lambda: verl_adapter._row_keys(nested), args.repeats))
    lines += ["", f"row keys of a micro-batch of 64 rows x 4096 tokens: {1e3 * keys:.2f} ms"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
