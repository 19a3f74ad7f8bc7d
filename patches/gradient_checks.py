"""The gradient checks every patch's new KL function passes (shared by the probes in tests/<framework>/).

`errors(per_sequence)` takes the patched function as `per_sequence(logp, ref_logp, old_logp, mask) -> [B]`, the
per-sequence KL term whose batch mean is the loss, and measures, in float64:
    random_error  on ragged random batches: relative distance of its value and gradient to kl_adapters.kl_surrogate
                  (preset "sequence-plain": the estimator the patches implement, without the variance
                  reductions; the same old_logp)
    exact_error   on every sequence of two tabular policies (kl_adapters.audit), on- and off-policy: relative distance
                  of its exact expected gradient sum_y q(y) grad per_sequence(y) to grad KL_seq
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PerSequence = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def errors(per_sequence: PerSequence) -> dict:
    from kl_adapters import audit, kl_surrogate

    random_error, gen = {}, torch.Generator().manual_seed(0)
    for seed in range(3):
        b, t = 6, 9
        mask = torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=gen)[:, None]
        mask[1, 2] = False  # a hole (e.g. a tool output)
        logp = (-torch.rand(b, t, generator=gen, dtype=torch.float64) * 3).requires_grad_()
        ref = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
        old = logp.detach() + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
        ours = per_sequence(logp, ref, old, mask).mean()
        theirs = kl_surrogate(logp, ref, mask, preset="sequence-plain", old_logp=old)
        g_ours, g_theirs = (torch.autograd.grad(x, logp)[0] for x in (ours, theirs))
        random_error[seed] = max(float((g_ours - g_theirs).norm() / g_theirs.norm()),
                                 float((ours - theirs).abs().detach() / theirs.detach()))
    exact_error = {}
    for vocab, horizon, seed in ((4, 4, 0), (3, 5, 1)):
        pol = audit.random_policies(vocab, horizon, seed)
        ref = audit.token_logps(pol.space, pol.ref_logits)
        for regime, sampler in (("on", pol.logits), ("off", pol.behaviour_logits)):
            target = audit.targets(pol.space, pol.logits, pol.ref_logits, sampler)["kl_seq"]
            theta = pol.logits.detach().clone().requires_grad_()
            logp = audit.token_logps(pol.space, theta)
            old = audit.token_logps(pol.space, sampler).detach() if regime == "off" else logp.detach()
            q = old.sum(-1).exp()  # probability of each sequence under the sampling policy
            (expected,) = torch.autograd.grad((q * per_sequence(logp, ref, old, pol.space.mask)).sum(), theta)
            exact_error[f"V{vocab}T{horizon}s{seed}/{regime}"] = audit.relative_error(expected.flatten(), target)
    return {"random_error": random_error, "exact_error": exact_error}
