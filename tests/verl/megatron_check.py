"""verl's Megatron engine (MegatronEngineWithLMHead: forward_step, the LM-head logits processor, megatron-core's
forward-backward schedule, postprocess_micro_batch_func, ppo_loss) driven by verl's TrainingWorker (compute_log_prob's
infer_batch, the actor update's train_mini_batch), with the adapter's flag in the actor config
(``kl_loss_type=kl_adapters:sequence``), tensor parallelism over all WORLD_SIZE ranks (data-parallel size 1): gloo
on CPU with megatron_cpu.py's stand-ins, or NCCL on CUDA. Run as a script by test_megatron.py (2 CPU ranks) and
test_gpu.py (1 GPU); prints one JSON line "RESULT{...}" per rank.

The model is a tiny megatron-core GPTModel built directly (megatron_cpu.gpt_model; verl builds it through its Megatron
bridge from a HuggingFace checkpoint, which needs Transformer Engine), the HuggingFace side of verl's model config
(architecture, tokenizer, EOS id) a saved config without weights. The engine and the worker are made without their
__init__ (which builds the model through the bridge), and megatron's distributed optimizer (CUDA-only gradient
buffers) is replaced by a plain SGD step (lr 1) that records the gradient it applies: the update is the gradient.

Checks, in order: `processor` (verl's _lm_head_logits_processor alone, at TP = world size and TP 1), then per
--variant (verl's thd or bshd forward) `engine_check`: pi(EOS | y_<t) that compute_log_prob's forward keeps for the
update and the training forward's model_output equal softmax(full logits)[EOS] of the same GPTModel called on each
sequence by itself (vocab shards gathered); each rank's update (its parameter shard) equals the oracle update of
engine_oracle.py (its docstring: the math; shared with engine_check.py, as are the batch, the actor configuration
and the worker calls), its EndOfSequence from the separate forward, to float32 rounding, and differs from the oracle
without EOS (the termination control variate reached the core); with verl's own kl_loss_type the forward's outputs
and the update are bit-identical to the adapter unpatched.
"""

import argparse
import json
import os
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")
parser = argparse.ArgumentParser()
parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
parser.add_argument("--preset", default="sequence")
#: verl's data format: its packed forward (use_remove_padding=True, thd: verl's default) or its padded one (bshd). The
#: core attention is megatron_cpu.PackedCausalAttention in both, on CPU and GPU: verl's Megatron forward is written
#: for Transformer Engine's attention (megatron's own DotProductAttention takes neither thd nor the [B, S] padding mask
#: of verl's bshd forward), and Transformer Engine is neither on the CPU nor in the device image
parser.add_argument("--variant", action="append", choices=("thd", "bshd"),
                    help="engine check(s) to run, each on fresh weights (default: thd)")
parser.add_argument("--processor", action="store_true", help="the logits processor checks only (no engine check)")
args = parser.parse_args()
for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(29500 + os.getpid() % 1000)).items():
    os.environ.setdefault(key, value)
if args.device == "cpu":
    os.environ["VERL_PLATFORM"] = "cpu"

from functools import partial  # noqa: E402

import torch  # noqa: E402

if args.device == "cpu":
    import cpu_platform_shim  # noqa: E402,F401

import megatron_cpu  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402
from verl.workers.config import HFModelConfig, McoreActorConfig, McoreEngineConfig  # noqa: E402
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead  # noqa: E402
from verl.workers.engine_workers import TrainingWorker  # noqa: E402
from verl.workers.utils import losses  # noqa: E402
from verl_cases import EOS_ID, P, R, VOCAB, make_tokens  # noqa: E402

import engine_oracle  # noqa: E402
from engine_oracle import MICRO  # noqa: E402
from kl_adapters import EndOfSequence  # noqa: E402
from kl_adapters.adapters import verl as verl_adapter  # noqa: E402
from kl_adapters.adapters.verl import loss as verl_loss  # noqa: E402

DEVICE = args.device
megatron_cpu.install()


def save_config(path):
    """What verl's HFModelConfig reads (architecture, tokenizer, EOS and pad ids); no weights (the GPTModel is built
    directly)."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=EOS_ID,
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)


class _NoProfiler:
    rank = 0
    check_enable = check_this_step = check_this_rank = staticmethod(lambda: False)
    step = staticmethod(lambda: None)


class Sgd:
    """Megatron's optimizer step replaced by p -= grad (lr 1, no clipping); keeps the last flattened gradient."""

    def __init__(self, model):
        self.model, self.last = model, None

    def zero_grad(self):
        self.model.zero_grad(set_to_none=True)

    def step(self):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()]
        self.last = torch.cat([g.detach().flatten().double().cpu() for g in grads])
        with torch.no_grad():
            for p, g in zip(self.model.parameters(), grads):
                p.sub_(g)
        return float(self.last.norm())


def build(path, variant):
    """verl's TrainingWorker around verl's MegatronEngineWithLMHead, both made without their __init__ (which builds
    the model through the Megatron bridge and the distributed optimizer): the attributes their train / infer paths
    read."""
    model = megatron_cpu.gpt_model(VOCAB, device=DEVICE, tp=mpu.get_tensor_model_parallel_world_size())
    remove_padding = variant == "thd"
    engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)
    engine.model_config = HFModelConfig(path=path, use_remove_padding=remove_padding)
    engine.engine_config = McoreEngineConfig(use_remove_padding=remove_padding, micro_batch_size_per_gpu=MICRO,
                                             infer_micro_batch_size_per_gpu=MICRO, use_dynamic_bsz=False,
                                             dtype="bfloat16")  # unused here: the model is built directly
    engine.module, engine.tf_config, engine.mode = [model], model.config, None
    engine.enable_routing_replay, engine.is_value_model = False, False
    engine._is_offload_param = engine._is_offload_optimizer = False
    sgd = Sgd(model)
    engine.optimizer = sgd
    engine.optimizer_zero_grad = sgd.zero_grad
    engine.optimizer_step = sgd.step
    engine.lr_scheduler_step = lambda: 1.0
    worker = TrainingWorker.__new__(TrainingWorker)
    worker.engine, worker.model_config, worker.engine_config = engine, engine.model_config, engine.engine_config
    worker.loss_fn, worker.flops_counter, worker.device_name, worker.profiler = None, None, DEVICE, _NoProfiler()
    return worker, model, sgd


actor_config = partial(engine_oracle.actor_config, McoreActorConfig, use_dynamic_bsz=False)
tokens = make_tokens(seed=0)
batch = partial(engine_oracle.batch, tokens)
log_probs = partial(engine_oracle.log_probs, batch)
train = partial(engine_oracle.train, batch)


@torch.no_grad()
def separate_forward(model):
    """(log pi(y_t | y_<t), pi(EOS | y_<t)) at every response position, padded: the GPTModel called on each sequence
    by itself (no packing, no verl), log-softmax of its full logits (the tensor-parallel ranks' vocab shards
    gathered), float64; and whether y_t is EOS."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    log_prob, prob = torch.zeros(tokens["responses"].shape), torch.zeros(tokens["responses"].shape)
    ids = torch.cat([tokens["prompts"], tokens["responses"]], 1)
    for row, length in enumerate(tokens["attention_mask"].sum(1).tolist()):
        x = ids[row:row + 1, :length].to(DEVICE)
        logits = model(input_ids=x, position_ids=torch.arange(length, device=DEVICE)[None], attention_mask=None)
        logp = gather_from_tensor_model_parallel_region(logits)[0].double().log_softmax(-1).cpu()
        logp = logp[P - 1:length - 1]  # position P - 1 + t predicts response token t
        log_prob[row, :length - P] = logp.gather(-1, ids[row, P:length, None]).squeeze(-1).float()
        prob[row, :length - P] = logp[:, EOS_ID].exp().float()
    return log_prob, prob, (tokens["responses"] == EOS_ID) & tokens["response_mask"].bool()


@torch.no_grad()
def restore(model, theta0):
    for p, p0 in zip(model.parameters(), theta0):
        p.copy_(p0)


def flag_off_is_upstream(worker, model, theta0, old, ref, adv) -> bool:
    """engine_oracle.flag_off_is_upstream from `theta0` (the model's parameters)."""
    same, _ = engine_oracle.flag_off_is_upstream(batch, worker, actor_config("low_var_kl"),
                                                 lambda: restore(model, theta0),
                                                 lambda: torch.cat([p.detach().flatten() for p in model.parameters()]),
                                                 old, ref, adv)
    for trigger in verl_adapter.SITES:  # patched again, as the entry point leaves verl (for a next variant)
        if trigger in sys.modules:
            verl_adapter.patch(trigger)
    return same


def engine_check(variant):
    path = tempfile.mkdtemp(prefix="tiny_gpt_")
    save_config(path)
    worker, model, sgd = build(path, variant)
    theta0 = [p.detach().clone() for p in model.parameters()]
    mask = tokens["response_mask"]
    flagged_loss, captured = engine_oracle.capturing(actor_config(f"kl_adapters:{args.preset}"))

    worker.set_loss_fn(flagged_loss)  # as ActorRolloutRefWorker.init_model: the loss set before compute_log_prob
    engine_log_probs = log_probs(worker)  # None on the ranks without outputs (tensor-parallel rank > 0)
    current, eos_prob, is_eos = separate_forward(model)
    kept = verl_loss._stored_eos(batch(), R)  # what the update will find (emptied: filled again below)
    kept_error = None if kept is None else float((kept.prob.cpu() - eos_prob).abs().max())
    kept_is_eos = kept is not None and torch.equal(kept.is_eos.cpu(), is_eos)
    log_probs(worker)
    eos = EndOfSequence(eos_prob, is_eos, R)
    old, ref, adv = engine_oracle.behaviour(current, mask)

    megatron_cpu.CALLS.clear()
    flagged = train(worker, flagged_loss, old, ref, adv)
    attention_calls = list(megatron_cpu.CALLS)
    grad_flagged = sgd.last
    grads, reference = engine_oracle.oracle_updates(batch, worker, actor_config("low_var_kl", use_kl_loss=False),
                                                    args.preset, mask, old, ref, adv, eos,
                                                    lambda: restore(model, theta0), lambda: sgd.last)
    result = {
        "kept_eos_error": kept_error,  # compute_log_prob's forward vs the separate one (None: nothing kept)
        "kept_is_eos": kept_is_eos,
        **engine_oracle.update_errors(captured, eos, grad_flagged, grads),
        "log_probs_error": None if engine_log_probs is None else float((engine_log_probs - current).abs().max()),
        "grad_norms": None if flagged is None else [flagged["grad_norm"], reference["grad_norm"]],
        "metric_keys": None if flagged is None else sorted(flagged),
        "micro_batch_rows": [len(rows) for rows, _ in captured],
        "attention_calls": attention_calls,  # (tokens, sequences) per stand-in call of the flagged update
        "flag_off_equal": flag_off_is_upstream(worker, model, theta0, old, ref, adv),
    }
    return result


def processor():
    """Tensor parallelism: each rank's logits processor gets its vocab shard of the same [1, T, V] logits (rank r:
    ids [r V / tp, (r + 1) V / tp)), EOS ids on both shards; pi(EOS) of the patched processor = softmax(full
    logits / temperature)[EOS ids].sum, and its log-probs are verl's (bit-identical to the unpatched processor)."""
    rank, world = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    eos_ids = (EOS_ID, VOCAB - 5)  # one id on each half of the vocabulary
    gen = torch.Generator().manual_seed(3)
    full = 3 * torch.randn(1, 40, VOCAB, generator=gen)
    label = torch.randint(0, VOCAB, (1, 40), generator=gen)
    label[0, :6] = torch.tensor(eos_ids * 3)
    temperature = 0.5 + torch.rand(1, 40, generator=gen)
    temperature[0, 7] = 0.0  # verl sets non-positive temperatures to 1e-8 (padding)
    shard = full.chunk(world, -1)[rank].contiguous().to(DEVICE)
    label, on_device = label.to(DEVICE), temperature.to(DEVICE)

    class Tokenizer:
        eos_token_id = EOS_ID

    class Generation:
        eos_token_id = list(eos_ids)

    engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)
    engine.model_config = type("ModelConfig", (), {"tokenizer": Tokenizer(), "generation_config": Generation()})()
    engine.engine_config = McoreEngineConfig()
    loss_fn = partial(losses.ppo_loss, config=actor_config(f"kl_adapters:{args.preset}"))
    kwargs = dict(calculate_sum_pi_squared=False, distillation_use_topk=False, distillation_only=False,
                  logits_processor_func=loss_fn, batch=None, data_format="thd")
    result = {}
    for entropy in (False, True):
        ret = engine._lm_head_logits_processor(shard.clone(), label, on_device.clone(), calculate_entropy=entropy,
                                               **kwargs)
        original = MegatronEngineWithLMHead._lm_head_logits_processor.__kl_adapters_original__
        upstream = original(engine, shard.clone(), label, on_device.clone(), calculate_entropy=entropy, **kwargs)
        ret = {k: v.cpu() for k, v in ret.items()}
        t = temperature.clone()
        t[t <= 0] = 1e-8
        expected = (full.double() / t.double()[..., None]).softmax(-1)[..., list(eos_ids)].sum(-1)
        result[f"entropy={entropy}"] = {
            "eos_error": float((ret[verl_adapter.EOS_PROB].double() - expected).abs().max()),
            "eos_max": float(expected.max()),
            "is_eos": bool(torch.equal(ret[verl_adapter.IS_EOS] > 0.5,
                                       torch.isin(label.cpu(), torch.tensor(eos_ids)))),
            "log_probs_equal": bool(torch.equal(ret["log_probs"], upstream["log_probs"].cpu())),
            "upstream_keys": sorted(upstream), "keys": sorted(ret)}
    off = partial(losses.ppo_loss, config=actor_config("low_var_kl"))
    plain = engine._lm_head_logits_processor(shard.clone(), label, on_device.clone(), calculate_entropy=False,
                                             **{**kwargs, "logits_processor_func": off})
    result["flag_off_keys"] = sorted(plain)
    result["tp"] = world
    return result


def main():
    """Tensor parallelism over every rank (TP = WORLD_SIZE): the logits processor at TP = world size and at TP 1,
    then (unless --processor) each --variant's engine check at TP = world size."""
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.distributed.init_process_group("gloo" if DEVICE == "cpu" else "nccl")
    world = torch.distributed.get_world_size()
    result = {}
    for tp in dict.fromkeys((world, 1)):
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp)
        result[f"processor_tp{tp}"] = processor()
        mpu.destroy_model_parallel()
    if not args.processor:
        mpu.initialize_model_parallel(tensor_model_parallel_size=world)
        if torch.cuda.is_available():
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(0)  # megatron's CUDA RNG tracker (read by its layers)
        result["engine"] = {variant: engine_check(variant) for variant in args.variant or ["thd"]}
        mpu.destroy_model_parallel()
    result.update(rank=torch.distributed.get_rank(), world=world, device=DEVICE)
    print("RESULT" + json.dumps(result, default=float), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
