"""TEST-ONLY IMPORT STUB for ray, not Ray: lets verl and OpenRLHF be imported on the GPU machine, where Ray's 74 MB
wheel is not carried (scripts/gpu.sh puts this folder on PYTHONPATH for the verl and openrlhf GPU suites only).

The GPU tests drive verl's worker and OpenRLHF's trainer in one process; no Ray cluster is started (the Ray activation
is proven on CPU, tests/*/test_ray.py). Every `ray` and `ray.<submodule>` attribute is a placeholder: usable as a
decorator (returns what it decorates), as a base class, and in isinstance checks (nothing is an instance); calling
ray.init / ray.get / ray.remote(...).remote raises, so a test that reaches Ray fails loudly instead of passing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+import-stub"
IS_IMPORT_STUB = True
_FORBIDDEN = {"init", "get", "put", "wait", "kill", "get_actor", "nodes", "cluster_resources", "available_resources"}


class _Missing(type):
    """A placeholder: a class (so subclassing and isinstance work) whose attributes are further placeholders."""

    def __getattr__(cls, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"{cls.__qualname__}.{attr}")

    def __call__(cls, *args, **kwargs):
        name = cls.__qualname__
        if name.rsplit(".", 1)[-1] in _FORBIDDEN or (name.endswith(".remote") and name != "ray.remote"):
            raise RuntimeError(f"{name}() called: ray is a test-only import stub here (tests/device_image/ray_stub)")
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # @ray.remote / @ray.method(...) on a class or function: keep it undecorated
        return _placeholder(f"{name}(...)")


def _placeholder(name: str) -> type:
    return _Missing(name, (), {"__qualname__": name, "__module__": "ray"})


def _module_getattr(prefix: str):
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"{prefix}.{attr}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import ray.util.placement_group` and the like: an empty module whose attributes are placeholders."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("ray."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name, "test-only import stub (tests/device_image/ray_stub)")
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        return None


sys.meta_path.insert(0, _SubmoduleFinder())
__getattr__ = _module_getattr("ray")


def is_initialized() -> bool:
    return False
