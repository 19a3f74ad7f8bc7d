"""Vision-language models on verl's FSDP engine (issue 47): verl's real actor update path -- TrainingWorker, FSDP2
engine, micro-batches of 4 rows, verl's monkey-patched Qwen VL forward, ppo_loss with
``kl_loss_type=kl_adapters:<preset>`` -- on a tiny random Qwen2.5-VL and Qwen2-VL fed images, against the oracle of
the text tests (test_engine.py): one SGD step (lr 1) from the same weights, flagged, equals verl's ppo_loss without KL
plus kl_surrogate(beta = per_sequence_beta(coef, mask, "token-mean", num_tokens=verl's global token count)) per
micro-batch, for `sequence` with the statistics kl_statistics(old, ref, mask, task=TaskAdvantages(advantages, coef),
eos=EndOfSequence(pi(EOS) of a separate transformers forward, ...)) of the whole batch. CPU, gloo, world size 1, the
test-only platform shim; builders, batch and run in vlm_cases.py.

The batch is verl's VLM layout (what its agent loop hands the actor): 8 rows, 7 with one random RGB image of 8 to 16
pixels a side through transformers' Qwen2-VL image processor (2x2-pixel patches, 2x2 merge: 4 to 16 <|image_pad|>
tokens in the prompt) and one text-only row; per row ``multi_modal_inputs`` {pixel_values, image_grid_thw,
images_seqlens}; position ids [B, 4, L] (a text row and Qwen2-VL's three mrope rows from the model's get_rope_index).
Two rows have the same prompt and response tokens and different images.

Pinned: (1) pi(EOS | y_<t) that the adapter reads from the engine's logits -- kept from compute_log_prob's forward
for the update's statistics, and put into model_output by the training forward -- equals softmax(logits)[EOS] of a
separate float64 transformers forward (transformers' own mrope positions, padded batch) to 1e-5, for every row,
including the two twins (their pi(EOS) differ by 2e-4 to 5e-4: a store keyed by token ids alone hands one of them
the other's); (2) the update equals the oracle's to 1e-4 of the KL part (`sequence`, `sequence-plain`, `token`), the
KL part being > 5% of the update, and pi(EOS) changes the oracle's update (> 1e-3), so (1) reached the core; (3) the
images reached the model: every micro-batch's forward got its rows' image patches (pixel_values rows); (4) with
use_remove_padding=True (verl's examples' setting) every micro-batch is one packed row and verl's varlen attention ran
on whole micro-batches (test-only CPU stand-in for flash_attn_varlen_func); the padded engine
(use_remove_padding=False) gives the same pi(EOS) and oracle match; (5) flag off (verl's own ``low_var_kl``):
compute_log_prob's outputs and the update are bit-identical to verl unpatched.

Families: Qwen2.5-VL (packed: the three presets; padded: `sequence`) and Qwen2-VL (packed, `sequence`); verl routes
both through the same patched forward and attention (verl.models.transformers.qwen2_vl). Not run: GLM-4.1V, whose
verl 0.9.1 forward (verl.models.transformers.glm4v._get_input_embeds) takes `.shape` of the vision tower's output,
a BaseModelOutputWithPooling under transformers 5.x (AttributeError with or without kl-adapters).
"""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kl_adapters

HERE = Path(__file__).resolve().parent
#: vlm_cases.py's runs (FAMILY:LAYOUT:PRESETS), in one process; flag off on the last
RUNS = ("qwen2_5_vl:padded:sequence", "qwen2_5_vl:packed:sequence,sequence-plain,token", "qwen2_vl:packed:sequence")
CASES = [(f"{family}/{layout}", preset) for family, layout, presets in (run.split(":") for run in RUNS)
         for preset in presets.split(",")]
#: engine_check's micro-batch size (rows)
MICRO = 4

pytestmark = pytest.mark.skipif(
    importlib.metadata.version("verl") in ("0.8.0", "0.9.0") and not importlib.util.find_spec("flash_attn"),
    reason="verl < 0.9.1 unpads batches with flash_attn.bert_padding (CUDA only), so its engine cannot run on CPU")


@pytest.fixture(scope="module")
def result() -> dict:
    """vlm_cases.py's RESULT, run with this process's kl_adapters (checkout or installed) on the subprocess's path."""
    root = str(Path(kl_adapters.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k != "KL_ADAPTERS"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [env.get("PYTHONPATH"), root])), KL_ADAPTERS_VLM_TEST_ROOT=root,
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, str(HERE / "vlm_cases.py"), *RUNS], cwd=HERE, env=env, capture_output=True,
                         text=True, timeout=480)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))[6:])


@pytest.mark.parametrize("run, preset", CASES, ids=[f"{run.replace('/', '-')}-{preset}" for run, preset in CASES])
def test_update_matches_the_oracle(result, run, preset):
    """(1) and (2): pi(EOS) of compute_log_prob's and the training forward = the separate forward's; the flagged update
    = the oracle's."""
    r = result[run]["presets"][preset]
    assert r["kl_vs_task"] > 0.05  # the KL term is a sizeable part of the update: the comparison is not vacuous
    assert r["kl_rel_error"] < 1e-4
    assert r["grad_norms"][0] == pytest.approx(r["grad_norms"][1], rel=1e-5)
    assert {"actor/pg_loss", "kl_loss", "kl_coef", "grad_norm", "kl_adapters/seq_kl", "kl_adapters/grad_weight_gap",
            "kl_adapters/is_ess"} <= set(r["metric_keys"])
    if preset == "sequence":  # the reduced preset reads pi(EOS): the kept rows and model_output's
        assert r["kept_eos_error"] is not None and r["kept_eos_error"] < 1e-5
        assert r["training_eos_error"] is not None and r["training_eos_error"] < 1e-5
        assert r["eos_effect"] > 1e-3
    else:  # the unreduced ones read none: nothing kept, nothing added to model_output
        assert r["kept_eos_error"] is None and r["training_eos_error"] is None


def test_images_reach_the_model_and_change_pi_eos(result):
    """(3): each training forward's pixel_values are its micro-batch's rows' patches (rows 0-3, then 4-7; row 3 has
    none); two rows with the same tokens and different images get different pi(EOS), which the kept rows' 1e-5 match
    of test_update_matches_the_oracle then tells apart."""
    patches = result["image_rows"]
    assert patches[3] == 0 and all(n > 0 for i, n in enumerate(patches) if i != 3)
    per_micro_batch = [sum(patches[i:i + MICRO]) for i in range(0, len(patches), MICRO)]
    for family, layout, _ in (run.split(":") for run in RUNS):
        seen = result[f"{family}/{layout}"]["pixel_rows"]
        assert seen and seen == per_micro_batch * (len(seen) // len(per_micro_batch)), (family, layout, seen)
    for family, gap in result["twin_gap"].items():
        assert gap > 1e-4, family


def test_remove_padding_packs_micro_batches_through_varlen_attention(result):
    """(4): packed, every model input is one row and the attention stand-in (behind verl's qwen2_vl_attn_forward) saw
    whole micro-batches: each forward's calls cover the batch's tokens once per layer; padded, rows of MICRO and no
    varlen attention."""
    tokens, layers = result["tokens"], 2
    for family, layout, _ in (run.split(":") for run in RUNS):
        run = result[f"{family}/{layout}"]
        if layout == "padded":
            assert set(run["model_input_rows"]) == {MICRO} and run["attention_calls"] == []
            continue
        assert set(run["model_input_rows"]) == {1}
        calls = run["attention_calls"]
        forwards = len(calls) // (2 * layers)  # two micro-batches per forward
        assert forwards > 0 and sum(calls) == forwards * layers * tokens, (family, calls)


def test_flag_off_is_verl_unpatched(result):
    """(5): with verl's own kl_loss_type, compute_log_prob's outputs and one update are bit-identical to verl
    unpatched (the last run's engine: Qwen2-VL, packed)."""
    assert result[f"{RUNS[-1].split(':')[0]}/{RUNS[-1].split(':')[1]}"]["flag_off_equal"] is True
