"""Reward path (OpenRLHF's default: no --algo.kl.use_loss), preset "reward": OpenRLHF's own RemoteExperienceMaker
(make_experience_batch: KL, compute_reward, advantages) and the PPO gradient its advantages produce."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

import kl_adapters
from kl_adapters import EndOfSequence, TaskAdvantages, kl_coefficients, kl_statistics, kl_surrogate, sequence_kl
from kl_adapters.adapters import openrlhf as adapter
from kl_adapters.adapters.openrlhf.statistics import KEYS
from openrlhf_cpu_shim import EOS, VOCAB, load_actor
from openrlhf_harness import (BETA, GROUP, MAX_NEW_TOKENS, RESPONSES, align_row, base_argv, build_trainer, cli_args,
                              softmax_eos)

PROMPT = 4


@pytest.fixture(scope="module")
def args(actor_dir):
    argv = [a for a in base_argv(actor_dir) if a != "--algo.kl.use_loss"]
    argv[argv.index("--algo.kl.estimator") + 1] = "k1"
    return cli_args(argv)  # group_norm, 4 samples per prompt, 2 prompts, sample batches of 4


@pytest.fixture(scope="module")
def models(actor_dir, ref_dir):
    return load_actor(actor_dir), load_actor(ref_dir)


class LocalGroup:
    """Test double of OpenRLHF's RayActorGroup as make_experience uses it: runs the model's forward (what
    PolicyModelActor / ReferenceModelActor.forward compute) in this process and returns one Ray object ref holding the
    list of per-batch results, as async_run_method_batch does for one actor. `edit` alters the log-probs it returns."""

    def __init__(self, model, edit=None):
        self.model, self.edit = model, edit

    @torch.no_grad()
    def async_run_method_batch(self, method_name, sequences, action_mask, attention_mask, **kwargs):
        import ray

        assert method_name == "forward"
        out = [self.model(s, a, attention_mask=m) for s, a, m in zip(sequences, action_mask, attention_mask)]
        return [ray.put([self.edit(o) if self.edit else o for o in out])]


def rollout(rewards):
    """Single-sample Experiences as OpenRLHF's SamplesGenerator makes them (action mask over sequence[1:]); responses
    shorter than the longest end with EOS."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    gen, samples = torch.Generator().manual_seed(0), []
    for n, r in zip(RESPONSES, rewards):
        sequence = torch.randint(2, VOCAB, (1, PROMPT + n), generator=gen)
        if n < max(RESPONSES):
            sequence[0, -1] = EOS
        action_mask = torch.zeros(1, PROMPT + n - 1, dtype=torch.long)
        action_mask[:, PROMPT - 1:] = 1
        samples.append(Experience(sequences=sequence, attention_mask=torch.ones_like(sequence), action_mask=action_mask,
                                  rewards=torch.tensor([float(r)]), response_length=torch.tensor([n]),
                                  total_length=torch.tensor([float(PROMPT + n)]), prompts=[""], labels=[""],
                                  images=[None], mm_train_inputs=[None], info={}))
    return samples


def make_experiences(args, models, rewards, ref_edit=None):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    actor, ref = models
    maker = RemoteExperienceMaker(LocalGroup(actor), None, None, LocalGroup(ref, ref_edit), FixedKLController(BETA),
                                  SimpleNamespace(args=copy.deepcopy(args)), SimpleNamespace(pad_token_id=0))
    return maker.make_experience_batch(rollout(rewards))


REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 1.0, 0.5]


def view(x, mask):
    """The adapter's positions, computed apart from it: each row from its response's start, cut to the horizon."""
    return align_row(x, mask)[:, :MAX_NEW_TOKENS]


@dataclass
class ByHand:
    """The whole rollout's rows (the sample batches zero-padded to one width, `view`ed) and kl_statistics of them within
    OpenRLHF's GRPO groups (rollout position // n_samples_per_prompt), fitted with `task` and with the actor's EOS
    probabilities of a separate forward (`softmax_eos`): computed here independently of the adapter."""

    logp: torch.Tensor
    base: torch.Tensor
    mask: torch.Tensor
    eos: EndOfSequence
    stats: object


def by_hand(experiences, models, task=None) -> ByHand:
    actor, ref = models
    width = max(e.action_mask.shape[1] for e in experiences)
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))  # noqa: E731
    mask = torch.cat([pad(e.action_mask) for e in experiences])
    cat = lambda xs: view(torch.cat([pad(x) for x in xs]), mask)  # noqa: E731
    logp = cat([e.action_log_probs for e in experiences])
    base = cat([ref(e.sequences, e.action_mask, attention_mask=e.attention_mask).detach() for e in experiences])
    payloads = [softmax_eos(actor, e.sequences, e.attention_mask, e.action_mask) for e in experiences]
    eos = EndOfSequence(cat([p.prob for p in payloads]), cat([p.is_eos for p in payloads]), MAX_NEW_TOKENS)
    group = torch.tensor([i for e in experiences for i in e.index]) // GROUP
    mask = view(mask, mask)
    return ByHand(logp, base, mask, eos, kl_statistics(logp, base, mask, group=group, task=task, eos=eos))


@pytest.mark.compat
def test_flag_off_bit_identical_and_reward_plain_matches_native_k1(args, models, ray_cluster):
    """Patched but off (--algo.kl.preset none): bit-identical experiences. Preset "reward-plain": OpenRLHF's
    k1-in-reward is already that preset, so advantages, returns and `kl` stay bit-identical where its clamp does not
    act; kl_adapters/seq_kl is added per sample."""
    native = make_experiences(args, models, REWARDS)
    kl_adapters.enable("reward-plain")
    off = copy.deepcopy(args)
    off.algo.kl.preset = "none"
    for ours in (make_experiences(off, models, REWARDS), make_experiences(args, models, REWARDS)):
        assert len(ours) == len(native) == 2
        for a, b in zip(native, ours):
            assert torch.equal(a.advantages, b.advantages) and torch.equal(a.returns, b.returns)
            assert torch.equal(a.info["kl"], b.info["kl"]) and torch.equal(a.info["return"], b.info["return"])
    ref = models[1]
    for exp in ours:
        base = ref(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask).detach()
        torch.testing.assert_close(exp.info[adapter.SEQ_KL], sequence_kl(exp.action_log_probs, base, exp.action_mask))


def test_reward_preset_returns_are_the_reduced_coefficients(args, models, ray_cluster):
    """Preset "reward": OpenRLHF's KL returns become -beta * c_t, c the reduced reward coefficient with the rollout's
    leave-one-out statistics (GRPO groups over both sample batches), fitted with the task the advantages will hold (the
    scores, group_norm-normalized, against beta = kl_coef) and the end-of-sequence probabilities of the actor's own
    rollout forward, delivered as per-token rewards whose reward-to-go is c (group_norm acts on the score only, so the
    KL part is not rescaled); `kl` (its logged k1 mean) unchanged."""
    native = make_experiences(args, models, REWARDS)
    kl_adapters.enable("reward")
    ours = make_experiences(args, models, REWARDS)
    hand = by_hand(ours, models, TaskAdvantages(torch.tensor(REWARDS), BETA, normalized=True))
    c = kl_coefficients(hand.logp, hand.base, hand.mask, preset="reward", statistics=hand.stats, eos=hand.eos)
    plain = kl_coefficients(hand.logp, hand.base, hand.mask, preset="reward-plain")
    real_hand = hand.mask.bool()
    assert hand.eos.is_eos.any()
    start = 0
    for a, b in zip(native, ours):
        rows = slice(start, start + len(b.action_mask))
        start += len(b.action_mask)
        # native returns = score part - beta * reward-plain coefficient (k1 reward-to-go) at the real tokens, in order
        real = b.action_mask.bool()
        torch.testing.assert_close((b.returns - a.returns)[real], -BETA * (c - plain)[rows][real_hand[rows]],
                                   rtol=1e-5, atol=1e-6)
        assert torch.equal(a.info["kl"], b.info["kl"])
    assert (c - plain).abs().max() > 1e-3, "the reduction must change the per-token rewards in this test"


def test_kl_reward_is_not_clamped(args, models, ray_cluster):
    """OpenRLHF clamps the KL to [-10, 10] (models/utils.py:113), which biases the reward; reward-plain's k1 reward is
    exact: where log pi/pi_ref = k > 10, the return changes by -beta * (k - 10) at and before that token."""

    def unlikely(logp):  # the reference finds the 3rd action token of each sample batch's first sequence unlikely
        logp = logp.clone()
        logp[0, PROMPT + 1] -= 15.0
        return logp

    native = make_experiences(args, models, REWARDS, ref_edit=unlikely)
    kl_adapters.enable("reward-plain")
    ours = make_experiences(args, models, REWARDS, ref_edit=unlikely)
    clamped = 0
    for a, b in zip(native, ours):
        k1 = b.action_log_probs - unlikely(models[1](b.sequences, b.action_mask, attention_mask=b.attention_mask))
        excess = torch.zeros_like(a.advantages)
        if b.action_mask[0, PROMPT + 1]:  # a real token (padding is masked out of the returns either way)
            excess[0, :PROMPT + 2] = k1[0, PROMPT + 1].detach() - 10.0
            clamped += int(excess[0, 0] > 4.0)
        torch.testing.assert_close(b.advantages - a.advantages, -BETA * excess)
    assert clamped == 1


@pytest.mark.compat
def test_reward_path_gradient_is_reward_preset(args, models, actor_dir, ray_cluster, cpu_cuda):
    """With a zero score, OpenRLHF's advantage is the KL return -beta * c_t, and its PPO loss (token mean over N_tok
    tokens) has, at the rollout policy, the gradient beta * (B / N_tok) * grad kl_surrogate(preset="reward",
    statistics=the rows' rollout-wide statistics, eos=the rollout policy's EndOfSequence): unbiased for grad KL_seq
    on-policy. Checked on the first optimizer step, against the core called by hand (own positions and EOS
    probabilities)."""
    kl_adapters.enable("reward")
    actor = load_actor(actor_dir)
    experiences = make_experiences(args, (actor, models[1]), [0.0] * len(RESPONSES))
    stats = by_hand(experiences, (actor, models[1]), TaskAdvantages(torch.zeros(len(RESPONSES)), BETA, True)).stats
    assert (stats.eos_coef != 0).any(), "the termination control variate must act in this test"
    trainer = build_trainer(args, actor, micro_batch=len(RESPONSES), gas=1)
    for exp in experiences:
        trainer.replay_buffer.append(copy.deepcopy(exp))
    params = list(actor.parameters())
    expected = [torch.zeros_like(p) for p in params]
    n_tok, start = sum(int(e.action_mask.sum()) for e in experiences), 0
    for exp in experiences:
        m = exp.action_mask
        logp = actor(exp.sequences, m, attention_mask=exp.attention_mask)
        with torch.no_grad():
            base = models[1](exp.sequences, m, attention_mask=exp.attention_mask)
        payload = softmax_eos(actor, exp.sequences, exp.attention_mask, m)
        eos = EndOfSequence(view(payload.prob, m), view(payload.is_eos, m), MAX_NEW_TOKENS)
        rows = stats[start:start + len(logp)]
        start += len(logp)
        surrogate = kl_surrogate(view(logp, m), view(base, m), view(m, m), preset="reward", statistics=rows,
                                 eos=eos) * len(logp)  # the sum over the rows
        for acc, g in zip(expected, torch.autograd.grad(surrogate, params)):
            acc += BETA / n_tok * g
    torch.manual_seed(0)
    trainer.ppo_train(kl_ctl=BETA)
    expected = torch.cat([g.flatten() for g in expected])
    assert (trainer.strategy.grad_log[0] - expected).norm() < 1e-4 * expected.norm()


def test_loss_path_attaches_rollout_statistics_fitted_with_the_advantages(args, models, ray_cluster):
    """--algo.kl.use_loss, preset "sequence": once compute_advantages_and_returns has made the advantages, each row's
    info holds its leave-one-out statistics of the whole rollout (GRPO groups across sample batches, from the log-probs
    and EOS probabilities of the rollout forward, no second forward), fitted with OpenRLHF's advantages (group_norm:
    normalized) against beta = kl_ctl (token-mean: the KL shares the policy loss's normaliser N_tok), on every
    rollout. The experiences hold OpenRLHF's plain tensors."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController

    loss_args = copy.deepcopy(args)
    loss_args.algo.kl.use_loss = True
    kl_adapters.enable("sequence")
    actor, ref = models
    maker = RemoteExperienceMaker(LocalGroup(actor), None, None, LocalGroup(ref), FixedKLController(BETA),
                                  SimpleNamespace(args=loss_args), SimpleNamespace(pad_token_id=0))
    for _ in range(2):
        experiences = maker.make_experience_batch(rollout(REWARDS))
        assert all(type(e.action_log_probs) is torch.Tensor for e in experiences)
        width = max(e.action_mask.shape[1] for e in experiences)
        advantages = torch.cat([torch.nn.functional.pad(e.advantages, (0, width - e.advantages.shape[1]))
                                for e in experiences])
        mask = torch.cat([torch.nn.functional.pad(e.action_mask, (0, width - e.action_mask.shape[1]))
                          for e in experiences])
        task = TaskAdvantages(view(advantages, mask), BETA, normalized=True)
        stats, start = by_hand(experiences, models, task).stats, 0
        for e in experiences:
            rows = slice(start, start + len(e.action_mask))
            start += len(e.action_mask)
            stored = {name: e.info[key] for name, key in KEYS.items()}
            for name in ("cv_coef", "eos_coef", "past_coef"):
                torch.testing.assert_close(stored[name], getattr(stats, name)[rows])
            torch.testing.assert_close(stored["baseline"][:, :MAX_NEW_TOKENS], stats.baseline[rows])
        assert start == len(RESPONSES) and (stats.eos_coef != 0).any()
