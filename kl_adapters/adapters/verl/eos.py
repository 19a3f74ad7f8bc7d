"""verl adapter, end-of-sequence probabilities: pi(EOS | y_<t) from the logits the FSDP engine's forward already makes
(`end_of_sequence.eos_probabilities`), put beside verl's log-probs for ppo_loss (`_eos_outputs`) or kept per row from
compute_log_prob's pass for the next update's statistics (`_keep_eos_rows`, `state.EOS_ROWS`)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from .._guard import UnsupportedFrameworkError
from ..end_of_sequence import eos_probabilities
from ..end_of_sequence import eos_token_ids as read_eos_token_ids
from .flags import _loss_settings
from .state import EOS_PENDING, EOS_REQUEST, EOS_ROWS, EosRequest

#: model_output keys beside verl's "log_probs", in its layout: pi(EOS | y_<t) of the forward that made them (float) and
#: whether y_t is an end-of-sequence token (bool); added by the FSDP engine's forward when a reduced preset is on
EOS_PROB, IS_EOS = "kl_adapters_eos_prob", "kl_adapters_is_eos"


def end_of_sequence_probabilities(logits: Tensor, labels: Tensor, log_probs: Tensor,
                                  eos_ids: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """(pi(EOS | x_<=j) summed over eos_ids, whether labels_j is an EOS id) at every position of one call of verl's
    logprobs_from_logits(logits [..., V] (already at the rollout temperature), labels [...]) -> log_probs [...]:
    `end_of_sequence.eos_probabilities` (two gathers per token, float32, detached). Pinned by
    tests/verl/test_eos.py::test_eos_probabilities_are_the_softmax and, through the FSDP engine against a separate
    forward, tests/verl/test_engine.py."""
    import torch

    prob = eos_probabilities(logits, labels, log_probs, eos_ids)
    return prob, torch.isin(labels, torch.as_tensor(eos_ids, device=labels.device))


def eos_token_ids(model_config) -> tuple[int, ...]:
    """The end-of-sequence ids verl's rollout stops at, from the engine's HFModelConfig: its generation config's
    eos_token_id (an id or a list) and its tokenizer's eos_token_id. () when neither is set."""
    return read_eos_token_ids(getattr(model_config, "generation_config", None), getattr(model_config, "tokenizer", None))


def _wants_eos(loss_fn) -> bool:
    """Whether a worker's loss function (verl's partial(ppo_loss, config=actor_config)) selects a reduced preset,
    whose termination control variate reads pi(EOS | y_<t)."""
    config = getattr(loss_fn, "keywords", {}).get("config") if loss_fn is not None else None
    if config is None or not hasattr(config, "kl_loss_type"):
        return False
    settings = _loss_settings(config)
    return settings is not None and settings.spec.uses_batch_statistics


def _record_eos(logprobs_from_logits: Callable) -> Callable:
    """Wrap the FSDP engine's logprobs_from_logits: while `_eos_outputs` asks for it (`state.EOS_REQUEST`), also record
    `end_of_sequence_probabilities` of the same logits. Its result is verl's, untouched."""

    def patched(logits, labels, *args, **kwargs):
        log_probs = logprobs_from_logits(logits, labels, *args, **kwargs)
        request = EOS_REQUEST.get()
        if request is not None:
            request.record = end_of_sequence_probabilities(logits, labels, log_probs, request.ids)
        return log_probs

    return patched


def _eos_outputs(prepare_model_outputs: Callable) -> Callable:
    """Wrap FSDPEngineWithLMHead.prepare_model_outputs, which turns the model's logits into model_output["log_probs"]:
    in the actor's training forward under a reduced preset (its loss function, passed here as
    logits_processor_func, `_wants_eos`), add model_output[EOS_PROB] / [IS_EOS] in log_probs' layout; in an armed
    compute_log_prob pass (`_keep_eos_rows`), keep them per row instead. Nothing else changes; with no reduced preset
    verl's method runs alone. No second forward: `_record_eos` reads the logits this forward already made. The
    Megatron engine has its own pair of wrappers (`megatron`); other engines add nothing, so no termination control
    variate there."""

    def patched(self, output, output_args, micro_batch, logits_processor_func, *args, **kwargs):
        pending = EOS_PENDING.get()
        ids = eos_token_ids(self.model_config) if pending is not None or _wants_eos(logits_processor_func) else ()
        if not ids:
            return prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func, *args, **kwargs)
        with EOS_REQUEST.bound(EosRequest(ids)) as request:
            model_output = prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func,
                                                 *args, **kwargs)
        record = request.record
        if record is None or model_output.get("log_probs") is None:  # fused kernels: verl made no logits here
            return model_output
        prob, is_eos = _like_log_probs(self, record, model_output["log_probs"], output_args)
        return place_eos(model_output, prob, is_eos, pending, micro_batch)

    return patched


def place_eos(model_output: dict, prob: Tensor, is_eos: Tensor, pending: dict | None, batch) -> dict:
    """Where an engine's forward puts its rows' pi(EOS) and end flags: into model_output (EOS_PROB, IS_EOS), where
    ppo_loss finds them, or, in an armed compute_log_prob pass (`pending`), into the pass's rows keyed by
    `_row_keys` of the batch's input_ids and multi_modal_inputs. The FSDP engine's and the Megatron engine's
    (`megatron`) wrappers both end here."""
    if pending is None:
        model_output[EOS_PROB], model_output[IS_EOS] = prob, is_eos
    else:
        keys = _row_keys(batch["input_ids"], batch.get("multi_modal_inputs", None))
        pending.update(zip(keys, zip(prob.unbind(), is_eos.unbind())))
    return model_output


def _like_log_probs(engine, record: tuple[Tensor, Tensor], log_probs: Tensor, output_args: dict):
    """The recorded (prob, is_eos) of `_record_eos` in the layout of model_output["log_probs"], made as verl makes
    log_probs: in the remove-padding forward (the one whose output_args carry "pad_size"), verl's own
    `_gather_and_unpad_packed(x, pad_size)` -- under Ulysses `gather_outputs_and_unpad` over the sequence-parallel
    group, which turns each rank's shard of the packed micro-batch into the whole one; without it, the tail padding
    cut -- then log_probs' nested offsets. Every rank of the group calls the gather, as for log_probs. Pinned by
    tests/verl/test_sequence_parallel.py (Ulysses over two ranks: the kept pi(EOS) and the update of world size 1)
    and tests/verl/test_coverage_engine.py (packed = padded)."""
    import torch

    packed = torch.stack((record[0], record[1].to(record[0].dtype)), -1).reshape(-1, 2)
    values = log_probs.values() if log_probs.is_nested else log_probs
    if "pad_size" in output_args:
        packed = engine._gather_and_unpad_packed(packed, output_args["pad_size"])
    if packed.shape[0] != values.shape[0]:
        raise UnsupportedFrameworkError(f"verl's engine made {values.shape[0]} log-probs from logits at "
                                        f"{packed.shape[0]} positions: this verl code path is not the tested one")
    prob, is_eos = packed[:, 0].contiguous(), packed[:, 1] > 0.5
    if not log_probs.is_nested:
        return prob, is_eos
    offsets = log_probs.offsets()
    return (torch.nested.nested_tensor_from_jagged(prob, offsets),
            torch.nested.nested_tensor_from_jagged(is_eos, offsets))


def _row_keys(input_ids: Tensor, multi_modal_inputs=None) -> list[bytes]:
    """One key per row of a nested [B, j] tensor of token ids: a digest of the row's ids and, for a vision-language
    model, of its entry of verl's `multi_modal_inputs` column (pixel_values, image_grid_thw, ...: the same tokens with
    another image have other end-of-sequence probabilities); rows with the same tokens and inputs have the same
    probabilities under the same policy. A row without multi-modal inputs keeps the digest of its ids alone. Pinned by
    tests/verl/test_vision_language.py (two rows with the same tokens and different images)."""
    import hashlib

    values, offsets = input_ids.values().cpu().numpy(), input_ids.offsets().tolist()
    rows = [None] * (len(offsets) - 1) if multi_modal_inputs is None else list(
        multi_modal_inputs.tolist() if hasattr(multi_modal_inputs, "tolist") else multi_modal_inputs)
    keys = []
    for a, b, inputs in zip(offsets, offsets[1:], rows):
        digest = hashlib.blake2b(values[a:b].tobytes(), digest_size=16)
        inputs = getattr(inputs, "data", inputs)  # a NonTensorData entry; None or {} for a text-only row
        if inputs is not None and not (isinstance(inputs, dict) and not inputs):
            _digest_update(digest, inputs)
        keys.append(digest.digest())
    return keys


def _digest_update(digest, value) -> None:
    """Feed one row's multi-modal inputs (a dict of tensors, lists, scalars) into `digest`: keys in sorted order,
    tensors by dtype, shape and bytes."""
    import torch

    if isinstance(value, dict):
        for key in sorted(value, key=str):
            digest.update(repr(key).encode())
            _digest_update(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"[{len(value)}".encode())
        for item in value:
            _digest_update(digest, item)
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{tensor.dtype}{tuple(value.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy())
    else:
        digest.update(repr(value).encode())


def _keep_eos_rows(infer_batch: Callable) -> Callable:
    """Wrap TrainingWorker.infer_batch: for the actor (its loss function `_wants_eos`), outside verl's reference pass
    through the actor (no_lora_adapter), keep each row's end-of-sequence probabilities in `EOS_ROWS` (replacing the
    previous pass's). That pass is compute_log_prob, which makes old_log_probs: the same forward, no extra cost
    beyond two gathers per token. Its output is verl's, untouched."""

    def patched(self, data, *args, **kwargs):
        from verl.utils import tensordict_utils as tu

        if not _wants_eos(self.loss_fn) or tu.get(data, key="no_lora_adapter", default=False):
            return infer_batch(self, data, *args, **kwargs)
        with EOS_PENDING.bound({}) as pending:
            output = infer_batch(self, data, *args, **kwargs)
        EOS_ROWS.replace(pending)
        return output

    return patched
