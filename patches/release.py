"""The released source of TRL, verl and OpenRLHF, fetched from the package index, and the upstream patches on it.

Used by patches/check.sh and tests/<framework>/test_upstream_patch.py (standard library only, plus `pip`, `git` and
GNU `patch` on PATH). Nothing is vendored: each call downloads the release with pip (`pip download --no-deps`), checks
its sha256 against the value pinned below, and unpacks it as a git repository with one commit, so that a patched tree
can be diffed against the release.

Released source per project (what `pip download` gets; the patch paths are relative to this root, which has the
layout of the upstream repository root):
    trl 1.16.0       sdist   trl-1.16.0/          trl/ (no tests/, no docs/: the patch adds its test as a new file)
    verl 0.9.1       sdist   verl-0.9.1/          verl/, tests/ (no docs/)
    openrlhf 0.11.2  wheel   openrlhf-0.11.2.data/purelib/   openrlhf/, tests/ (PyPI has no sdist of OpenRLHF)

Command line (regenerating a patch for a newer release: see patches/README.md):
    python patches/release.py unpack <project> <dir> [--version V]  the release in <dir>/pristine/<root>, a git repo
    python patches/release.py apply <project> <dir> [--version V]   the same in <dir>/patched/, with
                                                                    patches/<project>-<V>.patch applied
    python patches/release.py check <project> <dir> [--version V]   `apply`, then the patch's unit tests on the
                                                                    patched tree with this Python (exit status 0: pass)
    python patches/release.py diff <project> <tree>                 header of the pinned patch + `git diff` of <tree>
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PATCHES = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Release:
    project: str
    version: str
    kind: str  # "sdist" or "wheel"
    sha256: str | None  # of the downloaded archive; None for a version not pinned here (regeneration)
    tests: tuple[str, ...]  # the patch's unit tests, and the released tests of the functions it touches

    @property
    def patch(self) -> Path:
        return PATCHES / f"{self.project}-{self.version}.patch"

    def pip_args(self) -> list[str]:
        spec = f"{self.project}=={self.version}"
        if self.kind == "sdist":
            return ["--no-binary", ":all:", spec]
        # OpenRLHF publishes only a (pure-Python) cp311 wheel: ask for it explicitly, whatever runs pip
        return ["--only-binary", ":all:", "--python-version", "3.11", "--platform", "manylinux1_x86_64", spec]

    def source_root(self, unpacked: Path) -> Path:
        """The folder of the unpacked archive that corresponds to the upstream repository root."""
        if self.kind == "sdist":
            return unpacked / f"{self.project}-{self.version}"
        return unpacked / f"{self.project}-{self.version}.data" / "purelib"


PINNED = {
    "trl": Release("trl", "1.16.0", "sdist", "999bd4a85b08870b7bfa387e1efa5177d2a4b88fe82b2526a057ac5d3cc600cd",
                   ("tests/test_grpo_sequence_kl.py",)),
    "verl": Release("verl", "0.9.1", "sdist", "3e03d8816b2546b2c5580705671b8d0bb3f79b8364e7b5c56dbfc1245536ba22",
                    ("tests/trainer/ppo/test_kl_sequence_on_cpu.py", "tests/trainer/ppo/test_core_algos_on_cpu.py",
                     "tests/trainer/test_multi_trajectories_advantage_on_cpu.py")),
    "openrlhf": Release("openrlhf", "0.11.2", "wheel",
                        "c969d70db03a70724c3d8a5a01186c6e0728bce624fb3dff95e39b5396acefa6",
                        ("tests/test_kl_estimator_gradient.py",)),
}
#: environment for running code from a released tree: offline, and no verl plugin (e.g. kl-adapters') patching it
TREE_ENV = {"VERL_USE_EXTERNAL_PLUGINS": "none", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def release(project: str, version: str | None = None) -> Release:
    pinned = PINNED[project]
    if version in (None, pinned.version):
        return pinned
    return Release(project, version, pinned.kind, None, pinned.tests)


class PatchError(RuntimeError):
    """The patch does not apply cleanly (fuzz, offsets, rejects) to the released source."""


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    if shutil.which(cmd[0]) is None:
        raise RuntimeError(f"{cmd[0]!r} is not on PATH: fetching and patching releases needs pip, git and GNU patch")
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def _git(tree: Path, *args: str) -> str:
    out = _run(["git", "-c", "user.name=release", "-c", "user.email=release@localhost", *args], cwd=tree)
    if out.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed in {tree}:\n{out.stdout}{out.stderr}")
    return out.stdout


def download(rel: Release, dest: Path, python: str = sys.executable) -> Path:
    """`pip download` the release into dest (reused if already there) and check its sha256; returns the archive."""
    dest.mkdir(parents=True, exist_ok=True)
    found = [p for p in dest.glob(f"{rel.project}-{rel.version}*") if p.suffix in (".gz", ".whl")]
    if not found:
        out = _run([python, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest),
                    *rel.pip_args()])
        if out.returncode:
            raise RuntimeError(f"pip download {rel.project}=={rel.version} failed:\n{out.stdout}{out.stderr}")
        found = [p for p in dest.glob(f"{rel.project}-{rel.version}*") if p.suffix in (".gz", ".whl")]
    (archive,) = found
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if rel.sha256 is not None and digest != rel.sha256:
        raise RuntimeError(f"{archive.name}: sha256 {digest}, expected {rel.sha256} (the pinned release)")
    return archive


def unpack(rel: Release, archive: Path, dest: Path) -> Path:
    """Unpack the archive into dest and make its source root a git repository (one commit); returns the root."""
    root = rel.source_root(dest)
    if root.exists():
        raise FileExistsError(f"{root} exists: unpack into a new folder")
    dest.mkdir(parents=True, exist_ok=True)
    if rel.kind == "sdist":
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    else:
        with zipfile.ZipFile(archive) as whl:
            whl.extractall(dest)
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", f"{rel.project} {rel.version} as released ({archive.name})")
    return root


def apply_patch(tree: Path, patch: Path) -> None:
    """Apply `patch` to `tree` if it applies cleanly: `git apply --check` (no fuzz) and GNU `patch --dry-run
    --fuzz=0` with no hunk applied at an offset; raises PatchError with the tools' output otherwise."""
    check = _run(["git", "apply", "--check", "--verbose", str(patch)], cwd=tree)
    dry = _run(["patch", "-p1", "--dry-run", "--fuzz=0", "--forward", "--batch", "-i", str(patch)], cwd=tree)
    dirty = [line for line in dry.stdout.splitlines() if "offset" in line or "fuzz" in line or "FAILED" in line]
    if check.returncode or dry.returncode or dirty:
        raise PatchError(f"{patch.name} does not apply cleanly to {tree}:\ngit apply --check:\n{check.stdout}"
                         f"{check.stderr}\npatch --dry-run:\n{dry.stdout}{dry.stderr}")
    _git(tree, "apply", str(patch))


def fetch_tree(project: str, dest: Path, version: str | None = None, *, patched: bool,
               python: str = sys.executable) -> Path:
    """Released source of `project` unpacked under dest (as a git repo), with its upstream patch applied if
    `patched`; returns the source root."""
    rel = release(project, version)
    root = unpack(rel, download(rel, dest / "download", python), dest / ("patched" if patched else "pristine"))
    if patched:
        apply_patch(root, rel.patch)
    return root


def fetch_trees(project: str, dest: Path, version: str | None = None) -> tuple[Path, Path]:
    """(pristine, patched) source roots of the release under dest, downloaded once; fetching the patched one asserts
    that the patch applies cleanly."""
    return fetch_tree(project, dest, version, patched=False), fetch_tree(project, dest, version, patched=True)


def run_in_tree(tree: Path, args: list[str], *, python: str = sys.executable, path: tuple[str, ...] = (),
                timeout: float = 600) -> subprocess.CompletedProcess:
    """`python <args>` in `tree` with the tree first on sys.path (then `path`), so that `import <project>` is the
    tree's code, not the installed package; TREE_ENV set, KL_ADAPTERS unset."""
    env = {k: v for k, v in os.environ.items() if k != "KL_ADAPTERS"}
    env.update(TREE_ENV, PYTHONPATH=os.pathsep.join([str(tree), *path]))
    return subprocess.run([python, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)


def run_tests(rel: Release, tree: Path, python: str = sys.executable) -> subprocess.CompletedProcess:
    """The release's `tests` with pytest, on `tree`."""
    return run_in_tree(tree, ["-m", "pytest", "-q", "-p", "no:cacheprovider", *rel.tests], python=python)


def pytest_outcomes(cmd: list[str], report: Path, *, cwd: Path, env: dict[str, str], timeout: int) -> dict[str, str]:
    """Run `cmd` (a pytest command that writes its JUnit XML to `report`) and return {test id: passed|failed|error|
    skipped}, the outcome of every test it ran (the frameworks' own tests, run by tests/<fw>/upstream_selftests.py)."""
    import xml.etree.ElementTree as ET

    subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if not report.exists():
        raise RuntimeError(f"pytest wrote no report: {' '.join(cmd)}")
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = (
            "error" if "error" in kinds else "failed" if "failure" in kinds else "skipped" if "skipped" in kinds
            else "passed")
    return outcomes


def probe_both_trees(rel: Release, trees: tuple[Path, Path], probe: Path, out: Path, args: list[str],
                     path: tuple[str, ...] = ()) -> dict:
    """Run `probe <tree> *args <result file> <mode>` in the pristine and the patched tree, and the patch's own unit
    tests, concurrently (each in its own interpreter, `path` and this folder on sys.path); return their results
    ("pristine", "patched": what each probe torch.save-d; "unit_tests": the CompletedProcess)."""
    import torch

    def run_probe(tree: Path, mode: str):
        result = run_in_tree(tree, [str(probe), str(tree), *args, str(out / mode), mode],
                             path=(*path, str(Path(__file__).resolve().parent)))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        return torch.load(out / mode, weights_only=False)

    with ThreadPoolExecutor(3) as pool:
        pristine = pool.submit(run_probe, trees[0], "pristine")
        patched = pool.submit(run_probe, trees[1], "patched")
        unit_tests = pool.submit(run_tests, rel, trees[1])
        return {"pristine": pristine.result(), "patched": patched.result(), "unit_tests": unit_tests.result()}


def changed_files(rel: Release, trees: tuple[Path, Path]) -> set[str]:
    """Files the patch changes in the fetched release; asserts the pristine tree is untouched and that the patch file
    is exactly the patched tree's diff (after its header)."""
    pristine, patched = trees
    assert diff(pristine) == ""
    changed = diff(patched)
    assert changed in rel.patch.read_text()
    return {line.split(" b/")[1] for line in changed.splitlines() if line.startswith("diff --git")}


def header(patch: Path) -> str:
    """The free-text header of a patch file (everything before its first `diff --git`)."""
    text = patch.read_text()
    return text[: text.index("diff --git")]


def diff(tree: Path) -> str:
    """`git diff` of a tree made by `unpack` against the release, new files included."""
    _git(tree, "add", "-A")
    return _git(tree, "diff", "--cached", "--no-color", "--no-ext-diff")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["unpack", "apply", "check", "diff"])
    parser.add_argument("project", choices=sorted(PINNED))
    parser.add_argument("dir", type=Path)
    parser.add_argument("--version", default=None, help="another release than the pinned one (no sha256 check)")
    args = parser.parse_args(argv)
    if args.command == "diff":
        sys.stdout.write(header(PINNED[args.project].patch) + diff(args.dir))
        return
    root = fetch_tree(args.project, args.dir, args.version, patched=args.command != "unpack")
    print(root)
    if args.command == "check":
        result = run_tests(release(args.project, args.version), root)
        print(result.stdout[-3000:] + result.stderr[-3000:])
        sys.exit(result.returncode)


if __name__ == "__main__":
    main()
