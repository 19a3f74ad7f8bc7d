"""OpenRLHF 0.11.2's real actor training step on the exact toy problem: which KL configuration reaches pi*?

Usage: .venvs/openrlhf/bin/python bench/demo_openrlhf.py [--long] [--steps N] [--seeds 3] [--group G] [--lr LR]
       [--beta B] [--configs ...] [--workers 2] [--out DIR]  -> DIR/demo_openrlhf_quick.{json,png,txt,log} (--long:
       demo_openrlhf.*)   (`bash scripts/demo.sh openrlhf` builds .venvs/openrlhf and runs it)

First the exact gradient check (`kl_adapters.demo.gradient_check`) through the same training step: `check` below.

!!! CPU ONLY: TEST-ONLY IMPORT STUBS ON sys.path !!!
OpenRLHF 0.11.2 imports flash_attn and vllm at module level, and neither installs without CUDA. When they are not
importable, this script puts tests/openrlhf/cpu_stubs (import-only stand-ins written for the test suite, never called
on this code path) first on sys.path. With real flash-attn and vllm installed (a GPU machine) the stubs are not used.
Also from tests/openrlhf, CPU only: openrlhf_cpu_shim.cuda_shims() replaces torch.cuda.synchronize/current_device
while ActorPPOTrainer is *constructed* (its __init__ barriers and builds a replay buffer on the current CUDA device),
and is undone before training; its CPUStrategy (one process, dp size 1) stands in for DeepspeedStrategy.

What runs, per harness step (`kl_adapters.demo.harness.train` samples G completions of a tiny GPT-2 and takes the Adam
step): the group becomes an Experience (sequences = prompt + completion, action_mask, action_log_probs = the sampling
policy's log-probs, base_action_log_probs = pi_ref's). Under the adapter's flag it is the one OpenRLHF's
RemoteExperienceMaker.make_experience leaves on the loss path (plus rewards and a zero KL), and
**openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker.compute_advantages_and_returns** makes its
advantages (dr_grpo: r_i - mean_j r_j on every token, the harness's) and, under a reduced preset, the adapter's rollout
statistics, fitted with those advantages and with pi(EOS | y_<t) of the sampling policy, which the harness's forward
supplies (harness.batch_logps_and_eos) the way OpenRLHF's rollout forward carries it to the experience maker (on
action_log_probs, openrlhf/eos_payload.LogProbsWithEos); the maker's KL controller holds the previous step's kl_ctl
(OpenRLHF's holds the coefficient set before the rollout; bench/kl_budget.py changes kl_ctl from step to step).
OpenRLHF's own KL configurations get the harness's advantages r_i - mean_j r_j directly (the same). Then
**openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer.training_step** on that one Experience (on-policy: PPO's ratio is 1,
its clip never acts), with loss_batch_info from OpenRLHF's own iter_grad_accum_global_norm (what ppo_train passes; one
micro-batch = one optimizer step, gas 1). training_step runs OpenRLHF's Actor.forward around the harness's model (where
the adapter reads the current policy's pi(EOS | y_<t)), PolicyLoss (ppo, token-mean), compute_approx_kl through
ppo_actor's binding, aggregate_loss and `loss = actor_loss + kl_loss * kl_ctl`,
then calls strategy.backward(loss): the strategy here records that loss instead of stepping, and the harness
backpropagates it (strategy.optimizer_step is a no-op; the optimizer is the harness's Adam, as for every framework in
this benchmark). Arguments come from OpenRLHF's real CLI parsing (train_ppo_ray run as __main__ up to get_strategy,
tests/openrlhf/openrlhf_harness.cli_args) with --algo.kl.use_loss --algo.kl.estimator k3 --rollout.max_new_tokens
<the problem's horizon>; the kl-adapters configuration adds the adapter's flag --algo.kl.preset sequence (parsed by
``python -m kl_adapters.adapters.openrlhf_cli``'s main, which yields args.algo.kl.preset as OpenRLHF carries it into
its actors).

Beta (kl_ctl, = --algo.kl.init_coef with OpenRLHF's fixed KL controller), with beta the objective's coefficient, G the
group size and N_tok the step's completion-token count (OpenRLHF's batch_num_tokens): the task loss is a token mean,
(G-1)/N_tok grad E[r] (group-mean baseline), and so is every KL configuration's, OpenRLHF's own (k3, unbiased_gradient:
kl_ctl / N_tok per token) and the adapter's (--algo.kl.preset: kl_ctl / N_tok times the sum over the G sequences of the
per-sequence KL gradient estimate, the policy loss's normaliser), so
        kl_ctl = beta (G-1)/G                    (= harness.kl_coefficient; constant)
makes the step's gradient (G-1)/N_tok * grad(E[r] - beta KL_seq) under the adapter: the objective up to a positive
factor (N_tok is the sampled group's own count, so the factor is random; its correlation with the gradient estimate
is O(1/G)). The committed results (bench/results/demo_openrlhf*) ran before the adapter took the policy loss's
normaliser (it weighed the sequence KL by kl_ctl / N_seq then), with kl_ctl = beta (G-1)/N_tok per step: the same
gradient. beta=0: --algo.kl.init_coef 0 (OpenRLHF then computes no KL).

The training step itself (`OpenRLHFStep`) takes an Experience from its subclass: `OpenRLHFLoss` makes the toy group's
at every step; bench/task_openrlhf.py's takes a generation round's rows on the task benchmark.
"""

from __future__ import annotations

import os
import warnings

import openrlhf_paths  # noqa: F401  (tests/openrlhf and, without CUDA, its TEST-ONLY import stubs: see the docstring)

os.environ.pop("KL_ADAPTERS", None)  # only the flag selects kl-adapters here

from demo_common import main as demo_main  # noqa: E402

NAME, FRAMEWORK, BASELINE = "demo_openrlhf", "OpenRLHF 0.11.2 ActorPPOTrainer.training_step", "openrlhf-default-k3"
#: name -> (extra train_ppo_ray arguments, adapter flag value or None, description)
SPECS: dict[str, tuple[list[str], str | None, str]] = {
    "openrlhf-default-k3": ([], None, "--algo.kl.use_loss --algo.kl.estimator k3 (the GRPO KL loss OpenRLHF "
                                      "recommends)"),
    "unbiased_gradient": (["--algo.kl.unbiased_gradient"], None,
                          "... k3 --algo.kl.unbiased_gradient (OpenRLHF's fix, PR #1309: k1 per-token gradient)"),
    "kl_adapters:sequence": ([], "sequence", "... k3 --algo.kl.preset sequence (kl-adapters, kl_ctl = beta (G-1)/G)"),
    "kl_adapters:sequence-plain": ([], "sequence-plain", "... k3 --algo.kl.preset sequence-plain (without the "
                                                         "variance reductions)"),
    "beta=0": ([], None, "... k3 --algo.kl.init_coef 0 (no KL term)"),
}
CONFIGS = {k: v[2] for k, v in SPECS.items()}


def cli_argv(config: str, group: int, coef: float, horizon: int, *, prompts: int = 1, rows: int | None = None,
             estimator: str = "dr_grpo") -> list[str]:
    """train_ppo_ray's arguments for a configuration: `group` samples per prompt, `prompts` prompts per rollout, `rows`
    sequences per optimizer step (one micro-batch; default: one group), OpenRLHF's advantage `estimator`."""
    extra, preset, _ = SPECS[config]
    rows = rows or group
    argv = ["--actor.model_name_or_path", "toy-gpt2", "--reward.remote_url", "http://127.0.0.1:1",
            "--algo.advantage.estimator", estimator, "--rollout.n_samples_per_prompt", str(group),
            "--rollout.batch_size", str(prompts), "--rollout.micro_batch_size", "1", "--actor.num_gpus_per_node", "1",
            "--ref.num_gpus_per_node", "1", "--train.micro_batch_size", str(rows), "--train.batch_size", str(rows),
            "--train.max_epochs", "1", "--actor.policy_loss_type", "ppo", "--actor.loss_agg_mode", "token-mean",
            "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
            "--algo.kl.init_coef", "0" if config == "beta=0" else repr(coef), "--ds.attn_implementation", "eager",
            "--rollout.max_new_tokens", str(horizon), *extra]
    return argv + (["--algo.kl.preset", preset] if preset else [])


def parse_args(argv: list[str], config: str):
    """OpenRLHF's parsed args; the kl-adapters configuration goes through the adapter's launcher (its flag)."""
    from openrlhf_harness import cli_args

    return cli_args(argv, wrapper=SPECS[config][1] is not None)


def actor_of(model):
    """OpenRLHF's Actor around a Hugging Face model (what its trainer and experience maker call)."""
    from openrlhf.models import Actor

    actor = Actor(model)
    actor.packing_samples = False  # Actor(<nn.Module>) leaves it unset (only the path branch of __init__ sets it)
    return actor


def _strategy_class():
    from openrlhf_cpu_shim import CPUStrategy

    class HarnessStrategy(CPUStrategy):
        """CPUStrategy (dp 1, gas 1) whose backward hands the loss to the harness and whose optimizer step is a no-op:
        the harness backpropagates `loss` and steps its Adam."""

        loss = None

        def backward(self, loss, model, optimizer, **kwargs) -> None:
            self.loss = loss

        def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs) -> None:
            return None

    return HarnessStrategy


class OpenRLHFStep:
    """The loss OpenRLHF's ActorPPOTrainer.training_step builds on one Experience per call; its metrics per step in
    `.metrics`. Subclasses say where the Experience comes from (`experience(model, batch)`): `OpenRLHFLoss` (the toy
    problem's group) and bench/task_openrlhf.py's `TaskOpenRLHFLoss` (a generation round's rows).

    coef: the kl_ctl of every KL configuration (`kl_ctl`, module docstring); rows: the sequences of one optimizer step
    (OpenRLHF's micro_train_batch_size). kl-adapters' activation is per process (as
    in OpenRLHF, one trainer per actor process): constructing one switches off whatever an earlier one switched on,
    then parses this configuration's flags (`argv`, `cli_argv`). Use one at a time."""

    def __init__(self, config: str, argv: list[str], *, coef: float, rows: int):
        import openrlhf.trainer.ppo_utils.experience_maker  # noqa: F401  (imported first: the flag patches them when
        import openrlhf.trainer.ray.ppo_actor  # noqa: F401                  parsed)

        import kl_adapters

        kl_adapters.disable()

        self.config, self.coef, self.rows = config, coef, rows
        self.adapter = SPECS[config][1] is not None
        self.args = parse_args(argv, config)
        self.trainer = None
        self.metrics: list[dict[str, float]] = []

    def _build(self, model) -> None:
        import torch
        from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
        from openrlhf_cpu_shim import cuda_shims

        actor = actor_of(model)
        self.strategy = _strategy_class()(self.args, accumulated_gradient=1, lr=0.0, record=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # never stepped (see HarnessStrategy)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        shims = {} if torch.cuda.is_available() else cuda_shims()
        saved = {key: getattr(*key) for key in shims}
        try:
            for (owner, name), fn in shims.items():
                setattr(owner, name, fn)
            self.trainer = ActorPPOTrainer(self.strategy, actor, None, optimizer, scheduler,
                                           micro_train_batch_size=self.rows, dataloader_pin_memory=False)
        finally:
            for (owner, name), fn in saved.items():
                setattr(owner, name, fn)
        self.model = model
        # only its compute_advantages_and_returns runs: no model groups; the KL controller is set per rollout
        self.maker = RemoteExperienceMaker(None, None, None, None, None, self.strategy, None)

    def built_for(self, model) -> None:
        """The trainer (and experience maker) around `model`, built at its first use."""
        if self.trainer is None or model is not self.model:
            self._build(model)

    def kl_ctl(self) -> float:
        """The step's kl_ctl: coef (OpenRLHF's and the adapter's KL losses share the policy loss's normaliser N_tok);
        bench/kl_budget.py replaces it by its controller's value."""
        return 0.0 if self.config == "beta=0" else self.coef

    def experience(self, model, batch):
        raise NotImplementedError

    def __call__(self, model, batch):
        import torch
        from openrlhf.utils.loss_utils import iter_grad_accum_global_norm

        self.built_for(model)
        experience = self.experience(model, batch)
        ((experience, info),) = iter_grad_accum_global_norm([experience], self.strategy, 1, lambda e: e.action_mask)
        kl_ctl = self.kl_ctl()
        self.args.algo.kl.init_coef = kl_ctl  # OpenRLHF's FixedKLController value = init_coef
        status = self.trainer.training_step(experience, kl_ctl, 0, info)
        loss, self.strategy.loss = self.strategy.loss, None
        step = {"kl_ctl": kl_ctl}
        for key in ("policy_loss", "kl", "logprobs_diff", "ppo_kl", "kl_adapters/seq_kl", "kl_adapters/grad_weight_gap"):
            value = status["metrics"].get(key)
            if value is not None:
                step[key] = float(value.float().mean()) if isinstance(value, torch.Tensor) else float(value)
        self.metrics.append(step)
        return loss


class OpenRLHFLoss(OpenRLHFStep):
    """harness.LossFn: `OpenRLHFStep` on the toy problem's group (one prompt of G completions, made into an Experience
    at every step: `experience`), kl_ctl of OpenRLHF's own KL losses beta (G-1)/G (module docstring)."""

    def __init__(self, problem, config: str, group: int):
        from kl_adapters.demo.harness import kl_coefficient

        coef = kl_coefficient(problem, group)  # beta (G-1)/G
        super().__init__(config, cli_argv(config, group, coef, problem.horizon), coef=coef, rows=group)
        self.problem = problem
        self.previous_kl_ctl: float | None = None

    def experience(self, model, batch):
        """The group as OpenRLHF's experience maker hands it to the actor (module docstring): under the adapter, its
        compute_advantages_and_returns on the rollout's Experience, whose log-probs carry the sampling policy's
        pi(EOS | y_<t); OpenRLHF's own KL configurations get the same advantages from the harness (the gradient check
        feeds them single completions, which OpenRLHF's grouping by n_samples_per_prompt cannot take)."""
        import torch
        from openrlhf.trainer.ppo_utils.experience import Experience
        from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

        from kl_adapters.adapters.openrlhf.eos_payload import EosPayload, with_eos
        from kl_adapters.demo.harness import batch_logps_and_eos

        mask = batch.completion_mask
        attention = torch.cat([torch.ones_like(mask[:, :1], dtype=torch.long), mask.long()], 1)
        fields = dict(sequences=batch.input_ids, attention_mask=attention, action_mask=mask,
                      base_action_log_probs=batch.ref_logp, index=list(range(mask.shape[0])), info={})
        if not self.adapter:
            return Experience(**fields, action_log_probs=batch.old_logp, advantages=batch.advantages[:, None] * mask)
        with torch.no_grad():
            _, prob, is_eos = batch_logps_and_eos(self.problem, model, batch)
        experience = Experience(**fields, action_log_probs=with_eos(batch.old_logp, EosPayload(prob, is_eos)),
                                rewards=batch.rewards, kl=torch.zeros_like(batch.old_logp))
        current = self.kl_ctl()
        self.maker.kl_ctl = FixedKLController(current if self.previous_kl_ctl is None else self.previous_kl_ctl)
        self.previous_kl_ctl = current
        (experience,) = self.maker.compute_advantages_and_returns([experience])
        return experience


def run(problem, config: str, seed: int, settings) -> tuple[list[dict], list[dict]]:
    """One (configuration, seed) run: exact metrics after 0..steps steps, and OpenRLHF's metrics of each step."""
    warnings.filterwarnings("ignore")
    import kl_adapters
    from kl_adapters.demo.harness import train

    kl_adapters.disable()  # a reused worker process: nothing left on from an earlier configuration
    try:
        loss = OpenRLHFLoss(problem, config, settings.group)
        history = train(problem, loss, seed=seed, steps=settings.steps, group=settings.group,
                        learning_rate=settings.learning_rate, hidden=settings.hidden)
    finally:
        kl_adapters.disable()
    return history, loss.metrics


def check(problem, configs: list[str]):
    """`gradient_check.check`'s inputs: an OpenRLHFLoss per configuration (G = 2; made right before its enumeration,
    the activation being per process), the seed-0 policy, and the KL scale of a token-mean loss, grad =
    kl_coefficient / N_tok * sum_rows g (module docstring; tests/openrlhf/test_demo_runner.py's identities). Every
    kl-adapters configuration is enumerated over pairs: its experience goes through OpenRLHF's
    compute_advantages_and_returns, which groups rows by n_samples_per_prompt = G (a per-sample preset has the same
    expectation over pairs as over single completions)."""
    import functools

    from kl_adapters.demo.harness import kl_coefficient

    coef = kl_coefficient(problem, 2)
    losses = {c: (functools.partial(OpenRLHFLoss, problem, c, 2), 1 if SPECS[c][1] is None else 2) for c in configs}
    return problem.model(0), losses, lambda batch: coef / float(batch.completion_mask.sum())


if __name__ == "__main__":
    raise SystemExit(demo_main(name=NAME, framework=FRAMEWORK, run=run, configs=CONFIGS, baseline=BASELINE,
                               notes=__doc__, check=check))
