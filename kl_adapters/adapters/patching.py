"""One patching mechanism for the three adapters: wrap a framework's functions where it looks them up, check each one's
signature first, and give back the original objects; and one way for the wrappers to hand each other values.

An adapter lists its `Site`s (the function, the leading parameters its wrapper relies on, the wrapper factory) and
calls `install(framework, version, module, sites)` from its ``patch`` (`version`: `_guard.require_version`'s) and
`uninstall(framework)` from its ``unpatch``. `install` refuses a function whose leading parameters differ from the ones
the adapter was written for, with an `UnsupportedFrameworkError` naming the framework release and the tested ones,
before anything is replaced; it is idempotent (a site already wrapped is skipped). Each wrapper carries the object it
replaced (``ORIGINAL``), so `uninstall` sets every wrapped attribute back to that very object: with the adapters
unpatched the framework runs its own functions, the identical objects (each suite's flag-off tests).

State between wrappers (`Scoped`): a wrapper that knows something an inner call of the framework needs (the batch of a
training step, the request to read pi(EOS) from a forward's logits) binds it for the extent of its own call,
``with STEP.bound(value): original(...)``; the wrappers the framework calls inside read ``STEP.get()`` (None outside
any such call: the framework's own code path, unchanged). Each thread and asyncio task sees its own values
(contextvars), and the previous value is back when the block ends, however it ends. Where the framework's own code
reads an attribute the adapter must change for one call (TRL's ``beta``), `overriding` sets it for that block alone.
Imports neither torch nor any framework.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ._guard import UnsupportedFrameworkError
from .versions import supported_range

#: attribute of a wrapper holding the object it replaced
ORIGINAL = "__kl_adapters_original__"


@dataclass(frozen=True)
class Site:
    """One framework function to wrap: where it lives, the leading parameters its wrapper relies on, the wrapper.

    name        the attribute (a module's function, or with `owner` a method defined on that class itself)
    params      its leading parameter names in the release the adapter was written for
    wrap        original -> wrapper (`install` adds functools.wraps and `ORIGINAL`)
    module      the module holding it, when not the one `install` is given (imported if need be)
    owner       the class of that module whose method it is (wrapped on the class)
    everywhere  also rebind the ``from <module> import name`` copies in the framework's modules already loaded (the
                import-site binding pitfall); only for module functions
    params_in   releases whose function has other leading parameters: release -> those parameters
    """

    name: str
    params: tuple[str, ...]
    wrap: Callable[[Callable], Callable]
    module: str | None = None
    owner: str | None = None
    everywhere: bool = False
    params_in: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def expected_params(self, version: str) -> tuple[str, ...]:
        return self.params_in.get(version, self.params)


def is_ours(value: object) -> bool:
    """Whether `value` is a wrapper `install` made."""
    return isinstance(value, types.FunctionType) and ORIGINAL in value.__dict__


def _framework_modules(framework: str) -> list[types.ModuleType]:
    return [m for n, m in list(sys.modules.items())
            if (n == framework or n.startswith(framework + ".")) and m is not None]


#: framework -> the classes `install` wrapped methods on (their modules are found by name)
_owners: dict[str, list[type]] = {}


def install(framework: str, version: str, module: str, sites: Iterable[Site]) -> None:
    """Wrap every site of `module` (idempotent). UnsupportedFrameworkError, before any site is replaced, for a site whose
    function is missing or whose leading parameters are not `Site.expected_params(version)`."""
    planned = []
    for site in sites:
        holder_module = importlib.import_module(site.module or module)
        holder = getattr(holder_module, site.owner) if site.owner else holder_module
        original = vars(holder).get(site.name)
        if is_ours(original):
            continue
        params = tuple(inspect.signature(original).parameters) if callable(original) else None
        expected = site.expected_params(version)
        if params is None or params[: len(expected)] != expected:
            where = ".".join(filter(None, (holder_module.__name__, site.owner, site.name)))
            raise UnsupportedFrameworkError(
                f"{framework} {version}: {where}{params or ''} is not the function kl-adapters was tested with "
                f"({supported_range(framework)}, parameters {expected})")
        planned.append((site, holder, original))
    for site, holder, original in planned:
        wrapper = functools.wraps(original)(site.wrap(original))
        setattr(wrapper, ORIGINAL, original)
        if site.owner:
            _owners.setdefault(framework, []).append(holder)
        targets = _framework_modules(framework) if site.everywhere and not site.owner else [holder]
        for target in targets:
            if target is holder or vars(target).get(site.name) is original:
                setattr(target, site.name, wrapper)


def _holders(framework: str) -> list[object]:
    return [*_framework_modules(framework), *dict.fromkeys(_owners.get(framework, []))]


def uninstall(framework: str) -> None:
    """Set every wrapped attribute of `framework` (in its loaded modules and the wrapped classes) back to the object
    it replaced."""
    for holder in _holders(framework):
        for name, value in list(vars(holder).items()):
            if is_ours(value):
                setattr(holder, name, getattr(value, ORIGINAL))
    _owners.pop(framework, None)


def installed(framework: str) -> list[str]:
    """The wrapped attributes of `framework`, as 'Class.method' or 'module.function' (sorted)."""
    return sorted({f"{getattr(holder, '__name__', holder)}.{name}" for holder in _holders(framework)
                   for name, value in vars(holder).items() if is_ours(value)})


T = TypeVar("T")


class Scoped(Generic[T]):
    """A value the adapter's wrappers hand each other: bound by an outer wrapper for the extent of the framework call
    it wraps (`bound`), read by the wrappers the framework calls inside it (`get`: None outside every binding).
    Per thread and asyncio task (a ContextVar); a binding always ends with the previous value restored."""

    def __init__(self, name: str):
        self._var: contextvars.ContextVar[T | None] = contextvars.ContextVar(f"kl_adapters.{name}", default=None)

    def get(self) -> T | None:
        return self._var.get()

    @contextlib.contextmanager
    def bound(self, value: T) -> Iterator[T]:
        """`value` for the block, then the previous value again (also when the block raises)."""
        token = self._var.set(value)
        try:
            yield value
        finally:
            self._var.reset(token)

    def replace(self, value: T | None) -> None:
        """Set `value` until the next `replace` in this thread, for a value no single call encloses (verl: the batch an
        actor update trains on, tagged when it is split and read by the update's later ppo_loss calls)."""
        self._var.set(value)


@contextlib.contextmanager
def overriding(holder: object, name: str, value: object) -> Iterator[None]:
    """holder.name = value for the block, then the previous value again (also when the block raises): for an attribute
    the framework's own code reads during one call, where no narrower point exists (TRL's trainer.beta, which its
    _compute_loss reads to decide whether to add its KL term)."""
    previous = getattr(holder, name)
    setattr(holder, name, value)
    try:
        yield
    finally:
        setattr(holder, name, previous)
