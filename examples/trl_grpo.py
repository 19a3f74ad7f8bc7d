"""GRPO with TRL and an exact-gradient KL term: the one change is KLGRPOConfig(kl_preset=...).

Runs offline on CPU in about 10 s (20 steps) with a tiny random model (built locally):
    .venvs/trl/bin/python examples/trl_grpo.py [--preset sequence|reward|off] [--steps 20] [--num-iterations 2]
With a real model, pass --model <hub id or path>; everything else is plain TRL. Zero-code alternative for any TRL
script (including `trl grpo`): run it with KL_ADAPTERS=sequence in the environment.
"""

import argparse
import tempfile

from datasets import Dataset
from trl import GRPOTrainer

from kl_adapters.adapters.trl import KLGRPOConfig  # a GRPOConfig with the kl_preset / kl_is_clip fields


def reward_a(completions, **kwargs):
    """Toy task: write many 'a' characters."""
    return [c.count("a") / max(len(c), 1) for c in completions]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="model id or path (default: a tiny random Llama built locally)")
    p.add_argument("--preset", default="sequence", help="kl-adapters preset, or 'off' for TRL's own KL term")
    p.add_argument("--beta", type=float, default=0.04, help="TRL's beta: same strength relative to the policy loss")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--num-iterations", type=int, default=2, help="> 1: later minibatches are off-policy")
    a = p.parse_args()
    model = a.model
    if model is None:
        from kl_adapters.tiny_models import save_tiny_model

        model = str(save_tiny_model(tempfile.mkdtemp(prefix="tiny_llama_")))
    args = KLGRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo_"), kl_preset=a.preset, beta=a.beta, loss_type="dapo",
        num_iterations=a.num_iterations, per_device_train_batch_size=8, num_generations=8, max_completion_length=16,
        learning_rate=1e-3, max_steps=a.steps, logging_steps=5, report_to="none", save_strategy="no", seed=0,
        use_cpu=a.model is None, bf16=False,
    )
    dataset = Dataset.from_dict({"prompt": [f"q{i}: say a" for i in range(256)]})
    trainer = GRPOTrainer(model=model, reward_funcs=reward_a, args=args, train_dataset=dataset)
    trainer.train()
    for record in trainer.state.log_history:
        if "reward" in record:
            print({k: round(record[k], 5) for k in ("step", "reward", "kl", "kl_adapters/seq_kl",
                                                     "kl_adapters/grad_weight_gap") if k in record})


if __name__ == "__main__":
    main()
