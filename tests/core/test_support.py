"""The support matrix (kl_adapters/support.py, issue 49): complete, every test it names exists, docs/support.md is its
rendering, and no page states a support that contradicts it.

The page-by-page check reads README.md and every docs page except docs/support.md (the matrix itself) and
docs/history.md (a dated record: each entry says what was so on its date). It splits a page's prose into sentences
(a table row or a list item ends one; code blocks left out), finds where a sentence names a setting (`NAMES`:
patterns per setting, some of them one framework's flags), and reads the framework from the pattern, else the
nearest framework name in the sentence, else the page (trl.md, verl.md, openrlhf.md), else any framework. The status
word nearest to the mention in its part of the sentence (`CLAIMS`: refused, untested, tested, accepted) is what the
page claims, and it must agree with the matrix (`AGREES`); a sentence that names a refused setting without any
refusal (telling what happens under it) contradicts the matrix too, unless it links docs/support.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_docs import missing

from kl_adapters import support
from kl_adapters.support import ACCEPTED, NOT_APPLICABLE, REFUSED, TESTED

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "support.md"
#: pages that state support; docs/support.md is the matrix, docs/history.md a dated record of what was
PAGES = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in ("support.md",
                                                                                                   "history.md"))]
FRAMEWORK_WORDS = {"trl": r"\bTRL\b|\btrl\b", "verl": r"\bverl\b", "openrlhf": r"\bOpenRLHF\b|\bopenrlhf\b"}
#: setting -> {framework the pattern belongs to (None: any, read from the context): how pages name the setting}
NAMES = {
    "lora": {None: r"\bLoRA\b|\bPEFT\b|lora_rank|lora\.rank|use_peft"},
    "vllm": {None: r"\bvLLM\b|use_vllm|vllm\.num_engines|is_correction_level"},
    "packing": {"verl": r"use_remove_padding|remove-padding", "openrlhf": r"packing_samples",
                None: r"\b[Pp]ack(?:ed|ing)\b(?! the)"},
    "sequence-parallel": {"verl": r"\bUlysses\b|ulysses_sequence_parallel_size",
                          "openrlhf": r"ring_attn|ring attention|ring-flash-attn",
                          None: r"sequence parallelism|context parallelism|\bcp_size\b|\bsp_size\b"},
    "tensor-parallel": {"openrlhf": r"--ds\.tensor_parallel_size", None: r"tensor parallelism"},
    "sharding": {None: r"\bZeRO\b|\bDeepSpeed\b|\bFSDP2?\b|strategy `?fsdp2?\b"},
    "megatron": {"verl": r"\bMegatron\b"},
    "data-parallel": {None: r"data[- ]parallel(?:ism)?\b|multi-node|world size 2"},
    "vision-language": {None: r"vision-language|\bVLMs?\b|multimodal|Qwen2(?:\.5)?-VL"},
    "vision-language-other": {None: r"GLM-4\.1V|MiniCPM-o"},
    "liger": {"trl": r"(?<!ds\.)use_liger_kernel", "openrlhf": r"--ds\.use_liger_kernel", "verl": r"model\.use_liger\b",
              None: r"\bLiger\b"},
    "dynamic-batch": {"verl": r"use_dynamic_bsz", "openrlhf": r"dynamic_batch_enable",
                      None: r"dynamic batch(?:ing| size)"},
    "off-policy": {"trl": r"num_iterations\s*>\s*1", "verl": r"ppo_epochs\s*>\s*1",
                   "openrlhf": r"--train\.max_epochs", None: r"several updates per rollout"},
    "async": {"trl": r"AsyncGRPO", "verl": r"fully[- ]async|one[- ]step[- ]off[- ]policy",
              "openrlhf": r"async_enable", None: r"asynchronous rollouts"},
}
#: status words, in the order a match claims it (an "untested" is not also a "tested")
CLAIMS = {
    REFUSED: r"\brefus(?:ed|es|e|al|als)\b",
    ACCEPTED + "?": r"\baccept(?:ed|s)\b",
    ACCEPTED: r"\buntested\b|\bnot tested\b|\bno test\b",
    TESTED: r"(?<![\w-])tested\b",
}
#: claim -> the matrix statuses it agrees with ("accepted" alone: tested or not; "untested": refusals are for that)
AGREES = {REFUSED: {REFUSED, NOT_APPLICABLE}, ACCEPTED + "?": {TESTED, ACCEPTED}, ACCEPTED: {ACCEPTED, REFUSED},
          TESTED: {TESTED}}
#: words that look like claims but are names: the override variable, the doctor's hazard codes
_NOT_CLAIMS = re.compile(r"KL_ADAPTERS_ALLOW_UNTESTED|untested-path|refused-path|untested-version")


def sentences(text: str) -> list[str]:
    """A page's prose as sentences: fenced code and headings out, backticks dropped; a table row or a list item ends
    a sentence."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    out = []
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[|*-] |\d+\. |#))", text):
        block = " ".join(block.split())
        if not block.startswith("#"):
            out += [s.replace("`", "") for s in re.split(r"(?<=[.!?])\s+(?=[A-Z*`(\[-])", block) if s.strip()]
    return out


def _nearest(spans: list[tuple[int, int, str]], start: int, end: int) -> str | None:
    """The label of the span nearest to [start, end) (ties: the later one), or None."""
    def gap(span):
        return (max(span[0] - end, start - span[1], 0), -span[0])
    return min(spans, key=gap)[2] if spans else None


def mentions(sentence: str, page_framework: str | None) -> list[tuple[str, str | None, str | None]]:
    """(setting, framework or None, claim or None) for every place the sentence names a setting. The claim is the
    status word nearest to the mention within its part of the sentence (parts end at `;`, `, `, `)` and ` -- `: in "X
    is tested, Y refused" the refusal is Y's); the framework, the pattern's own, else the framework named nearest to it
    in the sentence, else the page's."""
    words = _NOT_CLAIMS.sub(lambda m: "_" * len(m.group()), sentence)
    claims, taken = [], set()
    for claim, pattern in CLAIMS.items():
        for m in re.finditer(pattern, words, re.I):
            if not taken & set(range(*m.span())):
                claims.append((*m.span(), claim))
                taken |= set(range(*m.span()))
    ends = [m.end() for m in re.finditer(r";|, |\)|\s--\s", sentence)]
    part = lambda position: sum(e <= position for e in ends)  # noqa: E731
    frameworks = [(*m.span(), fw) for fw, p in FRAMEWORK_WORDS.items() for m in re.finditer(p, sentence)]
    found = []
    for setting, patterns in NAMES.items():
        for owner, pattern in patterns.items():
            for m in re.finditer(pattern, sentence):
                framework = owner or _nearest(frameworks, *m.span()) or page_framework
                claim = _nearest([c for c in claims if part(c[0]) == part(m.start())], *m.span())
                found.append((setting, framework, claim))
    return found


def contradictions(page: Path) -> list[str]:
    """Every sentence of the page whose support statement disagrees with the matrix, with the matrix's status."""
    page_framework = page.stem if page.stem in support.FRAMEWORKS else None
    found = []
    for sentence in sentences(page.read_text()):
        for setting, framework, claim in mentions(sentence, page_framework):
            statuses = {support.entry(fw, setting).status for fw in ([framework] if framework else support.FRAMEWORKS)}
            if claim is None:  # what happens under a refused setting, told without saying it is refused
                bad = statuses == {REFUSED} and not re.search(CLAIMS[REFUSED] + "|support\\.md", sentence, re.I)
            else:
                bad = not statuses & AGREES[claim]
            if bad:
                where = support.FRAMEWORKS.get(framework, "any framework")
                found.append(f"{page.name}: {support.SETTINGS[setting]} in {where} is {' / '.join(sorted(statuses))}"
                             f", but: {sentence.strip()[:300]}")
    return list(dict.fromkeys(found))


def test_the_matrix_is_complete():
    assert set(support.MATRIX) == {(fw, s) for fw in support.FRAMEWORKS for s in support.SETTINGS}
    assert set(NAMES) == set(support.SETTINGS)


def test_every_named_test_exists():
    """The test of each tested or refused entry, and every test a note names (docs/support.md shows them)."""
    named = {e.test for e in support.MATRIX.values() if e.test}
    named |= {t for e in support.MATRIX.values() for t in re.findall(r"tests/[\w/.]+::\w+", e.note)}
    assert [reason for t in sorted(named) if (reason := missing(t))] == []


def test_the_page_is_the_modules():
    assert PAGE.read_text() == support.render(), "regenerate: python -m kl_adapters.support > docs/support.md"


def test_the_doctor_lines():
    """Tested: a note naming the test; accepted or refused: a warning saying what happens; not applicable: nothing."""
    notes, warnings = support.doctor_lines("openrlhf", ["lora", "megatron", "tensor-parallel", "sharding"])
    assert notes == [f"LoRA: tested ({support.entry('openrlhf', 'lora').test}; docs/support.md)"]
    assert [code for code, _ in warnings] == ["refused-path", "untested-path"]  # the matrix's order
    assert warnings[0][1].endswith("tensor parallelism: refused (tests/openrlhf/test_cli.py::"
                                   "test_untested_code_path_is_refused; docs/support.md)")
    assert warnings[1][1].startswith("OpenRLHF always trains through DeepSpeed")


def test_vision_language_names():
    names = ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct", None, "OpenGVLab/InternVL3-1B",
             "google/gemma-3-4b-it", "Qwen/Qwen2-VL-2B", "zai-org/GLM-4.1V-9B-Thinking", "openbmb/MiniCPM-o-2_6")
    assert [support.vision_language(n) for n in names] == [True, False, False, False, True, True, True, True]
    assert [support.vision_language_setting(n, "verl") for n in names] == [
        "vision-language", None, None, None, "vision-language-other", "vision-language", "vision-language-other",
        "vision-language-other"]
    assert support.vision_language_settings(names[6], "trl") == {"vision-language": False,
                                                                "vision-language-other": True}
    assert [support.vision_language_setting("Qwen/Qwen3.5-2B", fw) for fw in ("openrlhf", "verl")] == [
        "vision-language", "vision-language-other"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_contradicts_the_matrix(page):
    assert contradictions(page) == []


def test_the_check_finds_contradictions(tmp_path):
    """A made-up page: six statements that contradict the matrix (the first and the fourth as issue 49 found them in
    docs/openrlhf.md and docs/verl.md), and consistent ones beside them."""
    page = tmp_path / "verl.md"
    page.write_text("""# verl

OpenRLHF's `--ds.packing_samples` is refused as untested. Megatron and vision-language models are accepted but
untested (the doctor warns), Ulysses and ring attention are refused.

OpenRLHF's actor reads pi(EOS) through its own gather under ring attention.

* verl's Megatron engine is tested.
* TRL's `use_liger_kernel` is tested; LoRA is tested in all three frameworks.
* verl's FSDP engine with remove-padding, dynamic batch size and LoRA against the oracle, Ulysses refused, Megatron
  warned. Packing (refused as untested) reads none.

```
Ulysses runs fine here (code blocks are not read)
```
""")
    found = contradictions(page)
    assert [f.split(", but: ")[0] for f in found] == [
        "verl.md: packed samples / remove-padding in OpenRLHF is tested",
        "verl.md: sequence parallelism (Ulysses, ring attention, context parallelism) in verl is tested",
        "verl.md: sequence parallelism (Ulysses, ring attention, context parallelism) in OpenRLHF is tested",
        "verl.md: Megatron in verl is accepted, untested",
        "verl.md: sequence parallelism (Ulysses, ring attention, context parallelism) in verl is tested",
        "verl.md: packed samples / remove-padding in verl is tested"], found
