"""The environment a GPU suite runs in, as JSON: `environment_report.py <fw> <file>` (scripts/gpu.sh run writes
<out>/<fw>-environment.json); also printed.

Run with `python -P` (the checkout off sys.path). Imports the framework's modules that its GPU tests drive and
kl-adapters; exits non-zero if one fails to import, if kl-adapters is not the installed wheel, or if a carried
distribution's requirement is installed in a version it excludes. Requirements that are absent are listed
(`absent`), not failed: the frameworks declare dependencies their GPU test paths never import (ray, wandb, vllm...).
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import json
import platform
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

#: what each suite's GPU tests import
MODULES = {
    "trl": ["trl", "trl.trainer.grpo_trainer", "peft", "datasets"],
    "verl": ["verl", "verl.workers.engine_workers", "verl.workers.utils.losses", "verl.trainer.ppo.ray_trainer",
             "verl.trainer.ppo.v1", "tensordict", "megatron.core", "verl.workers.engine.megatron.transformer_impl"],
    "openrlhf": ["openrlhf", "openrlhf.trainer.ray.ppo_actor", "openrlhf.utils.deepspeed", "deepspeed"],
}


def requirement_problems(dist: metadata.Distribution) -> tuple[list[str], list[str]]:
    """(conflicts, absent) among dist's unconditional requirements, as 'dist: requirement (installed version)'."""
    conflicts, absent = [], []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            absent.append(f"{dist.metadata['Name']}: {req}")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            conflicts.append(f"{dist.metadata['Name']}: {req} (installed {have})")
    return conflicts, absent


def main(framework: str, path: Path) -> int:
    import torch

    failures = []
    for name in MODULES[framework]:
        try:
            importlib.import_module(name)
        except Exception as err:  # report every import that fails, not only the first
            failures.append(f"import {name}: {type(err).__name__}: {err}")
    import kl_adapters

    site = Path(metadata.distribution("kl-adapters").locate_file("")).resolve()
    if not Path(kl_adapters.__file__).resolve().is_relative_to(site):
        failures.append(f"kl_adapters imported from {kl_adapters.__file__}, not the installed wheel in {site}")
    carried = [d for d in metadata.distributions() if Path(d.locate_file("")).resolve() == site]
    conflicts, absent = [], []
    for dist in carried:
        c, a = requirement_problems(dist)
        conflicts += c
        absent += a
    failures += [f"version conflict: {c}" for c in conflicts]
    seen = {canonicalize_name(d.metadata["Name"]) for d in carried}
    report = {
        "framework": framework,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "carried": sorted(f"{d.metadata['Name']}=={d.version}" for d in carried),
        "from_image": {name: metadata.version(name) for name in
                       ("transformers", "accelerate", "peft", "huggingface_hub", "tokenizers", "numpy", "pyarrow")
                       if canonicalize_name(name) not in seen and _installed(name)},
        "absent_requirements": sorted(set(absent)),
        "ray": getattr(sys.modules.get("ray"), "__version__", None),
        "failures": failures,
    }
    path.write_text(json.dumps(report, indent=1) + "\n")  # a file: frameworks log to stdout while importing
    print(path.read_text())
    return 1 if failures else 0


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in MODULES:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(MODULES)}}} <file>")
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
