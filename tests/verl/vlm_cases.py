"""Builders and the engine run of tests/verl/test_vision_language.py.

Builders: a tiny randomly initialised Qwen2.5-VL or Qwen2-VL (`tiny_vlm`, from a config: no model hub; 2 text
layers of width 32, a 2-block vision tower on 2x2-pixel patches, 2x2 merge), a word-level tokenizer carrying Qwen's
vision tokens (`tokenizer`), transformers' own Qwen2-VL image processor (its PIL backend: torchvision, which the
processor's video half needs, is not installed, so no AutoProcessor is saved and verl's hf_processor finds none; the
actor update never uses one) on random RGB images of 8 to 16 pixels a side, and the batch in the layout verl's agent
loop hands the actor (`make_rows`, `position_ids`, `vlm_batch`): left-padded prompts holding each image's run of
<|image_pad|> tokens (one per merged 2x2 patch group), right-padded responses (a response shorter than R ends with
EOS, as a rollout's does), position ids of shape [B, 4, L] (a text row, then Qwen2-VL's three mrope rows from the
model's get_rope_index, which verl binds to its processor: `AgentLoopWorker._compute_position_ids`), and per row
`multi_modal_inputs` {pixel_values, image_grid_thw, images_seqlens} ({} for a text-only row), a NonTensorStack as
DataProto.to_tensordict makes it.

The engine run (`main`; a script run by the test, one process, world size 1, gloo on CPU through the test-only
platform shim): verl's TrainingWorker + FSDP2 engine with engine_check.py's builders (engine and actor
configuration, SGD step, parameter read-out, the oracle loss), float32 compute. With use_remove_padding=True verl
replaces Qwen2(.5)-VL's text attention by its own `qwen2_vl_attn_forward`, which calls flash-attention's
`flash_attn_varlen_func` on the packed micro-batch (cu_seqlens from the text position row); flash-attn needs CUDA,
so the run puts a TEST-ONLY CPU
stand-in (`varlen_attention_stand_in`, plain causal softmax attention within each packed sequence) at that name, and
neutralises verl's cast of float32 q/k/v to bf16 before it (`fa_peft_integration_check`, there for flash-attention's
dtypes: a no-op in verl's default bf16 mixed precision, where q/k/v already are bf16). Everything else -- verl's
monkey-patched Qwen VL forward (vision tower, image-token scatter, 4-row positions), packing, unpacking, micro-batches,
ppo_loss -- is verl's own. The padded engine (use_remove_padding=False) needs no stand-in: transformers' eager
attention with verl's 2-D mask.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

import numpy as np
import torch

#: vocabulary: <pad> 0, <bos> 1, <eos> 2, <unk> 3, text tokens t4..t59, then Qwen's vision tokens
VOCAB, EOS_ID, PAD_ID = 64, 2, 0
VISION_START, VISION_END, IMAGE_ID, VIDEO_ID = 60, 61, 62, 63
#: response length
R = 6
#: pixels per patch side, patches per merged token side
PATCH, MERGE = 2, 2
FAMILIES = ("qwen2_5_vl", "qwen2_vl")
#: each row's image (height, width) in pixels, None for a text-only row (verl's mixed text-image batches). Row 6 has
#: row 0's prompt and response tokens but another image: its pi(EOS) differs, so a per-row store keyed by the token
#: ids alone would hand one of them the other's
IMAGES = [(8, 8), (8, 16), (16, 8), None, (8, 8), (16, 16), (8, 8), (8, 16)]
TWIN = {6: 0}


def tokenizer():
    """A word-level fast tokenizer over VOCAB (pad 0, bos 1, eos 2, unk 3) with Qwen's vision tokens as special tokens
    at VISION_START, VISION_END, IMAGE_ID, VIDEO_ID."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = {"<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END, "<|image_pad|>": IMAGE_ID,
               "<|video_pad|>": VIDEO_ID}
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, VISION_START)}, **special}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", additional_special_tokens=list(special))


def tiny_vlm(family: str = "qwen2_5_vl", seed: int = 0):
    """A randomly initialised Qwen2_5_VLForConditionalGeneration (Qwen2.5-VL: windowed vision attention, window of
    2x2 merged tokens, block 1 full attention) or Qwen2VLForConditionalGeneration, float32, train mode. Text: 2
    layers, width 32, 4 heads (2 KV), mrope sections [2, 1, 1] (head_dim 8); vision: 2 blocks of width 16."""
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS_ID,
                pad_token_id=PAD_ID,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=2, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2)
    if family == "qwen2_5_vl":
        vision.update(hidden_size=16, intermediate_size=32, out_hidden_size=32, window_size=2 * PATCH * MERGE,
                      fullatt_block_indexes=[1])
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    elif family == "qwen2_vl":
        vision.update(embed_dim=16, hidden_size=32, mlp_ratio=2)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        raise ValueError(family)
    config = config_class(text_config=text, vision_config=vision, image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
                          vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                          tie_word_embeddings=False)
    torch.manual_seed(seed)
    return model_class(config).float().train()


def image_processor():
    """transformers' Qwen2-VL image processor (PIL backend) at the tiny model's patch and merge sizes; images of 16 to
    1024 pixels keep their size (multiples of PATCH * MERGE)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, min_pixels=16,
                                    max_pixels=1024)


def make_rows(seed: int = 0) -> dict:
    """The batch's tokens and images: prompts [B, P] (left-padded: text, <|vision_start|>, the image's
    <|image_pad|> run, <|vision_end|>, text), responses [B, R], attention_mask [B, P + R], response_mask,
    mm_token_type_ids (1 at image tokens) and per row its multi_modal_inputs (pixel_values [patches, 24],
    image_grid_thw [1, 3], images_seqlens; {} without an image). TWIN rows copy their source's tokens."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    process = image_processor()
    prompts, responses, lengths, inputs = [], [], [], []
    for row, size in enumerate(IMAGES):
        before, after = (torch.randint(4, VISION_START, (n,), generator=gen).tolist()
                         for n in torch.randint(1, 4, (2,), generator=gen).tolist())
        mm = {}
        image = []
        if size is not None:
            pixels = process(images=[rng.integers(0, 256, (*size, 3), dtype=np.uint8)], return_tensors="pt")
            grid = pixels["image_grid_thw"]
            mm = {"pixel_values": pixels["pixel_values"], "image_grid_thw": grid,
                  "images_seqlens": torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])}
            image = [VISION_START] + [IMAGE_ID] * int(grid.prod() // MERGE**2) + [VISION_END]
        length = R if row == 0 else int(torch.randint(1, R + 1, (1,), generator=gen))
        response = torch.randint(4, VISION_START, (R,), generator=gen)
        if length < R:
            response[length - 1] = EOS_ID
        response[length:] = PAD_ID
        prompt = before + image + after
        if row in TWIN:
            prompt, response, length = prompts[TWIN[row]], responses[TWIN[row]].clone(), lengths[TWIN[row]]
        prompts.append(prompt)
        responses.append(response)
        lengths.append(length)
        inputs.append(mm)
    P = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[PAD_ID] * (P - len(p)) + p for p in prompts])
    response_mask = (torch.arange(R)[None] < torch.tensor(lengths)[:, None]).long()
    attention_mask = torch.cat([(prompt_ids != PAD_ID).long(), response_mask], 1)
    ids = torch.cat([prompt_ids, torch.stack(responses)], 1)
    return {"prompts": prompt_ids, "responses": torch.stack(responses), "attention_mask": attention_mask,
            "response_mask": response_mask, "mm_token_type_ids": (ids == IMAGE_ID).long(),
            "multi_modal_inputs": inputs}


def position_ids(model, rows: dict) -> torch.Tensor:
    """[B, 4, P + R] as verl's agent loop makes them, row by row: the text positions (0, 1, ... over the attended
    tokens, 1 at padding), then the model's get_rope_index (3 mrope rows: temporal, height, width over each image's
    merged grid; 0 at padding)."""
    ids = torch.cat([rows["prompts"], rows["responses"]], 1)
    out = []
    for i in range(ids.shape[0]):
        grid = rows["multi_modal_inputs"][i].get("image_grid_thw")
        mask = rows["attention_mask"][i:i + 1]
        vision, _ = model.model.get_rope_index(ids[i:i + 1], rows["mm_token_type_ids"][i:i + 1], image_grid_thw=grid,
                                               attention_mask=mask)
        text = torch.ones(1, ids.shape[1], dtype=torch.long)
        text[0, mask[0].bool()] = torch.arange(int(mask.sum()))
        out.append(torch.cat([text[None], vision.transpose(0, 1)], 1)[0])
    return torch.stack(out)


def stacked_images(rows: dict) -> dict:
    """The batch's images as one transformers forward takes them: pixel_values and image_grid_thw concatenated in
    row order."""
    inputs = [mm for mm in rows["multi_modal_inputs"] if mm]
    return {key: torch.cat([mm[key] for mm in inputs]) for key in ("pixel_values", "image_grid_thw")}


@torch.no_grad()
def separate_eos(path: str, rows: dict):
    """pi(EOS | y_<t) at every response position from a plain transformers forward of the saved model (float64; sdpa
    attention: transformers 5.10's eager attention in float64 turns left-padded rows to nan; the batch padded;
    transformers' own mrope positions from input_ids and mm_token_type_ids): the reference for the engine's. Must run
    before verl's monkey patch replaces the Qwen VL forwards."""
    from kl_adapters import EndOfSequence
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
    images = stacked_images(rows)
    ids = torch.cat([rows["prompts"], rows["responses"]], 1)
    logits = model(input_ids=ids, attention_mask=rows["attention_mask"], mm_token_type_ids=rows["mm_token_type_ids"],
                   pixel_values=images["pixel_values"].double(), image_grid_thw=images["image_grid_thw"]).logits
    prob = logits.softmax(-1)[:, -R - 1:-1, EOS_ID]  # position P - 1 + t predicts response token t
    mask = rows["response_mask"]
    return EndOfSequence((prob * mask).float(), (rows["responses"] == EOS_ID) & mask.bool(), R)


def varlen_attention_stand_in(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                              dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
    """TEST-ONLY CPU stand-in for flash_attn.flash_attn_varlen_func as verl's Qwen VL attention calls it: q, k, v
    [total, H, D] (KV heads already repeated), sequences cut at cu_seqlens; softmax(q k^T * scale) v within each
    sequence (causal: lower triangle), [total, H, D]. Records each call's total length in CALLS."""
    assert dropout_p == 0.0 and "window_size" not in kwargs and kwargs.get("softcap") is None
    assert torch.equal(cu_seqlens_q, cu_seqlens_k) and q.shape[1] == k.shape[1]
    CALLS.append(q.shape[0])
    total = q.shape[0]
    starts = torch.zeros(total, dtype=torch.long)
    starts[cu_seqlens_q[1:-1].long()] = 1
    sequence = starts.cumsum(0)
    allowed = sequence[:, None] == sequence[None, :]
    if causal:
        allowed &= torch.ones(total, total, dtype=torch.bool).tril()
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


#: the packed length of each call of the stand-in
CALLS: list[int] = []


def install_cpu_attention() -> None:
    """TEST-ONLY: the stand-in where verl's `qwen2_vl_attn_forward` calls flash-attention, and no cast of float32
    q/k/v to bf16 before it (see the module docstring)."""
    from verl.models.transformers import qwen2_vl

    qwen2_vl.flash_attn_varlen_func = varlen_attention_stand_in
    # what verl's module reads from flash-attn >= 2.4 at import (a window_size kwarg would reach the stand-in's assert)
    qwen2_vl._flash_supports_window_size = qwen2_vl._flash_supports_deterministic = True
    qwen2_vl._flash_use_top_left_mask = False
    qwen2_vl.fa_peft_integration_check = lambda q, k, v, target_dtype=None: (q, k, v)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+", help="FAMILY:LAYOUT:PRESET[,PRESET...], LAYOUT padded "
                        "(use_remove_padding=False) or packed (True); padded runs first (verl's remove-padding "
                        "attention patch, once applied, holds for the process); flag off checked on the last run")
    args = parser.parse_args()
    runs = [(family, layout, presets.split(",")) for family, layout, presets in (r.split(":") for r in args.runs)]
    layouts = [layout for _, layout, _ in runs]
    assert {family for family, _, _ in runs} <= set(FAMILIES)
    assert set(layouts) <= {"padded", "packed"} and layouts == sorted(layouts, key=["padded", "packed"].index)
    warnings.filterwarnings("ignore")
    # engine_check parses its own arguments and sets a world-size-1 environment at import
    sys.argv[1:] = ["--device", "cpu"]
    import engine_check

    import kl_adapters

    expected = os.environ.get("KL_ADAPTERS_VLM_TEST_ROOT")  # the test's kl_adapters, not the one installed in the venv
    imported = os.path.dirname(os.path.dirname(os.path.realpath(kl_adapters.__file__)))
    assert expected is None or imported == os.path.realpath(expected), f"runs {imported}'s kl_adapters"

    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    rows = make_rows(seed=0)
    # every family's model saved and its separate forward made before any worker: verl's monkey patch replaces the
    # Qwen VL forwards of both families' classes
    families = {family: saved_family(family, rows) for family in dict.fromkeys(family for family, _, _ in runs)}
    install_cpu_attention()
    results = {}
    for i, (family, layout, presets) in enumerate(runs):
        engine_check.args.remove_padding = layout == "packed"
        results[f"{family}/{layout}"] = run_engine(engine_check, families[family], rows, presets,
                                                   flag_off=i == len(runs) - 1)
    results["twin_gap"] = {family: max(float((f["eos"].prob[a] - f["eos"].prob[b]).abs().max())
                                       for a, b in TWIN.items()) for family, f in families.items()}
    results["image_rows"] = [mm["pixel_values"].shape[0] if mm else 0 for mm in rows["multi_modal_inputs"]]
    results["tokens"] = int(rows["attention_mask"].sum())
    print("RESULT" + json.dumps(results, default=float))


def saved_family(family: str, rows: dict) -> dict:
    """The family's tiny model and the tokenizer saved to a folder, the batch's position ids from its get_rope_index
    and the separate forward's EndOfSequence."""
    path = tempfile.mkdtemp(prefix=f"tiny_{family}_")
    model = tiny_vlm(family)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return {"family": family, "path": path, "positions": position_ids(model, rows), "eos": separate_eos(path, rows)}


def vlm_batch(rows: dict, positions: torch.Tensor, family: str, **extra):
    """engine_check.batch for the VLM rows: the agent loop's layout through verl's left_right_2_no_padding, with the
    trainer's images_seqlens meta entry (read only by verl's MFU estimate) except for Qwen2-VL: verl 0.9.1's flops
    counter reads the vision config's intermediate_size, which Qwen2-VL's (embed_dim, mlp_ratio) lacks, and raises
    AttributeError -- a verl bug that stops any Qwen2-VL update given that entry, with or without kl-adapters."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    inputs = rows["multi_modal_inputs"]
    td = tu.get_tensordict(
        {"prompts": rows["prompts"], "responses": rows["responses"],
         "input_ids": torch.cat([rows["prompts"], rows["responses"]], 1), "attention_mask": rows["attention_mask"],
         "position_ids": positions, "response_mask": rows["response_mask"],
         "multi_modal_inputs": NonTensorStack.from_list([NonTensorData(mm) for mm in inputs]), **extra},
        non_tensor_dict={} if family == "qwen2_vl" else {
            "images_seqlens": [int(n) for mm in inputs for n in mm.get("images_seqlens", [])]})
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0)
    return td


def run_engine(engine_check, family: dict, rows: dict, presets: list[str], *, flag_off: bool) -> dict:
    """One engine (engine_check.args.remove_padding) on one family's model, through engine_check's builders: the
    task-only SGD step (lr 1); per preset, compute_log_prob's forward with the flagged loss where the preset reads
    pi(EOS) (the rows it keeps, compared with the separate forward's), one SGD step flagged and one with
    engine_check's oracle (for `sequence` also without pi(EOS): its effect), all from the same weights; with flag_off,
    verl's own kl_loss_type patched vs unpatched (it unpatches: last)."""
    from functools import partial

    from verl.workers.utils import losses
    from verl.workers.utils.padding import no_padding_2_padding

    from kl_adapters import get_preset
    from kl_adapters.adapters import verl as verl_adapter
    from kl_adapters.adapters.verl import loss as verl_loss
    from kl_adapters.adapters.verl.state import EOS_ROWS

    eos = family["eos"]
    engine_check.tokens = {k: rows[k] for k in ("prompts", "responses", "attention_mask", "response_mask")}
    engine_check.batch = partial(vlm_batch, rows, family["positions"], family["family"])
    CALLS.clear()
    worker = engine_check.build_worker(family["path"], "SGD", 1.0)
    theta0 = engine_check.params(worker)
    seen = {"input_rows": [], "pixel_rows": []}

    def record(module, args, kwargs):
        seen["input_rows"].append(int(kwargs["input_ids"].shape[0]))
        pixels = kwargs.get("pixel_values")
        seen["pixel_rows"].append(0 if pixels is None else int(pixels.shape[0]))

    gen = torch.Generator().manual_seed(1)
    mask = rows["response_mask"]
    task_loss = partial(losses.ppo_loss, config=engine_check.actor_config("low_var_kl", use_kl_loss=False))
    worker.set_loss_fn(task_loss)
    current = engine_check.log_probs(worker)  # behaviour and reference log-probs near the policy's
    old = (current + 0.3 * torch.randn(current.shape, generator=gen)) * mask
    ref = (current + 0.5 * torch.randn(current.shape, generator=gen)) * mask
    adv = torch.randn(mask.shape[0], 1, generator=gen) * mask
    engine_check.train(worker, task_loss, old, ref, adv)
    step_task = theta0 - engine_check.params(worker)
    out = {"presets": {}}
    for preset in presets:
        reduced = get_preset(preset).uses_batch_statistics
        captured = []

        def flagged_loss(config, model_output, data, dp_group=None, captured=captured):
            """verl's ppo_loss, recording model_output's pi(EOS) per micro-batch where the adapter put it there."""
            if verl_adapter.EOS_PROB in model_output:
                prob = no_padding_2_padding(model_output[verl_adapter.EOS_PROB], data).detach().cpu()
                captured.append((data[verl_loss._ROW].cpu(), prob))
            return losses.ppo_loss(config, model_output, data, dp_group)

        flagged_loss = partial(flagged_loss, config=engine_check.actor_config(f"kl_adapters:{preset}"))
        engine_check.reset(worker)
        kept_error = None
        if reduced:  # compute_log_prob's forward under the flagged loss keeps the rows' pi(EOS) for the update
            worker.set_loss_fn(flagged_loss)
            engine_check.log_probs(worker)
            rows_kept = dict(EOS_ROWS.rows)
            kept = verl_loss._stored_eos(engine_check.batch(), R)  # the update's own lookup (it empties the store)
            EOS_ROWS.replace(rows_kept)
            if kept is not None:
                assert torch.equal(kept.is_eos.cpu(), eos.is_eos)
                kept_error = float((kept.prob.cpu() - eos.prob).abs().max())
        hook = worker.engine.module.register_forward_pre_hook(record, with_kwargs=True)
        metrics = engine_check.train(worker, flagged_loss, old, ref, adv)
        hook.remove()
        step_flagged = theta0 - engine_check.params(worker)
        steps, oracle_metrics = {}, {}
        for name, loss_eos in (("oracle", eos), ("oracle_without_eos", None))[:2 if reduced else 1]:
            engine_check.reset(worker)
            oracle = engine_check.oracle(engine_check.actor_config("low_var_kl", use_kl_loss=False), preset, old, ref,
                                         adv, loss_eos)
            oracle_metrics[name] = engine_check.train(worker, oracle, old, ref, adv)
            steps[name] = theta0 - engine_check.params(worker)
        kl_part = steps["oracle"] - step_task
        training_eos = torch.zeros_like(eos.prob)
        for rows_index, prob in captured:
            training_eos[rows_index, :prob.shape[1]] = prob
        out["presets"][preset] = {
            "kept_eos_error": kept_error,
            "training_eos_error": float((training_eos - eos.prob).abs().max()) if captured else None,
            "eos_effect": float((steps["oracle_without_eos"] - steps["oracle"]).norm() / kl_part.norm())
            if reduced else None,
            "kl_rel_error": float((step_flagged - steps["oracle"]).norm() / kl_part.norm()),
            "kl_vs_task": float(kl_part.norm() / step_task.norm()),
            "grad_norms": [metrics["grad_norm"], oracle_metrics["oracle"]["grad_norm"]],
            "metric_keys": sorted(metrics),
        }
    out["model_input_rows"], out["pixel_rows"] = seen["input_rows"], seen["pixel_rows"]
    out["attention_calls"] = list(CALLS)
    if flag_off:
        out["flag_off_equal"] = engine_check.flag_off_is_upstream(worker, theta0, old, ref, adv)
    return out


if __name__ == "__main__":
    main()
