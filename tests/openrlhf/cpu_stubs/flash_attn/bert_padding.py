"""CPU import stub for tests only (see flash_attn/__init__.py): padding-free packing is unavailable."""

from einops import rearrange  # noqa: F401  (re-exported like the real module)


def _unavailable(*args, **kwargs):
    raise NotImplementedError("flash_attn CPU import stub: --ds.packing_samples / ring attention need flash-attn")


index_first_axis = pad_input = unpad_input = _unavailable
