"""The user's policy, reference, tokenizer and prompts, checked before any sampling; completions sampled at the
trainer's temperature; their log-probs with a gradient (`ModelSource`, the `measurement.Source` of a transformers model).

pi and pi_ref are the models' next-token distributions at `temperature` (softmax(logits / T)), as TRL, verl and
OpenRLHF compute log-probs for their KL terms, and completions are drawn from pi itself (no top-k / top-p: the
measurement needs samples of the policy the KL gradient is taken for), G per prompt, until an end-of-sequence token or
`max_new_tokens`. Prompts are tokenized as TRL 1.16's GRPOTrainer does: a string with the tokenizer's defaults, a list
of messages through its chat template with the generation prompt. Positions follow the attention mask (left padding).
Needs `transformers` (and `peft` for an adapter); nothing is fetched from a hub (local folders only).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..reductions import EndOfSequence
from .gradients import TokenBatch


class InputError(ValueError):
    """Bad input to `kl-adapters measure` (a folder, a tokenizer, a prompt file, a reward function): one line."""


def _folder(path: str, what: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise InputError(f"{what} {path!r} is not a folder (give a local transformers checkpoint folder)")
    return folder


def is_adapter(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file()


def adapter_base(folder: Path, base: str | None) -> Path:
    """The base model folder of a PEFT adapter: `base`, else the adapter's base_model_name_or_path."""
    if base is None:
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise InputError(f"adapter {folder} names no base model: give --base")
    return _checkpoint(base, "base model")


def _checkpoint(path: str, what: str) -> Path:
    folder = _folder(path, what)
    if not (folder / "config.json").is_file():
        raise InputError(f"{what} {path!r} has no config.json: not a transformers checkpoint folder")
    return folder


def _vocab_size(folder: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    config = getattr(config, "text_config", None) or config
    return int(config.vocab_size)


def _tokenizer(folders: list[Path], what: str):
    from transformers import AutoTokenizer

    for folder in folders:
        if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    raise InputError(f"no tokenizer for the {what} in {', '.join(map(str, folders))}")


@dataclass(frozen=True)
class Checked:
    """The folders after the checks: what to load, and the tokenizer (loaded: it is small)."""

    policy: Path
    base: Path | None  # the base model of an adapter policy
    reference: Path | None  # None: the adapter's base (the policy with its adapter disabled)
    behaviour: Path | None  # the sampler off-policy
    tokenizer: object


def check_models(policy: str, reference: str | None, base: str | None = None,
                 behaviour: str | None = None) -> Checked:
    """Every model folder exists and is a checkpoint; one vocabulary and one tokenizer among them (InputError)."""
    folder = _folder(policy, "policy")
    base_folder = adapter_base(folder, base) if is_adapter(folder) else None
    if base_folder is None:
        _checkpoint(policy, "policy")
        if base is not None:
            raise InputError(f"--base is for a PEFT adapter policy, and {policy} is a full checkpoint")
        if reference is None:
            raise InputError("give --reference: the policy is a full checkpoint, and measured against itself every "
                             "KL gradient is zero (an adapter policy's reference defaults to its base)")
    others = {"reference": None if reference is None else _checkpoint(reference, "reference"),
              "behaviour": None if behaviour is None else _checkpoint(behaviour, "behaviour policy")}
    model_folder = base_folder or folder
    size = _vocab_size(model_folder)
    tok = _tokenizer([folder, model_folder], "policy")
    for what, other in others.items():
        if other is None:
            continue
        if _vocab_size(other) != size:
            raise InputError(f"the {what} has another vocabulary: {_vocab_size(other)} token ids against the "
                             f"policy's {size} ({other})")
        theirs = _tokenizer([other], what) if _has_tokenizer(other) else tok
        if theirs.get_vocab() != tok.get_vocab():
            raise InputError(f"the {what}'s tokenizer ({other}) differs from the policy's: their log-probs would be "
                             "of different tokens")
    if tok.eos_token_id is None:
        raise InputError(f"the policy's tokenizer has no end-of-sequence token ({model_folder})")
    return Checked(folder, base_folder, others["reference"], others["behaviour"], tok)


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def load_prompts(path: str, limit: int | None = None) -> list[dict]:
    """Prompt rows ({"prompt": str | messages, other columns...}): JSONL (objects with "prompt", or strings), a text
    file (one prompt per line), JSON (a list of those), a saved `datasets` folder or a parquet / CSV file. Columns
    other than "prompt" go to the reward function, as TRL passes them."""
    source = Path(path)
    if not source.exists():
        raise InputError(f"prompt file {path!r} does not exist")
    if source.is_dir() or source.suffix in (".parquet", ".csv"):
        rows = _dataset_rows(source)
    elif source.suffix == ".jsonl":
        rows = [_row(json.loads(line), path, i) for i, line in enumerate(source.read_text().splitlines(), 1)
                if line.strip()]
    elif source.suffix == ".json":
        data = json.loads(source.read_text())
        rows = [_row(x, path, i) for i, x in enumerate(data if isinstance(data, list) else [], 1)]
    else:
        rows = [{"prompt": line} for line in source.read_text().splitlines() if line.strip()]
    if not rows:
        raise InputError(f"no prompts in {path}")
    return rows[:limit] if limit else rows


def _row(x, path: str, line: int) -> dict:
    if isinstance(x, str):
        return {"prompt": x}
    if isinstance(x, dict) and isinstance(x.get("prompt"), (str, list)) and x["prompt"]:
        return dict(x)
    raise InputError(f"{path} item {line}: expected a string or an object with a non-empty \"prompt\"")


def _dataset_rows(source: Path) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise InputError(f"reading {source} needs the `datasets` package (pip install datasets)") from None
    if source.is_dir():
        data = datasets.load_from_disk(str(source))
        if isinstance(data, datasets.DatasetDict):
            data = data["train"] if "train" in data else next(iter(data.values()))
    else:
        data = datasets.load_dataset(source.suffix[1:], data_files=str(source), split="train")
    if "prompt" not in data.column_names:
        raise InputError(f"{source} has no \"prompt\" column (columns: {', '.join(data.column_names)})")
    return [dict(r) for r in data]


def prompt_ids(tok, rows: list[dict]) -> list[list[int]]:
    """Token ids of each prompt, as TRL 1.16's GRPOTrainer renders them (InputError before any sampling)."""
    ids = []
    for i, row in enumerate(rows, 1):
        prompt = row["prompt"]
        if isinstance(prompt, list):
            if not getattr(tok, "chat_template", None):
                raise InputError(f"prompt {i} is a list of messages, and the tokenizer has no chat template")
            out = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            out = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        else:
            out = tok(prompt)["input_ids"]
        if not out:
            raise InputError(f"prompt {i} has no tokens")
        ids.append(list(out))
    return ids


def load_reward(spec: str) -> Callable[..., list]:
    """`module:function` or `path/to/file.py:function`, a reward function of TRL's signature (InputError)."""
    module, _, name = spec.rpartition(":")
    if not module or not name:
        raise InputError(f"--reward must be module:function or file.py:function, got {spec!r}")
    try:
        if module.endswith(".py"):
            found = importlib.util.spec_from_file_location(Path(module).stem, module)
            if found is None or not Path(module).is_file():
                raise InputError(f"reward file {module!r} does not exist")
            loaded = importlib.util.module_from_spec(found)
            found.loader.exec_module(loaded)
        else:
            sys.path.insert(0, str(Path.cwd()))
            loaded = importlib.import_module(module)
    except InputError:
        raise
    except Exception as err:
        raise InputError(f"cannot import the reward module {module!r}: {type(err).__name__}: {err}") from None
    fn = getattr(loaded, name, None)
    if not callable(fn):
        raise InputError(f"{module} has no function {name!r}")
    return fn


@dataclass(frozen=True)
class Models:
    policy: torch.nn.Module
    reference: torch.nn.Module | None  # None: the policy with its adapter disabled
    behaviour: torch.nn.Module | None
    tokenizer: object
    eos_ids: tuple[int, ...]
    pad_id: int


def load_models(checked: Checked, *, device: str, dtype: torch.dtype) -> Models:
    """The models on `device` in `dtype`, reference and behaviour frozen; an adapter policy's LoRA weights trainable."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # the command draws its own; loading is quick next to sampling

    def load(folder: Path) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).to(device)

    if checked.base is not None:
        try:
            from peft import PeftModel
        except ImportError:
            raise InputError(f"{checked.policy} is a PEFT adapter: measuring it needs `peft` (pip install peft)") from None
        policy = PeftModel.from_pretrained(load(checked.base), checked.policy, is_trainable=True)
    else:
        policy = load(checked.policy)
    frozen = {}
    for name in ("reference", "behaviour"):
        folder = getattr(checked, name)
        frozen[name] = None if folder is None else load(folder).eval().requires_grad_(False)
    policy.eval()  # no dropout: pi is the model as it samples
    tok = checked.tokenizer
    eos = getattr(policy.generation_config, "eos_token_id", None) if hasattr(policy, "generation_config") else None
    eos_ids = tuple(sorted({tok.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])}))
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    return Models(policy, frozen["reference"], frozen["behaviour"], tok, eos_ids, pad)


def select_parameters(model: torch.nn.Module, which: str) -> list[torch.nn.Parameter]:
    """The measured parameters: "trainable" (what requires a gradient: an adapter's LoRA weights, a full model's
    every weight) or "last:N" (the last N blocks of the largest ModuleList, the decoder's layers)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if which == "trainable":
        return [p for _, p in named]
    if which.startswith("last:") and which[5:].isdigit() and int(which[5:]) > 0:
        lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
        if not lists:
            raise InputError("--params last:N needs a model with a list of layers")
        prefix, layers = max(lists, key=lambda x: len(x[1]))
        keep = {f"{prefix}.{i}." for i in range(max(0, len(layers) - int(which[5:])), len(layers))}
        chosen = [p for n, p in named if any(n.startswith(k) for k in keep)]
        if chosen:
            return chosen
    raise InputError(f"--params must be trainable or last:N with N >= 1 layers, got {which!r}")


@dataclass
class Sampled:
    """G completions per prompt: [groups, G, T] tokens (pad after the end) and mask (EOS included)."""

    prompts: list[list[int]]
    tokens: Tensor
    mask: Tensor


def _positions(attention: Tensor) -> Tensor:
    return (attention.cumsum(-1) - 1).clamp(min=0)


def _left_padded(rows: list[list[int]], pad: int, device) -> tuple[Tensor, Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        attention[i, width - len(r):] = 1
    return ids.to(device), attention.to(device)


@torch.no_grad()
def sample(models: Models, prompts: list[list[int]], group: int, max_new_tokens: int, temperature: float,
           seed: int, batch: int, progress: Callable[[int, int], None] | None = None) -> Sampled:
    """`group` completions of each prompt from the behaviour policy (the policy when there is none), `batch`
    sequences at a time, with a KV cache; seeded."""
    model = models.behaviour or models.policy
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    eos = torch.tensor(models.eos_ids, device=device)
    per = max(1, batch // group)
    tokens = torch.full((len(prompts), group, max_new_tokens), models.pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), group, max_new_tokens), dtype=torch.bool)
    for start in range(0, len(prompts), per):
        rows = [p for p in prompts[start:start + per] for _ in range(group)]
        ids, attention = _left_padded(rows, models.pad_id, device)
        out = model(input_ids=ids, attention_mask=attention, position_ids=_positions(attention), use_cache=True)
        position = _positions(attention)[:, -1:]
        alive = torch.ones(len(rows), dtype=torch.bool, device=device)
        for t in range(max_new_tokens):
            probs = torch.softmax(out.logits[:, -1].float() / temperature, -1)
            token = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            token = torch.where(alive, token, models.pad_id)
            block = slice(start, start + len(rows) // group)
            tokens[block, :, t] = token.view(-1, group).cpu()
            mask[block, :, t] = alive.view(-1, group).cpu()
            alive = alive & ~torch.isin(token, eos)
            if not alive.any():
                break
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
            position = position + 1
            out = model(input_ids=token[:, None], attention_mask=attention, position_ids=position,
                        past_key_values=out.past_key_values, use_cache=True)
        if progress:
            progress(min(start + per, len(prompts)), len(prompts))
    width = int(mask.sum(-1).max())
    return Sampled(prompts, tokens[..., :width], mask[..., :width])


def decode(models: Models, sampled: Sampled) -> list[list[str]]:
    """Each completion's text without special tokens (as TRL hands completions to reward functions)."""
    return [[models.tokenizer.decode(row[live].tolist(), skip_special_tokens=True)
             for row, live in zip(tokens, mask)] for tokens, mask in zip(sampled.tokens, sampled.mask)]


def rewards(fn: Callable[..., list], rows: list[dict], models: Models, sampled: Sampled) -> Tensor:
    """[groups, G] the reward function on every completion, called once with TRL's keywords: prompts, completions
    (text, or an assistant message for a conversational prompt), completion_ids, and the prompt rows' other columns."""
    group = sampled.tokens.shape[1]
    texts = [t for g in decode(models, sampled) for t in g]
    prompts = [r["prompt"] for r in rows for _ in range(group)]
    completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]
    ids = [row[live].tolist() for tokens, mask in zip(sampled.tokens, sampled.mask) for row, live in zip(tokens, mask)]
    columns = {k: [r.get(k) for r in rows for _ in range(group)] for k in {k for r in rows for k in r} - {"prompt"}}
    out = fn(prompts=prompts, completions=completions, completion_ids=ids, **columns)
    values = torch.tensor([float("nan") if v is None else float(v) for v in out], dtype=torch.float64)
    if values.shape != (len(texts),):
        raise InputError(f"the reward function returned {len(out)} rewards for {len(texts)} completions")
    if not bool(torch.isfinite(values).all()):
        raise InputError("the reward function returned a non-finite reward or None")
    return values.view(-1, group)


class ModelSource:
    """`measurement.Source` over sampled completions: log-probs of the policy (with a gradient), of the reference
    and of the behaviour policy, and pi(EOS | prefix), by one forward each per micro-batch."""

    def __init__(self, models: Models, sampled: Sampled, temperature: float, rewards: Tensor | None = None):
        self.models, self.sampled, self.temperature, self.rewards = models, sampled, temperature, rewards
        self.off_policy = models.behaviour is not None

    @property
    def lengths(self) -> Tensor:
        return self.sampled.mask.sum(-1)

    def _logits(self, model, ids: Tensor, attention: Tensor, width: int) -> Tensor:
        """[B, width, V] logits / temperature at the positions that predict the completion's tokens."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        keep = {"logits_to_keep": width + 1} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
        logits = model(input_ids=ids, attention_mask=attention, position_ids=_positions(attention), **keep).logits
        return logits[:, -width - 1:-1].float() / self.temperature

    def batch(self, groups: Tensor) -> TokenBatch:
        s, m = self.sampled, self.models
        group = s.tokens.shape[1]
        device = next(m.policy.parameters()).device
        rows = [s.prompts[int(i)] for i in groups for _ in range(group)]
        prompts, prompt_mask = _left_padded(rows, m.pad_id, device)
        width = int(s.mask[groups].sum(-1).max())
        tokens = s.tokens[groups, :, :width].reshape(-1, width).to(device)
        mask = s.mask[groups, :, :width].reshape(-1, width).to(device)
        ids, attention = torch.cat([prompts, tokens], 1), torch.cat([prompt_mask, mask.long()], 1)
        log_pi = torch.log_softmax(self._logits(m.policy, ids, attention, width), -1)
        logp = log_pi.gather(-1, tokens[..., None]).squeeze(-1)
        eos_prob = log_pi.detach()[..., list(m.eos_ids)].exp().sum(-1)
        is_eos = mask & torch.isin(tokens, torch.tensor(m.eos_ids, device=device))
        zero = torch.zeros((), device=device)
        with torch.no_grad():
            ref = torch.where(mask, self._frozen(m.reference, ids, attention, tokens, width), zero)
            old = None if m.behaviour is None else torch.where(
                mask, self._frozen(m.behaviour, ids, attention, tokens, width), zero)
        ids_of_group = torch.arange(len(groups), device=device).repeat_interleave(group)
        reward = None if self.rewards is None else self.rewards[groups].reshape(-1).to(device)
        return TokenBatch(torch.where(mask, logp, zero), ref, mask, ids_of_group, old,
                          EndOfSequence(torch.where(mask, eos_prob, zero), is_eos), reward)

    def _frozen(self, model, ids, attention, tokens, width) -> Tensor:
        if model is None:  # an adapter policy's reference: its base, the adapter switched off
            with self.models.policy.disable_adapter():
                logits = self._logits(self.models.policy, ids, attention, width)
        else:
            logits = self._logits(model, ids, attention, width)
        return torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
