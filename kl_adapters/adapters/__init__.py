"""One package per framework (trl/, verl/, openrlhf/); each holds all of kl-adapters' knowledge of its framework. What
they share lives beside them: `patching` (signature-checked wrapping and its undoing, and `Scoped`, the one way their
wrappers hand each other values), `end_of_sequence` (EOS ids, pi(EOS) from logits), `budget_wiring` (the KL budget in
a trainer) and `metrics` (the kl_adapters/* metric names; the grad-weight-gap formula is the core's,
`surrogate.weight_gap`).

Contract with `loader` (which patches each framework as it is imported, `loader.ADAPTERS`): an adapter module exposes
`patch(trigger_module_name)` (idempotent, version- and code-path-guarded; patched functions consult
`kl_adapters.activation.active()` at call time and fall through to the original code when it is None) and `unpatch()`
(restores every original). An adapter module must not import its trigger modules at import time (only inside
`patch`), since importing a trigger runs `patch`; nor the loader (the loader imports it). Shared guard:
`_guard.require_version`.
"""
