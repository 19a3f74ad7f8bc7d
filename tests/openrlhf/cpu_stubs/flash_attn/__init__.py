"""CPU import stub for tests only: not flash-attn. OpenRLHF 0.11.2 imports flash_attn at module top
(models/ring_attn_utils.py:3-4), and flash-attn cannot be installed without CUDA. There is deliberately no
``flash_attn.ops``, so models/utils.py:180 falls back to its torch log-softmax path."""

__version__ = "0.0.0+cpustub"
