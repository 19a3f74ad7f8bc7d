"""OpenRLHF's own unit tests as a second opinion on the adapter: the same per-test outcome without kl-adapters, flag
off, flag on (issue 15, item 5).

Usage (scripts/compat.sh calls it so):
    python tests/openrlhf/upstream_selftests.py --python .venvs/openrlhf-0.11.0/bin/python

1. Fetches the release installed in --python from the package index (patches/release.py: pip download, sha256 where
   pinned, unpacked). OpenRLHF publishes no sdist, only a pure-Python wheel, which ships `tests/` beside `openrlhf/`.
2. Selects the test files that touch what the adapter patches or carries its data through (`TOUCHES`:
   compute_approx_kl, compute_reward, aggregate_loss, the PPO actor, the experience maker, Experience batching,
   hierarchize). Many of them load OpenRLHF's files by path (``tests/../openrlhf/...``) under private module names,
   so the unpacked `openrlhf/` is replaced by a link to the INSTALLED package: every test runs the installed code.
3. Runs them three times with --python, offline, on CPU, each test's outcome read from pytest's JUnit XML:
     without   KL_ADAPTERS unset: kl-adapters' only import-time hook in an OpenRLHF process, the
               kl_adapters_autoload.pth line, then imports nothing (OpenRLHF has no plugin entry point), so OpenRLHF
               runs as if kl-adapters were not installed; a plugin fails the run if `kl_adapters` was imported.
               (Cheaper than a second venv and the same thing: without KL_ADAPTERS no kl-adapters code is loaded.)
     flag off  the adapter's wrappers installed as the trigger modules are imported (a plugin calls
               kl_adapters.adapters.loader.arm("openrlhf")), no preset selected: the wrappers call OpenRLHF's originals.
     flag on   KL_ADAPTERS=sequence (the .pth hook patches OpenRLHF's modules as they are imported).
   The tests that pass `without` are the ones that run offline on CPU; each must have the same outcome in the other
   two runs. The rest (they need a GPU, the hub, or a package this CPU environment lacks) are counted, not compared.
   Tests that load OpenRLHF's files under private module names run code the adapter never patches (it patches
   modules by name); the flag-on line lists the adapter patches that were applied during the run.
Prints a table and a last line PASS / FAIL / NONE; exit status 1 if an outcome differs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "patches"))
import release  # noqa: E402

#: a test file is selected when it mentions one of these (what the adapter patches or carries its statistics through)
TOUCHES = re.compile(r"compute_approx_kl|compute_reward|aggregate_loss|ppo_actor|experience_maker|ppo_utils.experience"
                     r"|ppo_utils/experience|\"experience\.py\"|hierarchize")
MODES = ("without", "flag off", "flag on")
_PATCHED_LOG = "kl_adapters_patched.txt"
PLUGINS = {
    "kl_adapters_absent": "import sys\n\n\ndef pytest_sessionfinish(session):\n"
                          "    assert 'kl_adapters' not in sys.modules, 'kl_adapters was imported in the run without it'\n",
    "kl_adapters_flag_off": "def pytest_configure(config):\n    from kl_adapters.adapters import loader\n\n"
                            "    loader.arm('openrlhf')\n",
    "kl_adapters_record": "import sys\n\n\ndef pytest_sessionfinish(session):\n"
                          "    adapter = sys.modules.get('kl_adapters.adapters.openrlhf')\n"
                          f"    with open({_PATCHED_LOG!r}, 'w') as f:\n"
                          "        f.write(' '.join(adapter.patched()) if adapter else '')\n",
}


def installed(python: str) -> tuple[str, Path]:
    """(version, package folder) of the openrlhf installed in `python`'s environment."""
    code = ("import importlib.metadata as m, importlib.util as u, pathlib; "
            "print(m.version('openrlhf')); print(pathlib.Path(u.find_spec('openrlhf').origin).parent)")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    return out[0].strip(), Path(out[1].strip())


def prepare(version: str, package: Path, work: Path, python: str) -> tuple[Path, list[str]]:
    """The release's tree with `openrlhf/` linked to the installed package, and its selected test files."""
    rel = release.release("openrlhf", version)
    root = release.unpack(rel, release.download(rel, work / "download", python), work / "wheel")
    (root / "openrlhf").rename(root / "openrlhf.released")
    (root / "openrlhf").symlink_to(package, target_is_directory=True)
    for name, text in PLUGINS.items():
        (root / f"{name}.py").write_text(text)
    files = sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py") if TOUCHES.search(p.read_text()))
    return root, files


def run(python: str, root: Path, files: list[str], mode: str) -> dict[str, str]:
    """pytest on `files` in `root` under `mode`; returns {test id: passed|failed|error|skipped}."""
    env = {k: v for k, v in os.environ.items() if k not in ("KL_ADAPTERS", "PYTHONPATH")}
    env.update(release.TREE_ENV, KL_ADAPTERS_ALLOW_UNTESTED="1", PYTHONPATH=str(root), CUDA_VISIBLE_DEVICES="")
    plugins = {"without": ["kl_adapters_absent"], "flag off": ["kl_adapters_flag_off", "kl_adapters_record"],
               "flag on": ["kl_adapters_record"]}[mode]
    if mode == "flag on":
        env["KL_ADAPTERS"] = "sequence"
    report = root / f"{mode.replace(' ', '_')}.xml"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *[a for p in plugins for a in ("-p", p)],
           f"--junitxml={report}", *files]
    return release.pytest_outcomes(cmd, report, cwd=root, env=env, timeout=1800)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="interpreter of the environment to test")
    args = parser.parse_args(argv)
    args.python = os.path.abspath(args.python)  # not resolved: a venv's python is a symlink that must stay one
    version, package = installed(args.python)
    with tempfile.TemporaryDirectory(prefix="openrlhf-selftests-") as tmp:
        root, files = prepare(version, package, Path(tmp), args.python)
        results, patched = {}, {}
        for mode in MODES:
            results[mode] = run(args.python, root, files, mode)
            log = root / _PATCHED_LOG
            patched[mode] = log.read_text() if log.exists() else ""
            log.unlink(missing_ok=True)
    offline = sorted(t for t, o in results["without"].items() if o == "passed")
    differ = [t for t in offline if any(results[m].get(t) != "passed" for m in MODES[1:])]
    print(f"openrlhf {version}: {len(files)} test files: {', '.join(files)}")
    print(f"| openrlhf {version} | tests | " + " | ".join(MODES) + " |\n|---|---|---|---|---|")
    for t in differ:
        print(f"| differs | {t} | " + " | ".join(results[m].get(t, "absent") for m in MODES) + " |")
    print(f"| same | {len(offline) - len(differ)} of {len(offline)} offline CPU tests | "
          + " | ".join("passed" for _ in MODES) + " |")
    print(f"| not compared | {len(results['without']) - len(offline)} tests not passing without kl-adapters | - | - | - |")
    for mode in MODES[1:]:
        print(f"adapter patches applied ({mode}): {patched[mode] or 'none'}")
    verdict = "FAIL" if differ else "PASS" if offline else "NONE"
    print(f"{verdict}: {len(offline) - len(differ)}/{len(offline)} offline upstream tests with the same outcome "
          f"without kl-adapters, flag off, flag on (openrlhf {version})")
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
