"""verl's FSDP engine as verl's example scripts configure it (docs/coverage.md): ``use_remove_padding=True`` (each
micro-batch packed into one row; transformers masks attention per packed sequence from the position ids),
``use_dynamic_bsz=True`` (micro-batches cut by a token budget, rows of unequal count) and a LoRA actor
(``lora_rank=4``), whose reference is its adapter-disabled base (compute_ref_log_prob's ``no_lora_adapter`` pass). The
same oracle as test_engine.py (engine_check.py): one SGD step with ``kl_loss_type=kl_adapters:sequence`` equals verl's
ppo_loss without KL plus kl_surrogate with verl's global token count and the batch statistics, and pi(EOS) of the packed
forwards equals a separate padded forward's. Ulysses sequence parallelism (packed micro-batches sharded over ranks):
test_sequence_parallel.py."""

import importlib.metadata
import importlib.util

import pytest
from test_engine import check, run_engine_check


@pytest.mark.skipif(importlib.metadata.version("verl") in ("0.8.0", "0.9.0")
                    and not importlib.util.find_spec("flash_attn"),
                    reason="verl < 0.9.1 unpads batches with flash_attn.bert_padding (CUDA only)")
def test_remove_padding_dynamic_batch_size_and_lora_match_the_oracle():
    result = run_engine_check("--device", "cpu", "--steps", "1", "--remove-padding", "--dynamic-bsz", "--lora")
    check(result, steps=1)
    assert set(result["model_input_rows"]) == {1}  # packed: every micro-batch is one row of concatenated sequences
    rows = result["micro_batch_rows"]
    assert sum(rows) == 8 and len(rows) > 2 and len(set(rows)) > 1  # cut by tokens: not the 2 x 4 of fixed sizes
    # LoRA: the reference pass through the actor is the base model (the adapter starts at B = 0, so the first
    # log-probs are the base's) although the policy moved, and it keeps the actor pass's pi(EOS) rows
    assert result["lora_reference_error"] < 1e-6 and result["lora_policy_moved"] > 1e-3
    assert result["lora_kept_eos_rows"] == 8


def test_doctor_warns_that_megatron_is_untested(capsys):
    """The Megatron engine cannot run here: the doctor's fix for a Megatron config comes with that warning."""
    from kl_adapters.cli import main

    main(["doctor", "verl", "--config-name", "ppo_megatron_trainer", "actor_rollout_ref.actor.use_kl_loss=True",
          "actor_rollout_ref.actor.kl_loss_type=low_var_kl"])
    out = capsys.readouterr().out
    assert "[untested-path] actor strategy megatron" in out and "kl_adapters:sequence" in out
