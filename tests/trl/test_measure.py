"""`kl-adapters measure` in TRL's environment (issue 44): a PEFT adapter policy measured against its base (the adapter
switched off, the LoRA weights the measured parameters), a configuration read from TRL's own arguments through the
doctor's reader, prompts from a saved `datasets` folder with a chat template, and the same on a GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from measure_checks import launch_measurement, run, tiny_inputs  # noqa: E402


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("measure"))


@pytest.fixture(scope="module")
def adapter(inputs):
    """A LoRA adapter on the reference with random B (so it moves the policy), saved beside it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(inputs / "reference")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    model.save_pretrained(inputs / "adapter")
    return inputs / "adapter", sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def test_an_adapter_is_measured_against_its_base(adapter, inputs, capsys):
    folder, lora = adapter
    code, out, err = run(capsys, "--policy", folder, "--prompts", inputs / "prompts.jsonl", "-G", 3,
                         "--max-new-tokens", 8, "--folds", 3, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["context"]["reference"] == "the adapter's base" and doc["context"]["parameters"] == lora
    assert doc["measurement"]["exact_norm"]["estimate"] is not None


def test_a_configuration_read_from_trl_arguments(inputs, capsys):
    doc = launch_measurement(capsys, inputs, "trl", "--beta", "0.04", "--loss_type", "dapo")
    judged = doc["context"]["judged"]
    assert [c["preset"] for c in judged] == ["token"] and judged[0]["name"] == "trl loss"
    assert doc["context"]["beta"] == 0.04


def test_prompts_from_a_datasets_folder_through_a_chat_template(inputs, capsys, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer

    Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i}+1="}] for i in range(6)]}).save_to_disk(
        tmp_path / "prompts")
    tok = AutoTokenizer.from_pretrained(inputs / "policy")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    policy = tmp_path / "policy"
    tok.save_pretrained(policy)
    for f in (inputs / "policy").iterdir():
        if not (policy / f.name).exists():
            (policy / f.name).symlink_to(f)
    code, out, err = run(capsys, "--policy", policy, "--reference", inputs / "reference", "--prompts",
                         tmp_path / "prompts", "-G", 2, "--max-new-tokens", 6, "--folds", 3, "--json")
    assert code == 0, err
    assert json.loads(out)["context"]["num_prompts"] == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_a_gpu(inputs, capsys, dtype):
    code, out, err = run(capsys, "--policy", inputs / "policy", "--reference", inputs / "reference", "--prompts",
                         inputs / "prompts.jsonl", "-G", 4, "--max-new-tokens", 12, "--folds", 4, "--device", "cuda",
                         "--dtype", dtype, "--reward", f"{inputs / 'reward.py'}:reward", "--beta", "0.1", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["context"]["device"] == "cuda" and doc["measurement"]["rows"][0]["trained"] is not None
