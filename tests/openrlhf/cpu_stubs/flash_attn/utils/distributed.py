"""CPU import stub for tests only (see flash_attn/__init__.py)."""


def all_gather(*args, **kwargs):
    raise NotImplementedError("flash_attn CPU import stub: ring attention needs flash-attn")
