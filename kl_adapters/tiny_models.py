"""Tiny randomly initialised causal LMs and character tokenizers, built locally (no model hub).

For tests, examples, benchmarks and the demo. Needs `transformers` and `tokenizers` (present wherever a framework is).
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_CHARS = string.ascii_lowercase + string.digits + " .,:?+="


def char_tokenizer(chars: str = DEFAULT_CHARS):
    """A fast HF tokenizer with one token per character (ids: pad 0, bos 1, eos 2, unk 3), left padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + list(dict.fromkeys(chars)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>", unk_token="<unk>")
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_llama(vocab_size: int, *, hidden: int = 32, layers: int = 2, heads: int = 4, seed: int = 0,
               max_positions: int = 128):
    """A randomly initialised LlamaForCausalLM (float32) small enough for CPU tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def save_tiny_model(directory: str | Path, *, chars: str = DEFAULT_CHARS, seed: int = 0, **model_kwargs) -> Path:
    """Save a tiny Llama and its char tokenizer to `directory` (trainers that reload the reference need a path)."""
    directory = Path(directory)
    tokenizer = char_tokenizer(chars)
    tiny_llama(len(tokenizer), seed=seed, **model_kwargs).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
