"""patches/verl-0.9.1.patch on the verl 0.9.1 sdist fetched from the package index at test time (nothing vendored).

The patch must apply cleanly; the patched verl then runs in subprocesses with its tree first on sys.path and verl
plugins off (upstream_patch_probe.py), beside the unpatched release:
    flag off (verl's defaults)       ppo_loss (low_var_kl, k3+) losses and gradients, and the KL-in-reward path
                                     (apply_kl_penalty + advantages, v0 and v1) bit-identical to the release;
    kl_loss_type="sequence"          ppo_loss gradient = task gradient + grad kl_surrogate("sequence-plain", beta_seq,
                                     old_logp=old_log_probs) for every allowed loss_agg_mode, on- and off-policy,
                                     with verl's global normalisers (beta_seq = kl_loss_coef * B / D);
    algorithm.kl_in_advantage=True   advantages = estimator(scores) - beta * KL reward-to-go (grpo, rloo,
                                     reinforce_plus_plus; v1 multi-trajectory grpo), whose PG gradient on-policy is
                                     grad kl_surrogate("reward-plain");
    kl_penalty_sequence              = kl_surrogate on random ragged batches; exact expected gradient over every
                                     sequence of tabular policies (kl_adapters.audit) = grad KL_seq on- and off-policy
                                     (the reward path: on-policy, where it is unbiased);
and the patch's unit tests (plus verl's tests of the functions it touches) pass on the patched tree.
"""

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "patches"))
import release  # noqa: E402

REL = release.PINNED["verl"]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(pristine, patched) verl 0.9.1 source roots; fetching the patched one asserts that the patch applies cleanly."""
    return release.fetch_trees("verl", tmp_path_factory.mktemp("verl_release"))


@pytest.fixture(scope="module")
def runs(trees, tmp_path_factory):
    """Both probes and the patch's unit tests, run concurrently (each in its own interpreter)."""
    out = tmp_path_factory.mktemp("verl_probe")
    return release.probe_both_trees(REL, trees, HERE / "upstream_patch_probe.py", out, [],
                                    path=(str(HERE),))


def test_patch_applies_cleanly_to_the_released_sdist(trees):
    files = release.changed_files(REL, trees)
    assert {"verl/trainer/ppo/core_algos.py", "verl/workers/utils/losses.py", "verl/trainer/ppo/ray_trainer.py",
            "verl/trainer/ppo/v1/utils.py", "verl/trainer/config/algorithm.py", "verl/workers/config/actor.py",
            "tests/trainer/ppo/test_kl_sequence_on_cpu.py"} <= files


def test_each_probe_imported_its_own_tree(trees, runs):
    for tree, mode in zip(trees, ("pristine", "patched"), strict=True):
        assert Path(runs[mode]["verl_file"]).is_relative_to(tree)


def test_flag_off_is_bit_identical_to_the_release(runs):
    pristine, patched = runs["pristine"]["flag_off"], runs["patched"]["flag_off"]
    assert sorted(pristine) == sorted(patched) and len(pristine) == 5
    for key, (tensors, extra) in pristine.items():
        theirs, their_extra = patched[key]
        if key.startswith("ppo_loss"):
            assert torch.equal(tensors, theirs) and torch.equal(extra, their_extra), key
        else:
            assert all(torch.equal(tensors[name], theirs[name]) for name in tensors) and extra == their_extra, key


def test_sequence_kl_loss_gradient_is_task_plus_kl_surrogate(runs):
    """float32 model: the KL part of the gradient is matched to float32 rounding."""
    errors = runs["patched"]["loss_error"]
    assert len(errors) == 10 and max(errors.values()) < 1e-4, errors


def test_kl_in_advantage_adds_the_kl_reward_to_go_after_the_estimator(runs):
    errors = runs["patched"]["reward_error"]
    assert max(v for k, v in errors.items() if k.startswith("advantages/")) < 1e-6, errors
    assert errors["pg_gradient/v0/grpo"] < 1e-4, errors


def test_kl_penalty_sequence_equals_kl_surrogate_on_random_batches(runs):
    errors = runs["patched"]["random_error"]
    assert len(errors) == 3 and max(errors.values()) < 1e-12, errors


def test_exact_expected_gradient_is_grad_kl_seq(runs):
    errors = runs["patched"]["exact_error"]
    assert len(errors) == 6 and max(errors.values()) < 1e-6, errors


def test_generated_configs_match_verls_generator(runs):
    """The patch adds algorithm.kl_in_advantage to ppo_trainer.yaml and, by hand, to the four _generated_*.yaml
    references that verl's CI regenerates: they equal the generator's output for the patched sources."""
    assert runs["patched"]["generated_configs"] == dict.fromkeys(
        ["ppo_trainer", "ppo_megatron_trainer", "ppo_veomni_trainer", "ppo_torchtitan_trainer"], True)


def test_the_patch_unit_tests_pass_on_the_patched_tree(runs):
    """13 tests the patch adds, 25 released tests of core_algos and of the v1 advantage function it touches."""
    result = runs["unit_tests"]
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0 and "38 passed" in summary, result.stdout[-3000:] + result.stderr[-3000:]
