"""The adapters' loader: which framework modules each adapter patches, and patching them as they are imported.

`ADAPTERS` maps a framework to its adapter module and the framework modules whose import triggers that adapter's
`patch(trigger_module_name)` (the contract: kl_adapters/adapters/__init__.py). Patching is lazy: nothing is imported
until a trigger module is imported; then the import hook (`_PostImportFinder`, a sys.meta_path entry) runs the module
and the adapter's patch for it. Frameworks already imported are patched at once.

`kl_adapters.activation` is the switch and its state and loads no adapter; the package's import attaches this
module's `switched_on` / `switched_off` to it (`activation.attach_loader`), so that `enable`, `disable` and
KL_ADAPTERS act here. `arm` patches a framework whose own config can name a preset while no setting is active (verl's
plugin entry point). A refused KL_ADAPTERS stops the import of any trigger module with its one line
(`_exit_if_refused`). Imports neither torch nor any framework until a trigger module is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys

from .. import activation

#: framework -> (adapter module, modules whose import triggers that adapter's patch)
ADAPTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "trl": ("kl_adapters.adapters.trl", ("trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer")),
    # verl: the modules of kl_adapters.adapters.verl.SITES; a release lacks some (0.9.x: main_ppo_sync, 0.8.0: ppo.v1)
    "verl": ("kl_adapters.adapters.verl", ("verl.utils.config", "verl.trainer.constants_ppo", "verl.workers.utils.losses",
                                           "verl.workers.engine.fsdp.transformer_impl", "verl.workers.engine",
                                           "verl.workers.engine_workers",
                                           "verl.trainer.ppo.ray_trainer", "verl.trainer.ppo.v1.utils",
                                           "verl.trainer.ppo.v1.trainer_base",
                                           "verl.trainer.main_ppo_sync")),
    "openrlhf": ("kl_adapters.adapters.openrlhf",
                 ("openrlhf.trainer.ray.ppo_actor", "openrlhf.trainer.ppo_utils.experience_maker",
                  "openrlhf.trainer.ppo_trainer")),
}

_patched: set[str] = set()
_armed: set[str] = set()
_finder: _PostImportFinder | None = None
_log = logging.getLogger("kl_adapters")


def switched_on(patch: bool) -> None:
    """A setting was switched on (patch=True: patch every framework already imported) or a refused KL_ADAPTERS
    recorded (patch=False): install the import hook either way. Called by `activation` holding its LOCK."""
    _install_finder()
    if patch:
        for framework, (_, triggers) in ADAPTERS.items():
            for trigger in triggers:
                if trigger in sys.modules:
                    _patch(framework, trigger)


def switched_off() -> None:
    """`activation.disable`: forget armed frameworks, remove the import hook, unpatch every patched framework."""
    global _finder
    _armed.clear()
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    for framework in sorted(_patched):
        importlib.import_module(ADAPTERS[framework][0]).unpatch()
    _patched.clear()


def arm(framework: str) -> None:
    """Patch `framework` as its trigger modules are imported even while no setting is active.

    For frameworks whose own config can name a preset (verl: ``kl_loss_type=kl_adapters:<preset>``): the adapter's
    wrappers run the original code until a flag selects a preset. Errors while patching an armed-only framework are
    logged, not raised, so that a user who set no flag never sees the framework break.
    """
    with activation.LOCK:
        _armed.add(framework)
        _install_finder()
        for trigger in ADAPTERS[framework][1]:
            if trigger in sys.modules:
                _patch_armed(framework, trigger)


def _install_finder() -> None:
    global _finder
    if _finder is None:
        _finder = _PostImportFinder()
        sys.meta_path.insert(0, _finder)


def _patch_armed(framework: str, trigger: str) -> None:
    try:
        _patch(framework, trigger)
    except activation.SettingError:  # a refused KL_ADAPTERS is a flag the user set
        raise
    except Exception as exc:  # noqa: BLE001 - see arm()
        _log.warning("kl-adapters: could not patch %s, %s runs unpatched there: %s", trigger, framework, exc)


def _patch(framework: str, trigger: str) -> None:
    with activation.LOCK:
        adapter = importlib.import_module(ADAPTERS[framework][0])
        if not hasattr(adapter, "patch"):
            raise RuntimeError(f"{adapter.__name__} imported its own trigger module {trigger!r} while being imported; "
                               "adapters must import trigger modules inside patch() only")
        adapter.patch(trigger)
        _patched.add(framework)


def _exit_if_refused() -> None:
    """SystemExit with the one line of a refused KL_ADAPTERS (`activation.check_environment`), before a framework
    module that kl-adapters patches runs: no framework's import machinery catches it (TRL's lazy modules and verl's
    plugin loader catch Exception), so the run stops there, with that line and exit status 1."""
    try:
        activation.check_environment()
    except activation.SettingError as err:
        raise SystemExit(f"kl-adapters: {err}") from None


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
        _exit_if_refused()
        self._loader.exec_module(module)
        if activation.active() is not None:
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
