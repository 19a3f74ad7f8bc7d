"""Measurements on a released trl tree, run by test_upstream_patch.py in a subprocess whose sys.path starts with that
tree (patched or pristine), so that `import trl` is the tree's code. Writes a dict of tensors to OUT with torch.save.

    python upstream_patch_probe.py TREE MODEL_DIR OUT {pristine,patched}

Both trees: on a real prepared GRPO batch (TRL's default loss_type dapo; completions cut to ragged lengths) used
on-policy, and the same batch after the policy moved (off-policy, old_per_token_logps from before the move), the
loss and parameter gradient of GRPOTrainer.compute_loss with TRL's defaults and beta = 2: "flag_off".
Patched tree only: the same with kl_level="sequence", the task gradient (beta = 0) and the gradient of
kl_surrogate(preset="sequence-plain", beta = beta * B / D, old_logp = old_per_token_logps) with D TRL's normaliser
(the patch is the unreduced estimator; kl-adapters' "sequence" adds batch statistics the patch does not have) ->
"kl_error" = |g_flag - g_task - g_kl| / |g_kl| ("kl_share" = |g_kl| / |g_flag|); and
trl.trainer.utils.sequence_kl_per_token against kl_adapters on random ragged batches ("random_error") and on exact
tabular policies ("exact_error", vs grad KL_seq).
"""

import sys
from pathlib import Path

import torch

BETA = 2.0
LENGTHS = (8, 3, 5, 1)  # completion lengths after cutting (TRL masks what follows EOS the same way)


def dapo_normaliser(trainer, batch) -> float:
    """D such that TRL 1.16's dapo loss divides each token of the policy loss (and of its KL term) by D."""
    items = float(batch["num_items_in_batch"]) / trainer.accelerator.num_processes
    return items * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation


def grad_of(trainer, loss: torch.Tensor) -> torch.Tensor:
    """Flattened gradient of `loss` with respect to the trainable parameters."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
    return torch.cat([g.flatten() for g in grads])


def loss_and_grad(trainer, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPOTrainer.compute_loss on the batch, and its parameter gradient."""
    loss = trainer.compute_loss(trainer.model, dict(batch))
    return loss.detach(), grad_of(trainer, loss)


def trainer_measurements(model_dir: str, patched: bool) -> dict:
    from conftest import grpo_args, make_trainer, one_batch, perturb, policy_logps
    from datasets import Dataset
    from trl import GRPOConfig

    from kl_adapters import kl_surrogate

    dataset = Dataset.from_dict({"prompt": [f"q{i}: say a" for i in range(64)]})
    out = {"flag_off": {}, "kl_error": {}, "kl_share": {}}
    trainer = make_trainer(model_dir, dataset, args=grpo_args(GRPOConfig, loss_type="dapo", beta=BETA))
    perturb(trainer.model, seed=1)
    batch = one_batch(trainer)
    mask = batch["completion_mask"].clone()
    assert mask.shape[0] == len(LENGTHS)
    for row, length in enumerate(LENGTHS):
        mask[row, length:] = 0
    batch["completion_mask"] = mask
    with torch.no_grad():
        old = policy_logps(trainer, batch)
    for regime in ("on", "off"):
        if regime == "off":
            batch = {**batch, "old_per_token_logps": old}
            perturb(trainer.model, scale=0.2, seed=2)  # the policy moved since the batch was sampled
        out["flag_off"][regime] = loss_and_grad(trainer, batch)
        if not patched:
            continue
        trainer.args.kl_level = "sequence"
        _, flagged = loss_and_grad(trainer, batch)
        trainer.beta = 0.0
        _, task = loss_and_grad(trainer, batch)
        trainer.beta, trainer.args.kl_level = BETA, "token"
        beta_seq = BETA * mask.shape[0] / dapo_normaliser(trainer, batch)
        kl = grad_of(trainer, kl_surrogate(policy_logps(trainer, batch), batch["ref_per_token_logps"], mask,
                                           preset="sequence-plain", beta=beta_seq,
                                           old_logp=batch.get("old_per_token_logps")))
        out["kl_error"][regime] = float((flagged - task - kl).norm() / kl.norm())
        out["kl_share"][regime] = float(kl.norm() / flagged.norm())
    return out


def function_measurements() -> dict:
    """sequence_kl_per_token against kl_adapters: patches/gradient_checks.py."""
    from gradient_checks import errors
    from trl.trainer.utils import sequence_kl_per_token

    return errors(lambda logp, ref, old, mask: sequence_kl_per_token(logp, ref, old, mask.long()).sum(-1))


def main(tree: str, model_dir: str, out: str, mode: str) -> None:
    import trl

    assert Path(trl.__file__).resolve().is_relative_to(Path(tree).resolve()), trl.__file__
    torch.set_num_threads(1)
    patched = mode == "patched"
    result = {"trl_file": trl.__file__, **trainer_measurements(model_dir, patched)}
    if patched:
        result.update(function_measurements())
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
