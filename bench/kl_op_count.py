"""How many aten ops the KL term dispatches, per `kl_statistics` call and per KL term (kl_term + surrogate + backward).

On a GPU each op is at least one kernel launch, so at the batch sizes of a loss call the fit is launch-bound and its op
count, not its arithmetic, sets its time. Counted with a TorchDispatchMode on the batches of bench/kl_term_cost.py
(float32, CPU; the count does not depend on the device or the machine's load), for the configurations of that script:
`sequence-plain`, `sequence` with statistics from the batch, `sequence` with precomputed statistics, and
`kl_statistics` alone. Per op name: the ten most frequent in `kl_statistics`; per part of the fit: its ops by the
kl_adapters function that dispatched them (views included: no kernel, but a dispatch each).
Usage: .venvs/core/bin/python bench/kl_op_count.py [--name kl_op_count_cpu]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

import torch  # noqa: E402
from kl_term_cost import SHAPES, batch, configs, shape_name  # noqa: E402
from timing import write_result_and_table  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kl_adapters import kl_statistics  # noqa: E402


#: the package directory whose functions the per-part count names
PACKAGE = str(Path(kl_statistics.__code__.co_filename).parent)


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside the block, by name, and by the kl_adapters function that dispatched it
    (the innermost kl_adapters frame on the Python stack: the part of the fit it belongs to)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.parts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        frame = sys._getframe(1)
        while frame is not None and PACKAGE not in frame.f_code.co_filename:
            frame = frame.f_back
        if frame is not None:
            self.parts[f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}"] += 1
        return func(*args, **(kwargs or {}))


def count(fn) -> OpCounter:
    fn()  # warm-up (lazy initialisation outside the count)
    with OpCounter() as counter:
        fn()
    return counter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="kl_op_count_cpu")
    args = parser.parse_args()
    rows, lines = {}, [f"{'shape':<22}{'configuration':<32}{'aten ops':>10}"]
    for b, t, off_policy in SHAPES:
        logp, ref, old, mask, task, eos = batch(b, t, "cpu")
        terms = configs(logp, ref, old, mask, task, eos, off_policy)
        old = old if off_policy else None
        configurations = {"kl_statistics": lambda: kl_statistics(logp, ref, mask, old_logp=old, task=task, eos=eos),
                          "sequence-plain term": terms["sequence-plain"],
                          "sequence term (from the batch)": terms["sequence"],
                          "sequence term (precomputed)": terms["sequence+stats"]}
        name = shape_name(b, t, off_policy)
        counters = {c: count(fn) for c, fn in configurations.items()}
        rows[name] = {c: {"total": sum(v.ops.values()), "by_op": dict(v.ops.most_common()),
                          "by_part": dict(v.parts.most_common())} for c, v in counters.items()}
        for c, v in counters.items():
            lines.append(f"{name:<22}{c:<32}{sum(v.ops.values()):>10}")
        top = ", ".join(f"{op} {n}" for op, n in counters["kl_statistics"].ops.most_common(10))
        lines.append(f"{'':<22}kl_statistics' most frequent: {top}")
        parts = ", ".join(f"{part} {n}" for part, n in counters["kl_statistics"].parts.most_common())
        lines.append(f"{'':<22}kl_statistics' ops by the function that dispatched them: {parts}")
    text = "\n".join(lines)
    print(text)
    write_result_and_table(args.name, {"torch": torch.__version__, "results": rows}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
