"""Helpers shared by the `kl-adapters measure` tests of every suite (tests only; each suite puts tests/ on sys.path):
a tiny policy / reference pair saved as checkpoint folders, a prompt file, a reward function of TRL's signature, and
the command run in this process."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kl_adapters.cli import main
from kl_adapters.tiny_models import save_tiny_model

#: a Llama small enough for a CPU test (char tokenizer, no hub)
SIZE = {"hidden": 16, "layers": 1, "heads": 2}


def perturb(folder: Path, scale: float, seed: int) -> None:
    """Add scale x (each tensor's std) x N(0, 1) to a saved model's weights: a policy that moved from its reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)


def tiny_inputs(root: Path) -> Path:
    """root/{reference, policy} (the policy perturbed), root/prompts.jsonl (12 sums with an "answer" column),
    root/reward.py:reward (the answer in the completion, plus 0.1 per character)."""
    save_tiny_model(root / "reference", seed=0, **SIZE)
    save_tiny_model(root / "policy", seed=0, **SIZE)
    perturb(root / "policy", 0.5, seed=1)
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)})
                                                  for i in range(12)))
    (root / "reward.py").write_text("def reward(prompts, completions, completion_ids, answer, **kwargs):\n"
                                    "    return [float(a in c) + 0.1 * len(c) for c, a in zip(completions, answer)]\n")
    return root


def run(capsys, *argv) -> tuple[int, str, str]:
    """`kl-adapters measure ARGV` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()  # what the fixtures printed
    code = main(["measure", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def launch_measurement(capsys, root: Path, framework: str, *launch) -> dict:
    """The JSON document of a measurement whose configuration is read from a launch (the doctor's reader)."""
    code, out, err = run(capsys, "--policy", root / "policy", "--reference", root / "reference", "--prompts",
                         root / "prompts.jsonl", "-G", 3, "--max-new-tokens", 8, "--folds", 3, "--json",
                         "--launch", framework, *launch)
    assert code == 0, err
    return json.loads(out)
