"""The task benchmark's protocol definitions (kl_adapters.demo.task.report): collapse, spikes, paired tests."""

import math

from kl_adapters.demo.task import report


def _run(config, seed, final_id, *, first_id=0.3, length=3.0, finite=True, norms=(1.0,) * 20, setting="short"):
    row = lambda acc, ln: {"id": {"accuracy": acc, "kl": 0.5, "length": ln},  # noqa: E731
                           "ood": {"accuracy": acc / 2, "kl": 1.0, "length": ln}}
    return {"key": {"setting": setting}, "config": config, "seed": seed, "finite": finite,
            "history": [row(first_id, 3.0), row(final_id, length)], "trl": [{"grad_norm": n} for n in norms]}


def test_collapse_definition():
    assert not report.collapsed(_run("a", 0, 0.25))  # 5 points below the reference: not a collapse
    assert report.collapsed(_run("a", 0, 0.19))  # more than 10 points below
    assert report.collapsed(_run("a", 0, 0.5, finite=False))
    assert report.collapsed(_run("a", 0, 0.5, length=1.4))  # under half the reference's length
    assert report.collapsed(_run("a", 0, 0.5, length=6.1))  # over twice
    assert not report.collapsed(_run("a", 0, 0.5, length=5.9))


def test_spikes_count_steps_above_ten_times_the_median():
    assert report.spikes(_run("a", 0, 0.5, norms=[1.0] * 10 + [10.5, 9.0, 30.0])) == 2


def test_paired_comparison_against_the_best_and_ties():
    runs = [_run("good", s, 0.6 + 0.01 * s) for s in range(5)] + [_run("bad", s, 0.4 + 0.012 * s) for s in range(5)]
    runs += [_run("tie", s, 0.6 + 0.01 * s + (0.001 if s % 2 else -0.001)) for s in range(5)]
    summary = report.summarize(runs)
    test = report.versus_best(summary, "id")
    assert test["best"] in ("good", "tie")
    assert test["versus"]["bad"]["significant"] and test["versus"]["bad"]["difference"] < 0
    other = "tie" if test["best"] == "good" else "good"
    assert not test["versus"][other]["significant"]
    assert math.isclose(summary["bad"]["id"]["mean"], 0.424)
    assert "bad" in report.table(summary, "title")


def test_a_failed_run_counts_as_a_collapse_not_a_missing_row():
    runs = [_run("a", 0, 0.5), {"key": {"setting": "short"}, "config": "a", "seed": 1, "history": [], "error": "x"}]
    summary = report.summarize(runs)
    assert summary["a"]["failed_seeds"] == [1] and summary["a"]["seeds"] == [0]
    assert "1 / 2" in report.table(summary, "title")


def test_the_proxy_setting_scores_gold():
    run = _run("a", 0, 0.5, setting="proxy")
    for row in run["history"]:
        for split in row.values():
            split["gold"], split["proxy"] = split.pop("accuracy"), 0.9
    assert report.score_name(run) == "gold" and report.metrics_of(run)["proxy"] == 0.9


def test_lag_table_keeps_the_configurations_run_at_several_lags():
    """The lag-1 store holds every configuration of the main comparison; the lag table shows only those of the lag
    study (run at more than one lag)."""
    lag1 = report.summarize([_run(c, s, 0.5) for c in ("a", "b") for s in range(3)])
    lag4 = report.summarize([_run("a", s, 0.5) for s in range(3)])
    lines = report.lag_table({1: lag1, 4: lag4}, "title").splitlines()[3:]
    assert [line.split()[:2] for line in lines] == [["a", "1"], ["a", "4"]]
