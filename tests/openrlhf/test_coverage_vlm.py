"""Vision-language models (issue 47; OpenRLHF's examples/scripts/train_vlm_math_hybrid_engine.sh): OpenRLHF 0.11.2
trains them on the path kl-adapters patches. Its Actor loads AutoModelForImageTextToText when the checkpoint's config
has a ``vision_config`` (models/actor.py, utils/utils.py:is_vlm_model); each sample's processor outputs (pixel_values,
image_grid_thw: utils/vlm_utils.py:process_prompt_with_images) ride in ``Experience.mm_train_inputs`` through the
replay buffer; ActorPPOTrainer.training_step merges a micro-batch's (merge_mm_train_inputs) and passes them to
Actor.forward, which builds Qwen's mm_token_type_ids and lets the model compute its M-RoPE positions.

Checked on a tiny random Qwen2-VL (a config, no hub: 2 text layers, a 1-block vision tower) with synthetic 56x56 images,
tokenized by OpenRLHF's own process_prompt_with_images with transformers' Qwen2VLProcessor (4 image tokens a prompt):

* the rollout forward with images: under ``sequence`` the Actor's log-probs are OpenRLHF's bit for bit and carry
  pi(EOS | y_<t) = the softmax of a separate forward of the model with the same images; other images give other
  log-probs (the images are on the path);
* the loss path (``--algo.kl.use_loss``, the example's ``--data.max_images_per_prompt 1`` parsed by the launcher with
  ``--algo.kl.preset sequence``; its ``--actor.freeze_visual_encoder`` left off, so the vision tower trains too):
  OpenRLHF's ppo_train on 8 ragged rows (2 prompts with their own image, 4 samples each, micro-batches of
  2, gradient accumulation 2, 2 epochs, off-policy) gives at every optimizer step grad(OpenRLHF's task loss) +
  beta * grad[(1/N_tok) sum_b kl_surrogate_b], each row with its rollout statistics and the current policy's pi(EOS)
  read from the forward with images (test_loss_path.py's identity), and the KL's gradient reaches the vision tower.

The processor is built without a video processor: transformers requires one, which needs torchvision (not installed
here); no video is processed.
"""

from __future__ import annotations

from types import SimpleNamespace

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
SIDE = 56  # pixels: 4 x 4 patches of 14, merged 2 x 2 into 4 image tokens
GROUP = 4


def tokenizer():
    """A word-level tokenizer with Qwen2-VL's vision tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    vocab = {"<pad>": PAD, "</s>": EOS, **{s: i for i, s in enumerate(special, VISION_START)},
             **{f"w{i}": i for i in range(VIDEO + 1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w6"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="w6",
                                   additional_special_tokens=special)


def processor():
    """transformers' Qwen2VLProcessor (PIL image processor, one image = 4 merged tokens) without a video processor,
    which transformers checks for and which needs torchvision (the check is skipped while it is built)."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = (
        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg))
    try:
        return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessorPil(min_pixels=SIDE * SIDE,
                                                                         max_pixels=SIDE * SIDE),
                                tokenizer=tokenizer(), video_processor=None)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def save_tiny_vlm(path: str, seed: int) -> str:
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


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    return save_tiny_vlm(str(tmp_path_factory.mktemp("vlm_actor")), seed=1)


@pytest.fixture(scope="module")
def vlm_ref_dir(tmp_path_factory) -> str:
    return save_tiny_vlm(str(tmp_path_factory.mktemp("vlm_ref")), seed=2)


def image(seed: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(SIDE, SIDE, 3) * 255).astype("uint8"))


def prompts(image_seeds: list[int]) -> tuple[list[list[int]], list[dict]]:
    """Each row's prompt token ids and processor outputs (OpenRLHF's process_prompt_with_images): rows of a GRPO group
    share their prompt's image."""
    from openrlhf.utils.vlm_utils import process_prompt_with_images

    proc, ids, mm = processor(), [], []
    for seed in image_seeds:
        row_ids, row_mm, _ = process_prompt_with_images(proc, PROMPT, [image(seed)])
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
def batch(vlm_dir, vlm_ref_dir) -> dict:
    """test_loss_path.py's batch with images: 2 prompts (each its own image) x 4 samples, ragged responses of random
    words (the shorter ones end with EOS), right-padded after [prompt, response]; behaviour log-probs of a perturbed
    policy, the reference's, nonzero advantages, and the behaviour policy's pi(EOS) (all forwards with the images)."""
    ids, mm = prompts([10 + b // GROUP for b in range(len(RESPONSES))])
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


def test_rollout_forward_with_images_carries_pi_eos(vlm_dir, batch):
    """Rollout time (PolicyModelActor.forward: no gradient, the rows' pixel_values / image_grid_thw as keywords): under
    ``sequence`` OpenRLHF's log-probs bit for bit, carrying pi(EOS) = a separate forward's softmax with the images;
    other images give other log-probs."""
    import openrlhf.trainer.ray.ppo_actor  # noqa: F401  (a PolicyModelActor's process: kl-adapters patches the Actor)

    from kl_adapters.adapters.openrlhf.eos_payload import LogProbsWithEos, split_eos

    actor = load_actor(vlm_dir)
    assert actor.is_vlm and type(actor.model).__name__ == "Qwen2VLForConditionalGeneration"
    rows = [0, 1, 4, 5]  # two rows of each prompt
    sequences, attention_mask, action_mask = (batch[k][rows] for k in ("sequences", "attention_mask", "action_mask"))
    mm = merged([batch["mm_train_inputs"][r] for r in rows])
    with torch.no_grad():
        native = actor(sequences, action_mask, attention_mask, **mm)
        other_images = actor(sequences, action_mask, attention_mask, **merged(prompts([20, 20, 21, 21])[1]))
        kl_adapters.enable("sequence")
        ours = actor(sequences, action_mask, attention_mask, **mm)
    assert isinstance(ours, LogProbsWithEos)
    log_probs, eos = split_eos(ours)
    assert torch.equal(log_probs, native)
    assert (native - other_images).abs().max() > 1e-3  # the images are on the path
    expected = softmax_eos(WithImages(actor, batch), sequences, attention_mask, action_mask)
    torch.testing.assert_close(eos.prob, expected.prob, rtol=1e-5, atol=1e-7)
    assert torch.equal(eos.is_eos, expected.is_eos) and eos.is_eos.sum() == 2  # rows 1 and 4 end with EOS


def test_vlm_gradient_is_task_plus_kl_surrogate(vlm_dir, batch, cpu_cuda):
    """The example's --data.max_images_per_prompt 1 (no packing, group_norm: no critic, as OpenRLHF requires of VLMs)
    with the launcher's --algo.kl.preset sequence passes OpenRLHF's and kl-adapters' validation; OpenRLHF's ppo_train
    on the batch with its images gives every optimizer step the gradient of test_loss_path.py's identity (float32
    rounding), its KL part nonzero on the vision tower."""
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
    vision = torch.cat([torch.full((n,), "visual" in name) for name, n in zip(log.params_log[0], sizes)])
    assert vision.any()
    for k, grad in enumerate(log.grad_log):
        model = WithImages(load_params(vlm_dir, log.params_log[k]), batch)
        window = steps[GAS * k:GAS * (k + 1)]
        expected = reference_grad(model, window, trainer, settings, BETA, statistics=(batch, stats))
        task_only = reference_grad(model, window, trainer, settings, 0.0, statistics=(batch, stats))
        kl_part = expected - task_only
        assert kl_part.norm() > 0.1 * expected.norm(), "the KL term must matter in this test"
        assert kl_part[vision].norm() > 0, "the KL's gradient reaches the vision tower"
        assert (grad - expected).norm() < 1e-4 * kl_part.norm(), f"step {k}"
