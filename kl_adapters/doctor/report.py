"""The doctor's report: KL paths, hazards, verdict, fix, audit numbers; the table for people and the JSON document.

Verdict (and exit code of ``kl-adapters doctor``, `EXIT_CODES`; docs/doctor.md):
    refused    kl-adapters refuses the configuration: its adapter's own check, or a kl-adapters value it
               cannot accept (a run stops there, before training)                                      exit 3
    no-op      a KL is switched on but contributes nothing (zero coefficient, a flag whose path is off)   exit 1
    biased     some KL path's expected gradient is not beta * grad KL_seq in a regime the configuration
               implies (its preset is not unbiased there, or no preset has it), or a hazard biases it  exit 1
    unbiased   every KL path is unbiased in every implied regime and no hazard biases it              exit 0
    no-kl      the configuration has no KL term at all (nothing to be biased)                          exit 0
A configuration that cannot be read (framework not installed, parser error, a KL setting computed at run time) raises
`DoctorError` (exit `UNREADABLE`, 2). What kl-adapters refuses is a "refused" hazard: the adapter's own check of a
configuration the reader goes on analysing (its paths, other hazards and fix still shown), or a value that cannot be
analysed at all (a kl-adapters setting it cannot parse), raised as `activation.SettingError` or `Refused` inside
`refusals(report)`, which ends the analysis there.

Bias and cosine come from the exact audit (`kl_adapters.audit.audit`, `AUDIT_PROBLEM`): the preset's exact expected
gradient against grad KL_seq on a random tabular problem, on-policy and, when the configuration reuses a rollout for
several optimizer steps, off-policy. They measure the estimator, not the user's model: how far its gradient points
from the sequence-KL gradient on a small problem where that is computable exactly.

JSON document (``--json``; `SCHEMA` is its JSON Schema, tests/core/test_doctor.py::test_json_schema; schema 2 added
the verdict and severity "refused", exit code 3):
    {"schema": 2, "framework", "version", "tested": bool, "source", "verdict", "exit_code",
     "regimes": ["on-policy"(, "off-policy")], "off_policy_reason": str|null,
     "paths": [{"path": "loss"|"reward", "setting", "beta": float|null, "preset": str|null, "why", "source",
                "unbiased": bool, "audit": {"on-policy": {"relative_bias", "cosine"}, ...}|null}],
     "hazards": [{"code", "severity": "refused"|"no-op"|"bias"|"warning", "message"}],
     "fix": {"preset", "lines": [str], "beta"}|null, "audit_problem", "unresolved": [str], "notes": [str]}
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from ..activation import SettingError
from ..adapters.versions import TESTED, supported_range
from ..native import NativeKL
from ..presets import SAMPLED_TOKEN_PRESETS, Preset, get_preset

ON, OFF = "on-policy", "off-policy"
AUDIT_ARGS = (4, 4, 0)
AUDIT_PROBLEM = ("kl_adapters.audit.audit(4, 4, 0): vocabulary 4 incl. EOS, horizon 4 (121 sequences), seed 0, "
                 "pi_ref logits ~ N(0,1), pi = pi_ref + N(0,1), off-policy sampler mu = pi + N(0, 0.5^2), beta = 1")
SEVERITIES = ("refused", "no-op", "bias", "warning")
#: verdict -> exit code of `kl-adapters doctor` (a CI lint: 0 passes; 1 biased or a silent no-op; 3 refused)
EXIT_CODES = {"unbiased": 0, "no-kl": 0, "biased": 1, "no-op": 1, "refused": 3}
#: exit code when the configuration cannot be read (`DoctorError`)
UNREADABLE = 2


class DoctorError(Exception):
    """The configuration cannot be read (exit code 2): missing framework, unparsable file, unresolved KL setting."""


class Refused(Exception):
    """kl-adapters refuses the configuration (its adapter's check): the verdict "refused" (`refusals`)."""


@dataclass(frozen=True)
class Hazard:
    code: str
    severity: str  # one of SEVERITIES
    message: str

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")


@dataclass(frozen=True)
class KLPath:
    """One KL term of the configuration (in the loss or in the reward) and the preset with its gradient."""

    path: str  # "loss" | "reward"
    setting: str  # the native configuration, as the user wrote it
    beta: float | None
    native: NativeKL  # preset (None: no preset has this gradient), why, framework source


@dataclass(frozen=True)
class Fix:
    preset: str
    lines: tuple[str, ...]  # the flag / override lines of kl-adapters (and the settings they need)
    beta: str  # what beta means after the fix


@dataclass
class Report:
    framework: str
    version: str
    source: str
    regimes: tuple[str, ...] = (ON,)
    off_policy_reason: str | None = None
    paths: list[KLPath] = field(default_factory=list)
    hazards: list[Hazard] = field(default_factory=list)
    fix: Fix | None = None
    unresolved: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def tested(self) -> bool:
        return self.version in TESTED[self.framework]

    def add(self, code: str, severity: str, message: str) -> None:
        self.hazards.append(Hazard(code, severity, message))

    def unbiased(self, path: KLPath) -> bool:
        """Whether the path's preset is unbiased for grad KL_seq in every regime the configuration implies."""
        if path.native.preset is None:
            return False
        spec = get_preset(path.native.preset)
        return all(spec.unbiased_on_policy if r == ON else spec.unbiased_off_policy for r in self.regimes)

    @property
    def verdict(self) -> str:
        severities = {h.severity for h in self.hazards}
        if "refused" in severities:
            return "refused"
        if "no-op" in severities:
            return "no-op"
        if not self.paths:
            return "no-kl"
        if "bias" in severities or not all(self.unbiased(p) for p in self.paths):
            return "biased"
        return "unbiased"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def check_version(self) -> None:
        """Add the untested-version hazard when the installed release is not one kl-adapters is tested with."""
        if not self.tested:
            self.add("untested-version", "warning",
                     f"{self.framework} {self.version} is not a release kl-adapters is tested with "
                     f"({supported_range(self.framework)}): the mappings and source lines are those releases'")

    def as_dict(self) -> dict:
        return {
            "schema": 2, "framework": self.framework, "version": self.version, "tested": self.tested,
            "source": self.source, "verdict": self.verdict, "exit_code": self.exit_code,
            "regimes": list(self.regimes), "off_policy_reason": self.off_policy_reason,
            "paths": [{"path": p.path, "setting": p.setting, "beta": p.beta, "preset": p.native.preset,
                       "why": p.native.reason, "source": p.native.source, "unbiased": self.unbiased(p),
                       "audit": None if p.native.preset not in SAMPLED_TOKEN_PRESETS else
                       {r: audit_numbers(p.native.preset)[r] for r in self.regimes}} for p in self.paths],
            "hazards": [asdict(h) for h in self.hazards],
            "fix": None if self.fix is None else {"preset": self.fix.preset, "lines": list(self.fix.lines),
                                                  "beta": self.fix.beta},
            "audit_problem": AUDIT_PROBLEM, "unresolved": list(self.unresolved), "notes": list(self.notes),
        }


def installed_version(distribution: str) -> str:
    """The installed release of a framework; DoctorError (exit 2) when it is not installed in this Python, naming
    the install command (the doctor reads a configuration with the framework's own code)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise DoctorError(
            f"{distribution} is not installed in this Python ({sys.executable}), and the doctor reads a {distribution} "
            f"configuration with {distribution}'s own code: run it in the environment you train with, or install "
            f"{distribution} next to kl-adapters with pip install \".[{distribution}]\" from a kl-adapters clone "
            f"({supported_range(distribution)}; in the clone, bash scripts/envs.sh {distribution} builds "
            f".venvs/{distribution})") from None


@contextmanager
def refusals(report: Report) -> Iterator[None]:
    """Run a reader's analysis; a refusal raised inside (`Refused`, or `activation.SettingError` from a kl-adapters
    value) ends it and becomes the report's "refused" hazard (verdict "refused", exit 3)."""
    try:
        yield
    except (Refused, SettingError) as err:
        report.add("refused", "refused", str(err))


@functools.lru_cache(maxsize=None)
def audit_numbers(preset: str) -> dict[str, dict[str, float | None]]:
    """{regime: {"relative_bias", "cosine"}} of `preset` in the exact audit `AUDIT_PROBLEM` (cached per process;
    cosine None where the expected gradient is zero). For the sampled-token presets: `full` reads full next-token
    distributions, which the audit does not enumerate (its gradient is exact: tests/core/test_full_vocab.py)."""
    from ..audit import audit

    rows = audit(*AUDIT_ARGS, presets=(preset,), is_clip=None)
    return {r.regime: {"relative_bias": round(r.relative_bias, 4),
                       "cosine": None if math.isnan(r.cosine) else round(r.cosine, 4)} for r in rows}


_COLOURS = {"unbiased": "32", "no-kl": "32", "biased": "31", "no-op": "31", "refused": "31", "refused:": "31",
            "no-op:": "31", "bias:": "31", "warning:": "33"}


def format_report(report: Report, *, colour: bool = False) -> str:
    """A short table for people; `colour` adds ANSI colours (the CLI sets it only when stdout is a terminal)."""

    def paint(text: str, key: str) -> str:
        return f"\033[{_COLOURS[key]}m{text}\033[0m" if colour and key in _COLOURS else text

    doc = report.as_dict()
    tested = "tested" if report.tested else "NOT tested by kl-adapters"
    lines = [f"kl-adapters doctor: {report.framework} {report.version} ({tested}) -- {report.source}",
             "sampling: " + " + ".join(report.regimes)
             + (f" ({report.off_policy_reason})" if report.off_policy_reason else "")]
    if not report.paths and report.verdict != "refused":
        lines.append("KL: none configured")
    else:
        head = f"{'path':<7}{'native setting':<46}{'preset':<14}"
        head += "".join(f"{('on' if r == ON else 'off') + ': bias':>11}{'cos':>7}" for r in report.regimes)
        lines += [head, "-" * len(head)]
        for p in doc["paths"]:
            row = f"{p['path']:<7}{_cut(p['setting'], 45):<46}{p['preset'] or '(none)':<14}"
            for r in report.regimes:
                a = (p["audit"] or {}).get(r)
                row += (f"{a['relative_bias']:>11.3f}{'-' if a['cosine'] is None else format(a['cosine'], '.3f'):>7}"
                        if a else f"{'-':>11}{'-':>7}")
            lines += [row, f"{'':<7}why: {p['why']} [{p['source']}]"]
    if report.hazards:
        lines.append("hazards:")
        lines += [f"  {paint(h.severity + ':', h.severity + ':')} [{h.code}] {h.message}" for h in report.hazards]
    if report.unresolved:
        lines.append("not resolved without running the script: " + ", ".join(report.unresolved))
    lines += [f"  note: {n}" for n in report.notes]
    lines.append(f"verdict: {paint(report.verdict.upper(), report.verdict)} (exit {report.exit_code})")
    if report.verdict == "biased":
        lines.append(f"  what this does not tell: whether the bias matters for your run (your model, prompts, lengths "
                     f"and beta); measure it: kl-adapters measure --policy <checkpoint> --reference <ref> --prompts "
                     f"<file> --reward <module:fn> --launch {report.framework} <these arguments> (docs/measure.md)")
    if report.fix is not None:
        lines.append(f"fix (preset {report.fix.preset}):")
        lines += [f"  {line}" for line in report.fix.lines]
        lines.append(f"  beta after the fix: {report.fix.beta}")
    if report.paths:
        lines.append(f"bias = |E[grad] - grad KL_seq| / |grad KL_seq| in the exact audit {AUDIT_PROBLEM}")
    if any(p.native.preset == "full" for p in report.paths):
        lines.append("full: no audit row (the audit enumerates sampled-token presets); its expected gradient is "
                     "grad KL_seq exactly (tests/core/test_full_vocab.py)")
    return "\n".join(lines)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


_NUMBER = {"type": ["number", "null"]}
SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["schema", "framework", "version", "tested", "source", "verdict", "exit_code", "regimes",
                 "off_policy_reason", "paths", "hazards", "fix", "audit_problem", "unresolved", "notes"],
    "additionalProperties": False,
    "properties": {
        "schema": {"const": 2},
        "framework": {"enum": sorted(TESTED)},
        "version": {"type": "string"},
        "tested": {"type": "boolean"},
        "source": {"type": "string"},
        "verdict": {"enum": sorted(EXIT_CODES)},
        "exit_code": {"enum": sorted(set(EXIT_CODES.values()))},
        "regimes": {"type": "array", "items": {"enum": [ON, OFF]}, "minItems": 1},
        "off_policy_reason": {"type": ["string", "null"]},
        "paths": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "required": ["path", "setting", "beta", "preset", "why", "source", "unbiased", "audit"],
            "properties": {
                "path": {"enum": ["loss", "reward"]}, "setting": {"type": "string"}, "beta": _NUMBER,
                "preset": {"type": ["string", "null"]}, "why": {"type": "string"}, "source": {"type": "string"},
                "unbiased": {"type": "boolean"},
                "audit": {"type": ["object", "null"], "additionalProperties": {
                    "type": "object", "required": ["relative_bias", "cosine"], "additionalProperties": False,
                    "properties": {"relative_bias": {"type": "number"}, "cosine": _NUMBER}}},
            }}},
        "hazards": {"type": "array", "items": {
            "type": "object", "required": ["code", "severity", "message"], "additionalProperties": False,
            "properties": {"code": {"type": "string"}, "severity": {"enum": list(SEVERITIES)},
                           "message": {"type": "string"}}}},
        "fix": {"type": ["object", "null"], "required": ["preset", "lines", "beta"], "additionalProperties": False,
                "properties": {"preset": {"type": "string"}, "lines": {"type": "array", "items": {"type": "string"}},
                               "beta": {"type": "string"}}},
        "audit_problem": {"type": "string"},
        "unresolved": {"type": "array", "items": {"type": "string"}},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
}


def adapter_native(spec: Preset, flag: str, adapter: str) -> NativeKL:
    """The NativeKL of a path kl-adapters replaces with preset `spec` (the flag's `Settings.spec`): its gradient is the
    preset's by construction (adapter tests)."""
    return NativeKL(spec.name, f"{flag}: kl-adapters replaces the framework's KL term with preset {spec.name!r} "
                               f"({spec.gradient})", f"kl_adapters/adapters/{adapter}/")


def note_budget(report: Report, settings, beta: str, cadence: str, flag: str) -> None:
    """The KL budget (kl_adapters.budget) of a path with kl-adapters' settings: its target, or, with a fixed beta, how
    to state one (the KL per sequence a fixed beta leads to is known only from the run's logs)."""
    if settings is not None and settings.kl_target is not None:
        report.notes.append(f"KL budget: {settings.kl_target:g} nats of KL(pi || pi_ref) per sequence; {beta} is the "
                            f"controller's starting value and follows once per {cadence} (kl_adapters.budget; metrics "
                            "kl_adapters/beta, kl_adapters/kl_target)")
    elif settings is not None:
        report.notes.append(f"fixed beta ({beta}): its KL per sequence is known only from the run; to state that KL "
                            f"and let beta follow, set {flag}=<the run's logged kl_adapters/seq_kl, nats per sequence>")


def per_token_target(target: float, max_length: int | None, setting: str) -> str:
    """What a native adaptive controller's per-token KL target is per sequence (KL_seq = sum_t KL_t ~ target x the
    mean length), and the kl-adapters `setting` (naming it <that>) that targets KL_seq itself."""
    bound = f"; at most {target * max_length:g} nats at the maximum length {max_length}" if max_length else ""
    return (f"the same per-sequence budget is about {target:g} x the mean response length{bound}: kl-adapters' "
            f"{setting} targets KL_seq itself")
