"""The long-completion setting's reference design: steps 1 and 2 of bench/results/task/confirmatory/protocol.md.

Usage: .venvs/trl/bin/python bench/long_design.py [--noise 0.03] [--size small|large] [--cache DIR]
       .venvs/trl/bin/python bench/long_design.py --betas [--work DIR]
       (appends to bench/results/task/confirmatory/design_long.txt; the log of the training beside it, git-ignored)

Step 1: the teacher's per-step slip probability is the first of `arithmetic.LONG_NOISES` (0.03, 0.02, 0.015, 0.01)
whose reference scores 20-60% in domain on 1,024 held-out prompts (one completion each at temperature 1, as the
benchmark evaluates); the reference: a Llama of hidden 96, 4 layers, 4 heads, 512 positions, trained as the
benchmark's (AdamW, one-cycle, batch 32, 4,000 steps) on the long setting's splits only (in / out of domain 0.7 /
0.3, the benchmark's scratchpad proportions); `--size large`: hidden 128 and 6,000 steps, the protocol's fallback.
Step 2: the mean length of its in-domain completions (tokens, EOS included) must be >= 256.
Each line also says where the scratchpads go wrong (`arithmetic.scratch_steps`): the share of written steps whose
operand digits are the prompt's for that column, and whose column sum is right; design information, no verdict.
The training saves its state every 100 steps (`reference.CHECKPOINT_EVERY`): the same command after an interruption
resumes it, to the weights an uninterrupted run gives, so a level may span sessions.
Each call judges one noise level (default: the first not yet in the design file) and appends one line; the design
seeds are 300-301 (300: the held-out prompts' draw and the sampling seed).

Step 3, `--betas` (once `settings.LONG_DESIGN` names the chosen reference): the two design policies, `trl-default`
after 50 and after 150 GRPO steps at beta 0.05 with design seed 300 (bench/measure_task.py's `train`: runs of 50 and
150 steps of the benchmark's protocol through TRL), and `kl-adapters measure --config trl-default --reward verifier
--beta 0.05,0.01,0.02,0.1,0.2,0.5,1` on each (256 in-domain test prompts x G = 8, measure_task's `measure`); per beta
trl-default's bias relative to the expected trained gradient; the three betas with the largest point estimate on the
150-step policy (ties to the smaller beta), in increasing order, end the design file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout_path  # noqa: E402,F401  (this checkout's kl_adapters on sys.path)
from kl_adapters.demo.task import arithmetic, reference  # noqa: E402
from kl_adapters.demo.task.evaluate import decode, encode_prompts, mean_se, sample  # noqa: E402
from kl_adapters.demo.task.settings import LONG_SIZES as SIZES  # noqa: E402
from kl_adapters.demo.task.settings import long_reference as spec  # noqa: E402

OUT = Path(__file__).resolve().parent / "results/task/confirmatory/design_long.txt"
BAND, MIN_LENGTH, PROMPTS, MAX_NEW, SEED = (0.20, 0.60), 256, 1024, 360, 300
#: step 3's design policies: trl-default after this many GRPO steps; the last decides
BETA_STEPS = (50, 150)


def judged() -> list[str]:
    return [line for line in OUT.read_text().splitlines() if line.startswith("noise ")] if OUT.exists() else []


def judge(noise: float, size: str, cache: Path | None, say) -> str:
    """One design line: the reference's in-domain accuracy, its completions' mean length, the verdicts."""
    folder = reference.build(spec(noise, size), cache, say)
    model = reference_model(folder)
    examples = arithmetic.draw(arithmetic.SPLITS["long"]["id"], PROMPTS, seed=SEED, test=True)
    start = time.perf_counter()
    rewards, lengths, steps = [], [], []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        for i in range(0, PROMPTS, 256):
            chunk = examples[i:i + 256]
            samples = sample(model, *encode_prompts(reference.tokenizer(), [e.prompt for e in chunk]), MAX_NEW)
            texts = decode(reference.tokenizer(), samples)
            rewards += [arithmetic.reward(t, e.answer) for t, e in zip(texts, chunk)]
            steps += [arithmetic.scratch_steps(e.prompt, t) for t, e in zip(texts, chunk)]
            lengths += samples.mask.sum(1).tolist()
            say(f"  evaluated {len(rewards)}/{PROMPTS} ({time.perf_counter() - start:.0f} s)")
    accuracy, se = mean_se(rewards)
    length, length_se = mean_se(lengths)
    in_band = BAND[0] <= accuracy <= BAND[1]
    trained = json.loads((folder / "reference.json").read_text())
    written, copied, summed = (sum(column) for column in zip(*steps))
    share = lambda count: 100 * count / max(written, 1)  # noqa: E731
    return (f"noise {noise} size {size} (hidden {spec(noise, size).hidden}, {spec(noise, size).steps} steps, key "
            f"{folder.name}, trained in {trained['train_seconds']:.0f} s): in-domain accuracy {100 * accuracy:.1f} "
            f"+- {100 * se:.1f}% ({'in' if in_band else 'outside'} the 20-60% band), mean in-domain completion "
            f"{length:.1f} +- {length_se:.1f} tokens ({'>=' if length >= MIN_LENGTH else '<'} {MIN_LENGTH}), "
            f"truncated at {MAX_NEW}: {sum(x >= MAX_NEW for x in lengths)}; of its {written} scratchpad steps, "
            f"{share(copied):.1f}% copy the column's operand digits and {share(summed):.1f}% sum them right")


def choose_betas(work: Path, say, prompts: int = 256, group: int = 8) -> list[str]:
    """Protocol step 3: the design file's lines of the two design policies' measurements and the chosen betas."""
    from measure_task import measure, measure_inputs, train

    from kl_adapters.demo.task.driver import prepare

    prepared = prepare("long", "cpu", prompts, None, say)
    work.mkdir(parents=True, exist_ok=True)
    prompt_file = measure_inputs(prepared, work, prompts)
    lines, ratios = [], {}
    for steps in BETA_STEPS:
        policy = train(prepared, "trl-default", steps, SEED, work / f"long_trl-default_s{SEED}_{steps}", say)
        doc, seconds, command = measure(policy, prepared, prompt_file, "verifier", work, group)
        ratios[steps] = {m["beta"]: next((r["trained"] or {}).get("estimate") for r in m["rows"]
                                         if r["name"] == "trl-default")
                         for m in (doc["measurement"], *doc["other_betas"])}
        lines.append(f"betas: trl-default after {steps} steps (beta 0.05, seed {SEED}; mean completion "
                     f"{doc['context']['mean_length']:.1f} tokens; measured in {seconds:.0f} s: {command}): bias / "
                     "expected trained gradient " + ", ".join(f"beta {b:g} {_share(r)}"
                                                               for b, r in sorted(ratios[steps].items())))
    try:
        chosen = pick_betas(ratios[BETA_STEPS[-1]])
    except ValueError as e:
        return lines + [f"no betas chosen: on the {BETA_STEPS[-1]}-step policy {e}"]
    lines.append(f"chosen betas (largest on the {BETA_STEPS[-1]}-step policy): " + ", ".join(f"{b:g}" for b in chosen))
    return lines


def pick_betas(shares: dict[float, float | None]) -> list[float]:
    """The three betas with the largest bias share (ties to the smaller beta), in increasing order; a beta without an
    estimate makes the choice undefined (ValueError), never a silent fallback."""
    missing = [b for b, share in shares.items() if share is None]
    if missing:
        raise ValueError("the measurement has no estimate at beta " + ", ".join(f"{b:g}" for b in sorted(missing)))
    return sorted(sorted(shares, key=lambda b: (-shares[b], b))[:3])


def _share(ratio: float | None) -> str:
    return "-" if ratio is None else f"{100 * ratio:.2f}%"


def reference_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--noise", type=float, help="one of arithmetic.LONG_NOISES (default: the next not judged)")
    p.add_argument("--size", choices=SIZES, default="small")
    p.add_argument("--cache", type=Path, help="where references are cached (reference.default_cache())")
    p.add_argument("--betas", action="store_true",
                   help="protocol step 3 on the chosen reference (settings.LONG_DESIGN)")
    p.add_argument("--work", type=Path, default=Path.home() / ".cache" / "kl-adapters" / "long-design",
                   help="--betas: where the design policies are kept")
    args = p.parse_args(argv)
    if args.betas:
        with OUT.with_suffix(".log").open("a") as log:
            lines = choose_betas(args.work, lambda text: print(text, file=log, flush=True))
        with OUT.open("a") as out:
            out.write("".join(line + "\n" for line in lines))
        print("\n".join(lines))
        if lines[-1].startswith("no betas chosen"):
            raise SystemExit(1)
        return
    done = judged()
    noise = args.noise if args.noise is not None else next(
        (n for n in arithmetic.LONG_NOISES if not any(line.startswith(f"noise {n} size {args.size} ") for line in done)),
        None)
    if noise not in arithmetic.LONG_NOISES:
        raise SystemExit(f"no noise level left to judge at size {args.size} (or {args.noise} is not one of "
                         f"{arithmetic.LONG_NOISES})")
    log = OUT.with_suffix(".log").open("a")

    def say(text: str) -> None:
        print(text, file=log, flush=True)

    torch.set_num_threads(1)
    line = judge(noise, args.size, args.cache, say)
    if not OUT.exists():
        OUT.write_text("# the long-completion setting's reference design (bench/results/task/confirmatory/protocol.md "
                       "steps 1-2)\n# command: .venvs/trl/bin/python bench/long_design.py [--noise N] [--size S]\n"
                       f"# spec: {asdict(spec(noise, args.size))} (noise and size per line)\n")
    with OUT.open("a") as out:
        out.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
