"""verl's own CPU unit tests as a second opinion on the adapter (issue 15, item 5).

Usage: python tests/verl/upstream_selftests.py --python <venv python> [--work DIR]

For the verl release installed in <venv python>'s environment: download that release's sdist (patches/release.py;
pip, from the package index), pick the CPU tests it ships (``tests/**/*_on_cpu.py``) that touch what the adapter
patches (`TOUCHES`: the patched functions and their modules), and run them three times against the INSTALLED verl:
    without      kl-adapters not active at all: VERL_USE_EXTERNAL_PLUGINS=none (verl does not import its plugin entry
                 point) and KL_ADAPTERS unset (the kl_adapters .pth line then imports nothing), so no kl_adapters
                 module is loaded; checked by a probe interpreter before the runs (`_loaded_in`)
    flag off     kl-adapters installed as users have it: the verl.plugins entry point patches verl (inert wrappers)
    flag on      KL_ADAPTERS=sequence (every KL path verl's tests drive goes through the adapter's code)
Every test must have the same outcome (passed / failed / skipped / error) in all three: a table is printed, then a
last line PASS or FAIL (the verdict scripts/compat.sh shows); the exit status is 1 on FAIL. The unpacked tree's own
``verl/`` package is removed before the runs, so the tests import the installed verl (with the adapter's patches) and
not the sdist's copy of it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "patches"))
import release  # noqa: E402  (patches/release.py: download and unpack helpers)

#: strings whose presence in a test file means it exercises code the adapter patches (kl_adapters.adapters.verl.SITES)
TOUCHES = ("workers.utils.losses", "ppo_loss", "kl_penalty", "ray_trainer", "apply_kl_penalty", "compute_advantage",
           "ppo.v1", "main_ppo_sync", "constants_ppo", "get_ppo_ray_runtime_env", "utils.config", "validate_config",
           "tensordict_utils", "make_iterator", "engine.fsdp", "transformer_impl", "logprobs_from_logits",
           "prepare_model_outputs", "engine_workers", "TrainingWorker", "infer_batch")
MODES = {
    "without": {"VERL_USE_EXTERNAL_PLUGINS": "none"},
    "flag off": {},
    "flag on": {"KL_ADAPTERS": "sequence"},
}
_BASE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "TOKENIZERS_PARALLELISM": "false"}


def _env(mode: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KL_ADAPTERS", "VERL_USE_EXTERNAL_PLUGINS", "PYTHONPATH")}
    return {**env, **_BASE_ENV, **MODES[mode]}


def _installed_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('verl'))"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _loaded_in(python: str, mode: str, cwd: Path) -> bool:
    """Whether importing verl's patched modules loads kl_adapters in this mode."""
    code = "import sys, verl.workers.utils.losses, verl.trainer.ppo.ray_trainer; print('kl_adapters' in sys.modules)"
    out = subprocess.run([python, "-c", code], env=_env(mode), cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"probe failed in mode {mode!r}:\n{out.stderr[-3000:]}")
    return out.stdout.strip().splitlines()[-1] == "True"


def select_tests(tree: Path) -> list[str]:
    """The release's CPU test files that mention something the adapter patches, relative to the tree."""
    return sorted(str(p.relative_to(tree)) for p in (tree / "tests").rglob("*_on_cpu.py")
                  if any(s in p.read_text(errors="replace") for s in TOUCHES))


def run_mode(python: str, tree: Path, tests: list[str], mode: str, out: Path) -> dict[str, str]:
    """pytest the tests in one mode; test id -> outcome (from pytest's JUnit XML)."""
    xml = out / f"{mode.replace(' ', '_')}.xml"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *tests]
    return release.pytest_outcomes(cmd, xml, cwd=tree, env=_env(mode), timeout=1800)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="interpreter of the environment to test")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a new temporary one)")
    args = parser.parse_args(argv)
    args.python = os.path.abspath(args.python)  # the runs' cwd is the unpacked sdist; not resolved (a venv symlink)
    work = args.work or Path(tempfile.mkdtemp(prefix="verl-selftests-"))
    version = _installed_version(args.python)
    rel = release.release("verl", version)
    tree = release.unpack(rel, release.download(rel, work / "download", args.python), work / "tree")
    shutil.rmtree(tree / "verl")  # the tests must import the installed verl, which the adapter patches
    tests = select_tests(tree)
    loaded = {mode: _loaded_in(args.python, mode, tree) for mode in MODES}
    if loaded != {"without": False, "flag off": True, "flag on": True}:
        raise RuntimeError(f"kl_adapters loaded per mode {loaded}: the modes do not isolate what they claim")
    results = {mode: run_mode(args.python, tree, tests, mode, work) for mode in MODES}
    ids = sorted(set().union(*results.values()))
    differ = [i for i in ids if len({results[m].get(i, "absent") for m in MODES}) > 1]
    print(f"verl {version}: {len(ids)} tests from {len(tests)} files: {', '.join(tests)}")
    for mode in MODES:
        counts = {o: list(results[mode].values()).count(o) for o in ("passed", "failed", "skipped", "error")}
        print(f"  {mode:9s} " + "  ".join(f"{k} {v}" for k, v in counts.items()))
    for test in differ:
        print("  DIFFERS  " + test + "  " + "  ".join(f"{m}: {results[m].get(test, 'absent')}" for m in MODES))
    print(f"{'FAIL' if differ else 'PASS'}: {len(ids) - len(differ)}/{len(ids)} upstream CPU tests with the same "
          f"outcome without kl-adapters, flag off, flag on (verl {version})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
