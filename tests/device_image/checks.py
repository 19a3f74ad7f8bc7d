"""Checks of the GPU suite's preparation that need no GPU (run by tests/device_image/prove.sh).

  checks.py wheelhouse <fw>       .gpu-wheels/<fw> holds exactly envs/gpu-<fw>.txt's pins (each one a pin of the CPU
                                  suite, envs/<fw>.txt) and one kl-adapters wheel, every wheel installable on CPython
                                  3.12 manylinux x86_64 (the device), and it is at most 60 MiB
  checks.py run <fw> <outdir>     what `scripts/gpu.sh run <fw> <outdir>` left without a GPU: the environment report
                                  without failures, the GPU tests collected and every one skipped (none passed, failed
                                  or errored), the benchmark's smoke result
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
MAX_BYTES = 60 * 2**20
MANYLINUX = {"manylinux1", "manylinux2010", "manylinux2014"} | {f"manylinux_2_{n}" for n in range(5, 40)}


def pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of a pins file (`name==version` lines; # comments)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise ValueError(f"{path}: not an exact pin: {line!r}")
            out[canonicalize_name(name)] = version
    return out


def runs_on_device(tag: Tag) -> bool:
    """CPython 3.12 on manylinux x86_64 (glibc <= 2.39)."""
    python_ok = tag.interpreter in {"py3", "py312", "cp312"} or (tag.interpreter.startswith("cp3") and tag.abi == "abi3"
                                                                 and int(tag.interpreter[3:]) <= 12)
    abi_ok = tag.abi in {"none", "abi3", "cp312"}
    platform_ok = tag.platform == "any" or (tag.platform.endswith("_x86_64")
                                            and tag.platform.removesuffix("_x86_64") in MANYLINUX)
    return python_ok and abi_ok and platform_ok


def check_wheelhouse(framework: str) -> list[str]:
    folder = ROOT / ".gpu-wheels" / framework
    wanted, cpu_suite = pins(ROOT / "envs" / f"gpu-{framework}.txt"), pins(ROOT / "envs" / f"{framework}.txt")
    problems = [f"{name}=={v} is not envs/{framework}.txt's pin ({cpu_suite.get(name)})"
                for name, v in wanted.items() if cpu_suite.get(name) != v]
    wheels = sorted(folder.glob("*.whl"))
    found = {}
    for wheel in wheels:
        name, version, _, tags = parse_wheel_filename(wheel.name)
        found.setdefault(name, []).append(str(version))
        if not any(runs_on_device(t) for t in tags):
            problems.append(f"{wheel.name}: no tag for CPython 3.12 manylinux x86_64")
    for name, versions in found.items():
        if len(versions) > 1:
            problems.append(f"{name}: {len(versions)} wheels ({versions})")
    expected = {**wanted, "kl-adapters": None}
    problems += [f"missing: {n}=={v}" for n, v in wanted.items() if found.get(n) != [v]]
    problems += [f"not pinned in envs/gpu-{framework}.txt: {n}" for n in found if n not in expected]
    size = sum(w.stat().st_size for w in wheels)
    if size > MAX_BYTES:
        problems.append(f"{size / 2**20:.1f} MiB > 60 MiB")
    print(f"{framework}: {len(wheels)} wheels, {size / 2**20:.1f} MiB")
    return problems


def check_run(framework: str, out: Path) -> list[str]:
    problems = []
    report = json.loads((out / f"{framework}-environment.json").read_text())
    problems += [f"environment: {f}" for f in report["failures"]]
    suite = ET.parse(out / f"{framework}-junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    print(f"{framework}: GPU tests {counts}")
    if counts["tests"] == 0:
        problems.append("no GPU test collected")
    if counts["failures"] or counts["errors"] or counts["skipped"] != counts["tests"]:
        problems.append(f"GPU tests without a GPU must all skip: {counts}")
    bench = out / f"gpu_{framework}_smoke.json"
    if not bench.exists():
        problems.append(f"no benchmark smoke result {bench.name}")
    elif not {"kl_term", "step"} <= set(json.loads(bench.read_text())):
        problems.append(f"{bench.name}: no kl_term / step measurement")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "wheelhouse":
        problems = check_wheelhouse(argv[1])
    elif len(argv) == 3 and argv[0] == "run":
        problems = check_run(argv[1], Path(argv[2]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for p in problems:
        print(f"FAIL {argv[1]}: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
