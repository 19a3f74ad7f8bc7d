"""TRL's own unit tests as a second opinion on the adapter: same per-test outcome without kl-adapters, flag off, flag on.

Usage (scripts/compat.sh calls it so):
    python tests/trl/upstream_selftests.py --python .venvs/trl-1.15.0/bin/python [--tests DIR]

1. Fetches the sdist of the trl release installed in --python from the package index (patches/release.py: pip download,
   unpacked) and takes its `tests/`. trl's sdists ship none (1.14.0-1.16.0 checked: MANIFEST.in says `prune tests`), so
   the script says so and exits 0, having run nothing. --tests DIR: the `tests/` folder of a checkout of
   github.com/huggingface/trl at the release's tag (`git clone --depth 1 --branch v<version> ...`) instead.
2. Selects the test files that touch what the adapter patches (GRPOTrainer, RLOOTrainer and the batch helpers its
   rollout statistics travel through: split_tensor_dict, shuffle_sequence_dict), copied alone into a temporary folder
   so that `import trl` is the installed release, not a source tree.
3. Runs them three times with --python, offline (no model hub), results per test from pytest's JUnit XML:
     without   KL_ADAPTERS unset and nothing imports kl_adapters: its only import-time hook, the
               kl_adapters_autoload.pth line, imports it only when KL_ADAPTERS is set (checked: a plugin fails the run
               if `kl_adapters` is in sys.modules at the end), so TRL runs as if kl-adapters were not installed;
     flag off  the adapter's wrappers installed (a pytest plugin calls kl_adapters.adapters.trl.patch), no preset;
     flag on   KL_ADAPTERS=sequence (the .pth hook patches every GRPOTrainer).
   The tests that pass in `without` are the ones that run offline on CPU; each must have the same outcome in the two
   other runs. The others (they need the hub, a GPU, or an API another release has) are counted, not compared.
Prints a table and a last line PASS / FAIL / NONE (no test ran offline); exit status 1 if an outcome differs. KL_ADAPTERS_ALLOW_UNTESTED=1 is set for the runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "patches"))
import release  # noqa: E402

#: a test file is selected when it mentions one of these (the code the adapter patches or carries its data through)
TOUCHES = re.compile(r"GRPOTrainer|RLOOTrainer|grpo_trainer|rloo_trainer|split_tensor_dict|shuffle_sequence_dict")
MODES = ("without", "flag off", "flag on")
PLUGINS = {
    "kl_adapters_absent": "import sys\n\n\ndef pytest_sessionfinish(session):\n"
                          "    assert 'kl_adapters' not in sys.modules, 'kl_adapters was imported in the run without it'\n",
    "kl_adapters_flag_off": "def pytest_configure(config):\n    import trl.trainer.grpo_trainer, trl.trainer.rloo_trainer\n"
                            "    from kl_adapters.adapters import trl\n\n    trl.patch('trl.trainer.grpo_trainer')\n",
}


def installed_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('trl'))"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def released_tests(version: str, work: Path, python: str) -> Path | None:
    """The `tests/` folder of the release's sdist, or None if it ships none."""
    rel = release.release("trl", version)
    root = release.unpack(rel, release.download(rel, work / "download", python), work / "sdist")
    return root / "tests" if (root / "tests").is_dir() else None


def select(tests: Path, dest: Path) -> list[str]:
    """Copy the tests folder (helpers, data) to dest; return the selected test files (relative names)."""
    shutil.copytree(tests, dest / "tests")
    return sorted(str(p.relative_to(dest)) for p in (dest / "tests").rglob("test_*.py") if TOUCHES.search(p.read_text()))


def run(python: str, root: Path, files: list[str], mode: str) -> dict[str, str]:
    """pytest on `files` in `root` under `mode`; returns {test id: passed|failed|error|skipped}."""
    env = {k: v for k, v in os.environ.items() if k != "KL_ADAPTERS"}
    env.update(release.TREE_ENV, KL_ADAPTERS_ALLOW_UNTESTED="1", PYTHONPATH=str(root), CUDA_VISIBLE_DEVICES="")
    plugin = {"without": "kl_adapters_absent", "flag off": "kl_adapters_flag_off"}.get(mode)
    if mode == "flag on":
        env["KL_ADAPTERS"] = "sequence"
    report = root / f"{mode.replace(' ', '_')}.xml"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *files]
    if plugin:
        cmd[3:3] = ["-p", plugin]
    return release.pytest_outcomes(cmd, report, cwd=root, env=env, timeout=3600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="interpreter of the environment to test")
    parser.add_argument("--tests", type=Path, help="tests/ of a trl checkout at the release's tag (default: sdist's)")
    args = parser.parse_args(argv)
    args.python = os.path.abspath(args.python)  # not resolved: a venv's python is a symlink that must stay one
    version = installed_version(args.python)
    with tempfile.TemporaryDirectory(prefix="trl-selftests-") as tmp:
        work = Path(tmp)
        tests = args.tests or released_tests(version, work, args.python)
        if tests is None:
            print(f"NONE: the trl {version} sdist ships no tests (MANIFEST.in: prune tests); pass --tests <checkout>/tests")
            return 0
        root = work / "run"
        root.mkdir()
        files = select(tests, root)
        for name, text in PLUGINS.items():
            (root / f"{name}.py").write_text(text)
        results = {mode: run(args.python, root, files, mode) for mode in MODES}
    offline = sorted(t for t, o in results["without"].items() if o == "passed")
    differ = [t for t in offline if any(results[m].get(t) != "passed" for m in MODES[1:])]
    print(f"| trl {version} | tests | " + " | ".join(MODES) + " |\n|---|---|---|---|---|")
    for t in differ:
        print(f"| differs | {t} | " + " | ".join(results[m].get(t, "absent") for m in MODES) + " |")
    print(f"| same | {len(offline) - len(differ)} of {len(offline)} offline CPU tests in {len(files)} files | "
          + " | ".join("passed" for _ in MODES) + " |")
    print(f"| not compared | {len(results['without']) - len(offline)} tests not passing without kl-adapters "
          "(hub, GPU, other API) | - | - | - |")
    verdict = "FAIL" if differ else "PASS" if offline else "NONE"  # NONE: nothing to compare ran
    print(f"{verdict}: {len(offline) - len(differ)}/{len(offline)} offline upstream tests with the same outcome "
          f"without kl-adapters, flag off, flag on (trl {version})")
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
