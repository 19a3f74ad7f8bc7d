"""Measurements on a released OpenRLHF tree, run by test_upstream_patch.py in a subprocess whose sys.path starts with
that tree (patched or pristine), then the suite's CPU stubs and shims, so that `import openrlhf` is the tree's code.
Writes a dict to OUT with torch.save.

    python upstream_patch_probe.py TREE ACTOR_DIR REF_DIR OUT {pristine,patched}

Both trees ("flag_off"): OpenRLHF's own CLI parsing (train_ppo_ray as __main__) and ActorPPOTrainer.ppo_train on a
tiny random Llama with the CPU strategy shim -- 8 ragged sequences, micro-batches of 2, gradient accumulation 2,
2 epochs (4 optimizer steps), behaviour log-probs from a perturbed policy, KL as a k3 loss (--algo.kl.use_loss,
init_coef 0.1) -- the gradient of every optimizer step and the returned status.
Patched tree only:
    "step_error"    --algo.kl.level sequence: per optimizer step |g - g_expected| / |g_kl|, g_expected = grad of
                    OpenRLHF's task loss + init_coef * (1/N_seq) * sum over the step's N_seq sequences of
                    kl_surrogate("sequence-plain", old_logp=action_log_probs) (the patch's estimator; g_kl its KL part;
                    "kl_share" = |g_kl| / |g|)
    "kl_metric"     OpenRLHF's logged kl of the first step vs its own token-mean k3 (unchanged meaning)
    "cli"           the CLI's refusals (--algo.kl.level sequence without --algo.kl.use_loss, or with unbiased_gradient)
    "random_error"  compute_sequence_kl vs kl_surrogate on random ragged batches (float64)
    "exact_error"   exact expected gradient over every sequence of tabular policies vs grad KL_seq, on- and off-policy
"""

import sys
from pathlib import Path

import torch


def sequence_level(argv: list[str], actor_dir: str, batch: dict) -> dict:
    from openrlhf_harness import BETA, GAS, cli_args, load_params, ppo_train_on, reference_grad

    from kl_adapters.activation import Settings

    from openrlhf.models import aggregate_loss
    from openrlhf.models.utils import compute_approx_kl

    trainer, steps, _ = ppo_train_on(cli_args(argv + ["--algo.kl.level", "sequence"]), actor_dir, batch)
    log = trainer.strategy
    errors, share, sequence = {}, {}, Settings("sequence-plain", None)
    for k, grad in enumerate(log.grad_log):
        window = steps[GAS * k:GAS * (k + 1)]
        model = load_params(actor_dir, log.params_log[k])
        expected = reference_grad(model, window, trainer, sequence, BETA, divisor="sequence")
        kl_part = expected - reference_grad(model, window, trainer, sequence, 0.0, divisor="sequence")
        errors[k], share[k] = float((grad - expected).norm() / kl_part.norm()), float(kl_part.norm() / grad.norm())
    exp, info = steps[0]
    with torch.no_grad():
        logp = load_params(actor_dir, log.params_log[0])(exp.sequences, exp.action_mask,
                                                         attention_mask=exp.attention_mask)
        native = aggregate_loss(compute_approx_kl(logp, exp.base_action_log_probs, exp.action_log_probs, "k3"),
                                exp.action_mask, **info)
    return {"step_error": errors, "kl_share": share, "kl_metric": (float(exp.info["kl"]), float(native))}


def cli_refusals(argv: list[str]) -> dict:
    from openrlhf_harness import cli_args

    refused = {}
    flag = ["--algo.kl.level", "sequence"]
    for name, extra in (("without_use_loss", [a for a in argv if a != "--algo.kl.use_loss"] + flag),
                        ("with_unbiased_gradient", argv + flag + ["--algo.kl.unbiased_gradient"])):
        try:
            cli_args(extra)
            refused[name] = None
        except AssertionError as error:
            refused[name] = str(error)
    return refused


def function_errors() -> dict:
    """compute_sequence_kl against kl_adapters: patches/gradient_checks.py."""
    from gradient_checks import errors
    from openrlhf.models.utils import compute_sequence_kl

    return errors(compute_sequence_kl)


def main(tree: str, actor_dir: str, ref_dir: str, out: str, mode: str) -> None:
    import openrlhf
    from openrlhf_cpu_shim import install_cuda_shims
    from openrlhf_harness import base_argv, cli_args, loss_path_batch, ppo_train_on

    assert Path(openrlhf.__file__).resolve().is_relative_to(Path(tree).resolve()), openrlhf.__file__
    torch.set_num_threads(1)
    install_cuda_shims()
    argv, batch = base_argv(actor_dir), loss_path_batch(actor_dir, ref_dir)
    trainer, _, status = ppo_train_on(cli_args(argv), actor_dir, batch)
    result = {"openrlhf_file": openrlhf.__file__, "flag_off": (trainer.strategy.grad_log, status)}
    if mode == "patched":
        result.update(sequence_level(argv, actor_dir, batch), cli=cli_refusals(argv), **function_errors())
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
