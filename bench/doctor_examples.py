"""Run `kl-adapters doctor` on the example configurations the frameworks ship, and tabulate what their KL optimizes.

The released source distributions ship no examples (trl 1.16.0 sdist: only trl/scripts/{grpo,rloo}.py; verl 0.9.1
sdist and the OpenRLHF 0.11.2 wheel: none), so the examples come from the repositories at the newest commits
available here, read with the installed releases (trl 1.16.0, verl 0.9.1, OpenRLHF 0.11.2):

    git clone https://github.com/volcengine/verl     && git -C verl checkout b178a3cd56f58b2d502255daba591e92833930a7
    git clone https://github.com/OpenRLHF/OpenRLHF   && git -C OpenRLHF checkout 3c3be6234e0cb353e76bb8019947db9dfe99fca7
    git clone https://github.com/huggingface/trl     && git -C trl checkout f2cd57710ae345ea6428ae95363267fcf38a3dc8
    python patches/release.py unpack trl /tmp/trl-release          # trl/scripts/{grpo,rloo}.py of the 1.16.0 sdist

One collection per framework, each in its own environment, then the table (any Python):

    .venvs/verl/bin/python bench/doctor_examples.py collect verl verl /tmp/doctor_verl.json
    .venvs/openrlhf/bin/python bench/doctor_examples.py collect openrlhf OpenRLHF /tmp/doctor_openrlhf.json
    .venvs/trl/bin/python bench/doctor_examples.py collect trl trl /tmp/doctor_trl.json \
        --release /tmp/trl-release/pristine/trl-1.16.0
    python bench/doctor_examples.py table /tmp/doctor_{verl,openrlhf,trl}.json bench/results/doctor_examples

Which files: verl examples/**/*.sh running verl.trainer.main_ppo; OpenRLHF examples/scripts/*.sh running
openrlhf.cli.train_ppo_ray; TRL examples/scripts/**/*.py and the release's trl/scripts/*.py using GRPOConfig or
RLOOConfig, and the ```python blocks of docs/source/*.md that call them. Scripts are read with an empty environment
(unset variables are reported, not guessed); TRL examples as launched on 8 processes (TRL's accelerate configs; only
GRPOConfig's batch-size checks read it); verl's and OpenRLHF's read past keys / arguments the installed release no
longer has (hazard `unknown-arguments`: the scripts come from older repository snapshots). Every file is diagnosed; the table lists those with a KL term and those the doctor could not
read (with the reason), and counts the ones without a KL term.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import textwrap
from pathlib import Path

MODULES = {"verl": "verl.trainer.main_ppo", "openrlhf": "openrlhf.cli.train_ppo_ray"}


def candidates(framework: str, root: Path, release: Path | None) -> list[tuple[str, Path]]:
    """(name shown in the table, file to diagnose) of every example of `framework` under `root`."""
    if framework in MODULES:
        pattern = "examples/**/*.sh" if framework == "verl" else "examples/scripts/*.sh"
        return [(str(p.relative_to(root)), p) for p in sorted(root.glob(pattern))
                if MODULES[framework] in p.read_text(errors="replace")]
    found = [(str(p.relative_to(root)), p) for p in sorted(root.glob("examples/scripts/**/*.py"))]
    if release is not None:
        found += [(f"trl-1.16.0 sdist: {p.relative_to(release)}", p) for p in sorted(release.glob("trl/scripts/*.py"))]
    found = [(n, p) for n, p in found if re.search(r"\b(GRPOConfig|RLOOConfig)\b", p.read_text(errors="replace"))]
    return found + _doc_blocks(root)


def _doc_blocks(root: Path) -> list[tuple[str, Path]]:
    """The ```python blocks of TRL's docs that call GRPOConfig(...) or RLOOConfig(...), each as a temporary file."""
    out, folder = [], Path(tempfile.mkdtemp(prefix="trl_doc_blocks_"))
    for doc in sorted(root.glob("docs/source/*.md")):
        lines = doc.read_text(errors="replace").splitlines()
        start = None
        for number, line in enumerate(lines, 1):
            if line.strip().startswith("```python") and start is None:
                start = number
            elif line.strip() == "```" and start is not None:
                block = "\n".join(lines[start:number - 1])
                if re.search(r"\b(GRPOConfig|RLOOConfig)\(", block):
                    path = folder / f"{doc.stem}_L{start}.py"
                    # docs elide arguments as `..., ` / `, ...`: drop them (what remains is the literal config)
                    path.write_text(re.sub(r",\s*\.\.\.(?=\s*[,)])|\.\.\.\s*,", "", textwrap.dedent(block)))
                    out.append((f"{doc.relative_to(root)}:{start}", path))
                start = None
    return out


def collect(framework: str, root: Path, release: Path | None) -> list[dict]:
    from kl_adapters.doctor import DoctorError, diagnose

    rows = []
    for name, path in candidates(framework, root, release):
        options = {"verl": {"env": {}, "strict": False}, "openrlhf": {"env": {}, "strict": False}, "trl": {}}[framework]
        argv = [str(path)] + (["--num_processes", "8"] if framework == "trl" else [])
        try:
            doc = diagnose(framework, argv, **options).as_dict()
            doc["source"] = name
        except DoctorError as err:
            doc = {"source": name, "framework": framework, "verdict": "unreadable", "exit_code": 2, "error": str(err)}
        except SyntaxError as err:  # a docs block that is not a complete program
            doc = {"source": name, "framework": framework, "verdict": "unreadable", "exit_code": 2,
                   "error": f"not Python: {err}"}
        rows.append(doc)
        print(f"{doc['exit_code']} {doc['verdict']:<10} {name}", file=sys.stderr)
    return rows


def _bias(path: dict, regime: str) -> str:
    audit = (path.get("audit") or {}).get(regime)
    return "-" if audit is None else f"{audit['relative_bias']:.2f}"


def _fix_line(row: dict) -> str:
    """The fix's flag line (the one naming a kl-adapters preset), with the preset."""
    if row["fix"] is None:
        return "-"
    lines = row["fix"]["lines"]
    flag = next((line for line in lines if "kl_adapters" in line or "preset" in line or "KL_ADAPTERS" in line),
                lines[0])
    return f"{row['fix']['preset']}: {flag}"


def summary(rows: list[dict]) -> str:
    """One line per (framework, KL path, preset, biasing hazards, regimes): how many examples, bias, fix."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["verdict"] in ("no-kl", "unreadable"):
            continue
        hazards = ",".join(sorted({h["code"] for h in r["hazards"] if h["severity"] != "warning"})) or "-"
        key = (r["framework"], " + ".join(f"{p['path']}:{p['preset'] or '(none)'}" for p in r["paths"]) or "-",
               hazards, "+".join("off" if g == "off-policy" else "on" for g in r["regimes"]), r["verdict"])
        groups.setdefault(key, []).append(r)
    lines = [f"{'framework':<9} {'n':>3}  {'KL path:preset':<32} {'bias on':>7} {'off':>5}  {'sampling':<8} "
             f"{'biasing hazards':<28} {'verdict':<8} fix"]
    for (framework, paths, hazards, regimes, verdict), group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        first = group[0]
        on = "/".join(_bias(p, "on-policy") for p in first["paths"]) or "-"
        off = "/".join(_bias(p, "off-policy") for p in first["paths"]) or "-"
        lines.append(f"{framework:<9} {len(group):>3}  {paths:<32} {on:>7} {off:>5}  {regimes:<8} {hazards:<28} "
                     f"{verdict:<8} {_fix_line(first)}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """script -> KL configuration -> preset -> bias (on / off-policy) -> hazards -> fix."""
    lines = ["== summary (examples with a KL term, grouped)", summary(rows), ""]
    by_framework: dict[str, list[dict]] = {}
    for row in rows:
        by_framework.setdefault(row["framework"], []).append(row)
    for framework, group in by_framework.items():
        counts = {v: sum(r["verdict"] == v for r in group) for v in ("unbiased", "biased", "no-op", "no-kl",
                                                                     "unreadable")}
        version = next((r["version"] for r in group if "version" in r), "?")
        lines += [f"== {framework} (read with {version}): {len(group)} examples: "
                  + ", ".join(f"{n} {v}" for v, n in counts.items()), ""]
        lines.append(f"{'example':<66} {'verdict':<10} {'path':<6} {'preset':<13} {'on':>5} {'off':>5}  "
                     "KL configuration | bias hazards | fix")
        for r in group:
            if r["verdict"] == "no-kl":
                continue
            if r["verdict"] == "unreadable":
                lines.append(f"{r['source']:<66} {'unreadable':<10} {' '.join(r['error'].split())[:160]}")
                continue
            hazards = ",".join(h["code"] for h in r["hazards"] if h["severity"] != "warning") or "-"
            fix = _fix_line(r)
            for i, p in enumerate(r["paths"] or [{"path": "-", "preset": None, "setting": "(none)"}]):
                head = f"{r['source']:<66} {r['verdict']:<10}" if i == 0 else f"{'':<66} {'':<10}"
                lines.append(f"{head} {p['path']:<6} {p['preset'] or '(none)':<13} {_bias(p, 'on-policy'):>5} "
                             f"{_bias(p, 'off-policy'):>5}  {p['setting']} | {hazards} | {fix if i == 0 else ''}")
        no_kl = [r["source"] for r in group if r["verdict"] == "no-kl"]
        lines += ["", f"no KL term ({len(no_kl)}): " + ", ".join(no_kl), ""]
    return "\n".join(lines)


def parse_command(description: str, collect_rows, argv: list[str] | None) -> argparse.Namespace | None:
    """The two steps of an examples benchmark: ``collect FRAMEWORK ROOT OUT [--release DIR]`` writes
    collect_rows(framework, root, release) to OUT (None returned); ``table PARTS... OUT`` returns its arguments."""
    parser = argparse.ArgumentParser(description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect")
    c.add_argument("framework", choices=("trl", "verl", "openrlhf"))
    c.add_argument("root", type=Path, help="the framework's repository checkout")
    c.add_argument("out", type=Path)
    c.add_argument("--release", type=Path, help="TRL: the unpacked release sdist (trl/scripts/*.py)")
    t = sub.add_parser("table")
    t.add_argument("parts", type=Path, nargs="+")
    t.add_argument("out", type=Path, help="writes OUT.txt and OUT.json")
    args = parser.parse_args(argv)
    if args.command == "collect":
        args.out.write_text(json.dumps(collect_rows(args.framework, args.root, args.release), indent=1))
        return None
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_command(__doc__.splitlines()[0], collect, argv)
    if args is None:
        return
    rows = [row for part in args.parts for row in json.loads(part.read_text())]
    command = "python bench/doctor_examples.py table " + " ".join(str(p) for p in args.parts) + f" {args.out}"
    header = f"# kl-adapters doctor on the frameworks' example configurations (made by: see bench/doctor_examples.py; " \
             f"last step: {command})\n# bias = relative bias of the preset's expected gradient vs grad KL_seq in the " \
             "exact audit (audit(4, 4, 0)); off = off-policy, shown when the example reuses a rollout\n"
    args.out.with_suffix(".txt").write_text(header + table(rows) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
