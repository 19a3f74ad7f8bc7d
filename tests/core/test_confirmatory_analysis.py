"""bench/confirmatory.py decides a hypothesis only on its full ten seeds (protocol.md, "The family"): while seeds are
missing it reports interim figures as running and counts the hypothesis in Holm's correction as not run; a run that
failed counts as run (the protocol tests on the seeds where both configurations finished)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import confirmatory  # noqa: E402

from kl_adapters.demo.output import append_run  # noqa: E402


def _run(config: str, seed: int, score: float | None) -> dict:
    key = {"setting": "proxy", "framework": "trl", "rl": {"beta": 0.5, "lag": 1}}
    history = [] if score is None else [{"id": {"gold": score / 100}}]
    return {"key": key, "config": config, "seed": seed, "history": history, "wall_seconds": 60.0}


def _l2(folder: Path) -> dict:
    return next(r for r in confirmatory.analyse(folder) if r["id"] == "L2")


def test_a_hypothesis_is_decided_on_its_ten_seeds_only(tmp_path: Path) -> None:
    store = tmp_path / "confirm_proxy_trl.jsonl.gz"
    for seed in confirmatory.SEEDS[:5]:
        append_run(store, _run("sequence-plain", seed, 40.0 + seed % 3))
        append_run(store, _run("k3-loss", seed, 30.0))
    interim = _l2(tmp_path)
    assert interim["n"] == 5 and interim["p"] < 0.05 and not interim["complete"]
    assert interim["decision"].startswith("running: 5 of 10 seeds") and interim["holm"] == 1.0
    for seed in confirmatory.SEEDS[5:]:
        append_run(store, _run("sequence-plain", seed, None if seed == 209 else 40.0 + seed % 3))  # 209 failed
        append_run(store, _run("k3-loss", seed, 30.0))
    done = _l2(tmp_path)
    assert done["complete"] and done["n"] == 9 and done["decision"] == "confirmed"
    assert confirmatory.run_time(tmp_path) == {"confirm_proxy_trl": (20, 1200.0)}
