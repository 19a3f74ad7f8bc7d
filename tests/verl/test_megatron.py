"""verl's Megatron engine (``actor.strategy=megatron``; issue 47) on CPU: the adapter's pi(EOS | y_<t) from the logits
MegatronEngineWithLMHead's LM head makes (kl_adapters/adapters/verl/megatron.py), so that `sequence` gets its
termination control variate there as under FSDP, and the KL term through the same ppo_loss.

megatron_check.py on two gloo ranks, tensor parallelism 2 (each rank's LM-head logits a vocab shard), megatron-core
0.16.1 with megatron_cpu.py's test-only stand-ins (CUDA devices mapped to the CPU, a packed causal attention in place
of Transformer Engine's), a tiny GPTModel built directly, a plain SGD step in place of megatron's optimizer. Checked:
  * verl's `_lm_head_logits_processor` itself, at TP 2 and TP 1, on logits whose EOS ids lie on both vocab shards:
    the patched processor's pi(EOS) = softmax(full logits / temperature)[EOS ids].sum to 1e-6, its log-probs (and
    entropy) bit-identical to verl's own, nothing added with verl's own kl_loss_type;
  * the whole engine path -- TrainingWorker.infer_batch (compute_log_prob) and .train_mini_batch (the actor update:
    make_iterator, forward_backward_batch, forward_step, megatron's forward-backward schedule, the logits processor,
    postprocess_micro_batch_func, ppo_loss), two micro-batches, verl's packed (thd: its default) and padded (bshd)
    forwards: the pi(EOS) kept from compute_log_prob's forward and the training forward's equal the softmax of the
    full logits of the same GPTModel called on each sequence by itself (the TP ranks' shards gathered); the update's
    gradient on each rank equals the oracle's (verl's ppo_loss without KL + kl_surrogate, the whole batch's
    statistics with the task and those pi(EOS)) to float32 rounding and differs from the oracle without pi(EOS);
    with verl's own kl_loss_type the forward's outputs and the update are bit-identical to the adapter unpatched.
In process: the Megatron sites are installed where verl imports its Megatron engine and skipped where it cannot, and
the driver (validation, runtime_env) and the reward path (driver-side, no actor engine) are the same under the
Megatron trainer config as under the FSDP one. Not covered on CPU: Transformer Engine's attention (verl's production
Megatron forward), megatron's distributed optimizer and DDP buffers, verl's bridge-built model, pipeline and context
parallelism, CUDA. The GPU run of the same engine path (NCCL, CUDA, TP 1, thd and bshd): tests/verl/test_gpu.py.
The subprocesses import this checkout's kl_adapters (PYTHONPATH), as the pytest process does.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (scripts/envs.sh verl installs it)")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORLD = 2
#: verl's data formats: its packed forward (use_remove_padding=True, its default) and its padded one
VARIANTS = ("thd", "bshd")
#: float32 on both sides (the engine's packed forward and the oracle's: the same engine, the same batch)
RTOL = 1e-4


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """megatron_check.py on WORLD gloo ranks (TP = WORLD): each rank's RESULT."""
    env = {k: v for k, v in os.environ.items() if k != "KL_ADAPTERS"}
    env.update(WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000),
               PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH")))))
    variants = [arg for variant in VARIANTS for arg in ("--variant", variant)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "megatron_check.py"), "--device", "cpu", *variants], cwd=HERE,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):  # a rank failed: the others would wait at a collective
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    outs = [p.communicate()[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return [json.loads(next(line for line in out.splitlines() if line.startswith("RESULT"))[6:]) for out in outs]


@pytest.mark.parametrize("tp", [WORLD, 1])
def test_logits_processor_eos_is_the_softmax_of_the_full_logits(ranks, tp):
    for rank in ranks:
        result = rank[f"processor_tp{tp}"]
        assert result["tp"] == tp
        for entropy in ("entropy=False", "entropy=True"):
            case = result[entropy]
            assert case["eos_error"] < 1e-6 and case["eos_max"] > 0.1, case
            assert case["is_eos"] and case["log_probs_equal"]
            assert case["keys"] == sorted([*case["upstream_keys"], "kl_adapters_eos_prob", "kl_adapters_is_eos"])
        assert result["flag_off_keys"] == ["log_probs"]  # verl's own kl_loss_type: nothing added


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_eos_is_the_softmax_of_the_full_logits(ranks, variant):
    """compute_log_prob's forward keeps every row's pi(EOS) for the update; the training forward hands ppo_loss its
    micro-batch's; both = a separate forward's softmax; the engine's log-probs = the separate forward's."""
    for rank in ranks:
        engine = rank["engine"][variant]
        assert engine["kept_eos_error"] is not None and engine["kept_eos_error"] < 1e-5 and engine["kept_is_eos"]
        assert engine["training_eos_error"] < 1e-5
        assert engine["micro_batch_rows"] == [4, 4]
    assert ranks[0]["engine"][variant]["log_probs_error"] < 1e-5  # outputs come back on tensor-parallel rank 0 only


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_update_matches_the_oracle(ranks, variant):
    """The gradient the update applies (each rank's parameter shard) = the oracle's, whose pi(EOS) mattered."""
    for rank in ranks:
        engine = rank["engine"][variant]
        assert engine["kl_vs_task"] > 0.05  # the KL term is a sizeable part of the update: not vacuous
        assert engine["eos_effect"] > 1e-2  # the termination control variate changes the update
        assert engine["kl_rel_error"] < RTOL, engine["kl_rel_error"]
        # each stand-in attention call covers a micro-batch of 4 sequences (packed in thd, a padded batch in bshd)
        assert engine["attention_calls"] and all(seqs == 4 for _, seqs in engine["attention_calls"])
    first = ranks[0]["engine"][variant]
    assert first["grad_norms"][0][0] == pytest.approx(first["grad_norms"][1][0], rel=1e-5)
    assert {"kl_loss", "kl_coef", "grad_norm", "kl_adapters/seq_kl", "kl_adapters/grad_weight_gap",
            "kl_adapters/is_ess"} <= set(first["metric_keys"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_flag_off_is_upstream(ranks, variant):
    assert all(rank["engine"][variant]["flag_off_equal"] for rank in ranks)


def test_megatron_sites_follow_the_engines_import():
    """verl.workers.engine imports the Megatron engine where megatron-core imports: the adapter wraps its logits
    processor and prepare_model_outputs there; where that import failed (megatron-core absent) the trigger patches
    nothing and raises nothing."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from kl_adapters.adapters import patching
    from kl_adapters.adapters import verl as verl_adapter
    from kl_adapters.adapters.verl import megatron

    for name in ("_lm_head_logits_processor", "prepare_model_outputs"):
        assert patching.is_ours(vars(MegatronEngineWithLMHead)[name]), name
    verl_adapter.unpatch()
    module = sys.modules.pop(megatron.MODULE)
    try:
        verl_adapter.patch("verl.workers.engine")
        assert not any(patching.is_ours(v) for v in vars(MegatronEngineWithLMHead).values())
    finally:
        sys.modules[megatron.MODULE] = module


#: what verl's validate_config needs on top of either trainer config (no default for the micro-batch sizes)
MICRO_BATCHES = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]


def compose(config_name, overrides):
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


@pytest.mark.parametrize("overrides", [
    ["algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=kl_adapters:reward"],
    ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=kl_adapters:sequence"]])
def test_driver_is_the_same_under_the_megatron_trainer(overrides):
    """The driver sees no engine: the Megatron trainer config (actor strategy megatron) passes verl's and the
    adapter's validation with the same verdict, and forwards the same runtime_env, as the FSDP one."""
    from verl.trainer import main_ppo

    from kl_adapters.adapters import verl as verl_adapter

    verdicts, envs = [], []
    for name in ("ppo_megatron_trainer", "ppo_trainer"):
        config = compose(name, ["algorithm.adv_estimator=grpo", *MICRO_BATCHES, *overrides])
        main_ppo.validate_config(config, use_reference_policy=True, use_critic=False)  # ours, then verl's own
        verdicts.append(verl_adapter.check_config(config))
        env = main_ppo.get_ppo_ray_runtime_env(config)["env_vars"]
        envs.append({k: v for k, v in env.items() if k.startswith("KL_ADAPTERS")})  # what the adapter adds
        assert config.actor_rollout_ref.actor.strategy == ("megatron" if name == "ppo_megatron_trainer" else "fsdp")
    assert verdicts[0] == verdicts[1] and verdicts[0] is not None
    assert envs[0] == envs[1]


def test_reward_path_is_the_same_under_the_megatron_trainer():
    """The reward path runs in the driver on the rollout batch (apply_kl_penalty, the advantage estimator), never
    in the actor's engine: test_reward_path's identity (advantages = estimator(KL-free scores) + the KL reward-to-go)
    holds with the Megatron trainer's algorithm config as composed, bit for bit the same advantages."""
    from test_reward_path import G, kl_to_go, reward_batch
    from verl.trainer.ppo import core_algos, ray_trainer
    from verl_cases import Case

    case = Case(seed=2, on_policy=True)
    results = []
    for name in ("ppo_megatron_trainer", "ppo_trainer"):
        algo = compose(name, ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=True",
                              "algorithm.kl_penalty=kl_adapters:reward", "algorithm.kl_ctrl.kl_coef=0.1"]).algorithm
        data, _ = ray_trainer.apply_kl_penalty(reward_batch(case), kl_ctrl=core_algos.get_kl_controller(algo.kl_ctrl),
                                               kl_penalty=algo.kl_penalty)
        out = ray_trainer.compute_advantage(data, adv_estimator=algo.adv_estimator, num_repeat=G,
                                            norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, config=algo)
        results.append(out.batch["advantages"])
    data = reward_batch(case)
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    scores_only = ray_trainer.compute_advantage.__kl_adapters_original__(
        data, adv_estimator="grpo", num_repeat=G, norm_adv_by_std_in_grpo=True, config=algo)
    assert torch.equal(results[0], results[1])
    torch.testing.assert_close(results[0], scores_only.batch["advantages"] + kl_to_go(case, scores_only),
                               rtol=1e-6, atol=1e-7)
