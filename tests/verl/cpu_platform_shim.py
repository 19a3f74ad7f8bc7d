"""TEST-ONLY shim: lets verl 0.9.1's FSDP engine run on CPU. verl has no CPU platform (its registry knows nvidia,
huawei and amd), so this registers one that reuses the CUDA platform with device "cpu" and gloo, and registers the
FSDP language-model engine for device "cpu". Not part of kl-adapters; imported only by tests/verl/engine_check.py.
Set VERL_PLATFORM=cpu before importing it."""

import torch
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import PlatformRegistry


class _CpuDeviceModule:
    """The parts of a torch.cuda-like module verl's engine calls."""

    is_available = staticmethod(lambda: True)
    max_memory_allocated = max_memory_reserved = memory_allocated = memory_reserved = staticmethod(lambda *a, **k: 0)
    empty_cache = synchronize = reset_peak_memory_stats = staticmethod(lambda *a, **k: None)
    current_device = staticmethod(lambda: "cpu")
    manual_seed = manual_seed_all = staticmethod(torch.manual_seed)
    mem_get_info = staticmethod(lambda *a, **k: (0, 1))
    get_device_name = staticmethod(lambda *a, **k: "CPU")
    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformCUDA):
    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: _CpuDeviceModule)

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, index):
        pass

    def synchronize(self, index=None):
        pass

    def empty_cache(self):
        pass

    def set_allocator_settings(self, settings):
        pass

    def communication_backend_name(self):
        return "gloo"

    def get_device_capability(self, index=0):
        return None, None

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)


from verl.workers.engine import EngineRegistry  # noqa: E402 (its import needs the platform registered)
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402

for _backend in ("fsdp", "fsdp2"):
    EngineRegistry._engines["language_model"][_backend]["cpu"] = FSDPEngineWithLMHead
