"""OpenRLHF: what reading pi(EOS | y_<t) from OpenRLHF's own policy forward costs (issue 20).

The adapter wraps Actor.forward and actor.py's log_probs_from_logits: from the logits and the log-probs OpenRLHF has
just computed, log pi(EOS) = logsumexp(z_EOS) - (z_y - log pi(y)) (two gathers, no second pass over the vocabulary).
Three configurations on the same tiny random Llama and fixed batch (bench/openrlhf_overhead.py's setup):
  native          kl-adapters off
  sequence-no-eos --algo.kl.preset sequence with the EOS read switched off (no EOS ids: the reduced preset without
                  its termination control variate)
  sequence        --algo.kl.preset sequence as shipped
Measured (timing.alternating: one call of each per round, ABBA order):
  rollout_forward  the policy's inference forward of PolicyModelActor.forward at rollout time (Actor.forward without
                   gradient; under "sequence" it returns the log-probs carrying the payload)
  training_step    OpenRLHF's ActorPPOTrainer.training_step (forward, PolicyLoss, KL, backward, optimizer step with
                   lr 0), the rows' rollout-wide statistics given as the experience maker stores them
Usage: .venvs/openrlhf/bin/python bench/openrlhf_eos_cost.py [--repeats 60] [--hidden 64] [--batch 8] [--response 64]
       [--device cpu|cuda] [--note TEXT]
"""

from __future__ import annotations

import torch
from openrlhf_overhead import ROOT, parser, prepare, training_step_fn  # (puts tests/openrlhf and the stubs on the path)
from timing import alternating, compare, write_result

import kl_adapters
from kl_adapters.adapters.openrlhf import eos as openrlhf_eos
from kl_adapters.adapters.openrlhf.eos_payload import split_eos

NATIVE, NO_EOS, EOS = "native", "sequence-no-eos", "sequence"
EOS_IDS = openrlhf_eos.eos_token_ids


def switch(config: str, _round: int = 0) -> None:
    """kl-adapters off for `native`; on, with the EOS ids read (`sequence`) or none (`sequence-no-eos`)."""
    openrlhf_eos.eos_token_ids = (lambda model: []) if config == NO_EOS else EOS_IDS
    if config == NATIVE:
        kl_adapters.disable()
    elif kl_adapters.activation.active() is None:
        kl_adapters.enable("sequence")


def rollout_forward_fn(actor, tensors):
    sequences, attention_mask, action_mask = tensors

    def run():
        with torch.no_grad():
            return actor(sequences, action_mask, attention_mask)

    return run


def main() -> None:
    p = parser(__doc__, 60)
    p.add_argument("--note", default="", help="recorded with the result (e.g. the machine's load)")
    opts = p.parse_args()
    import openrlhf.trainer.ray.ppo_actor  # noqa: F401  (a PolicyModelActor's process: the Actor is patched with it)

    sync, args, actor, tensors, old, base = prepare(opts)
    fns = {"rollout_forward": rollout_forward_fn(actor, tensors),
           "training_step": training_step_fn(args, actor, tensors, old, base, opts.device)}
    for config in (NATIVE, NO_EOS, EOS):
        switch(config)
        carried = split_eos(fns["rollout_forward"]())[1] is not None
        assert carried == (config == EOS), "the payload must come with the EOS read only"
    times = {name: alternating({c: fn for c in (NATIVE, NO_EOS, EOS)}, repeats=opts.repeats, warmup=5, sync=sync,
                               before=switch) for name, fn in fns.items()}
    switch(NATIVE)
    result = {"model": f"tiny random Llama, hidden {opts.hidden}, 2 layers, vocabulary 64",
              "batch": f"{opts.batch} sequences x 16 prompt + up to {opts.response} response tokens (ragged)",
              "device": opts.device, "threads": torch.get_num_threads(), "repeats": opts.repeats, "note": opts.note}
    for name, per_config in times.items():
        result[name] = {"eos_vs_no_eos": compare(per_config, NO_EOS, EOS),
                        "eos_vs_native": compare(per_config, NATIVE, EOS)}
    path = write_result(f"openrlhf_eos_cost_{opts.device}", result)
    for name in times:
        r = result[name]["eos_vs_native"]
        med = r["median_s"]
        print(f"{name:16s} " + "  ".join(f"{c} {1e3 * med[c]:.2f} ms" for c in (NATIVE, NO_EOS, EOS))
              + f"  sequence / sequence-no-eos {result[name]['eos_vs_no_eos']['median_paired_ratio']:.3f}"
              + f"  sequence / native {r['median_paired_ratio']:.3f}")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
