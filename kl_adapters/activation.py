"""Switching the framework adapters on and off, framework-agnostic.

Three ways to activate, one state:
    kl_adapters.enable("sequence")          in code (also exports KL_ADAPTERS so child processes / Ray workers inherit)
    KL_ADAPTERS=sequence python train.py    no code change: the kl_adapters_autoload.pth line imports
                                            `kl_adapters.autoload` at interpreter start, which calls `activate_from_env`
    a framework's own config flag           handled by that framework's adapter; it wins over the two above
Value syntax: ``<preset>[:<option>=<value>,...]`` with options is_clip=<float> (cap on importance weights) and
kl_target=<nats> (a KL budget, `kl_adapters.budget`: beta follows so that KL(pi || pi_ref) per sequence tracks it);
"", "0", "off", "none" mean off.

Patching is lazy: nothing is imported until a framework module listed in `ADAPTERS` is imported; then its adapter's
`patch(trigger_module_name)` runs (already-imported frameworks are patched at once). Adapters are idempotent and look the
settings up at call time through `active()`, so a disabled adapter falls through to the framework's original code.
`disable()` unpatches everything (reversible). This module imports neither torch nor any framework.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass

ENV_VAR = "KL_ADAPTERS"
_OFF = ("", "0", "off", "none", "false")

#: framework -> (adapter module, modules whose import triggers that adapter's patch)
ADAPTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "trl": ("kl_adapters.adapters.trl", ("trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer")),
    # verl: the modules of kl_adapters.adapters.verl.SITES; a release lacks some (0.9.x: main_ppo_sync, 0.8.0: ppo.v1)
    "verl": ("kl_adapters.adapters.verl", ("verl.utils.config", "verl.trainer.constants_ppo", "verl.workers.utils.losses",
                                           "verl.workers.engine.fsdp.transformer_impl", "verl.workers.engine_workers",
                                           "verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.utils",
                                           "verl.trainer.ppo.v1.trainer_base",
                                           "verl.trainer.main_ppo_sync")),
    "openrlhf": ("kl_adapters.adapters.openrlhf",
                 ("openrlhf.trainer.ray.ppo_actor", "openrlhf.trainer.ppo_utils.experience_maker",
                  "openrlhf.trainer.ppo_trainer")),
}


@dataclass(frozen=True)
class Settings:
    """What is switched on: a preset name and its options."""

    preset: str
    is_clip: float | None = None
    kl_target: float | None = None  # KL budget in nats per sequence (kl_adapters.budget); None: beta stays fixed

    def __str__(self) -> str:
        """KL_ADAPTERS syntax; round-trips through `parse` exactly (repr of a float is its shortest exact form)."""
        options = [f"{key}={float(value)!r}" for key, value in (("is_clip", self.is_clip),
                                                                ("kl_target", self.kl_target)) if value is not None]
        return self.preset + (":" + ",".join(options) if options else "")


def parse(value: str | None, *, check_preset: bool = True) -> Settings | None:
    """Parse a KL_ADAPTERS value; unknown presets or options raise ValueError naming the valid ones.

    check_preset=False skips the registry lookup (which imports torch); the name is then checked when an adapter patches.
    """
    if value is None or value.strip().lower() in _OFF:
        return None
    name, _, opts = value.strip().partition(":")
    if check_preset:
        from .presets import get_preset

        get_preset(name)
    options: dict[str, float | None] = {"is_clip": None, "kl_target": None}
    for item in filter(None, (o.strip() for o in opts.split(","))):
        key, _, raw = item.partition("=")
        if key not in options:
            raise ValueError(f"unknown {ENV_VAR} option {key!r} in {value!r}; valid options: {', '.join(options)}")
        try:
            options[key] = float(raw)
        except ValueError:
            raise ValueError(f"{ENV_VAR} option {key} needs a number, got {raw!r}") from None
    settings = Settings(name, **options)
    validate(settings, check_preset=check_preset)
    return settings


def validate(settings: Settings, *, check_preset: bool = True) -> None:
    """ValueError for options that are out of range or do not fit the preset (a KL budget needs a preset unbiased for
    the sequence KL and no is_clip, `budget.check_budget_preset`); check_preset=False: the torch-free checks only."""
    from ._validate import check_is_clip
    from .budget import check_budget_preset, check_target

    check_is_clip(settings.is_clip)
    if settings.kl_target is not None:
        check_target(settings.kl_target)
        if check_preset:
            check_budget_preset(settings.preset, settings.is_clip)


_lock = threading.RLock()
_settings: Settings | None = None
_patched: set[str] = set()
_armed: set[str] = set()
_finder: _PostImportFinder | None = None
_log = logging.getLogger("kl_adapters")


def active() -> Settings | None:
    """The settings adapters apply now (None: off, frameworks run their original code)."""
    return _settings


def resolve(config_value: str | None) -> Settings | None:
    """A framework config flag wins over enable()/KL_ADAPTERS; an empty or None flag defers to them."""
    return parse(config_value) if config_value not in (None, "") else _settings


def enable(preset: str, *, is_clip: float | None = None, kl_target: float | None = None) -> Settings:
    """Switch every supported framework to `preset` (patching installed frameworks as they are imported); kl_target:
    a KL budget (module docstring)."""
    settings = parse(str(Settings(preset, is_clip, kl_target)))
    _activate(settings)
    os.environ[ENV_VAR] = str(settings)
    return settings


def disable() -> None:
    """Switch off: restore every patched framework function, forget the setting (also unsets KL_ADAPTERS) and any
    `arm`ed framework (its config names then stop selecting presets in this process)."""
    global _settings, _finder
    with _lock:
        _settings = None
        _armed.clear()
        os.environ.pop(ENV_VAR, None)
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None
        for framework in sorted(_patched):
            importlib.import_module(ADAPTERS[framework][0]).unpatch()
        _patched.clear()


def activate_from_env() -> Settings | None:
    """Activate from KL_ADAPTERS if it is set (called at interpreter start by the .pth hook and by plugin loaders)."""
    settings = parse(os.environ.get(ENV_VAR), check_preset="torch" in sys.modules)
    if settings is not None:
        _activate(settings)
    return settings


def arm(framework: str) -> None:
    """Patch `framework` as its trigger modules are imported even while no setting is active.

    For frameworks whose own config can name a preset (verl: ``kl_loss_type=kl_adapters:<preset>``): the adapter's
    wrappers run the original code until a flag selects a preset. Errors while patching an armed-only framework are
    logged, not raised, so that a user who set no flag never sees the framework break.
    """
    with _lock:
        _armed.add(framework)
        _install_finder()
        for trigger in ADAPTERS[framework][1]:
            if trigger in sys.modules:
                _patch_armed(framework, trigger)


def _activate(settings: Settings) -> None:
    global _settings
    with _lock:
        _settings = settings
        _install_finder()
        for framework, (_, triggers) in ADAPTERS.items():
            for trigger in triggers:
                if trigger in sys.modules:
                    _patch(framework, trigger)


def _install_finder() -> None:
    global _finder
    if _finder is None:
        _finder = _PostImportFinder()
        sys.meta_path.insert(0, _finder)


def _patch_armed(framework: str, trigger: str) -> None:
    try:
        _patch(framework, trigger)
    except Exception as exc:  # noqa: BLE001 - see arm()
        _log.warning("kl-adapters: could not patch %s, %s runs unpatched there: %s", trigger, framework, exc)


def _patch(framework: str, trigger: str) -> None:
    from .presets import get_preset

    with _lock:
        if _settings is not None:
            get_preset(_settings.preset)  # KL_ADAPTERS read at interpreter start is validated here, before any patch
            validate(_settings)
        adapter = importlib.import_module(ADAPTERS[framework][0])
        if not hasattr(adapter, "patch"):
            raise RuntimeError(f"{adapter.__name__} imported its own trigger module {trigger!r} while being imported; "
                               "adapters must import trigger modules inside patch() only")
        adapter.patch(trigger)
        _patched.add(framework)


def _framework_of(module_name: str) -> str | None:
    for framework, (_, triggers) in ADAPTERS.items():
        if module_name in triggers:
            return framework
    return None


class _PatchAfterExec(importlib.abc.Loader):
    """Wraps a module's loader: run the module, then the adapter's patch for it."""

    def __init__(self, loader: importlib.abc.Loader, framework: str):
        self._loader, self._framework = loader, framework

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        if _settings is not None:
            _patch(self._framework, module.__name__)
        elif self._framework in _armed:
            _patch_armed(self._framework, module.__name__)

    def __getattr__(self, name):  # e.g. get_source / is_package for tracebacks and pkgutil
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """sys.meta_path entry that intercepts only the trigger modules of `ADAPTERS`."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        framework = _framework_of(fullname)
        if framework is None or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchAfterExec(spec.loader, framework)
        return spec


def with_kl_adapters_env(runtime_env: dict | None) -> dict:
    """A Ray runtime_env carrying the active setting to every worker process (multi-node included).

    Adds KL_ADAPTERS to runtime_env["env_vars"]; workers activate at start through the installed .pth hook. Usable as
    ``RAY_RUNTIME_ENV_HOOK=kl_adapters.activation.ray_runtime_env_hook`` or by adapters that build Ray options.
    """
    env = dict(runtime_env or {})
    if _settings is not None:
        env["env_vars"] = {**(env.get("env_vars") or {}), ENV_VAR: str(_settings)}
    return env


def ray_runtime_env_hook(runtime_env: dict | None) -> dict:
    """Entry point for Ray's RAY_RUNTIME_ENV_HOOK (called by ray.init with the job's runtime_env)."""
    if _settings is None:
        activate_from_env()
    return with_kl_adapters_env(runtime_env)
