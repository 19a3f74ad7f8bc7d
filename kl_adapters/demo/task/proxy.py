"""The proxy reward of the RLHF setting: a reward model fitted on a limited sample of the reference's outputs.

Gao, Schulman & Hilton (2022) measured reward-model overoptimization: a policy trained on a learned proxy reward gains
gold reward at first, then loses it as it moves further (in KL) from the policy the reward model was fitted on. Here
the gold reward is the verifier (`arithmetic.reward`), and the proxy is a small LlamaForSequenceClassification (a
scalar head on the last token) fitted by logistic regression on `samples` completions of the reference on in-domain
training prompts, labelled by the verifier. It agrees with the gold reward on typical reference outputs (its held-out
agreement is measured on fresh reference samples and stored in proxy.json) but has seen nothing else, so it can be
exploited. The proxy reward of a completion is sigmoid(score), in [0, 1] like the gold reward.

`build(reference_folder, spec, cache)` samples, fits and caches it under cache/<key>/ (the key hashes the spec and the
reference folder's name, which is the reference's own key).
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from . import arithmetic
from .reference import PAD_ID, tokenizer


@dataclass(frozen=True)
class ProxySpec:
    samples: int = 8192  # reference completions the reward model is fitted on
    format: str = "short"
    hidden: int = 64
    layers: int = 3
    steps: int = 2000
    batch: int = 64
    learning_rate: float = 2e-3
    seed: int = 0

    def key(self, reference: Path) -> str:
        text = json.dumps({"spec": asdict(self), "reference": reference.name}, sort_keys=True)
        return "proxy-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def build(reference: Path, spec: ProxySpec, say: Callable[[str], None] = print) -> Path:
    """The folder of the fitted proxy reward model, next to the reference's (cached)."""
    folder = reference.parent / spec.key(reference)
    if (folder / "proxy.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM

    from .evaluate import decode, encode_prompts, sample

    split = arithmetic.SPLITS[spec.format]["id"]
    policy = AutoModelForCausalLM.from_pretrained(reference).eval()
    tok = tokenizer()
    max_new = 8 if spec.format == "short" else 128

    def reference_samples(n: int, seed: int) -> list[tuple[str, str, float]]:
        examples = arithmetic.draw(split, n, seed=10_000 + seed, test=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            texts = decode(tok, sample(policy, *encode_prompts(tok, [e.prompt for e in examples]), max_new))
        return [(e.prompt, t, arithmetic.reward(t, e.answer)) for e, t in zip(examples, texts)]

    say(f"fitting the proxy reward model on {spec.samples} reference completions (cached in {folder}) ...")
    start = time.perf_counter()
    data, held_out = reference_samples(spec.samples, spec.seed), reference_samples(1024, spec.seed + 1)
    model = _model(len(tok), spec)
    _fit(model, tok, data, spec)
    scores = Proxy(model, tok)([t for _, t, _ in held_out], [arithmetic.Example(p, "") for p, _, _ in held_out])
    gold = [g for *_, g in held_out]
    agreement = sum((s > 0.5) == (g > 0.5) for s, g in zip(scores, gold)) / len(gold)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    (folder / "proxy.json").write_text(json.dumps(
        {"spec": asdict(spec), "reference": reference.name, "fit_seconds": time.perf_counter() - start,
         "train_gold_rate": sum(g for *_, g in data) / len(data), "held_out_agreement": agreement,
         "held_out_correlation": _correlation(scores, gold), "held_out_samples": len(gold)}, indent=1) + "\n")
    return folder


class Proxy:
    """completions, examples -> sigmoid(reward model score) of prompt + completion (a `evaluate.Scorer`)."""

    def __init__(self, model, tok):
        self.model, self.tok = model.eval(), tok

    @classmethod
    def load(cls, folder: Path) -> Proxy:
        from transformers import AutoModelForSequenceClassification

        return cls(AutoModelForSequenceClassification.from_pretrained(folder), tokenizer())

    def __call__(self, completions: list[str], examples: list[arithmetic.Example]) -> list[float]:
        import torch

        with torch.no_grad():
            ids, attention = _encode(self.tok, [e.prompt + c for e, c in zip(examples, completions)])
            return torch.sigmoid(self.model(input_ids=ids, attention_mask=attention).logits[:, 0]).tolist()


def _model(vocab: int, spec: ProxySpec):
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(spec.seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
                         num_hidden_layers=spec.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=192, pad_token_id=PAD_ID, num_labels=1)
    return LlamaForSequenceClassification(config).float()


def _encode(tok, texts: list[str]):
    """Right-padded ids and mask (the classifier reads the last non-pad token)."""
    import torch

    ids = [tok.convert_tokens_to_ids(list(t)) for t in texts]
    width = max(map(len, ids))
    out = torch.full((len(ids), width), PAD_ID)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        out[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    return out, mask


def _fit(model, tok, data: list[tuple[str, str, float]], spec: ProxySpec) -> None:
    import torch

    rng = random.Random(f"proxy/{spec.seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=spec.learning_rate, total_steps=spec.steps,
                                                   pct_start=0.05)
    model.train()
    for _ in range(spec.steps):
        rows = rng.sample(data, spec.batch)
        ids, attention = _encode(tok, [p + c for p, c, _ in rows])
        logits = model(input_ids=ids, attention_mask=attention).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor([g for *_, g in rows]))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()


def _correlation(x: list[float], y: list[float]) -> float:
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else float("nan")
