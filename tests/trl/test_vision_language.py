"""GRPOTrainer with a vision-language model (support.py's vision-language row, issue 47): the KL term with images.

The model is a tiny randomly initialised Qwen2-VL (`vlm_cases.tiny_qwen2_vl`: 2 text layers with multimodal RoPE, a
1-block vision tower) with its processor built in-process (the project's character tokenizer with Qwen2-VL's special
tokens and a chat template, transformers' PIL Qwen2-VL image processor from arguments; the processor class is
Qwen2VLProcessor without its video slot, `ImageOnlyQwen2VLProcessorStub`, a test stub because that slot needs
torchvision, which cannot be installed beside the CPU torch), on conversational prompts each with one synthetic 8x8
or 8x4 image. TRL passes pixel_values / image_grid_thw / mm_token_type_ids to every forward of the batch. Pinned, on
real TRL batches (generation, rewards, advantages, reference log-probs):
1. the images reach the KL term's inputs: TRL's reference log-probs are the reference model's given the images, and
   the policy's log-probs change when the images are blanked;
2. pi(EOS | y_<t) that the reduced presets read from TRL's own policy forward (the backbone hook,
   kl_adapters/adapters/trl/eos.py) is the policy's given the images: it equals softmax(logits / temperature) over
   TRL's EOS ids of a separate full-logits forward with the images, and differs from the one with blanked images;
3. the gradient identity of tests/trl/test_grpo_gradients.py with images, presets `sequence` (pi(EOS) read inside the
   forward), `sequence-plain` and `token`: trainer gradient = TRL's task gradient (beta = 0) + grad kl_surrogate(logp,
   ref, mask, preset, beta * B / D, task / group / eos by hand), the oracle's forward given the images; the KL part
   reaches the vision tower's weights; `token` is TRL's native KL gradient (so D is TRL's with images too);
4. rollout time (steps_per_generation 2: TRL computes old log-probs of the generation batch in per-device chunks, each
   with its rows' pixel rows): the statistics stored in the batch are kl_statistics of the whole generation batch with
   pi(EOS) of the rollout forward given the images, and the trainer's gradient on a micro-batch uses them;
5. `full` refuses a batch with images in one line (support.py's row says so);
6. flag off, a real train() step is bit-identical to unpatched TRL (metrics and weights).
"""

import pytest
import torch
from conftest import flat_grad, groups_by_hand, grpo_args, one_batch, perturb, same_groups
from test_grpo_gradients import assert_close, trainer_grad
from test_grpo_training import _history_and_params
from test_statistics import generation_and_micro_batches
from vlm_cases import (eos_by_hand, image_dataset, make_vlm_trainer, multimodal_inputs, policy_logps,
                       save_tiny_qwen2_vl, statistics_inputs_by_hand)

from kl_adapters import TaskAdvantages, kl_statistics, kl_surrogate
from kl_adapters.adapters import trl as adapter
from kl_adapters.adapters._guard import UnsupportedFrameworkError
from kl_adapters.adapters.trl import loss as trl_loss
from kl_adapters.adapters.trl import rollout as trl_rollout


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for this module (restored after): the tiny model is overhead-bound, and two OpenMP threads on
    a shared 2-core machine made each small matmul up to 300x slower (measured under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"))


@pytest.fixture(scope="module")
def images():
    """Two prompts, an 8x8 and an 8x4 image: every generation batch of 2 prompts holds both image sizes (TRL's
    sampler draws distinct prompts per generation batch)."""
    return image_dataset(2)


def blanked(batch):
    """The batch's pixel_values replaced by zeros: what a forward that dropped the images' content would see."""
    return {"pixel_values": torch.zeros_like(batch["pixel_values"])}


def expected_parts(trainer, batch, preset, beta=0.1, **options):
    """(grad of the task loss at beta = 0, grad of kl_surrogate on the same tensors), the policy's log-probs from a
    forward given the batch's images; task / group / eos by hand unless `options` names the statistics."""
    task = trainer_grad(trainer, batch, "off", beta=0.0)
    mask = batch["completion_mask"]
    old = adapter.behaviour_logps(batch, batch["ref_per_token_logps"])
    beta_seq = beta * mask.shape[0] / adapter.per_token_normaliser(trainer, batch, mask)
    options = options or statistics_inputs_by_hand(trainer, batch, preset, beta)
    kl = flat_grad(trainer, lambda: kl_surrogate(policy_logps(trainer, batch), batch["ref_per_token_logps"], mask,
                                                 preset=preset, beta=beta_seq, old_logp=old, **options))
    return task, kl


def vision_entries(trainer):
    """[P] bool: which entries of flat_grad's vector are the vision tower's weights."""
    return torch.cat([torch.full((p.numel(),), "visual" in name) for name, p in trainer.model.named_parameters()
                      if p.requires_grad])


@pytest.fixture(scope="module")
def on_policy(vlm_dir, images):
    """(trainer, one on-policy micro-batch of 8 shuffled rows: 2 prompts x 4 generations, an 8x8 and an 8x4 image);
    groups of 4 so the reduced presets fit their statistics (a row needs two others), the policy moved well away from
    the reference so the KL part of the gradient is not small."""
    trainer = make_vlm_trainer(vlm_dir, images, loss_type="dapo", num_generations=4, per_device_train_batch_size=8,
                               temperature=0.7)
    perturb(trainer.model, scale=1.0, seed=47)
    batch = one_batch(trainer)
    assert batch.get("old_per_token_logps") is None
    return trainer, batch


def test_images_reach_the_kl_terms_inputs(on_policy):
    trainer, batch = on_policy
    assert batch["num_images"] == [1] * 8 and batch["image_grid_thw"].shape == (8, 3)
    assert sorted({int(g.prod()) for g in batch["image_grid_thw"]}) == [8, 16]  # both image sizes in the micro-batch
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    assert int(batch["mm_token_type_ids"].sum()) == int(batch["image_grid_thw"].prod(-1).sum()) // 4
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        ref = trainer._get_per_token_logps_and_entropies(trainer.ref_model, input_ids, attention_mask, width,
                                                         **multimodal_inputs(batch))[0]
        mine = policy_logps(trainer, batch)
        blind = policy_logps(trainer, {**batch, **blanked(batch)})
    mask = batch["completion_mask"].bool()
    torch.testing.assert_close(batch["ref_per_token_logps"][mask], ref[mask], rtol=1e-5, atol=1e-6)
    assert float((mine - blind)[mask].abs().max()) > 1e-3  # the images move the completions' probabilities


def test_eos_probabilities_are_read_with_the_images(on_policy, monkeypatch):
    trainer, batch = on_policy
    seen = []
    real = trl_loss.end_of_sequence
    monkeypatch.setattr(trl_loss, "end_of_sequence", lambda *a: seen.append(real(*a)) or seen[-1])
    trainer_grad(trainer, batch, "sequence")
    (eos,) = seen
    want, blind = eos_by_hand(trainer, batch), eos_by_hand(trainer, batch, **blanked(batch))
    torch.testing.assert_close(eos.prob, want.prob, rtol=1e-5, atol=1e-7)
    assert torch.equal(eos.is_eos, want.is_eos) and eos.horizon == trainer.max_completion_length
    mask = batch["completion_mask"].bool()
    assert float(((blind.prob - want.prob) / want.prob)[mask].abs().max()) > 1e-3  # the check would see no images


#: the KL part of the gradient (trainer's minus the task's) matches grad kl_surrogate to this fraction of its own scale
#: (measured 0.4-1.0e-5); pi(EOS) from a forward with blanked images moves `sequence`'s by 3.2e-4 of it
KL_PART_RTOL = 5e-5


@pytest.mark.parametrize("preset", ["sequence", "sequence-plain", "token"])
def test_gradient_is_task_plus_kl_surrogate(on_policy, preset):
    trainer, batch = on_policy
    got = trainer_grad(trainer, batch, preset)
    task, kl = expected_parts(trainer, batch, preset)
    assert_close(got, task + kl)
    assert_close(got - task, kl, rtol=KL_PART_RTOL)
    vision = vision_entries(trainer)
    assert float(kl[vision].abs().max()) > 1e-2 * float(kl.abs().max())  # the KL gradient reaches the vision tower
    if preset == "sequence":  # the identity needs pi(EOS) given the images: without them it misses
        options = {**statistics_inputs_by_hand(trainer, batch, preset, 0.1),
                   "eos": eos_by_hand(trainer, batch, **blanked(batch))}
        _, blind = expected_parts(trainer, batch, preset, **options)
        assert float((got - task - blind).abs().max()) > 3 * KL_PART_RTOL * float(kl.abs().max())
    if preset == "token":  # TRL 1.16's native KL term (use_bias_correction_kl=True) has the `token` gradient
        assert_close(got, trainer_grad(trainer, batch, "off"))


def test_full_refuses_images(on_policy):
    """`full` (the reference at loss time from hidden states, text-only) stops the step in one line on a batch with
    images."""
    trainer, batch = on_policy
    with pytest.raises(UnsupportedFrameworkError) as error:
        trainer_grad(trainer, batch, "full")
    (line,) = str(error.value).splitlines()
    assert line == "kl_preset='full' supports text-only models (multimodal inputs are not tested)"


def test_rollout_statistics_with_images(vlm_dir, images, monkeypatch):
    """steps_per_generation 2 with micro-batches of 4 rows: TRL computes the 8-row generation batch's old log-probs in
    chunks of 4 rows (each given its rows' pixel rows) and splits pixel_values by image grid into the micro-batches."""
    trainer = make_vlm_trainer(vlm_dir, images, loss_type="dapo", num_generations=4, temperature=0.7,
                               per_device_train_batch_size=4, steps_per_generation=2)
    perturb(trainer.model, scale=1.0, seed=48)
    recorded = []
    real = adapter.rollout_statistics
    monkeypatch.setattr(trl_rollout, "rollout_statistics",
                        lambda tr, batch, preset, eos: recorded.append(eos) or real(tr, batch, preset, eos))
    whole, micro = generation_and_micro_batches(trainer)
    assert whole["old_per_token_logps"] is not None and len(micro) == 2
    assert sorted({int(g.prod()) for g in whole["image_grid_thw"]}) == [8, 16]
    eos = eos_by_hand(trainer, whole)  # the policy has not moved since the rollout
    (rollout_eos,) = recorded  # pi(EOS) the adapter read from TRL's chunked rollout forward: given the images
    torch.testing.assert_close(rollout_eos.prob, eos.prob, rtol=1e-5, atol=1e-7)
    blind = eos_by_hand(trainer, whole, **blanked(whole))
    mask = whole["completion_mask"].bool()
    assert float(((blind.prob - eos.prob) / eos.prob)[mask].abs().max()) > 1e-3
    group = groups_by_hand(whole)
    assert same_groups(whole[adapter.GROUP_KEY], group)
    expected = kl_statistics(whole["old_per_token_logps"], whole["ref_per_token_logps"], whole["completion_mask"],
                             group=group, task=TaskAdvantages(whole["advantages"], 0.1, True), eos=eos)
    for field, key in adapter.ROLLOUT_STATISTICS_KEYS.items():
        torch.testing.assert_close(whole[key], getattr(expected, field), rtol=1e-4, atol=1e-6)
    batch = micro[0]
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    perturb(trainer.model, scale=0.1, seed=49)  # the policy moves between rollout and loss: off-policy
    got = trainer_grad(trainer, batch, "sequence")
    task, kl = expected_parts(trainer, batch, "sequence", statistics=adapter.statistics_of(batch),
                              eos=eos_by_hand(trainer, batch))
    assert_close(got, task + kl)
    assert_close(got - task, kl, rtol=KL_PART_RTOL)


def _train(vlm_dir, images, **overrides):
    trainer = make_vlm_trainer(vlm_dir, images, num_generations=2, max_steps=1, **overrides)
    trainer.train()
    return trainer


def test_flag_off_is_bit_identical_to_unpatched_trl(vlm_dir, images):
    """Unpatched TRL with GRPOConfig vs patched TRL with KLGRPOConfig(kl_preset=None), one real train() step with
    images: same metrics, same weights."""
    from trl import GRPOConfig

    adapter.unpatch()
    try:
        reference = _history_and_params(_train(vlm_dir, images, args=grpo_args(config_cls=GRPOConfig, max_steps=1,
                                                                              num_generations=2)))
    finally:
        adapter.patch("trl.trainer.grpo_trainer")
    patched = _history_and_params(_train(vlm_dir, images, kl_preset=None))
    assert patched[0] == reference[0]
    assert all((a == b).all() for a, b in zip(patched[1], reference[1]))
