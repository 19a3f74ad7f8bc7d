"""CPU import stub for tests only (see flash_attn/__init__.py)."""
