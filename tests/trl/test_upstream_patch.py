"""patches/trl-1.16.0.patch on the trl 1.16.0 sdist fetched from the package index at test time (nothing vendored).

The patch must apply cleanly; the patched trl then runs in subprocesses with its tree first on sys.path
(upstream_patch_probe.py), beside the unpatched release:
    flag off (TRL's defaults)   GRPOTrainer.compute_loss: loss and parameter gradient bit-identical to the release;
    kl_level="sequence"         its gradient = task gradient (beta = 0) + grad kl_surrogate(preset="sequence-plain",
                                beta * B / D, old_logp) with D TRL's normaliser (loss_type dapo, ragged completions),
                                on- and off-policy;
    sequence_kl_per_token       = kl_surrogate on random ragged batches; exact expected gradient over every sequence of
                                tabular policies (kl_adapters.audit) = grad KL_seq, on- and off-policy;
and the unit tests the patch adds pass on the patched tree.
"""

import shutil
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "patches"))
import release  # noqa: E402

REL = release.PINNED["trl"]


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(pristine, patched) trl 1.16.0 source roots; fetching the patched one asserts that the patch applies cleanly."""
    return release.fetch_trees("trl", tmp_path_factory.mktemp("trl_release"))


@pytest.fixture(scope="module")
def runs(trees, model_dir, tmp_path_factory):
    """Both probes and the patch's unit tests, run concurrently (each in its own interpreter)."""
    out = tmp_path_factory.mktemp("trl_probe")
    return release.probe_both_trees(REL, trees, HERE / "upstream_patch_probe.py", out, [model_dir],
                                    path=(str(HERE),))


def test_patch_applies_cleanly_to_the_released_sdist(trees):
    files = release.changed_files(REL, trees)
    assert files == {"tests/test_grpo_sequence_kl.py", "trl/trainer/grpo_config.py", "trl/trainer/grpo_trainer.py",
                     "trl/trainer/utils.py"}


def test_a_shifted_hunk_is_not_clean(trees, tmp_path):
    """`apply_patch` refuses what GNU patch would apply at an offset (the check behind every suite's fixture)."""
    tree = shutil.copytree(trees[0], tmp_path / "tree")
    config = tree / "trl" / "trainer" / "grpo_config.py"
    config.write_text("# one more line\n" + config.read_text())
    with pytest.raises(release.PatchError, match="offset"):
        release.apply_patch(tree, REL.patch)


def test_each_probe_imported_its_own_tree(trees, runs):
    for tree, mode in zip(trees, ("pristine", "patched"), strict=True):
        assert Path(runs[mode]["trl_file"]).is_relative_to(tree)


def test_flag_off_is_bit_identical_to_the_release(runs):
    pristine, patched = runs["pristine"]["flag_off"], runs["patched"]["flag_off"]
    assert sorted(pristine) == sorted(patched) == ["off", "on"]
    for key, (loss, grad) in pristine.items():
        assert torch.equal(loss, patched[key][0]) and torch.equal(grad, patched[key][1]), key


def test_sequence_level_gradient_is_task_plus_kl_surrogate(runs):
    """float32 model: the KL part, 10-30 % of the gradient here, is matched to float32 rounding."""
    errors, share = runs["patched"]["kl_error"], runs["patched"]["kl_share"]
    assert len(errors) == 2 and max(errors.values()) < 1e-5, errors
    assert min(share.values()) > 0.05, share


def test_sequence_kl_per_token_equals_kl_surrogate_on_random_batches(runs):
    errors = runs["patched"]["random_error"]
    assert len(errors) == 3 and max(errors.values()) < 1e-12, errors


def test_exact_expected_gradient_is_grad_kl_seq(runs):
    errors = runs["patched"]["exact_error"]
    assert len(errors) == 4 and max(errors.values()) < 1e-6, errors


def test_the_patch_unit_tests_pass_on_the_patched_tree(runs):
    result = runs["unit_tests"]
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0 and "6 passed" in summary, result.stdout[-3000:] + result.stderr[-3000:]
