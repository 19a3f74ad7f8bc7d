"""The reference policy: a small Llama trained by supervised learning on the noisy teacher (`arithmetic`), cached.

`build(spec, cache)` trains a randomly initialised LlamaForCausalLM (RoPE, so left padding does not move a
sequence's relative positions) from `tiny_models`, with the character tokenizer over `arithmetic.CHARS`, on a
mixture of the four splits' teacher completions (loss on the completion and its EOS only), AdamW with a one-cycle
schedule, gradient clipping 1.0, a fixed seed and a fixed number of torch threads. It saves the model, the tokenizer
and reference.json (the spec, the loss curve, the wall time) under cache/<spec key>/, where the key is a hash of the
spec and `DATA_VERSION`; a second call returns the cached folder. Every `CHECKPOINT_EVERY` steps the training state
(model, optimizer, schedule, the data and torch generators, the loss so far, the time spent) goes to
cache/<spec key>.partial.pt, so that an interrupted build resumes where it stopped and ends with the weights an
uninterrupted one gives (tests/core/test_reference_resume.py); the file is removed once the reference is saved. The same spec on the same machine gives the same
weights (the determinism of torch's CPU kernels at a fixed thread count); on another machine the weights may differ in
the last bits, which moves every downstream number within its run-to-run spread, not systematically.

RL starts from this model and regularises towards it, as in practice: TRL loads policy and reference from the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from . import arithmetic

#: bump when the generator or the teacher changes, so cached references are rebuilt
DATA_VERSION = 1
#: the tokenizer's special ids (tiny_models.char_tokenizer)
PAD_ID, EOS_ID = 0, 2
#: steps between two saves of the training state (a resumed build repeats at most this many)
CHECKPOINT_EVERY = 100


@dataclass(frozen=True)
class ReferenceSpec:
    """Model size and supervised training of the reference."""

    hidden: int = 64
    layers: int = 3
    heads: int = 4
    max_positions: int = 160
    steps: int = 3000
    batch: int = 64
    learning_rate: float = 3e-3
    seed: int = 0
    threads: int = 1
    #: the teacher's slip rate for every split of the mixture (None: each split's own, `arithmetic.SPLITS`)
    noise: float | None = None
    #: the training mixture: (format, split) -> weight
    mixture: tuple[tuple[str, str, float], ...] = (("short", "id", 0.35), ("short", "ood", 0.15),
                                                   ("scratch", "id", 0.35), ("scratch", "ood", 0.15))

    def key(self) -> str:
        spec = {k: v for k, v in asdict(self).items() if k != "noise" or v is not None}  # keys from before `noise`
        text = json.dumps({"spec": spec, "data": DATA_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def default_cache() -> Path:
    """$KL_ADAPTERS_CACHE, else $XDG_CACHE_HOME/kl-adapters, else ~/.cache/kl-adapters (then /task-reference)."""
    root = os.environ.get("KL_ADAPTERS_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / \
        "kl-adapters"
    return Path(root) / "task-reference"


def tokenizer():
    from ...tiny_models import char_tokenizer

    return char_tokenizer(arithmetic.CHARS)


def build(spec: ReferenceSpec, cache: Path | None = None, say: Callable[[str], None] = print) -> Path:
    """The folder of the trained reference (model, tokenizer, reference.json): cached, else trained now."""
    folder = (cache or default_cache()) / spec.key()
    if (folder / "reference.json").exists():
        return folder
    import torch

    from ...tiny_models import tiny_llama

    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        tok = tokenizer()
        model = tiny_llama(len(tok), hidden=spec.hidden, layers=spec.layers, heads=spec.heads, seed=spec.seed,
                           max_positions=spec.max_positions)
        params = sum(p.numel() for p in model.parameters())
        say(f"training the reference ({params:,} parameters, {spec.steps} steps; cached in {folder}) ...")
        partial = folder.with_name(folder.name + ".partial.pt")
        losses, seconds = _train(model, tok, spec, say, partial)
    finally:
        torch.set_num_threads(threads)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    (folder / "reference.json").write_text(json.dumps(
        {"spec": asdict(spec), "data_version": DATA_VERSION, "parameters": params, "train_seconds": seconds,
         "loss_every_100": losses}, indent=1) + "\n")
    partial.unlink(missing_ok=True)
    return folder


def _train(model, tok, spec: ReferenceSpec, say: Callable[[str], None], partial: Path) -> tuple[list[float], float]:
    """(the loss every 100 steps, seconds spent): supervised training, resumed from `partial` when it exists and
    saved there every `CHECKPOINT_EVERY` steps."""
    import torch

    rng = random.Random(f"reference/{spec.seed}")
    pools = {(fmt, part): arithmetic.draw(arithmetic.SPLITS[fmt][part], 20_000, spec.seed, test=False)
             for fmt, part, _ in spec.mixture}
    choices, weights = [(f, p) for f, p, _ in spec.mixture], [w for *_, w in spec.mixture]
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=spec.learning_rate, total_steps=spec.steps,
                                                   pct_start=0.05)
    start, losses, running, first, spent = time.perf_counter(), [], 0.0, 0, 0.0
    if partial.exists():
        state = torch.load(partial, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        first, losses, running, spent = state["step"], state["losses"], state["running"], state["seconds"]
        say(f"  resumed at step {first}/{spec.steps} from {partial.name} ({spent:.0f} s spent before)")
    model.train()
    for step in range(first, spec.steps):
        rows = []
        for fmt, part in rng.choices(choices, weights, k=spec.batch):
            example = rng.choice(pools[fmt, part])
            noise = arithmetic.SPLITS[fmt][part].noise if spec.noise is None else spec.noise
            rows.append((example.prompt, arithmetic.solution(example.prompt, noise, rng)))
        input_ids, attention, labels = supervised_batch(tok, rows)
        logits = model(input_ids=input_ids, attention_mask=attention).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        running += float(loss.detach())
        if (step + 1) % 100 == 0 or step + 1 == spec.steps:
            losses.append(running / (step % 100 + 1))
            running = 0.0
            say(f"  reference step {step + 1}/{spec.steps}: loss {losses[-1]:.3f} "
                f"({spent + time.perf_counter() - start:.0f} s)")
        if (step + 1) % CHECKPOINT_EVERY == 0 and step + 1 < spec.steps:
            _save_partial(partial, model, optimizer, schedule, rng, step + 1, losses, running,
                          spent + time.perf_counter() - start)
    return losses, spent + time.perf_counter() - start


def _save_partial(partial: Path, model, optimizer, schedule, rng: random.Random, step: int, losses: list[float],
                  running: float, seconds: float) -> None:
    """The training state after `step` steps, written whole (to a temporary name, then renamed)."""
    import torch

    partial.parent.mkdir(parents=True, exist_ok=True)
    temporary = partial.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "step": step, "losses": losses,
                "running": running, "seconds": seconds}, temporary)
    temporary.replace(partial)


def supervised_batch(tok, rows: list[tuple[str, str]]):
    """Right-padded (input_ids, attention_mask, labels) of (prompt, completion) pairs: labels are the completion's
    tokens and EOS at the positions that predict them, -100 elsewhere."""
    import torch

    encoded = [(tok.convert_tokens_to_ids(list(p)), tok.convert_tokens_to_ids(list(c)) + [EOS_ID]) for p, c in rows]
    width = max(len(p) + len(c) for p, c in encoded)
    input_ids = torch.full((len(rows), width), PAD_ID)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (p, c) in enumerate(encoded):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(p + c)
        attention[i, :n] = 1
        labels[i, len(p) - 1:n - 1] = torch.tensor(c)
    return input_ids, attention, labels
