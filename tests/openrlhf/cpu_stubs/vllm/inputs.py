"""CPU import stub for tests only (see vllm/__init__.py)."""

TokensPrompt = dict
