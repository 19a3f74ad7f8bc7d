"""Vision-language models (issue 47; OpenRLHF's examples/scripts/train_vlm_math_hybrid_engine.sh): OpenRLHF 0.11.2
trains them on the path kl-adapters patches. Its Actor loads AutoModelForImageTextToText when the checkpoint's config
has a ``vision_config`` (models/actor.py, utils/utils.py:is_vlm_model); each sample's processor outputs (pixel_values,
image_grid_thw: utils/vlm_utils.py:process_prompt_with_images) ride in ``Experience.mm_train_inputs`` through the
replay buffer; ActorPPOTrainer.training_step merges a micro-batch's (merge_mm_train_inputs) and passes them to
Actor.forward, which builds Qwen's mm_token_type_ids and lets the model compute its M-RoPE positions.

Checked on two tiny random model families (configs, no hub; each with a 1-block vision tower) with synthetic images,
tokenized by OpenRLHF's own process_prompt_with_images (4 image tokens a prompt):

* ``qwen2_vl``: a Qwen2-VL (2 text layers) with transformers' Qwen2VLProcessor, 56x56 images (patches of 14);
* ``qwen3_5``: a Qwen3.5 (transformers' ``qwen3_5``: Qwen3_5ForConditionalGeneration, the architecture of the example's
  Qwen/Qwen3.5-2B) with one gated delta-net linear-attention layer and one gated full-attention layer, interleaved
  M-RoPE, and the processor transformers maps ``qwen3_5`` to (Qwen3VLProcessor around the Qwen2-VL image processor,
  patches of 16: 64x64 images). Without flash-linear-attention and causal-conv1d (not installed here) transformers
  runs the linear attention's pure-torch fallbacks (torch_chunk_gated_delta_rule, causal_conv1d_fn).

For each family:

* the rollout forward with images: under ``sequence`` the Actor's log-probs are OpenRLHF's bit for bit and carry
  pi(EOS | y_<t) = the softmax of a separate forward of the model with the same images; other images give other
  log-probs (the images are on the path);
* the loss path (``--algo.kl.use_loss``, the example's ``--data.max_images_per_prompt 1`` parsed by the launcher with
  ``--algo.kl.preset sequence``; its ``--actor.freeze_visual_encoder`` left off, so the vision tower trains too):
  OpenRLHF's ppo_train on 8 ragged rows (2 prompts with their own image, 4 samples each, micro-batches of
  2, gradient accumulation 2, 2 epochs, off-policy) gives at every optimizer step grad(OpenRLHF's task loss) +
  beta * grad[(1/N_tok) sum_b kl_surrogate_b], each row with its rollout statistics and the current policy's pi(EOS)
  read from the forward with images (test_loss_path.py's identity), and the KL's gradient reaches the vision tower
  (and, for Qwen3.5, the linear-attention layer).

The processors are built without a video processor: transformers requires one, which needs torchvision (not installed
here); no video is processed.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from openrlhf_cpu_shim import EOS, PAD, load_actor, perturbed
from openrlhf_harness import (
    BETA,
    GAS,
    MICRO,
    RESPONSES,
    base_argv,
    batch_statistics,
    build_trainer,
    cli_args,
    load_params,
    record_steps,
    reference_grad,
    rows_of,
    softmax_eos,
)

import kl_adapters
from kl_adapters import activation

VOCAB = 64
VISION_START, VISION_END, IMAGE, VIDEO = 2, 3, 4, 5
#: each prompt: its image (4 image tokens once the processor expands it) and two words
PROMPT = "<|vision_start|><|image_pad|><|vision_end|> w7 w8"
GROUP = 4


def tokenizer():
    """A word-level tokenizer with Qwen's vision tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    vocab = {"<pad>": PAD, "</s>": EOS, **{s: i for i, s in enumerate(special, VISION_START)},
             **{f"w{i}": i for i in range(VIDEO + 1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w6"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="w6",
                                   additional_special_tokens=special)


def without_video_processor(processor_class, image_processor):
    """processor_class(image_processor, tokenizer()) without a video processor, which transformers checks for and
    which needs torchvision (the check is skipped while it is built)."""
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = (
        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg))
    try:
        return processor_class(image_processor=image_processor, tokenizer=tokenizer(), video_processor=None)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def qwen2_vl_processor(side: int):
    """transformers' Qwen2VLProcessor (PIL image processor, patches of 14: one side x side image = 4 merged tokens)."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return without_video_processor(Qwen2VLProcessor, Qwen2VLImageProcessorPil(min_pixels=side * side,
                                                                              max_pixels=side * side))


def save_tiny_qwen2_vl(path: str, seed: int) -> str:
    """A tiny random Qwen2-VL (text: 2 layers, width 32, M-RoPE; vision: 1 block, patches of 14) saved to `path`."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, eos_token_id=EOS,
                         pad_token_id=PAD, bos_token_id=EOS),
        vision_config=dict(depth=1, embed_dim=16, num_heads=2, hidden_size=32, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        tie_word_embeddings=False)
    Qwen2VLForConditionalGeneration(config).save_pretrained(path)
    return path


def qwen3_5_processor(side: int):
    """The processor transformers' auto classes give ``qwen3_5``: Qwen3VLProcessor around the Qwen2-VL image processor
    (PIL), with Qwen3.5's preprocessor settings (patches of 16, merge 2, mean = std = 0.5): one side x side image = 4
    merged tokens."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                               min_pixels=side * side, max_pixels=side * side,
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return without_video_processor(Qwen3VLProcessor, image_processor)


def save_tiny_qwen3_5(path: str, seed: int) -> str:
    """A tiny random Qwen3.5 saved to `path`. Text: width 32, a gated delta-net linear-attention layer (4 value heads
    over 2 key heads of 8, causal conv of 4) then a gated full-attention layer (4 heads of 16 over 2 key-value heads),
    interleaved M-RoPE on half of each head (partial rotary; Qwen3.5's: a quarter); vision: 1 block, patches of 16, a
    4 x 4 learned position grid.

    Each linear-attention head's decay rate A is drawn from U(0, 1) instead of transformers' U(0, 16): with that one
    and dt_bias = 1 the state decays by exp(-A softplus(1)), exp(-10) a token on average (all four heads above 10 with
    these seeds), so the recurrence would forget the prompt at once; with U(0, 1) it keeps 27% or more a token, and the
    prompt (and its image) reaches the response through it too."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3_5Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                         max_position_embeddings=256,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                              mrope_section=[2, 1, 1], mrope_interleaved=True),
                         eos_token_id=EOS, pad_token_id=PAD, bos_token_id=EOS),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=32,
                           num_position_embeddings=16),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        tie_word_embeddings=False)
    model = Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if layer.block_type == "linear_attention":
                layer.linear_attn.A_log.copy_(torch.rand(layer.linear_attn.A_log.shape).log())
    model.save_pretrained(path)
    return path


class Family(NamedTuple):
    """A vision-language model family the tests run: its model class, a tiny random model saved to a folder (path,
    seed), its processor for side x side images, that side, and the parameter names (substrings) the KL's gradient
    must reach."""

    model_class: str
    save: Callable[[str, int], str]
    processor: Callable[[int], Any]
    side: int
    reached: tuple[str, ...]


FAMILIES = {
    "qwen2_vl": Family("Qwen2VLForConditionalGeneration", save_tiny_qwen2_vl, qwen2_vl_processor, 56, ("visual",)),
    "qwen3_5": Family("Qwen3_5ForConditionalGeneration", save_tiny_qwen3_5, qwen3_5_processor, 64,
                      ("visual", "linear_attn")),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for this module (restored after): the tiny models are overhead-bound, and two OpenMP threads
    on a shared 2-core machine made each small op 6-12 ms (the file: 98 s, against 9.3 s with one; measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def vlm_dir(family, tmp_path_factory) -> str:
    return family.save(str(tmp_path_factory.mktemp("vlm_actor")), 1)


@pytest.fixture(scope="module")
def vlm_ref_dir(family, tmp_path_factory) -> str:
    return family.save(str(tmp_path_factory.mktemp("vlm_ref")), 2)


def image(seed: int, side: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(side, side, 3) * 255).astype("uint8"))


def prompts(family: Family, image_seeds: list[int]) -> tuple[list[list[int]], list[dict]]:
    """Each row's prompt token ids and processor outputs (OpenRLHF's process_prompt_with_images): rows of a GRPO group
    share their prompt's image."""
    from openrlhf.utils.vlm_utils import process_prompt_with_images

    proc, ids, mm = family.processor(family.side), [], []
    for seed in image_seeds:
        row_ids, row_mm, _ = process_prompt_with_images(proc, PROMPT, [image(seed, family.side)])
        ids.append(row_ids)
        mm.append(row_mm)
    return ids, mm


def merged(mm: list[dict]) -> dict:
    """The rows' processor outputs concatenated (what merge_mm_train_inputs gives training_step)."""
    return {key: torch.cat([m[key] for m in mm]) for key in mm[0]}


class WithImages:
    """An OpenRLHF Actor given each row's images where the suite's helpers (openrlhf_harness.reference_grad and
    softmax_eos: a separate forward's softmax) call an Actor or its model without them: the rows are matched to the
    batch by their token ids (`rows_of`); the Hugging Face model also gets Qwen's mm_token_type_ids (1 at image
    tokens)."""

    def __init__(self, actor, batch: dict):
        self.actor, self.batch, self.temperature = actor, batch, actor.temperature

    def images(self, sequences) -> dict:
        rows = rows_of(self.batch, SimpleNamespace(sequences=sequences))
        return merged([self.batch["mm_train_inputs"][r] for r in rows])

    def __call__(self, sequences, action_mask, attention_mask=None):
        return self.actor(sequences, action_mask, attention_mask=attention_mask, **self.images(sequences))

    @property
    def model(self):
        def forward(sequences, attention_mask=None):
            return self.actor.model(sequences, attention_mask=attention_mask, **self.images(sequences),
                                    mm_token_type_ids=(sequences == IMAGE).int())
        return forward

    def parameters(self):
        return self.actor.parameters()


@pytest.fixture(scope="module")
def batch(family, vlm_dir, vlm_ref_dir) -> dict:
    """test_loss_path.py's batch with images: 2 prompts (each its own image) x 4 samples, ragged responses of random
    words (the shorter ones end with EOS), right-padded after [prompt, response]; behaviour log-probs of a perturbed
    policy, the reference's, nonzero advantages, and the behaviour policy's pi(EOS) (all forwards with the images)."""
    ids, mm = prompts(family, [10 + b // GROUP for b in range(len(RESPONSES))])
    assert [row.count(IMAGE) for row in ids] == [4] * len(RESPONSES)
    prompt, width = len(ids[0]), max(RESPONSES)
    gen = torch.Generator().manual_seed(0)
    sequences = torch.full((len(RESPONSES), prompt + width), PAD)
    action_mask = torch.zeros(len(RESPONSES), width, dtype=torch.bool)
    for b, n in enumerate(RESPONSES):
        sequences[b, :prompt] = torch.tensor(ids[b])
        sequences[b, prompt:prompt + n] = torch.randint(VIDEO + 1, VOCAB, (n,), generator=gen)
        if n < width:
            sequences[b, prompt + n - 1] = EOS
        action_mask[b, :n] = True
    attention_mask = torch.cat([torch.ones(len(RESPONSES), prompt, dtype=torch.long), action_mask.long()], dim=1)
    out = dict(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask, mm_train_inputs=mm)
    behaviour = WithImages(perturbed(load_actor(vlm_dir), 0.05, seed=3), out)
    reference = WithImages(load_actor(vlm_ref_dir), out)
    with torch.no_grad():
        out["action_log_probs"] = behaviour(sequences, action_mask, attention_mask)
        out["base_action_log_probs"] = reference(sequences, action_mask, attention_mask)
    out["advantages"] = 0.3 * torch.randn(action_mask.shape, generator=torch.Generator().manual_seed(4)) * action_mask
    out["rollout_eos"] = softmax_eos(behaviour, sequences, attention_mask, action_mask)
    return out


def test_rollout_forward_with_images_carries_pi_eos(family, vlm_dir, batch):
    """Rollout time (PolicyModelActor.forward: no gradient, the rows' pixel_values / image_grid_thw as keywords): under
    ``sequence`` OpenRLHF's log-probs bit for bit, carrying pi(EOS) = a separate forward's softmax with the images;
    other images give other log-probs."""
    import openrlhf.trainer.ray.ppo_actor  # noqa: F401  (a PolicyModelActor's process: kl-adapters patches the Actor)

    from kl_adapters.adapters.openrlhf.eos_payload import LogProbsWithEos, split_eos

    actor = load_actor(vlm_dir)
    assert actor.is_vlm and type(actor.model).__name__ == family.model_class
    rows = [0, 1, 4, 5]  # two rows of each prompt
    sequences, attention_mask, action_mask = (batch[k][rows] for k in ("sequences", "attention_mask", "action_mask"))
    mm = merged([batch["mm_train_inputs"][r] for r in rows])
    with torch.no_grad():
        native = actor(sequences, action_mask, attention_mask, **mm)
        other_images = actor(sequences, action_mask, attention_mask, **merged(prompts(family, [20, 20, 21, 21])[1]))
        kl_adapters.enable("sequence")
        ours = actor(sequences, action_mask, attention_mask, **mm)
    assert isinstance(ours, LogProbsWithEos)
    log_probs, eos = split_eos(ours)
    assert torch.equal(log_probs, native)
    assert (native - other_images).abs().max() > 1e-3  # the images are on the path
    expected = softmax_eos(WithImages(actor, batch), sequences, attention_mask, action_mask)
    torch.testing.assert_close(eos.prob, expected.prob, rtol=1e-5, atol=1e-7)
    assert torch.equal(eos.is_eos, expected.is_eos) and eos.is_eos.sum() == 2  # rows 1 and 4 end with EOS


def test_vlm_gradient_is_task_plus_kl_surrogate(family, vlm_dir, batch, cpu_cuda):
    """The example's --data.max_images_per_prompt 1 (no packing, group_norm: no critic, as OpenRLHF requires of VLMs)
    with the launcher's --algo.kl.preset sequence passes OpenRLHF's and kl-adapters' validation; OpenRLHF's ppo_train
    on the batch with its images gives every optimizer step the gradient of test_loss_path.py's identity (float32
    rounding), its KL part nonzero on the vision tower (and on Qwen3.5's linear-attention layer)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    from kl_adapters.adapters.openrlhf.statistics import attach

    args = cli_args(base_argv(vlm_dir) + ["--data.max_images_per_prompt", "1", "--algo.kl.preset", "sequence"],
                    wrapper=True)
    assert args.data.max_images_per_prompt == 1 and str(args.algo.kl.preset) == "sequence"
    stats = batch_statistics(batch)
    trainer = build_trainer(args, load_actor(vlm_dir), micro_batch=MICRO, gas=GAS)
    steps = record_steps(trainer)
    tensors = ("sequences", "attention_mask", "action_mask", "action_log_probs", "base_action_log_probs", "advantages")
    experience = Experience(**{k: batch[k].clone() for k in tensors}, total_length=batch["attention_mask"].sum(-1),
                            index=list(range(len(RESPONSES))), info={},
                            mm_train_inputs=[dict(m) for m in batch["mm_train_inputs"]])
    attach(experience, stats)
    trainer.replay_buffer.append(experience)
    torch.manual_seed(0)  # ppo_train shuffles the replay buffer
    trainer.ppo_train(kl_ctl=BETA)

    log, settings = trainer.strategy, activation.parse("sequence")
    assert len(log.grad_log) == len(steps) // GAS == 4
    assert all(len(exp.mm_train_inputs) == len(exp.sequences) for exp, _ in steps)  # each row's images rode along
    sizes = [p.numel() for p in log.params_log[0].values()]
    parts = {part: torch.cat([torch.full((n,), part in name) for name, n in zip(log.params_log[0], sizes)])
             for part in family.reached}
    assert all(mask.any() for mask in parts.values())
    for k, grad in enumerate(log.grad_log):
        model = WithImages(load_params(vlm_dir, log.params_log[k]), batch)
        window = steps[GAS * k:GAS * (k + 1)]
        expected = reference_grad(model, window, trainer, settings, BETA, statistics=(batch, stats))
        task_only = reference_grad(model, window, trainer, settings, 0.0, statistics=(batch, stats))
        kl_part = expected - task_only
        assert kl_part.norm() > 0.1 * expected.norm(), "the KL term must matter in this test"
        for part, mask in parts.items():
            assert kl_part[mask].norm() > 0, f"the KL's gradient reaches {part}"
        assert (grad - expected).norm() < 1e-4 * kl_part.norm(), f"step {k}"
