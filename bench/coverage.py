"""Coverage of real configurations (issue 37, part 3): every example of the three frameworks that has a KL term, with
the doctor's fix applied -- does kl-adapters accept it, and is the code path it then takes run by a test in tests/?

The examples are bench/doctor_examples.py's (same repository snapshots, same reading: an empty environment, verl's and
OpenRLHF's unknown keys read past, TRL as launched on 8 processes). For each one the doctor gives a verdict; an
unbiased example needs no fix (it runs the framework's own code, whose KL gradient kl-adapters pins with a test), any
other gets the doctor's fix applied to its arguments (verl: the fix's overrides appended; OpenRLHF: the fix's flags
appended, ``--algo.kl.unbiased_gradient`` dropped; TRL GRPO: ``--kl_preset sequence``; TRL RLOO: the fix's first
option, ``--num_iterations 1 --normalize_advantages false`` and one generation per optimizer step) and is diagnosed
again: accepted when that verdict is "unbiased" (the adapter's own refusals make it "refused"). Then the features that
decide the code path are read from the configuration the framework's parser made (`features`), and each non-default
one is judged by the support matrix (kl_adapters.support, docs/support.md: `SETTING` names the matrix's setting a value
turns on, `verdict` reads that entry's status and test; the matrix is the one place that says what is tested): the row
is on a tested path when its path has a test and every feature it sets has one.

One collection per framework, each in its own environment (the repositories checked out as in
bench/doctor_examples.py), then the table (any Python):

    .venvs/verl/bin/python bench/coverage.py collect verl verl /tmp/coverage_verl.json
    .venvs/openrlhf/bin/python bench/coverage.py collect openrlhf OpenRLHF /tmp/coverage_openrlhf.json
    .venvs/trl/bin/python bench/coverage.py collect trl trl /tmp/coverage_trl.json \
        --release /tmp/trl-release/pristine/trl-1.16.0
    python bench/coverage.py table /tmp/coverage_{verl,openrlhf,trl}.json bench/results/coverage

tests/core/test_coverage_table.py checks that every test the table names exists, and that judging the committed rows
again with these mappings gives the committed verdicts.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)

from doctor_examples import candidates, parse_command  # noqa: E402

from kl_adapters import support  # noqa: E402

#: (framework, KL path) -> the test that runs that path through the framework's own code with kl-adapters' fix
#: (for a native unbiased path: the test that pins the framework's own KL gradient). None: no such test.
PATH_TESTS = {
    ("verl", "loss"): "tests/verl/test_engine.py::test_fsdp2_engine_on_cpu_matches_the_oracle",
    ("verl", "reward"): "tests/verl/test_reward_path.py::test_policy_gradient_equals_kl_surrogate_reward_preset",
    ("verl", "reward-native"): "tests/verl/test_doctor.py::test_mapping_is_verls_own_gradient",
    ("openrlhf", "loss"): "tests/openrlhf/test_loss_path.py::test_gradient_is_task_plus_kl_surrogate",
    ("openrlhf", "reward"): "tests/openrlhf/test_reward_path.py::test_reward_path_gradient_is_reward_preset",
    ("trl", "loss"): "tests/trl/test_grpo_gradients.py::test_off_policy_gradient_uses_rollout_logps",
    ("trl", "reward-native"): "tests/trl/test_rloo.py::test_rloo_advantage_is_loo_baselined_k1_sum",
}

#: a SETTING value that stands for every number above 1 (a parallel size)
ABOVE_ONE = "> 1"

#: (framework, feature, value) -> the setting of the support matrix (kl_adapters.support) that value turns on; the
#: matrix alone says what kl-adapters does there and which test runs it (`verdict`). verl's fsdp2 is the matrix's FSDP
#: row (its default fsdp, the value the path test runs, shares the engine's forward, outputs and ppo_loss). A
#: non-default value no entry names has no test (the row is "untested").
SETTING = {
    ("verl", "strategy", "fsdp2"): "sharding",
    ("verl", "strategy", "megatron"): "megatron",
    ("verl", "use_remove_padding", True): "packing",
    ("verl", "use_dynamic_bsz", True): "dynamic-batch",
    ("verl", "ulysses_sequence_parallel_size", ABOVE_ONE): "sequence-parallel",
    ("verl", "lora", True): "lora",
    ("verl", "use_liger", True): "liger",
    ("verl", "vision-language model", "vision-language"): "vision-language",
    ("verl", "vision-language model", "vision-language-other"): "vision-language-other",
    ("openrlhf", "ds.packing_samples", True): "packing",
    ("openrlhf", "ds.ring_attn_size", ABOVE_ONE): "sequence-parallel",
    ("openrlhf", "ds.tensor_parallel_size", ABOVE_ONE): "tensor-parallel",
    ("openrlhf", "lora", True): "lora",
    ("openrlhf", "ds.use_liger_kernel", True): "liger",
    ("openrlhf", "train.dynamic_batch_enable", True): "dynamic-batch",
    ("openrlhf", "algo.advantage.is_correction_level", "token"): "vllm",
    ("openrlhf", "algo.advantage.is_correction_level", "seq"): "vllm",
    ("openrlhf", "vision-language model", "vision-language"): "vision-language",
    ("openrlhf", "vision-language model", "vision-language-other"): "vision-language-other",
    ("trl", "vllm_importance_sampling_correction", True): "vllm",
    ("trl", "peft (LoRA reference)", True): "lora",
    ("trl", "use_liger_kernel", True): "liger",
    ("trl", "deepspeed / fsdp", True): "sharding",
    ("trl", "vision-language model", "vision-language"): "vision-language",
    ("trl", "vision-language model", "vision-language-other"): "vision-language-other",
}

#: (framework, feature, value) -> its test, for KL path options that are no setting of the support matrix
PATH_OPTION_TESTS = {
    ("trl", "importance_sampling_level", "sequence"):
        "tests/trl/test_grpo_gradients.py::test_sequence_level_importance_sampling",
}


def setting(framework: str, key: str, value) -> str | None:
    """The support matrix's setting a feature's value turns on (`SETTING`), None where no entry names it."""
    found = SETTING.get((framework, key, value)) if not isinstance(value, (list, dict)) else None
    if found is None and isinstance(value, int) and not isinstance(value, bool) and value > 1:
        found = SETTING.get((framework, key, ABOVE_ONE))
    return found


def verdict(framework: str, key: str, value) -> tuple[str | None, str | None]:
    """(the support matrix's status, the test that runs the fixed KL path with the feature at that value, None if
    none): the matrix's entry of the setting it turns on (a test only where that entry is tested), or a path option's
    test (`PATH_OPTION_TESTS`); (None, None) for a value no mapping names."""
    if not isinstance(value, (list, dict)) and (framework, key, value) in PATH_OPTION_TESTS:
        return support.TESTED, PATH_OPTION_TESTS[framework, key, value]
    name = setting(framework, key, value)
    if name is None:
        return None, None
    e = support.entry(framework, name)
    return e.status, e.test if e.status == support.TESTED else None


#: the settings `features` reads, at the values the path tests run
DEFAULTS = {
    "verl": {"strategy": "fsdp", "use_remove_padding": False, "use_dynamic_bsz": False,
             "ulysses_sequence_parallel_size": 1, "lora": False, "use_liger": False, "vision-language model": None},
    "openrlhf": {"ds.packing_samples": False, "ds.ring_attn_size": 1, "ds.tensor_parallel_size": 1,
                 "lora": False, "ds.use_liger_kernel": False, "train.dynamic_batch_enable": False,
                 "algo.advantage.is_correction_level": "off", "vision-language model": None},
    "trl": {"importance_sampling_level": "token", "vllm_importance_sampling_correction": False,
            "peft (LoRA reference)": False, "use_liger_kernel": False, "deepspeed / fsdp": False,
            "vision-language model": None},
}


def features(framework: str, argv: list[str], options: dict, text: str) -> dict:
    """The settings that decide the KL code path, as the framework's own parser reads `argv` (after the fix; `options`
    the doctor's, `text` the example's source)."""
    if framework == "verl":
        from omegaconf import OmegaConf

        from kl_adapters.doctor.verl import compose

        config, _ = compose(list(argv), strict=False)

        def get(key):
            try:
                return OmegaConf.select(config, key, default=None)
            except Exception:  # an interpolation of a value the script computes at run time
                return "?"
        out = {"strategy": get("actor_rollout_ref.actor.strategy"),
               "use_remove_padding": get("actor_rollout_ref.model.use_remove_padding"),
               "use_dynamic_bsz": get("actor_rollout_ref.actor.use_dynamic_bsz"),
               "ulysses_sequence_parallel_size": get("actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
               "lora": _lora(get("actor_rollout_ref.model.lora_rank"))
               or get("actor_rollout_ref.model.lora_adapter_path") is not None,
               "use_liger": get("actor_rollout_ref.model.use_liger"),
               "vision-language model": support.vision_language_setting(get("actor_rollout_ref.model.path"),
                                                                        "verl")}
        # a key the config does not have (Megatron's has no Ulysses size) is at its default
        return {k: DEFAULTS["verl"][k] if v is None else _plain(v) for k, v in out.items()}
    if framework == "openrlhf":
        from kl_adapters.doctor.openrlhf import parse

        args = parse(list(argv), strict=False)[0]

        def get(key):
            value = args
            for name in key.split("."):
                value = getattr(value, name)
            return value
        special = {"lora": lambda: _lora(get("ds.lora.rank")),
                   "ds.use_liger_kernel": lambda: bool(getattr(args.ds, "use_liger_kernel", False)),
                   "vision-language model": lambda: support.vision_language_setting(
                       get("actor.model_name_or_path"), "openrlhf")}
        return {k: special[k]() if k in special else _plain(get(k)) for k in DEFAULTS["openrlhf"]}
    from kl_adapters.doctor import trl as reader

    config, *_ = reader._parse(options["trainer"], *reader._num_processes(list(argv)))
    return {"importance_sampling_level": getattr(config, "importance_sampling_level", "token"),
            "vllm_importance_sampling_correction": bool(getattr(config, "use_vllm", False)
                                                        and getattr(config, "vllm_importance_sampling_correction",
                                                                    False)),
            "peft (LoRA reference)": _use_peft(argv) or "peft_config=LoraConfig(" in text,
            "use_liger_kernel": bool(getattr(config, "use_liger_kernel", False)),
            "deepspeed / fsdp": bool(getattr(config, "deepspeed", None) or getattr(config, "fsdp", None)),
            "vision-language model": support.vision_language_setting(_value(argv, "--model_name_or_path"), "trl")}


def _value(argv: list[str], flag: str) -> str | None:
    """The value given to `flag` last in argv (``--flag value`` or ``--flag=value``)."""
    found = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif word.startswith(flag + "="):
            found = word.split("=", 1)[1]
    return found


def _use_peft(argv: list[str]) -> bool:
    """TRL's ModelConfig --use_peft (what get_peft_config reads): a LoRA policy whose reference is the base model."""
    if "--use_peft" not in argv:
        return False
    i = argv.index("--use_peft")
    return i + 1 == len(argv) or argv[i + 1].startswith("--") or argv[i + 1].lower() in ("true", "1")


def _lora(rank) -> bool | str:
    """Whether a LoRA rank turns LoRA on ("?" when the script computes it at run time)."""
    rank = _plain(rank)
    return rank if rank == "?" else bool(rank)


def _plain(value):
    """A JSON value: strings as written, `shell.UNRESOLVED` markers as "?"."""
    if isinstance(value, str) and "UNRESOLVED" in value:
        return "?"
    return value


def _fix_arguments(framework: str, report: dict) -> tuple[list[str], list[str]]:
    """(arguments to add, flags to drop) that apply the doctor's fix (see the module docstring)."""
    fix = report["fix"]
    if framework == "verl":
        return [line for line in fix["lines"] if re.fullmatch(r"[\w.+~]+=\S+", line)], []
    if framework == "openrlhf":
        add, drop = [], []
        for line in fix["lines"]:
            tail = line.split(">", 1)[-1]
            if tail.startswith("(drop"):
                drop += re.findall(r"--[\w.]+", tail)
                continue
            add += tail.split()
        return add, drop
    if any("kl_preset" in line for line in fix["lines"]) and fix["preset"] == "sequence" and \
            report["paths"][0]["path"] == "loss":
        return ["--kl_preset", "sequence"], []
    return ["--num_iterations", "1", "--normalize_advantages", "false", "--steps_per_generation", "1",
            "--gradient_accumulation_steps", "1"], []


def _arguments(framework: str, path: Path) -> tuple[list[str], dict]:
    """(the example's arguments as the doctor reads them, the doctor's options): a TRL script's usage arguments and
    config literals (so that a fix appended after them wins), a launch script's command."""
    if framework == "trl":
        from kl_adapters.doctor.trl import script_arguments

        trainer, argv = script_arguments(path, ["--num_processes", "8"])
        return argv, {"trainer": trainer}
    from kl_adapters.doctor import openrlhf, verl
    from kl_adapters.doctor.shell import launch_arguments

    modules = {"verl": verl.MODULES, "openrlhf": openrlhf.MODULES}[framework]
    return list(launch_arguments([str(path)], modules, {}).args), {"env": {}, "strict": False}


def _kl_paths(framework: str, report: dict) -> list[str]:
    """The PATH_TESTS keys of a report's KL paths: an unbiased path without kl-adapters' preset is "reward-native"."""
    return [p["path"] if "kl_adapters" in p["source"] else f"{p['path']}-native" for p in report["paths"]]


def row(framework: str, name: str, path: Path) -> dict:
    from kl_adapters.doctor import DoctorError, diagnose

    out = {"framework": framework, "source": name}
    try:
        argv, options = _arguments(framework, path)
        before = diagnose(framework, argv, **options).as_dict()
    except (DoctorError, SyntaxError) as err:
        return {**out, "before": "unreadable", "error": " ".join(str(err).split())[:200]}
    out["before"] = before["verdict"]
    if before["verdict"] == "no-kl":
        return out
    out["preset_before"] = "/".join(p["preset"] or "(none)" for p in before["paths"])
    after, fixed = before, list(argv)
    if before["verdict"] != "unbiased" and before["fix"] is not None:
        add, drop = _fix_arguments(framework, before)
        fixed = [a for a in argv if a.split("=", 1)[0] not in drop] + add
        out["fix"] = " ".join(add + [f"(drop {d})" for d in drop])
        try:
            after = diagnose(framework, fixed, **options).as_dict()
        except DoctorError as err:
            return {**out, "after": "unreadable", "error": " ".join(str(err).split())[:200]}
    out["after"] = after["verdict"]
    out["preset_after"] = "/".join(p["preset"] or "(none)" for p in after["paths"])
    out["refusal"] = next((h["message"] for h in after["hazards"] if h["severity"] == "refused"), None)
    out["warnings"] = sorted({h["code"] for h in after["hazards"] if h["code"] == "untested-path"})
    out["features"] = features(framework, fixed, options, path.read_text(errors="replace"))
    out["kl_paths"] = _kl_paths(framework, after)
    return out


def judge(r: dict) -> dict:
    """The row's accepted / tested / tests / untested (features without a test), from its collected facts."""
    if r["before"] in ("no-kl", "unreadable") or r.get("after") in (None, "unreadable"):
        return r
    framework = r["framework"]
    tests = [PATH_TESTS.get((framework, p)) for p in r["kl_paths"]]
    untested = [f"{p} path" for p, t in zip(r["kl_paths"], tests) if t is None]
    for key, value in r["features"].items():
        if value == DEFAULTS[framework].get(key) or all(p.endswith("-native") for p in r["kl_paths"]):
            continue
        status, test = verdict(framework, key, value)
        if test is None:
            untested.append(f"{key}={value} ({status or 'no test'})")
        tests.append(test)
    accepted = r["after"] == "unbiased"
    return {**r, "accepted": accepted, "tests": sorted({t for t in tests if t}),
            "untested": untested, "tested": accepted and not untested}


def collect(framework: str, root: Path, release: Path | None) -> list[dict]:
    rows = []
    for name, path in candidates(framework, root, release):
        rows.append(row(framework, name, path))
        print(f"{rows[-1]['before']:<10} -> {rows[-1].get('after', '-'):<10} {name}", file=sys.stderr)
    return rows


def coverage(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Per framework: examples with a KL term, accepted after the fix, accepted on a tested path."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        if r["before"] in ("no-kl", "unreadable"):
            continue
        c = out.setdefault(r["framework"], {"kl": 0, "accepted": 0, "tested": 0})
        c["kl"] += 1
        c["accepted"] += bool(r.get("accepted"))
        c["tested"] += bool(r.get("tested"))
    return out


def table(rows: list[dict]) -> str:
    lines = [f"{'framework':<9} {'with KL':>7} {'accepted':>8} {'on a tested path':>16}"]
    for framework, c in coverage(rows).items():
        lines.append(f"{framework:<9} {c['kl']:>7} {c['accepted']:>8} {c['tested']:>9} ({c['tested'] / c['kl']:.0%})")
    total = {k: sum(c[k] for c in coverage(rows).values()) for k in ("kl", "accepted", "tested")}
    lines += [f"{'all':<9} {total['kl']:>7} {total['accepted']:>8} {total['tested']:>9} "
              f"({total['tested'] / max(total['kl'], 1):.0%})", ""]
    for r in rows:
        if r["before"] in ("no-kl", "unreadable"):
            continue
        state = ("tested" if r.get("tested") else "UNTESTED" if r.get("accepted") else
                 "REFUSED" if r.get("after") == "refused" else r.get("after", "?").upper())
        why = r.get("refusal") or ", ".join(r.get("untested", [])) or ", ".join(t.split("::")[-1] for t in
                                                                                 r.get("tests", []))
        feats = " ".join(f"{k}={v}" for k, v in r.get("features", {}).items() if v != DEFAULTS[r["framework"]].get(k))
        lines.append(f"{r['framework']:<8} {r['source'][:64]:<64} {r['before']:<8} -> {r.get('after', '?'):<8} "
                     f"{state:<8} [{feats or 'defaults'}] {' '.join(why.split())[:220]}")
    unreadable = [r for r in rows if r["before"] == "unreadable" or r.get("after") == "unreadable"]
    lines += ["", f"not counted: {sum(r['before'] == 'no-kl' for r in rows)} without a KL term, {len(unreadable)} the "
              "doctor cannot read (bench/results/doctor_examples.txt gives why)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_command(__doc__.splitlines()[0], collect, argv)
    if args is None:
        return
    rows = [judge(r) for part in args.parts for r in json.loads(part.read_text())]
    command = "python bench/coverage.py table " + " ".join(str(p) for p in args.parts) + f" {args.out}"
    text = (f"# kl-adapters coverage of the frameworks' example configurations with the doctor's fix applied "
            f"(made by: see bench/coverage.py; last step: {command})\n"
            "# accepted: the doctor's verdict after the fix is unbiased; tested: its KL path and every non-default "
            "feature deciding it have a test (the support matrix, kl_adapters/support.py, via bench/coverage.py "
            "SETTING)\n" + table(rows) + "\n")
    args.out.with_suffix(".txt").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "coverage": coverage(rows),
                                                         "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
