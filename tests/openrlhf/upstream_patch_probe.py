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
                    kl_surrogate("sequence", old_logp=action_log_probs) (g_kl its KL part; "kl_share" = |g_kl| / |g|)
    "kl_metric"     OpenRLHF's logged kl of the first step vs its own token-mean k3 (unchanged meaning)
    "cli"           the CLI's refusals (--algo.kl.level sequence without --algo.kl.use_loss, or with unbiased_gradient)
    "random_error"  compute_sequence_kl vs kl_surrogate on random ragged batches (float64)
    "exact_error"   exact expected gradient over every sequence of tabular policies vs grad KL_seq, on- and off-policy
"""

import sys
from pathlib import Path

import torch

BETA, MICRO, GAS = 0.1, 2, 2
RESPONSES = [6, 3, 5, 6, 2, 6, 4, 5]


def make_batch(actor_dir: str, ref_dir: str) -> dict:
    from openrlhf_cpu_shim import load_actor, perturbed, random_batch

    actor, ref = load_actor(actor_dir), load_actor(ref_dir)
    behaviour = perturbed(actor, 0.05, seed=3)
    sequences, attention_mask, action_mask = random_batch(len(RESPONSES), 4, RESPONSES, seed=0)
    with torch.no_grad():
        old = behaviour(sequences, action_mask, attention_mask=attention_mask)
        base = ref(sequences, action_mask, attention_mask=attention_mask)
    advantages = 0.3 * torch.randn(action_mask.shape, generator=torch.Generator().manual_seed(4)) * action_mask
    return dict(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask, action_log_probs=old,
                base_action_log_probs=base, advantages=advantages)


def train(args, actor_dir: str, batch: dict):
    """OpenRLHF's ppo_train on the batch: (trainer, recorded (experience, loss_batch_info) per step, status)."""
    from openrlhf_cpu_shim import load_actor
    from openrlhf_harness import build_trainer, record_steps

    from openrlhf.trainer.ppo_utils.experience import Experience

    trainer = build_trainer(args, load_actor(actor_dir), micro_batch=MICRO, gas=GAS)
    steps = record_steps(trainer)
    trainer.replay_buffer.append(Experience(**{k: v.clone() for k, v in batch.items()},
                                            total_length=batch["attention_mask"].sum(-1),
                                            index=list(range(len(RESPONSES))), info={}))
    torch.manual_seed(0)  # ppo_train shuffles the replay buffer
    status = trainer.ppo_train(kl_ctl=BETA)
    return trainer, steps, status


def expected_grad(model, window, trainer, beta: float) -> torch.Tensor:
    """grad of sum_micro PolicyLoss / gas + beta * (1/N_seq) * sum over the step's sequences of kl_surrogate(seq),
    the KL computed one sequence at a time (B = 1), N_seq counted here."""
    from kl_adapters import kl_surrogate

    task, per_sequence = 0.0, []
    for exp, info in window:
        logp = model(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask)
        task = task + trainer.actor_loss_fn(logp, exp.action_log_probs, exp.advantages, action_mask=exp.action_mask,
                                            **info)[0] / GAS
        per_sequence += [kl_surrogate(logp[b:b + 1], exp.base_action_log_probs[b:b + 1], exp.action_mask[b:b + 1],
                                      preset="sequence", old_logp=exp.action_log_probs[b:b + 1])
                         for b in range(len(logp)) if exp.action_mask[b].any()]
    loss = task + beta * torch.stack(per_sequence).sum() / len(per_sequence)
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))])


def load_params(actor_dir: str, params: dict):
    from openrlhf_cpu_shim import load_actor

    model = load_actor(actor_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def sequence_level(argv: list[str], actor_dir: str, batch: dict) -> dict:
    from openrlhf_harness import cli_args

    from openrlhf.models import aggregate_loss
    from openrlhf.models.utils import compute_approx_kl

    trainer, steps, _ = train(cli_args(argv + ["--algo.kl.level", "sequence"]), actor_dir, batch)
    log = trainer.strategy
    errors, share = {}, {}
    for k, grad in enumerate(log.grad_log):
        window = steps[GAS * k:GAS * (k + 1)]
        model = load_params(actor_dir, log.params_log[k])
        expected = expected_grad(model, window, trainer, BETA)
        kl_part = expected - expected_grad(model, window, trainer, 0.0)
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
    from openrlhf_harness import base_argv, cli_args

    assert Path(openrlhf.__file__).resolve().is_relative_to(Path(tree).resolve()), openrlhf.__file__
    torch.set_num_threads(1)
    install_cuda_shims()
    argv, batch = base_argv(actor_dir), make_batch(actor_dir, ref_dir)
    trainer, _, status = train(cli_args(argv), actor_dir, batch)
    result = {"openrlhf_file": openrlhf.__file__, "flag_off": (trainer.strategy.grad_log, status)}
    if mode == "patched":
        result.update(sequence_level(argv, actor_dir, batch), cli=cli_refusals(argv), **function_errors())
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
