"""The support matrix (issue 49): for each framework and each setting users combine with it, what kl-adapters does
there, read from the adapters' code and the tests -- the one place that says it.

Statuses (`STATUSES`):
    tested               a test runs kl-adapters' code path with the setting on (`Entry.test`, ``tests/...::name``)
    accepted, untested   nothing refuses it and no test runs it: the note says what happens and why there is no test
    refused              the run stops before training with one line naming the setting (KL_ADAPTERS_ALLOW_UNTESTED=1
                         turns the refusal into a warning); `Entry.test` pins the refusal
    not applicable       the framework has no such setting on the path kl-adapters patches

Read by: docs/support.md (`render`, ``python -m kl_adapters.support > docs/support.md``), `kl-adapters doctor` (each
reader reports the verdict of every setting a configuration turns on: `doctor_lines`), bench/coverage.py (the test of
each tested setting) and tests/core/test_support.py (every named test exists, the page is `render()`'s, and no other
page states a support that contradicts this). Imports nothing beyond the standard library.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

TESTED, ACCEPTED, REFUSED, NOT_APPLICABLE = "tested", "accepted, untested", "refused", "not applicable"
STATUSES = (TESTED, ACCEPTED, REFUSED, NOT_APPLICABLE)
FRAMEWORKS = {"trl": "TRL", "verl": "verl", "openrlhf": "OpenRLHF"}
PAGE = "docs/support.md"


@dataclass(frozen=True)
class Entry:
    """One framework's support of one setting: its status, what happens, and the test (required for tested and
    refused, none otherwise)."""

    status: str
    note: str
    test: str | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if (self.test is not None) != (self.status in (TESTED, REFUSED)):
            raise ValueError(f"a {self.status!r} entry {'needs' if self.test is None else 'names no'} test")


#: setting key -> its name, in the matrix's order
SETTINGS = {
    "lora": "LoRA",
    "vllm": "vLLM rollouts",
    "packing": "packed samples / remove-padding",
    "sequence-parallel": "sequence parallelism (Ulysses, ring attention, context parallelism)",
    "tensor-parallel": "tensor parallelism",
    "sharding": "DeepSpeed ZeRO / FSDP",
    "megatron": "Megatron",
    "data-parallel": "multi-node / data parallel",
    "vision-language": "vision-language models of a tested family (Qwen2-VL, Qwen2.5-VL; OpenRLHF also Qwen3.5)",
    "vision-language-other": "other vision-language models (GLM-4.1V, MiniCPM-o, Gemma 3, ...)",
    "liger": "Liger kernels",
    "dynamic-batch": "dynamic batch size",
    "off-policy": "off-policy (several updates per rollout)",
    "async": "asynchronous rollouts (lag)",
}

_VERL_ENGINE = "tests/verl/test_coverage_engine.py::test_remove_padding_dynamic_batch_size_and_lora_match_the_oracle"

MATRIX: dict[tuple[str, str], Entry] = {
    # TRL: GRPOTrainer (RLOOTrainer is left as it is)
    ("trl", "lora"): Entry(
        TESTED, "a PEFT LoRA policy; the reference is TRL's adapter-disabled base (`full` too; on a GPU: "
        "tests/trl/test_gpu.py::test_lora_on_cuda)",
        "tests/trl/test_grpo_gradients.py::test_lora_reference_is_adapter_disabled_base"),
    ("trl", "vllm"): Entry(
        TESTED, "vLLM's sampling log-probs are the behaviour policy of the KL's importance weights (tokens vLLM could "
        "not score fall back to the trainer's old log-probs); TRL's truncated ratio still weights the task loss. The "
        "test gives TRL's batch those log-probs: vLLM itself needs a GPU",
        "tests/trl/test_grpo_gradients.py::test_vllm_importance_sampling_correction"),
    ("trl", "packing"): Entry(
        NOT_APPLICABLE, "GRPOTrainer pads its completions; it has no packing or padding-free option (TRL's "
        "padding_free is the SFT collator's)"),
    ("trl", "sequence-parallel"): Entry(
        NOT_APPLICABLE, "GRPOConfig itself refuses a parallelism_config with cp_size or sp_size > 1 "
        "(trl/trainer/grpo_config.py)"),
    ("trl", "tensor-parallel"): Entry(
        ACCEPTED, "nothing refuses accelerate's parallelism_config with tp_size > 1; not run. It makes the weights "
        "DTensors, which the reduced presets' pi(EOS) read gathers whole as under FSDP2 (the DeepSpeed ZeRO / FSDP "
        "row)"),
    ("trl", "sharding"): Entry(
        ACCEPTED, "DeepSpeed or FSDP (TrainingArguments `deepspeed` / `fsdp`, or accelerate's config): the KL term reads "
        "TRL's log-probs and reference log-probs, which sharding does not change; the reduced presets' pi(EOS) read "
        "takes lm_head.weight during the policy's forward and gathers it as TRL's fused head does (FSDP2's DTensor "
        "with `full_tensor()`, ZeRO-3's partitioned weight in TRL's `maybe_gather_lm_head_ctx`). Tested on CPU: "
        "FSDP2 `fully_shard` over two gloo ranks (tests/trl/test_sharded_eos.py::"
        "test_fsdp2_sharded_head_gives_the_unsharded_gap), ZeRO-3 with a test stub of DeepSpeed's partitioning "
        "(DeepSpeed is not installed: "
        "tests/trl/test_sharded_eos.py::test_zero3_partitioned_head_is_gathered); `full` (a gradient through "
        "lm_head.weight after the forward) is refused under ZeRO-3 and FSDP at the trainer's construction "
        "(tests/trl/test_sharded_eos.py::test_full_is_refused_under_sharding) and by the doctor "
        "(tests/trl/test_doctor.py::test_full_under_sharding_is_refused). Untested as a whole: no test runs "
        "TRL's trainer under DeepSpeed or FSDP (the data-parallel test runs DDP)"),
    ("trl", "megatron"): Entry(NOT_APPLICABLE, "TRL has no Megatron engine"),
    ("trl", "data-parallel"): Entry(
        TESTED, "processes under accelerate (DDP; gloo on CPU): the loss-time statistics are fitted on every "
        "process's rows, as by one process holding them all; multi-node is the same accelerate launch",
        "tests/trl/test_data_parallel.py::test_world_size_2_gradient_is_world_size_1"),
    ("trl", "vision-language"): Entry(
        TESTED, "a vision-language model (a tiny Qwen2-VL with images of two sizes): TRL passes pixel_values and "
        "image_grid_thw to every forward, the reduced presets' pi(EOS) read inside the policy's forward and TRL's "
        "chunked rollout forward sees them, and the gradient is TRL's task gradient plus grad kl_surrogate for "
        "sequence, sequence-plain and token; flag off bit-identical; `full` refuses multimodal inputs in one line "
        "(the tests' processor is Qwen2VLProcessor without its video slot: torchvision does not install beside a CPU "
        "torch)",
        "tests/trl/test_vision_language.py::test_gradient_is_task_plus_kl_surrogate"),
    ("trl", "vision-language-other"): Entry(
        ACCEPTED, "a vision-language model of another family: GRPOTrainer passes its processor's inputs to every "
        "forward as for Qwen2-VL, but no test runs one (the tests' vision-language model is a Qwen2-VL)"),
    ("trl", "liger"): Entry(
        TESTED, "use_liger_kernel=True: transformers' Trainer swaps the layer kernels (trl >= 1.15 with Liger's fused "
        "cross-entropy off) and trl 1.14.x computes the log-probs with its own chunked torch path; the loss is still "
        "TRL's _compute_loss through the adapter (no tested release has a fused Liger GRPO loss; a loss that skipped "
        "TRL's log-prob method would stop the step in one line naming the release). On CPU the layer-kernel step is "
        "a named test stub (Liger needs Triton on a GPU); with real kernels: "
        "tests/trl/test_gpu.py::test_liger_kernels_on_cuda (skipped without CUDA and liger-kernel, not run yet)",
        "tests/trl/test_liger.py::test_one_step_goes_through_trls_loss"),
    ("trl", "dynamic-batch"): Entry(NOT_APPLICABLE, "GRPOTrainer's batches have a fixed number of sequences"),
    ("trl", "off-policy"): Entry(
        TESTED, "num_iterations > 1, or steps_per_generation not dividing gradient_accumulation_steps: the "
        "rollout-time old log-probs are the behaviour policy (a real GRPOTrainer.train() with num_iterations=2: "
        "tests/trl/test_grpo_training.py)",
        "tests/trl/test_grpo_gradients.py::test_off_policy_gradient_uses_rollout_logps"),
    ("trl", "async"): Entry(
        NOT_APPLICABLE, "trl.experimental's AsyncGRPOTrainer has no KL term to a reference; GRPOTrainer's own lag "
        "(steps_per_generation) is the off-policy row"),
    # verl: the FSDP engines' ppo_loss, the reward path's advantage step
    ("verl", "lora"): Entry(
        TESTED, "lora_rank > 0 or lora_adapter_path: the reference pass through the actor (no_lora_adapter) is the "
        "base model", _VERL_ENGINE),
    ("verl", "vllm"): Entry(
        ACCEPTED, "the rollout engine (vLLM, SGLang) only generates: the actor recomputes old_log_probs "
        "(compute_log_prob, which the FSDP engine tests run) unless the rollout correction's bypass mode reuses the "
        "rollout's (then without the termination control variate); rollout importance weights weight the KL term as "
        "they weight the policy loss "
        "(tests/verl/test_loss_path.py::test_sequence_level_rollout_is_weights_reweight_each_sequence). No test "
        "generates with vLLM (it needs a GPU)"),
    ("verl", "packing"): Entry(
        TESTED, "use_remove_padding=True (verl's default): every micro-batch packed into one row; pi(EOS) of the "
        "packed forwards equals a padded forward's", _VERL_ENGINE),
    ("verl", "sequence-parallel"): Entry(
        TESTED, "ulysses_sequence_parallel_size > 1 (with use_remove_padding, which verl requires for it): each "
        "rank's forward makes the logits of its shard of the packed micro-batch; verl gathers the log-probs back "
        "(gather_outputs_and_unpad) before ppo_loss, and the adapter gathers pi(EOS) with the same call, so every "
        "preset's KL term sees whole sequences. The test runs verl's Ulysses over two gloo ranks on CPU with a "
        "test-only stand-in for flash-attention's varlen forward between verl's all-to-alls",
        "tests/verl/test_sequence_parallel.py::test_ulysses_gradient_is_world_size_1"),
    ("verl", "tensor-parallel"): Entry(
        NOT_APPLICABLE, "the FSDP engines have none; Megatron's is the Megatron row; the rollout's tensor parallelism "
        "only generates"),
    ("verl", "sharding"): Entry(
        TESTED, "the FSDP engine (strategy fsdp2 on CPU, gloo; parameters sharded over two ranks in "
        "tests/verl/test_data_parallel.py); the default fsdp shares its forward, outputs and ppo_loss "
        "(FSDPEngineWithLMHead; FSDP1 syncs module states on a GPU); on an H200: "
        "tests/verl/test_gpu.py::test_fsdp_actor_update_on_gpu",
        "tests/verl/test_engine.py::test_fsdp2_engine_on_cpu_matches_the_oracle"),
    ("verl", "megatron"): Entry(
        ACCEPTED, "actor strategy megatron: the KL term goes through the same ppo_loss, and the reduced presets get "
        "pi(EOS) from the engine's vocab-parallel LM-head logits (termination control variate); on CPU through "
        "verl's TrainingWorker and Megatron engine at tensor parallel size 2, packed and padded, with test-only "
        "stand-ins for CUDA and the attention kernel, the update equals the oracle's "
        "(tests/verl/test_megatron.py::test_engine_update_matches_the_oracle); no GPU run yet "
        "(tests/verl/test_gpu.py::test_megatron_actor_update_on_gpu), Transformer Engine attention, the distributed "
        "optimizer and pipeline / context parallelism untested; the doctor warns "
        "(tests/verl/test_coverage_engine.py::test_doctor_warns_that_megatron_is_untested)"),
    ("verl", "data-parallel"): Entry(
        TESTED, "ranks of the FSDP engine: the statistics fitted once per update on every rank's rows (gathered over "
        "ppo_loss's dp_group); multi-node: the verl.plugins entry point and the job's runtime_env reach every worker "
        "on every node (one node's Ray cluster: tests/verl/test_ray.py::test_ray_workers_run_the_patched_loss)",
        "tests/verl/test_data_parallel.py::test_world_size_2_gradient_is_world_size_1"),
    ("verl", "vision-language"): Entry(
        TESTED, "Qwen2.5-VL and Qwen2-VL with images through verl's FSDP2 engine (verl's own Qwen VL forward, per-row "
        "multi_modal_inputs, 4-row mrope position ids; remove-padding and padded): pi(EOS) equals a separate "
        "transformers forward's (kept rows keyed by their tokens and images), the update equals the oracle's for "
        "sequence, sequence-plain and token, flag off bit-identical (a test-only CPU stand-in for flash-attention's "
        "varlen kernel)",
        "tests/verl/test_vision_language.py::test_update_matches_the_oracle"),
    ("verl", "vision-language-other"): Entry(
        ACCEPTED, "a vision-language model of another family: verl has a forward per family "
        "(verl/models/transformers/), which no test runs; GLM-4.1V fails in verl 0.9.1's own glm4v forward under "
        "transformers 5 (with or without kl-adapters), MiniCPM-o is remote code"),
    ("verl", "liger"): Entry(
        ACCEPTED, "actor_rollout_ref.model.use_liger swaps layer kernels with fused_linear_cross_entropy off, so verl "
        "still makes the logits the adapter reads; not run (Liger needs a GPU)"),
    ("verl", "dynamic-batch"): Entry(
        TESTED, "use_dynamic_bsz=True: micro-batches cut by a token budget", _VERL_ENGINE),
    ("verl", "off-policy"): Entry(
        TESTED, "ppo_epochs > 1 or several mini-batches per rollout: verl's old_log_probs are the behaviour policy",
        "tests/verl/test_loss_path.py::test_gradient_is_task_plus_kl_surrogate"),
    ("verl", "async"): Entry(
        ACCEPTED, "verl's experimental fully-async and one-step-off-policy trainers run the same patched ppo_loss in "
        "the actor, and the reward path's wrappers bind wherever a trainer imports them; no test runs those trainers "
        "(the separation trainer's advantage step: "
        "tests/verl/test_reward_path.py::test_reward_kl_added_after_grpo_normalisation)"),
    # OpenRLHF: train_ppo_ray through the openrlhf_cli launcher or KL_ADAPTERS
    ("openrlhf", "lora"): Entry(
        TESTED, "--ds.lora.rank > 0: the reference is the base checkpoint",
        "tests/openrlhf/test_coverage_lora.py::test_lora_actor_gradient_is_task_plus_kl_surrogate"),
    ("openrlhf", "vllm"): Entry(
        ACCEPTED, "vLLM engines only generate: the actor's log-probs are recomputed by OpenRLHF's own forward "
        "(PolicyModelActor, run in a real local Ray cluster: "
        "tests/openrlhf/test_ray.py::test_flag_activates_real_policy_actor); vLLM is an import stub in the tests; its "
        "importance-sampling correction (--algo.advantage.is_correction_level) weights the policy loss, not the KL, "
        "as in OpenRLHF. No test generates with vLLM (it needs a GPU)"),
    ("openrlhf", "packing"): Entry(
        TESTED, "--ds.packing_samples: pi(EOS) read from the packed forward and padded back with OpenRLHF's unpad "
        "indices; packed rows give the unpacked rows' gradient",
        "tests/openrlhf/test_coverage_packing.py::test_packed_rows_give_the_unpacked_gradient_and_statistics"),
    ("openrlhf", "sequence-parallel"): Entry(
        TESTED, "--ds.ring_attn_size > 1 (ring attention; OpenRLHF packs samples with it): each rank's forward makes "
        "the logits of its slice of the packed micro-batch, OpenRLHF gathers the log-probs back to whole rows "
        "(gather_and_pad_tensor) before the loss, and the adapter gathers pi(EOS) with the same call; two gloo ranks "
        "with a test-only CPU stand-in for ring-flash-attn give world size 1's gradient (real ring-flash-attn / NCCL: "
        "not run)",
        "tests/openrlhf/test_ring_attention.py::test_ring_attention_gradient_is_world_size_1"),
    ("openrlhf", "tensor-parallel"): Entry(
        REFUSED, "--ds.tensor_parallel_size > 1 is refused before Ray starts (it needs several GPUs)",
        "tests/openrlhf/test_cli.py::test_untested_code_path_is_refused"),
    ("openrlhf", "sharding"): Entry(
        ACCEPTED, "OpenRLHF always trains through DeepSpeed (--ds.zero_stage, default 2); the adapter reads log-probs "
        "and logits from OpenRLHF's forward, never a parameter. ZeRO stage 0 ran on an H200 "
        "(tests/openrlhf/test_gpu.py::test_gradient_identity_under_deepspeed_bf16); stages 1-3 are untested: the CPU "
        "suite's strategy shim stands in for DeepSpeed's engine"),
    ("openrlhf", "megatron"): Entry(NOT_APPLICABLE, "OpenRLHF trains with DeepSpeed only"),
    ("openrlhf", "data-parallel"): Entry(
        TESTED, "ranks of one optimizer step (gloo; DeepSpeed's engine replaced by the CPU shim and one gradient "
        "all-reduce); the statistics are fitted once per rollout and travel with their rows; multi-node: the flag "
        "travels in OpenRLHF's pickled args to every actor",
        "tests/openrlhf/test_data_parallel.py::test_world_size_2_gradient_is_world_size_1"),
    ("openrlhf", "vision-language"): Entry(
        TESTED, "a vision-language model (a tiny Qwen2-VL, and a tiny Qwen3.5 with its gated delta-net layers, "
        "the family of OpenRLHF's VLM example; with images): the images ride in Experience.mm_train_inputs "
        "into OpenRLHF's forward, which the reduced presets read pi(EOS) from, and every step's gradient (vision tower "
        "included) is the task's plus grad kl_surrogate (the tests' processor is Qwen2VLProcessor without its video "
        "slot: torchvision does not install beside a CPU torch)",
        "tests/openrlhf/test_coverage_vlm.py::test_vlm_gradient_is_task_plus_kl_surrogate"),
    ("openrlhf", "vision-language-other"): Entry(
        ACCEPTED, "a vision-language model of another family: OpenRLHF's forward takes its processor's inputs as "
        "for Qwen2-VL, but no test runs one (the tests' vision-language models are a Qwen2-VL and a Qwen3.5)"),
    ("openrlhf", "liger"): Entry(
        ACCEPTED, "--ds.use_liger_kernel loads Liger's causal LM; OpenRLHF's forward passes no labels, so the logits "
        "the adapter reads are still made; not run (Liger needs a GPU)"),
    ("openrlhf", "dynamic-batch"): Entry(
        TESTED, "--train.dynamic_batch_enable: the optimizer step's sequence count over micro-batches of unequal size",
        "tests/openrlhf/test_loss_path.py::test_dynamic_batching_gradient"),
    ("openrlhf", "off-policy"): Entry(
        TESTED, "--train.max_epochs > 1 or --train.batch_size below the rollout's samples: the experiences' "
        "action_log_probs are the behaviour policy",
        "tests/openrlhf/test_loss_path.py::test_gradient_is_task_plus_kl_surrogate"),
    ("openrlhf", "async"): Entry(
        ACCEPTED, "--train.async_enable: rollouts from an older policy; the statistics ride with their rows and the "
        "loss weighs them with the rollout's action_log_probs, as off-policy; no test runs it"),
}

#: a vision-language model's name (Qwen*-VL, Qwen3.5, MiniCPM-o, GLM-4.1V, ...): multimodal inputs, another forward
_VISION_LANGUAGE_NAME = re.compile(r"(?i)-vl\b|vl-|minicpm-?o|\d\.?\dv-|llava|vision|gemma-?3|idefics|smolvlm|qwen3\.5")


#: per framework, the vision-language families its tests run (the "vision-language" setting); any other
#: vision-language model is "vision-language-other"
_QWEN2_VL = r"qwen2(?:\.5)?-vl"
_TESTED_FAMILIES = {"trl": re.compile(rf"(?i){_QWEN2_VL}"), "verl": re.compile(rf"(?i){_QWEN2_VL}"),
                    "openrlhf": re.compile(rf"(?i){_QWEN2_VL}|qwen3\.5")}


def vision_language(model_path) -> bool:
    """Whether a configuration's model is a vision-language model, by its name (a path computed at run time, or any
    other value, reads as a text model)."""
    return isinstance(model_path, str) and _VISION_LANGUAGE_NAME.search(model_path) is not None


def vision_language_setting(model_path, framework: str) -> str | None:
    """The matrix's setting a model turns on in a framework, by its name: "vision-language" (a family the
    framework's tests run), "vision-language-other" (another vision-language model) or None (a text model): how the
    doctor and bench/coverage.py recognise it."""
    if not vision_language(model_path):
        return None
    return "vision-language" if _TESTED_FAMILIES[framework].search(model_path) else "vision-language-other"


def vision_language_settings(model_path, framework: str) -> dict[str, bool]:
    """Both vision-language settings, each on or off for this model (`vision_language_setting`): the doctors'."""
    found = vision_language_setting(model_path, framework)
    return {key: found == key for key in ("vision-language", "vision-language-other")}


def entry(framework: str, setting: str) -> Entry:
    """The matrix's entry; KeyError naming the valid frameworks and settings."""
    try:
        return MATRIX[framework, setting]
    except KeyError:
        raise KeyError(f"no support entry for {framework!r}, {setting!r}: frameworks {', '.join(FRAMEWORKS)}, "
                       f"settings {', '.join(SETTINGS)}") from None


def doctor_lines(framework: str, settings: Iterable[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """What `kl-adapters doctor` says of the settings a configuration turns on, in the matrix's order: (notes, one per
    tested setting, naming its test; warnings as (hazard code, message): "untested-path" for an accepted, untested
    setting, "refused-path" for a refused one, saying what happens first, then the setting and its status). Each ends
    with docs/support.md; a setting not applicable says nothing."""
    wanted = set(settings)
    notes, warnings = [], []
    for key in (k for k in SETTINGS if k in wanted):
        e = entry(framework, key)
        where = f"{e.test}; {PAGE}" if e.test else PAGE
        if e.status == TESTED:
            notes.append(f"{SETTINGS[key]}: tested ({where})")
        elif e.status != NOT_APPLICABLE:
            code = "untested-path" if e.status == ACCEPTED else "refused-path"
            warnings.append((code, f"{e.note} -- {SETTINGS[key]}: {e.status} ({where})"))
    return notes, warnings


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """docs/support.md: the overview table, then per framework each setting's status, what happens and its test."""
    names = " | ".join(FRAMEWORKS.values())
    out = [
        "# Support matrix",
        "",
        "What kl-adapters does with each setting users combine with it, per framework, read from the adapters' code "
        "and the tests. The data is `kl_adapters/support.py` (`MATRIX`); this page is its `render()` (`python -m "
        "kl_adapters.support > docs/support.md`), and `tests/core/test_support.py` checks that the page is the "
        "module's, that every test it names exists and that no other page states a support that contradicts it. "
        "`kl-adapters doctor` prints the verdict of every setting a configuration turns on ([doctor](doctor.md)); "
        "`bench/coverage.py` reads the tests of the tested ones ([coverage](coverage.md)). Releases: "
        "[versions](versions.md).",
        "",
        "* **tested**: a test runs kl-adapters' code path with the setting on (named below);",
        "* **accepted, untested**: nothing refuses it and no test runs it (what happens, and why there is no test);",
        "* **refused**: the run stops before training with one line naming the setting (`KL_ADAPTERS_ALLOW_UNTESTED=1` "
        "turns the refusal into a warning, at your own risk); the test pins the refusal;",
        "* **not applicable**: the framework has no such setting on the path kl-adapters patches.",
        "",
        f"| setting | {names} |",
        "|---|" + "---|" * len(FRAMEWORKS),
    ]
    for key, name in SETTINGS.items():
        out.append(f"| {name} | " + " | ".join(entry(fw, key).status for fw in FRAMEWORKS) + " |")
    for fw, fw_name in FRAMEWORKS.items():
        out += ["", f"## {fw_name}", "", "| setting | status | what happens | test |", "|---|---|---|---|"]
        for key, name in SETTINGS.items():
            e = entry(fw, key)
            test = f"`{e.test}`" if e.test else ""
            out.append(f"| {name} | {e.status} | {_cell(e.note)} | {test} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
