"""patches/openrlhf-0.11.2.patch on the OpenRLHF 0.11.2 release fetched from the package index at test time (nothing
vendored). PyPI has no OpenRLHF sdist: the release is the wheel, whose openrlhf-0.11.2.data/purelib folder holds
openrlhf/ and tests/ in the repository's layout.

The patch must apply cleanly; the patched OpenRLHF then runs in subprocesses with its tree first on sys.path (then the
suite's CPU stubs and shims; upstream_patch_probe.py), beside the unpatched release:
    flag off (--algo.kl.level token)   ActorPPOTrainer.ppo_train (k3 KL loss, 4 optimizer steps, off-policy from the
                                       first): every step's gradient and the status bit-identical to the release;
    --algo.kl.level sequence           every step's gradient = task gradient + init_coef * (1/N_seq) * sum over the
                                       step's sequences of grad kl_surrogate("sequence", old_logp=action_log_probs);
                                       the logged kl keeps its meaning; the CLI refuses it without --algo.kl.use_loss
                                       or with --algo.kl.unbiased_gradient;
    compute_sequence_kl                = kl_surrogate on random ragged batches; exact expected gradient over every
                                       sequence of tabular policies (kl_adapters.audit) = grad KL_seq, on- and
                                       off-policy;
and the tests in tests/test_kl_estimator_gradient.py (the released ones and those the patch adds) pass on the patched
tree.
"""

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "patches"))
import release  # noqa: E402

REL = release.PINNED["openrlhf"]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(pristine, patched) OpenRLHF 0.11.2 source roots; fetching the patched one asserts that the patch applies
    cleanly."""
    return release.fetch_trees("openrlhf", tmp_path_factory.mktemp("openrlhf_release"))


@pytest.fixture(scope="module")
def runs(trees, actor_dir, ref_dir, tmp_path_factory):
    """Both probes and the patch's unit tests, run concurrently (each in its own interpreter)."""
    out = tmp_path_factory.mktemp("openrlhf_probe")
    return release.probe_both_trees(REL, trees, HERE / "upstream_patch_probe.py", out, [actor_dir, ref_dir],
                                    path=(str(HERE / "cpu_stubs"), str(HERE)))


def test_patch_applies_cleanly_to_the_released_wheel(trees):
    files = release.changed_files(REL, trees)
    assert files == {"openrlhf/cli/train_ppo_ray.py", "openrlhf/models/utils.py", "openrlhf/trainer/ray/ppo_actor.py",
                     "tests/test_kl_estimator_gradient.py"}


def test_each_probe_imported_its_own_tree(trees, runs):
    for tree, mode in zip(trees, ("pristine", "patched"), strict=True):
        assert Path(runs[mode]["openrlhf_file"]).is_relative_to(tree)


def test_flag_off_is_bit_identical_to_the_release(runs):
    (pristine, pristine_status), (patched, patched_status) = runs["pristine"]["flag_off"], runs["patched"]["flag_off"]
    assert len(pristine) == len(patched) == 4
    assert all(torch.equal(a, b) for a, b in zip(pristine, patched, strict=True))
    assert pristine_status == patched_status


def test_sequence_level_gradient_is_task_plus_kl_surrogate_per_sequence(runs):
    errors, share = runs["patched"]["step_error"], runs["patched"]["kl_share"]
    assert len(errors) == 4 and max(errors.values()) < 1e-5, errors
    assert min(share.values()) > 0.1, share  # the KL term matters in this check


def test_logged_kl_keeps_its_meaning(runs):
    logged, native = runs["patched"]["kl_metric"]
    assert logged == pytest.approx(native, rel=1e-6)


def test_cli_refuses_what_the_flag_cannot_do(runs):
    refused = runs["patched"]["cli"]
    assert "--algo.kl.use_loss" in refused["without_use_loss"]
    assert "unbiased_gradient" in refused["with_unbiased_gradient"]


def test_compute_sequence_kl_equals_kl_surrogate_on_random_batches(runs):
    errors = runs["patched"]["random_error"]
    assert len(errors) == 3 and max(errors.values()) < 1e-12, errors


def test_exact_expected_gradient_is_grad_kl_seq(runs):
    errors = runs["patched"]["exact_error"]
    assert len(errors) == 4 and max(errors.values()) < 1e-6, errors


def test_the_patch_unit_tests_pass_on_the_patched_tree(runs):
    result = runs["unit_tests"]
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0 and "16 passed" in summary, result.stdout[-3000:] + result.stderr[-3000:]
