"""OpenRLHF loss path: cost of kl-adapters (preset "sequence") vs OpenRLHF's own KL loss (k3, --algo.kl.use_loss).

Two measurements, on the same tiny random Llama and one fixed micro-batch (deterministic: fixed seeds and sizes):
  training_step  OpenRLHF's ActorPPOTrainer.training_step: forward, PolicyLoss, KL loss, backward, optimizer step
                 (SGD with lr 0, so every repeat sees the same parameters)
  kl_term        only the KL: compute_approx_kl through ppo_actor's binding + aggregate_loss + backward, on fixed
                 [B, T] log-prob tensors (where the adapter adds work: worst case, absolute cost)
kl-adapters runs with the micro-batch rows' rollout-wide statistics given (as make_experience stores them; computed
once per rollout, outside the timed calls). The two configurations alternate call by call (ABBA order, `--repeats` timed calls each after 5 warm-up calls), so
drift in machine load hits both alike; the result file holds every timing, the medians, their ratio and the median of
the per-pair ratios. On CPU it runs single-threaded with the test suite's import stubs (flash_attn, vllm) and CPU
strategy shim from tests/openrlhf.
Usage: .venvs/openrlhf/bin/python bench/openrlhf_overhead.py [--repeats 100] [--hidden 64] [--batch 8]
       [--response 64] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

from openrlhf_paths import ROOT  # tests/openrlhf and, without CUDA, its TEST-ONLY import stubs on sys.path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from openrlhf_cpu_shim import cuda_shims, load_actor, random_batch, save_tiny_model  # noqa: E402
from openrlhf_harness import base_argv, build_trainer, cli_args  # noqa: E402
from timing import alternating, compare, write_result  # noqa: E402

import kl_adapters  # noqa: E402
from kl_adapters.adapters import openrlhf as adapter  # noqa: E402
from kl_adapters.adapters.openrlhf.state import LOSS_STEP, LossStep  # noqa: E402
from kl_adapters.adapters.openrlhf.statistics import attach, rollout_statistics  # noqa: E402

BETA = 0.01


def setup(opts, folder: str):
    model_dir = save_tiny_model(os.path.join(folder, "actor"), seed=1, hidden=opts.hidden)
    ref_dir = save_tiny_model(os.path.join(folder, "ref"), seed=2, hidden=opts.hidden)
    # --algo.kl.use_loss --algo.kl.estimator k3; responses up to --response tokens
    args = cli_args(base_argv(model_dir) + ["--rollout.max_new_tokens", str(opts.response)])
    lengths = [opts.response - (7 * b) % (opts.response // 2) for b in range(opts.batch)]  # ragged, deterministic
    sequences, attention_mask, action_mask = random_batch(opts.batch, 16, lengths, seed=0)
    actor, ref = load_actor(model_dir).to(opts.device), load_actor(ref_dir).to(opts.device)
    tensors = [t.to(opts.device) for t in (sequences, attention_mask, action_mask)]
    with torch.no_grad():
        old = actor(tensors[0], tensors[2], attention_mask=tensors[1])
        base = ref(tensors[0], tensors[2], attention_mask=tensors[1])
    return args, actor, tensors, old, base


def experience(tensors, old, base):
    from openrlhf.trainer.ppo_utils.experience import Experience

    sequences, attention_mask, action_mask = tensors
    advantages = torch.randn(action_mask.shape, generator=torch.Generator().manual_seed(1)).to(old.device)
    return Experience(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                      action_log_probs=old, base_action_log_probs=base, advantages=advantages * action_mask,
                      index=list(range(len(sequences))), info={})


def training_step_fn(args, actor, tensors, old, base, device):
    from openrlhf.utils.loss_utils import get_loss_batch_info

    trainer = build_trainer(args, actor, micro_batch=len(old), gas=1, lr=0.0, device=device, record=False)
    exp = experience(tensors, old, base)
    info = get_loss_batch_info(trainer.strategy, exp.action_mask)
    stats = rollout_statistics([exp], [old], [base], n_samples_per_prompt=1)[0]  # once per rollout in training

    def run():
        exp.info = {}  # training_step writes its metrics there
        if kl_adapters.activation.active() is not None:  # the rows' statistics, as make_experience stores them
            attach(exp, stats)
        return trainer.training_step(exp, BETA, 0, info)

    return run


def kl_term_fn(tensors, old, base):
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf.models import aggregate_loss
    from openrlhf.utils.loss_utils import get_loss_batch_info

    mask = tensors[2]
    info = get_loss_batch_info(None, mask)
    exp = experience(tensors, old, base)
    # the statistics make_experience computes once per rollout (outside the timed loss call, as in training)
    stats = rollout_statistics([exp], [old], [base], n_samples_per_prompt=1)[0]

    def run():
        logp = (old + 0.01).requires_grad_(True)
        kl = ppo_actor.compute_approx_kl(logp, base, log_probs_old=old, kl_estimator="k3")
        (aggregate_loss(kl, mask, **info) * BETA).backward()

    def patched():  # the context the patched training_step sets around OpenRLHF's own
        with LOSS_STEP.bound(LossStep(kl_adapters.activation.active(), exp, info, stats, horizon=mask.shape[1])):
            run()

    return run, patched


def switch(config: str, _round: int = 0) -> None:
    if config == "native":
        kl_adapters.disable()
    elif kl_adapters.activation.active() is None:
        kl_adapters.enable("sequence")


def parser(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The options of this benchmark (and of bench/openrlhf_eos_cost.py, which shares its setup)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    return p


def prepare(opts):
    """Seed, one thread and the CUDA shims on CPU; (sync, `setup`'s args, actor, tensors, old, base)."""
    torch.manual_seed(0)
    if opts.device == "cpu":
        torch.set_num_threads(1)
        for (owner, name), fn in cuda_shims().items():
            setattr(owner, name, fn)
    sync = torch.cuda.synchronize if opts.device == "cuda" else None
    with tempfile.TemporaryDirectory() as folder:
        return (sync, *setup(opts, folder))


def main() -> None:
    opts = parser(__doc__, 100).parse_args()
    sync, args, actor, tensors, old, base = prepare(opts)
    step = training_step_fn(args, actor, tensors, old, base, opts.device)
    kl_native, kl_patched = kl_term_fn(tensors, old, base)
    for config in ("native", "kl_adapters_sequence"):
        switch(config)
        assert (adapter.SEQ_KL in step()["metrics"]) == (config != "native"), "the patch must act iff enabled"
    times = {"training_step": alternating({"native": step, "kl_adapters_sequence": step}, repeats=opts.repeats,
                                          warmup=5, sync=sync, before=switch),
             "kl_term": alternating({"native": kl_native, "kl_adapters_sequence": kl_patched}, repeats=opts.repeats,
                                    warmup=5, sync=sync, before=switch)}
    kl_adapters.disable()

    result = {"model": f"tiny random Llama, hidden {opts.hidden}, 2 layers, vocabulary 64",
              "batch": f"{opts.batch} sequences x 16 prompt + up to {opts.response} response tokens (ragged)",
              "device": opts.device, "threads": torch.get_num_threads(), "beta": BETA,
              "openrlhf_kl": "--algo.kl.use_loss --algo.kl.estimator k3 (native) vs --algo.kl.preset sequence",
              "repeats": opts.repeats}
    for measurement, per_config in times.items():
        result[measurement] = compare(per_config, "native", "kl_adapters_sequence")
    path = write_result(f"openrlhf_overhead_{opts.device}", result)
    for measurement in times:
        r = result[measurement]
        print(f"{measurement:14s} native {1e3 * r['median_s']['native']:.2f} ms  kl-adapters "
              f"{1e3 * r['median_s']['kl_adapters_sequence']:.2f} ms  ratio {r['ratio']:.3f}")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
