"""pi(EOS) under DeepSpeed ZeRO-3 and FSDP2 (support.py's DeepSpeed ZeRO / FSDP row), on CPU.

The reduced presets read pi(EOS | y_<t) from the backbone's last hidden state and the output projection W
(`eos._head_gap`); a sharded W must be read whole, as TRL's fused LM head reads it. Pinned here:
1. FSDP2 (`fully_shard`, two gloo ranks): the EOS gap the adapter records from the sharded policy's forward equals
   `_eos_gap` of the same model unsharded on every rank, both with the head in the root's shard group (FSDP2 swaps
   the unsharded weight in during the forward) and with the head sharded on its own (a DTensor, `full_tensor()`);
2. ZeRO-3: with W partitioned to an empty tensor (`ZeroThreeStub`: DeepSpeed is not installed here), the gap of TRL's
   own forward equals the unpartitioned one, the weight gathered through TRL's `maybe_gather_lm_head_ctx`;
3. `full` (a gradient through W outside the model's forward, which neither framework can gather and reduce) is
   refused at the trainer's construction under ZeRO-3 and FSDP, in one line.
"""

import functools
import os
import socket
import sys
import types
from contextlib import contextmanager
from enum import Enum
from importlib.machinery import ModuleSpec
from types import SimpleNamespace

import pytest
import torch
from conftest import make_trainer, one_batch, perturb

from kl_adapters.adapters._guard import UnsupportedFrameworkError
from kl_adapters.adapters import trl as adapter
from kl_adapters.adapters.trl import eos as trl_eos
from kl_adapters.adapters.trl import trainer_init

EOS_IDS = (2, 5)
TEMPERATURE = 0.7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _policy_logps(model, input_ids, attention_mask, logits_to_keep):
    """log pi(y) of the last `logits_to_keep` tokens from the model's own logits: the shape of TRL's forward."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1:-1]
    logps = torch.log_softmax(logits.float() / TEMPERATURE, -1)
    return logps.gather(-1, input_ids[:, -logits_to_keep:, None])[..., 0], None


def recorded_gap(model, input_ids, width) -> torch.Tensor:
    """The EOS gap the adapter records from one policy forward of `model` (`eos._recorded`, a stand-in trainer)."""
    trainer = SimpleNamespace(model=model, accelerator=SimpleNamespace(unwrap_model=lambda m: m),
                              eos_token_ids=EOS_IDS, temperature=TEMPERATURE)
    request = trl_eos.Recording(trainer, first_only=True)
    trl_eos._recorded(request, _policy_logps, model, input_ids, torch.ones_like(input_ids), width)
    return request.seen[0].eos_gap


def unsharded_gap(model, input_ids, width) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids).last_hidden_state
    return trl_eos._eos_gap(hidden, input_ids, model.lm_head.weight, torch.tensor(EOS_IDS), width, TEMPERATURE)


def fsdp2_rank(rank: int, world: int, port: int, out: str) -> None:
    """One gloo rank: the adapter's recorded gap of the fully_shard'ed tiny Llama, head in the root group and head
    sharded on its own, beside the unsharded gap (same weights, same tokens on every rank)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from kl_adapters.tiny_models import tiny_llama

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    input_ids = torch.randint(4, 40, (3, 9), generator=torch.Generator().manual_seed(0))
    results = {}
    for case in ("root", "own"):
        model = tiny_llama(40)
        want = unsharded_gap(model, input_ids, 5)
        for layer in model.model.layers:
            fully_shard(layer)
        if case == "own":
            fully_shard(model.lm_head)
        fully_shard(model)
        results[case] = (recorded_gap(model, input_ids, 5), want)
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def test_fsdp2_sharded_head_gives_the_unsharded_gap(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(fsdp2_rank, args=(2, _free_port(), str(tmp_path / "gaps")), nprocs=2)
    for rank in range(2):
        for case, (got, want) in torch.load(tmp_path / f"gaps.{rank}").items():
            assert type(got) is torch.Tensor, case
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, head {case}")


class ZeroThreeStub:
    """A test stub of DeepSpeed ZeRO-3 for one module's weight (DeepSpeed is not installed here): `partition` empties
    the data as ZeRO-3 does outside the module's own forward (ds_status NOT_AVAILABLE), the module's forward hooks
    gather it for that forward (ZeRO-3's parameter coordinator), the stub `deepspeed` module's
    `zero.GatheredParameters` puts it back for the duration of the context, and transformers'
    `is_deepspeed_zero3_enabled` says True. `gathers` counts the GatheredParameters entered."""

    class ZeroParamStatus(Enum):
        AVAILABLE = 1
        NOT_AVAILABLE = 2

    def __init__(self, monkeypatch, module: torch.nn.Module):
        self.param, self.full, self.gathers = module.weight, module.weight.data, 0
        module.register_forward_pre_hook(lambda *_: self.available())
        module.register_forward_hook(lambda *_: self.partition())
        for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero",
                     "deepspeed.runtime.zero.partition_parameters"):
            module = types.ModuleType(name)
            module.__spec__ = ModuleSpec(name, None)  # no distribution: accelerate still finds no DeepSpeed installed
            monkeypatch.setitem(sys.modules, name, module)
        sys.modules["deepspeed"].zero = SimpleNamespace(GatheredParameters=self.gathered)
        sys.modules["deepspeed.runtime.zero.partition_parameters"].ZeroParamStatus = self.ZeroParamStatus
        monkeypatch.setattr("transformers.integrations.deepspeed.is_deepspeed_zero3_enabled", lambda: True)
        self.partition()

    def partition(self):
        self.param.data, self.param.ds_status = torch.empty(0), self.ZeroParamStatus.NOT_AVAILABLE

    def available(self):
        self.param.data, self.param.ds_status = self.full, self.ZeroParamStatus.AVAILABLE

    @contextmanager
    def gathered(self, params):
        assert params == [self.param]
        self.gathers += 1
        self.available()
        try:
            yield
        finally:
            self.partition()


def test_zero3_partitioned_head_is_gathered(model_dir, dataset, monkeypatch):
    """TRL's forward gets W from the head's own forward (trl 1.14.x) or from maybe_gather_lm_head_ctx (trl >= 1.15's
    fused head); the adapter's EOS read, after the backbone and before either, enters TRL's context and gets the
    unpartitioned gap."""
    trainer = make_trainer(model_dir, dataset)
    perturb(trainer.model, seed=31)
    batch = one_batch(trainer)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]

    def gap():
        request = trl_eos.Recording(trainer, first_only=True)
        with trl_eos.RECORDING.bound(request), torch.no_grad():
            trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, width)
        return request.seen[0].eos_gap

    want = gap()
    stub = ZeroThreeStub(monkeypatch, trainer.model.lm_head)
    got = gap()
    assert stub.gathers >= 1 and trainer.model.lm_head.weight.numel() == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sharding", ["DeepSpeed ZeRO-3", "FSDP"])
def test_full_is_refused_under_sharding(model_dir, dataset, monkeypatch, sharding):
    """ZeRO-3 (transformers' flag, which TrainingArguments' `deepspeed` config sets) stops the construction; FSDP
    (Trainer's is_fsdp_enabled, which TRL also reads to wrap its reference model, so it is set on a built trainer)
    stops the same check."""
    if sharding == "FSDP":
        trainer = make_trainer(model_dir, dataset, kl_preset="full")
        trainer.is_fsdp_enabled = True
        construct = functools.partial(trainer_init._check_sharded_head, trainer, adapter.settings_for(trainer),
                                      "kl_preset")
    else:
        monkeypatch.setattr("transformers.integrations.deepspeed.is_deepspeed_zero3_enabled", lambda: True)
        construct = functools.partial(make_trainer, model_dir, dataset, kl_preset="full")
    with pytest.raises(UnsupportedFrameworkError) as error:
        construct()
    (line,) = str(error.value).splitlines()
    assert line.startswith(f"kl_preset='full' is refused under {sharding}: ")
