"""CPU import stub for tests only: not vLLM. OpenRLHF 0.11.2 imports vllm at module top
(trainer/ray/__init__.py -> vllm_engine.py:7-12, samples_generator.py:7) and PolicyModelActor reads
``vllm.__version__`` (ppo_actor.py:504-509); vLLM cannot be installed without CUDA. No generation is possible."""

__version__ = "0.29.0"


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
