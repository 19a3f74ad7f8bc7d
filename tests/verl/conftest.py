"""verl suite fixtures: offline, no KL_ADAPTERS leaking in, and verl's KL modules patched (inert) before each test,
as the installed `verl.plugins` entry point leaves them in a real process."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("KL_ADAPTERS", None)

import sys  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

import importlib  # noqa: E402
import importlib.util  # noqa: E402

from kl_adapters import activation  # noqa: E402
from kl_adapters.adapters import verl as verl_adapter  # noqa: E402

# the entry point patches each trigger as it is imported; a release lacks some (verl 0.8.0: no v1 trainer)
for _trigger in ("verl.workers.utils.losses", "verl.trainer.ppo.ray_trainer", *verl_adapter.SITES):
    if importlib.util.find_spec(_trigger.rsplit(".", 1)[0]) and importlib.util.find_spec(_trigger):
        importlib.import_module(_trigger)


def repatch() -> None:
    for trigger in verl_adapter.SITES:
        if trigger in sys.modules:
            verl_adapter.patch(trigger)


@pytest.fixture(autouse=True)
def verl_patched(monkeypatch):
    """Each test starts with no activation and every loaded trigger patched; it ends the same way."""
    monkeypatch.delenv(activation.ENV_VAR, raising=False)
    activation.disable()
    repatch()
    yield
    activation.disable()
    repatch()
