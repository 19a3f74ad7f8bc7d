"""Builders for the vision-language tests of the TRL suite (tests/trl/test_vision_language.py): a tiny randomly
initialised Qwen2-VL saved to disk, its processor built in-process, a dataset of synthetic images, and the oracle's
forwards with TRL's multimodal inputs.

Everything is local (no hub): the tokenizer is the project's character tokenizer (`kl_adapters.tiny_models`) with
Qwen2-VL's special tokens and a small chat template; the image processor is transformers' PIL Qwen2-VL image
processor constructed from arguments (2x2-pixel patches, 2x2 merge: an 8x8 image is a 4x4 patch grid, 4 image tokens
in the prompt; an 8x4 one 2).
"""

import torch
from conftest import grpo_args, groups_by_hand

from kl_adapters import EndOfSequence, TaskAdvantages
from kl_adapters.presets import get_preset
from kl_adapters.tiny_models import char_tokenizer

#: Qwen2-VL's special tokens (the processor and TRL look the image / video pads up by these names)
VL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

#: a Qwen-style chat template: an image part becomes <|vision_start|><|image_pad|><|vision_end|>, which the
#: processor expands to one pad per merged patch
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")

#: the batch keys TRL's _compute_loss hands to _get_per_token_logps_and_entropies besides the token ids (trl 1.16)
MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                   "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")

#: the keys of those a model forward takes (TRL's own bookkeeping, num_images / num_tiles, is not a model input)
MODEL_KEYS = tuple(k for k in MULTIMODAL_KEYS if k not in ("num_images", "num_tiles"))

IMAGE_SIZE = 8  # pixels per side


def vl_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VL_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _image_only_processor_class():
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessorStub(Qwen2VLProcessor):
        """Test stub: Qwen2VLProcessor without its video slot. transformers 5 checks each sub-processor's class at
        construction, and the video processor's base class needs torchvision, which cannot be installed beside the
        TRL environment's CPU torch (PyPI's torchvision wheels link against CUDA torch; the CPU build is not on PyPI).
        Everything else is Qwen2VLProcessor's own: its __call__ expands the image pads and returns pixel_values,
        image_grid_thw and mm_token_type_ids (`videos` is never passed)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = VL_TOKENS[4], VL_TOKENS[5]
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageOnlyQwen2VLProcessorStub


def vl_processor():
    """The processor TRL gets as processing_class: Qwen2-VL's PIL image processor (2-pixel patches, 2x2 merge,
    between 16 and 64 pixels) and `vl_tokenizer` (left padding), in `ImageOnlyQwen2VLProcessorStub`."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2,
                                               size={"shortest_edge": 16, "longest_edge": IMAGE_SIZE ** 2})
    return _image_only_processor_class()(image_processor=image_processor, tokenizer=vl_tokenizer(),
                                         chat_template=CHAT_TEMPLATE)


def tiny_qwen2_vl(seed: int = 0):
    """A randomly initialised Qwen2VLForConditionalGeneration (float32): 2 text layers of width 32 with multimodal
    RoPE, a 1-block vision tower of width 16 projecting to 32; the vision token ids are `vl_tokenizer`'s."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = vl_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(list(VL_TOKENS))
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2),
        vision_start_token_id=ids[2], vision_end_token_id=ids[3], image_token_id=ids[4], video_token_id=ids[5],
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config).float()


def save_tiny_qwen2_vl(directory):
    """Save `tiny_qwen2_vl` to `directory` (TRL reloads the reference model from its path) and return the path."""
    tiny_qwen2_vl().save_pretrained(directory)
    return str(directory)


def image_dataset(n: int = 16):
    """n conversational prompts, each with one synthetic RGB image (a colour per prompt and one white pixel): 8x8
    pixels (4 image tokens) at even prompts, 8 wide by 4 high (2 image tokens) at odd ones, so rows differ in pixel
    rows and prompt length."""
    from datasets import Dataset
    from PIL import Image

    images = []
    for i in range(n):
        size = (IMAGE_SIZE, IMAGE_SIZE if i % 2 == 0 else IMAGE_SIZE // 2)
        image = Image.new("RGB", size, ((37 * i) % 256, (91 * i) % 256, (53 * i + 90) % 256))
        image.putpixel((i % size[0], (3 * i) % size[1]), (255, 255, 255))
        images.append(image)
    prompts = [[{"role": "user", "content": f"q{i}: say a"}] for i in range(n)]
    return Dataset.from_dict({"prompt": prompts, "image": images})


def reward_a_chat(completions, **kwargs):
    """conftest.reward_a on conversational completions (a list of messages each): the fraction of 'a' characters of
    the reply plus a small length term."""
    texts = [c[-1]["content"] for c in completions]
    return [t.count("a") / max(len(t), 1) + 0.01 * len(t) for t in texts]


def make_vlm_trainer(model_dir, dataset, *, args=None, **overrides):
    """GRPOTrainer on the tiny Qwen2-VL with `vl_processor` (conftest.grpo_args: kl_preset="sequence", float32, ...)."""
    from trl import GRPOTrainer

    return GRPOTrainer(model=model_dir, reward_funcs=reward_a_chat, args=args or grpo_args(**overrides),
                       train_dataset=dataset, processing_class=vl_processor())


def multimodal_inputs(batch, keys=MULTIMODAL_KEYS):
    """The batch's multimodal entries among `keys` that are present (not None)."""
    return {k: batch[k] for k in keys if batch.get(k) is not None}


def policy_logps(trainer, batch):
    """conftest.policy_logps with the batch's multimodal inputs: log pi_theta of the completion tokens, with gradient,
    from TRL's own forward, given the images as TRL's _compute_loss gives them."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    return trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask,
                                                      batch["completion_ids"].size(1), **multimodal_inputs(batch))[0]


def completion_logits(lm, batch, temperature, **replace):
    """[B, T, V] next-token logits / temperature of the completion tokens from the model's own unfused forward, with
    the batch's images (`replace` overrides a multimodal input, e.g. blanked pixel_values)."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    horizon = batch["completion_ids"].shape[1]
    inputs = {**multimodal_inputs(batch, MODEL_KEYS), **replace}
    return lm(input_ids=input_ids, attention_mask=attention_mask, **inputs).logits[:, -horizon - 1:-1] / temperature


def eos_ids_by_hand(trainer):
    """The ids that end a completion (trl >= 1.14.2): the processor's tokenizer's eos and every generation-config eos
    id (conftest.eos_ids_by_hand reads a tokenizer as the processing class)."""
    ids = {trainer.processing_class.tokenizer.eos_token_id}
    config_ids = trainer.model.generation_config.eos_token_id
    if config_ids is not None:
        ids |= {config_ids} if isinstance(config_ids, int) else set(config_ids)
    return sorted(ids)


def eos_by_hand(trainer, batch, **replace):
    """conftest.eos_by_hand from `completion_logits` with the batch's images: EndOfSequence of the trainer's current
    policy, softmax(logits / temperature) summed over TRL's EOS ids (float64), horizon max_completion_length."""
    ids = eos_ids_by_hand(trainer)
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        logits = completion_logits(trainer.model, batch, trainer.temperature, **replace)
        prob = torch.softmax(logits.double(), -1)[..., ids]
    is_eos = torch.isin(batch["completion_ids"], torch.tensor(ids, device=mask.device)) & mask
    return EndOfSequence(torch.where(mask, prob.sum(-1), 0.0).float(), is_eos, trainer.max_completion_length)


def statistics_inputs_by_hand(trainer, batch, preset, beta):
    """conftest.statistics_inputs_by_hand with `eos_by_hand` of this module (the policy's pi(EOS) given the images)."""
    if not get_preset(preset).uses_batch_statistics:
        return {}
    task = TaskAdvantages(batch["advantages"], beta, normalized=trainer.args.scale_rewards != "none")
    return {"task": task, "group": groups_by_hand(batch), "eos": eos_by_hand(trainer, batch)}
