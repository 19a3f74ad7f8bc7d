"""Switching the framework adapters on and off, framework-agnostic.

Three ways to activate, one state:
    kl_adapters.enable("sequence")          in code (also exports KL_ADAPTERS so child processes / Ray workers inherit)
    KL_ADAPTERS=sequence python train.py    no code change: the kl_adapters_autoload.pth line imports kl_adapters at
                                            interpreter start, whose import calls `activate_from_env(defer=True)`
    a framework's own config flag           handled by that framework's adapter; it wins over the two above
Value syntax: ``<preset>[:<option>=<value>,...]`` with options is_clip=<float> (cap on importance weights) and
kl_target=<nats> (a KL budget, `kl_adapters.budget`: beta follows so that KL(pi || pi_ref) per sequence tracks it);
"", "0", "off", "none" mean off.

One check for every path (`validate`, through `parse` / `checked`): whichever way a setting arrives it is accepted or
refused alike, a refusal being a `SettingError` whose one line names the setting, its value and what is valid
(tests/activation_table.py, exercised on every path of each suite). A refused KL_ADAPTERS never lets a run proceed
with the framework's own KL: Python's site module swallows errors of a .pth line, so `activate_from_env(defer=True)`
records the refusal instead of raising, and the import of any framework module kl-adapters patches then exits with
that line (SystemExit, which no framework's import machinery wraps); `active()` and the adapters' `patch` raise it.
When a preset applies, each adapter logs one line per process (`announce`).

This module is the switch and its state; it loads no adapter. What switching does to the frameworks is the adapters'
loader's (`kl_adapters.adapters.loader`, attached by the package's import: `attach_loader`): it patches each framework
as it is imported, or at once if it already is, and unpatches on `disable()`. Adapters look the settings up at call
time through `active()`, so a disabled adapter falls through to the framework's original code. This module imports
neither torch nor any framework.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .presets import Preset

ENV_VAR = "KL_ADAPTERS"
_OFF = ("", "0", "off", "none", "false")


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

    @property
    def spec(self) -> Preset:
        """The preset named, resolved (imports torch): the one lookup the adapters make, passing this object down."""
        from .presets import get_preset

        return get_preset(self.preset)


class SettingError(ValueError):
    """A refused kl-adapters setting: one line naming the setting, its value and what is valid."""


#: the options of the KL_ADAPTERS syntax (`Settings` fields besides the preset)
OPTIONS = ("is_clip", "kl_target")


def parse(value: str | None, *, check_preset: bool = True, setting: str = ENV_VAR,
          written: str | None = None) -> Settings | None:
    """Parse a KL_ADAPTERS-syntax value; None when off. A refused value raises SettingError
    "<setting>='<written>': <why>; <what is valid>" (unknown option, a number that is not one, or `validate`'s
    refusals).

    setting: where the user wrote it (KL_ADAPTERS, kl_preset, --algo.kl.preset, a verl key); written: what they wrote,
    when it is more than `value` (verl's ``kl_adapters:<value>``). check_preset=False skips the checks that read the
    preset registry (which imports torch); `check_environment` makes them before any framework is patched.
    """
    if value is None or value.strip().lower() in _OFF:
        return None
    where = f"{setting}={(written or value).strip()!r}"
    name, _, opts = value.strip().partition(":")
    options: dict[str, float | None] = dict.fromkeys(OPTIONS)
    for item in filter(None, (o.strip() for o in opts.split(","))):
        key, _, raw = item.partition("=")
        if key not in options:
            raise SettingError(f"{where}: unknown option {key!r}; valid options: {', '.join(OPTIONS)}")
        try:
            options[key] = float(raw)
        except ValueError:
            raise SettingError(f"{where}: option {key} needs a number, got {raw!r}") from None
    return checked(Settings(name, **options), where, check_preset=check_preset)


def checked(settings: Settings, where: str, *, check_preset: bool = True) -> Settings:
    """`settings` when `validate` accepts them, else SettingError "<where>: <why>" (where: the setting as written)."""
    try:
        validate(settings, check_preset=check_preset)
    except ValueError as err:
        raise SettingError(f"{where}: {err}") from None
    return settings


def validate(settings: Settings, *, check_preset: bool = True) -> None:
    """The one check of a setting, whichever path it came by. ValueError for: an unknown preset; is_clip that is not
    a number >= 1, or on a preset without importance weights to cap (`_validate.check_is_clip`); a kl_target that is
    not a number > 0, on a preset whose gradient is not the sequence KL's, or with is_clip
    (`budget.check_budget_preset`). check_preset=False: the torch-free range checks only.
    Pinned by tests/core/test_activation.py::test_table_on_parse (the table: tests/activation_table.py)."""
    from ._validate import check_is_clip
    from .budget import check_budget_preset, check_target

    check_is_clip(settings.is_clip)
    if settings.kl_target is not None:
        check_target(settings.kl_target)
    if check_preset:
        spec = settings.spec
        check_is_clip(settings.is_clip, spec)
        if settings.kl_target is not None:
            check_budget_preset(spec, settings.is_clip)


#: held while the state below changes and while the loader patches (one lock: the loader's patching reads the state)
LOCK = threading.RLock()
_settings: Settings | None = None
#: the setting as written (e.g. "KL_ADAPTERS='sequnce'") while _settings still waits for the checks that read the
#: preset registry: KL_ADAPTERS read before torch was imported (`activate_from_env`); None once checked
_unchecked: str | None = None
#: the one-line refusal of the KL_ADAPTERS this process read (`activate_from_env(defer=True)`), raised by every use
_refused: str | None = None
_announced: set[tuple[str, str, str]] = set()
_log = logging.getLogger("kl_adapters")


def _unattached(*_) -> None:
    raise RuntimeError("kl_adapters.adapters.loader is not attached (the import of kl_adapters attaches it)")


#: the adapters' loader (`attach_loader`)
_switched_on: Callable[[bool], None] = _unattached
_switched_off: Callable[[], None] = _unattached


def attach_loader(switched_on: Callable[[bool], None], switched_off: Callable[[], None]) -> None:
    """What switching does to the frameworks, given by the layer that knows them (kl_adapters/__init__.py attaches
    `kl_adapters.adapters.loader`'s functions at import): `switched_on(patch)` after a setting is switched on
    (patch=True: patch the frameworks already imported too) or a refused KL_ADAPTERS is recorded (patch=False: only
    the import hook, which stops a framework's import with the refusal); `switched_off()` after `disable`. Both are
    called holding LOCK."""
    global _switched_on, _switched_off
    _switched_on, _switched_off = switched_on, switched_off


def active() -> Settings | None:
    """The settings adapters apply now (None: off, frameworks run their original code). SettingError when the
    KL_ADAPTERS this process read is refused (`check_environment`)."""
    if _unchecked is not None or _refused is not None:
        check_environment()
    return _settings


def check_environment() -> None:
    """SettingError when the KL_ADAPTERS this process read is refused; a value read before torch was imported gets
    the checks that read the preset registry first (so a misspelt preset is refused here, not at interpreter start)."""
    global _settings, _unchecked, _refused
    with LOCK:
        if _unchecked is not None:
            try:
                checked(_settings, _unchecked)
            except SettingError as err:
                _settings, _refused = None, str(err)
            _unchecked = None
        if _refused is not None:
            raise SettingError(_refused)


def resolve(config_value: str | None, *, setting: str) -> Settings | None:
    """A framework config flag (named `setting` in errors) wins over enable()/KL_ADAPTERS; an empty or None flag
    defers to them."""
    return parse(config_value, setting=setting) if config_value not in (None, "") else active()


def enable(preset: str, *, is_clip: float | None = None, kl_target: float | None = None) -> Settings:
    """Switch every supported framework to `preset` (patching installed frameworks as they are imported); kl_target:
    a KL budget (module docstring). Replaces KL_ADAPTERS, a refused one included."""
    settings = parse(str(Settings(preset, is_clip, kl_target)), setting="kl_adapters.enable")
    _activate(settings)
    os.environ[ENV_VAR] = str(settings)
    return settings


def disable() -> None:
    """Switch off: restore every patched framework function, forget the setting (also unsets KL_ADAPTERS, and
    forgets its refusal) and any armed framework (`kl_adapters.adapters.loader.arm`: its config names then stop
    selecting presets in this process)."""
    global _settings, _unchecked, _refused
    with LOCK:
        _settings = _unchecked = _refused = None
        os.environ.pop(ENV_VAR, None)
        _switched_off()


def activate_from_env(*, defer: bool = False) -> Settings | None:
    """Activate from KL_ADAPTERS if it is set; a refused value raises SettingError.

    defer=True (the import of kl_adapters, which the .pth hook makes at interpreter start, where Python would swallow
    the error): a refusal is recorded instead, and every framework import kl-adapters patches then exits with it
    (module docstring). Pinned by tests/core/test_activation.py::test_table_through_the_pth_hook.
    """
    global _refused
    value = os.environ.get(ENV_VAR)
    torch_loaded = "torch" in sys.modules
    try:
        settings = parse(value, check_preset=torch_loaded)
    except SettingError as err:
        if not defer:
            raise
        with LOCK:
            _refused = str(err)
            _switched_on(False)
        return None
    if settings is not None:
        _activate(settings, unchecked=None if torch_loaded else f"{ENV_VAR}={value.strip()!r}")
    return settings


def announce(framework: str, path: str, settings: Settings, note: str = "") -> None:
    """Log once per process and setting that `settings` replace `framework`'s KL on `path` ("loss" or "reward"):
    ``kl-adapters: preset sequence active in trl 1.16.0 (KL path: loss; kl_target 0.5)``. WARNING level, which
    Python shows without any logging configuration. Adapters call it where a preset applies (at configuration, and
    in a Ray worker at its first KL term); later calls log nothing. Pinned by
    tests/core/test_activation.py::test_announce_logs_one_line_per_process."""
    key = (framework, path, str(settings))
    with LOCK:
        if key in _announced:
            return
        _announced.add(key)
    try:
        release = importlib.metadata.version(framework)
    except importlib.metadata.PackageNotFoundError:
        release = "(release unknown)"
    parts = [f"KL path: {path}", *(f"{key} {getattr(settings, key):g}" for key in OPTIONS
                                   if getattr(settings, key) is not None), *([note] if note else [])]
    _log.warning("kl-adapters: preset %s active in %s %s (%s)", settings.preset, framework, release, "; ".join(parts))


def _activate(settings: Settings, unchecked: str | None = None) -> None:
    global _settings, _unchecked, _refused
    with LOCK:
        _settings, _unchecked, _refused = settings, unchecked, None
        _switched_on(True)


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
