"""CPU shim for tests only: stands in for the CUDA / DeepSpeed-engine parts of OpenRLHF 0.11.2 so that OpenRLHF's own
trainer code (ActorPPOTrainer, PolicyModelActor, RemoteExperienceMaker) runs on a CPU-only machine. Not part of
kl-adapters. Importable by Ray workers (the test cluster puts this folder on PYTHONPATH).

Also builds the test fixtures that need no hub: a tiny random Llama saved to a folder, with a word-level tokenizer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

VOCAB = 64
PAD, EOS = 0, 1


def _noop(*args, **kwargs) -> None:
    return None


def _barrier_if_initialized(*args, **kwargs) -> None:
    if torch.distributed.is_initialized():
        return _ORIGINAL_BARRIER(*args, **kwargs)
    return None


_ORIGINAL_BARRIER = torch.distributed.barrier


def cuda_shims() -> dict[tuple[object, str], Callable]:
    """The CUDA calls OpenRLHF makes unconditionally on its training path, as no-ops on CPU.

    torch_dist_barrier_and_cuda_sync (ppo_actor.py:106), fit()'s empty_cache/synchronize (ppo_actor.py:600-605), and
    torch.cuda.current_device() (replay_buffer.py:40 at construction: 0; ppo_actor.py:171 to move batches: "cpu" --
    see `set_current_device`).
    """
    return {(torch.cuda, "synchronize"): _noop, (torch.cuda, "empty_cache"): _noop,
            (torch.distributed, "barrier"): _barrier_if_initialized, (torch.cuda, "current_device"): lambda: 0}


def install_cuda_shims() -> None:
    """Ray worker_process_setup_hook of the test cluster: install `cuda_shims` in the worker process."""
    for (owner, name), fn in cuda_shims().items():
        setattr(owner, name, fn)


def set_current_device(device: int | str) -> None:
    """torch.cuda.current_device() is an int when the replay buffer is built, "cpu" when ppo_train moves batches."""
    torch.cuda.current_device = lambda: device


class CPUStrategy:
    """Stands in for DeepspeedStrategy on one CPU process (dp world size 1), keeping DeepSpeed's engine semantics.

    backward divides the loss by the gradient-accumulation steps (gas) and optimizer_step steps only at the end of
    each window of gas micro-batches, as DeepSpeed's engine does; with dynamic batching DeepSpeed runs with gas 1 and
    OpenRLHF calls optimizer_step at the window's end only. Every real step records the parameters it started from
    (`params_log`) and the gradient it applied (`grad_log`), so tests can recompute that gradient independently
    (record=False skips that, for benchmarks).
    """

    def __init__(self, args, *, accumulated_gradient: int = 1, lr: float = 0.5, record: bool = True):
        self.args, self.accumulated_gradient, self.lr, self.record = args, accumulated_gradient, lr, record
        self.ring_attn_group = None
        self.model = None
        self.grad_log: list[torch.Tensor] = []
        self.params_log: list[dict[str, torch.Tensor]] = []
        self._micro_steps = 0

    # what PolicyModelActor.init_model_from_pretrained calls
    def setup_distributed(self) -> None:
        return None

    def get_ds_train_config(self, *args, **kwargs) -> None:
        return None

    def get_ds_eval_config(self, *args, **kwargs) -> None:
        return None

    def prepare(self, model_and_config):
        actor, _config = model_and_config
        self.model = actor
        optimizer = torch.optim.SGD(actor.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return actor, optimizer, scheduler

    # what ActorPPOTrainer calls
    @property
    def _dynamic(self) -> bool:
        return bool(self.args.train.dynamic_batch_enable)

    def backward(self, loss, model, optimizer, **kwargs) -> None:
        gas = 1 if self._dynamic else self.accumulated_gradient
        (loss / gas).backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs) -> None:
        self._micro_steps += 1
        if not self._dynamic and self._micro_steps % self.accumulated_gradient:
            return
        if self.record:
            params = {k: p for k, p in self.model.named_parameters() if p.requires_grad}  # LoRA: its adapters
            self.params_log.append({k: p.detach().clone() for k, p in params.items()})
            self.grad_log.append(torch.cat([p.grad.flatten() for p in params.values()]).clone())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    def get_grad_norm(self, model) -> float:
        return float(self.grad_log[-1].norm()) if self.grad_log else 0.0

    def all_reduce(self, data, op="mean"):
        return data

    def is_rank_0(self) -> bool:
        return False  # also silences ppo_train's progress bars

    def print(self, *args) -> None:
        return None


def save_tiny_model(path: str, seed: int, hidden: int = 32) -> str:
    """A tiny random Llama (2 layers, width `hidden`, vocabulary 64) and a word-level tokenizer, saved to `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"<pad>": PAD, "</s>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="w2")
    tokenizer.save_pretrained(path)
    return path


def load_actor(path: str, dtype: torch.dtype = torch.float32):
    """OpenRLHF's Actor around the saved model (eager attention), cast to `dtype` for exact gradient comparisons."""
    from openrlhf.models import Actor

    actor = Actor(path, attn_implementation="eager", param_dtype="bf16")
    actor.model.to(dtype)
    return actor


@torch.no_grad()
def perturbed(actor, scale: float, seed: int):
    """A copy of `actor` with N(0, scale^2) added to every parameter (a behaviour policy mu != pi_theta)."""
    other = copy.deepcopy(actor)
    gen = torch.Generator().manual_seed(seed)
    for p in other.parameters():
        p.add_(scale * torch.randn(p.shape, generator=gen).to(p.dtype))
    return other


def random_batch(batch: int, prompt: int, response: list[int], seed: int):
    """Token ids, attention mask and action mask of `batch` sequences: fixed-length prompts, ragged responses."""
    gen = torch.Generator().manual_seed(seed)
    width = max(response)
    sequences = torch.randint(2, VOCAB, (batch, prompt + width), generator=gen)
    action_mask = torch.zeros(batch, width, dtype=torch.bool)
    for b, n in enumerate(response):
        action_mask[b, :n] = True
        sequences[b, prompt + n:] = PAD
    attention_mask = torch.cat([torch.ones(batch, prompt, dtype=torch.long), action_mask.long()], dim=1)
    return sequences, attention_mask, action_mask
