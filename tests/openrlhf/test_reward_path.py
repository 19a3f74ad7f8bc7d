"""Reward path (OpenRLHF's default: no --algo.kl.use_loss), preset "reward": OpenRLHF's own RemoteExperienceMaker
(make_experience_batch: KL, compute_reward, advantages) and the PPO gradient its advantages produce."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import kl_adapters
from kl_adapters import kl_coefficients, kl_statistics, kl_surrogate, sequence_kl
from kl_adapters.adapters import openrlhf as adapter
from kl_adapters.adapters.openrlhf_statistics import KEYS
from openrlhf_cpu_shim import VOCAB, load_actor
from openrlhf_harness import BETA, RESPONSES, base_argv, build_trainer, cli_args

PROMPT = 4


@pytest.fixture(scope="module")
def args(actor_dir):
    argv = [a for a in base_argv(actor_dir) if a != "--algo.kl.use_loss"]
    argv[argv.index("--algo.kl.estimator") + 1] = "k1"
    return cli_args(argv)  # group_norm, 2 samples per prompt, 4 prompts, sample batches of 4


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
    """Single-sample Experiences as OpenRLHF's SamplesGenerator makes them (action mask over sequence[1:])."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    gen, samples = torch.Generator().manual_seed(0), []
    for n, r in zip(RESPONSES, rewards):
        sequence = torch.randint(2, VOCAB, (1, PROMPT + n), generator=gen)
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


def rollout_statistics_by_hand(experiences, ref):
    """The whole rollout's rows (the two sample batches, zero-padded to one width) and kl_statistics of them within
    OpenRLHF's GRPO groups (rollout position // n_samples_per_prompt), computed here independently of the adapter."""
    width = max(e.action_mask.shape[1] for e in experiences)
    pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))  # noqa: E731
    logp = torch.cat([pad(e.action_log_probs) for e in experiences])
    base = torch.cat([pad(ref(e.sequences, e.action_mask, attention_mask=e.attention_mask).detach())
                      for e in experiences])
    mask = torch.cat([pad(e.action_mask) for e in experiences])
    group = torch.tensor([i for e in experiences for i in e.index]) // 2  # --rollout.n_samples_per_prompt 2
    return logp, base, mask, kl_statistics(logp, base, mask, group=group)


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
    leave-one-out statistics (GRPO groups over both sample batches), delivered as per-token rewards whose reward-to-go
    is c (group_norm acts on the score only, so the KL part is not rescaled); `kl` (its logged k1 mean) unchanged."""
    native = make_experiences(args, models, REWARDS)
    kl_adapters.enable("reward")
    ours = make_experiences(args, models, REWARDS)
    logp, base, mask, stats = rollout_statistics_by_hand(ours, models[1])
    c = kl_coefficients(logp, base, mask, preset="reward", statistics=stats)
    plain = kl_coefficients(logp, base, mask, preset="reward-plain")
    start = 0
    for a, b in zip(native, ours):
        rows, width = slice(start, start + len(b.action_mask)), b.action_mask.shape[1]
        start += len(b.action_mask)
        # native returns = score part - beta * reward-plain coefficient (k1 reward-to-go) at the real tokens
        real = b.action_mask.bool()
        torch.testing.assert_close((b.returns - a.returns)[real], -BETA * (c[rows, :width] - plain[rows, :width])[real],
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
    statistics=the rows' rollout-wide statistics): c_t = k1_t + sum_{s>t} X_s - b_t, unbiased for grad KL_seq
    on-policy. Checked on the first optimizer step."""
    kl_adapters.enable("reward")
    actor = load_actor(actor_dir)
    experiences = make_experiences(args, (actor, models[1]), [0.0] * len(RESPONSES))
    stats, start = rollout_statistics_by_hand(experiences, models[1])[3], 0
    trainer = build_trainer(args, actor, micro_batch=len(RESPONSES), gas=1)
    for exp in experiences:
        trainer.replay_buffer.append(copy.deepcopy(exp))
    params = list(actor.parameters())
    expected = [torch.zeros_like(p) for p in params]
    n_tok = sum(int(e.action_mask.sum()) for e in experiences)
    for exp in experiences:
        logp = actor(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask)
        with torch.no_grad():
            base = models[1](exp.sequences, exp.action_mask, attention_mask=exp.attention_mask)
        rows = stats[start:start + len(logp)]
        start += len(logp)
        rows = rows.with_width(logp.shape[1])
        surrogate = kl_surrogate(logp, base, exp.action_mask, preset="reward", statistics=rows) * len(logp)  # sum
        for acc, g in zip(expected, torch.autograd.grad(surrogate, params)):
            acc += BETA / n_tok * g
    torch.manual_seed(0)
    trainer.ppo_train(kl_ctl=BETA)
    expected = torch.cat([g.flatten() for g in expected])
    assert (trainer.strategy.grad_log[0] - expected).norm() < 1e-4 * expected.norm()


def test_loss_path_make_experience_attaches_rollout_statistics(args, models, ray_cluster):
    """--algo.kl.use_loss, preset "sequence": make_experience stores each row's leave-one-out statistics of the whole
    rollout (GRPO groups across sample batches, from the log-probs it already computed) in the row's info."""
    loss_args = copy.deepcopy(args)
    loss_args.algo.kl.use_loss = True
    kl_adapters.enable("sequence")
    experiences = make_experiences(loss_args, models, REWARDS)
    stats, start = rollout_statistics_by_hand(experiences, models[1])[3], 0
    for e in experiences:
        rows, width = slice(start, start + len(e.action_mask)), e.action_mask.shape[1]
        start += len(e.action_mask)
        stored = {name: e.info[key] for name, key in KEYS.items()}
        for name in ("cv_coef", "eos_coef", "past_coef"):
            torch.testing.assert_close(stored[name], getattr(stats, name)[rows])
        torch.testing.assert_close(stored["baseline"] * e.action_mask, stats.baseline[rows, :width] * e.action_mask)
    assert start == len(RESPONSES)
