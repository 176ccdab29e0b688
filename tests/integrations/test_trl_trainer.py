"""``DTAGRPOTrainer`` against TRL's own ``GRPOTrainer``: the same generated batch, one optimizer step, the same
gradient per parameter (float64); the refusals at construction. Skipped without TRL (``pip install -e ".[trl]"``).

Both trainers load the same tiny GPT-2 (float64; its layer norms compute in float64) with the same seed, so they
generate the same completions and TRL computes the same advantages and log-probs for both. TRL's own log-prob
kernel (its fused LM head) accumulates in float32, so for the float64 comparison both trainers' TRL-side log-probs
(old, reference, and the stock trainer's loss) come from an exact float64 forward of the same model; a second test
compares with TRL's kernel untouched, to float32 accuracy. Prompts are of one length: TRL left-pads prompts and a
model with absolute positions (GPT-2) then sees shifted positions, which a tree (true positions) does not.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install -e '.[trl]'")

from transformers import TrainerCallback  # noqa: E402

import lightning_dta as dta  # noqa: E402
from lightning_dta.integrations.trl import DTAGRPOTrainer  # noqa: E402
from tests.parity.harness import save_model_dir, tiny_model  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPTS = ["t5 t6 t7", "t8 t9 t10", "t11 t5 t12", "t13 t14 t6"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_model_dir(str(tmp_path_factory.mktemp("trl") / "tiny-gpt2"), tiny_model())


def reward_t9(completions, **_):
    """More of token t9 is better: a reward the batch spreads over."""
    return [c.split().count("t9") / max(len(c.split()), 1) + 0.1 * len(c.split()) for c in completions]


def exact_logps(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                **_):
    """TRL's _get_per_token_logps_and_entropies without its float32 kernel: the model's own forward, float64."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1:-1]
    log_probs = torch.log_softmax(logits / trainer.temperature, dim=-1)
    logps = log_probs.gather(-1, input_ids[:, -logits_to_keep:, None])[..., 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1) if compute_entropy else None
    return logps, entropy, None


class Grads(TrainerCallback):
    """The summed gradient at the optimizer step (max_grad_norm=0: no clipping)."""

    def __init__(self, trainer) -> None:
        self.trainer, self.grads = trainer, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def run(cls, model_dir, tmp_path, exact: bool = True, steps: int = 1, **settings):
    from datasets import Dataset
    from transformers import AutoTokenizer

    config = trl.GRPOConfig(**{
        "output_dir": str(tmp_path / cls.__name__), "per_device_train_batch_size": 4, "num_generations": 4,
        "max_completion_length": 6, "use_cpu": True, "report_to": [], "bf16": False, "fp16": False,
        "logging_steps": 1, "max_steps": steps, "max_grad_norm": 0.0, "gradient_checkpointing": False,
        "learning_rate": 1e-2, "seed": 7, "model_init_kwargs": {"dtype": torch.float64},
        "save_strategy": "no", **settings})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=model_dir, reward_funcs=reward_t9, args=config,
                      train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
                      processing_class=AutoTokenizer.from_pretrained(model_dir))
    if exact:
        trainer._get_per_token_logps_and_entropies = lambda *a, **k: exact_logps(trainer, *a, **k)
    grads = Grads(trainer)
    trainer.add_callback(grads)
    trainer.train()
    return trainer, grads.grads


SETTINGS = {
    "dapo": {},
    "grpo, 2 micro-batches, KL": dict(loss_type="grpo", gradient_accumulation_steps=2, beta=0.05),
    "dr_grpo, 2 iterations": dict(loss_type="dr_grpo", num_iterations=2, gradient_accumulation_steps=2),
    "gspo, temperature": dict(importance_sampling_level="sequence", epsilon=0.05, temperature=0.8),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_one_step_gradient_equals_grpo_trainers(name, model_dir, tmp_path):
    steps = 2 if "iterations" in name else 1  # the second optimizer step reuses the batch against old log-probs
    _, theirs = run(trl.GRPOTrainer, model_dir, tmp_path, steps=steps, **SETTINGS[name])
    ours_trainer, ours = run(DTAGRPOTrainer, model_dir, tmp_path, steps=steps, **SETTINGS[name])
    assert len(ours) == len(theirs) == steps
    for step, (mine, expected) in enumerate(zip(ours, theirs)):
        assert set(mine) == set(expected)
        for param, grad in expected.items():
            error = float((mine[param] - grad).norm()) / max(float(grad.norm()), 1e-30)
            assert error < 1e-9, f"step {step} {param}: relative gradient error {error:.2e}"
    assert ours_trainer.dta_last_step.metrics["compression_ratio"] > 1.0  # the group's prompt is shared


def test_against_trls_own_kernel(model_dir, tmp_path):
    """With TRL's fused LM head untouched (float32 accumulators) in both, the gradients agree to float32."""
    _, theirs = run(trl.GRPOTrainer, model_dir, tmp_path, exact=False, beta=0.05)
    _, ours = run(DTAGRPOTrainer, model_dir, tmp_path, exact=False, beta=0.05)
    for param, grad in theirs[0].items():
        error = float((ours[0][param] - grad).norm()) / max(float(grad.norm()), 1e-30)
        assert error < 1e-5, f"{param}: relative gradient error {error:.2e}"


def test_rollouts_from_trls_inputs():
    """Left-padded prompts lose their padding, completions end at their mask, a masked-out completion trains
    nothing, tool tokens are not trained, TRL's tensors land in the converted fields."""
    trainer = DTAGRPOTrainer.__new__(DTAGRPOTrainer)
    trainer.dta_loss = dta.PolicyLoss.from_trl({"beta": 0.1})
    inputs = {"prompt_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]), "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
              "completion_ids": torch.tensor([[10, 11, 12, 0], [13, 14, 15, 16]]),
              "completion_mask": torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]]),
              "tool_mask": torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]),
              "advantages": torch.tensor([0.5, -1.0]),
              "ref_per_token_logps": torch.tensor([[-1.0, -2.0, -3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])}
    first, second = trainer.rollouts(inputs)
    assert first.input_ids == [5, 6, 10, 11, 12] and first.loss_mask == [0, 0, 1, 0, 1]
    assert first.ref_logprobs == [0.0, 0.0, -1.0, -2.0, -3.0] and first.advantages == 0.5
    assert second.input_ids == [7, 8, 9] and sum(second.loss_mask) == 0  # counted in grpo's mean over rows
    with pytest.raises(ValueError, match="multimodal"):
        trainer.rollouts({**inputs, "pixel_values": torch.zeros(1)})


@pytest.mark.parametrize("settings, match", [
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
    (dict(loss_type="sapo"), "loss_type"),
    (dict(use_liger_kernel=True), "use_liger_kernel"),
    (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
    (dict(loss_type="bnpo", gradient_accumulation_steps=2), "loss_type"),
])
def test_unsupported_settings_are_refused_at_construction(settings, match, model_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer

    config = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            use_cpu=True, report_to=[], bf16=False, gradient_checkpointing=False, **settings)
    with pytest.raises(ValueError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DTAGRPOTrainer(model=model_dir, reward_funcs=reward_t9, args=config,
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                       processing_class=AutoTokenizer.from_pretrained(model_dir))


def test_gradient_checkpointing_becomes_recompute(model_dir, tmp_path, monkeypatch):
    import logging

    from datasets import Dataset
    from transformers import AutoTokenizer

    from lightning_dta.integrations import trl as integration

    # A handler on our logger itself, not pytest's caplog on the root: AReaL's logging setup (imported by
    # tests/parity in the same session) reconfigures the root's handlers and disables loggers made before it.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    monkeypatch.setattr(integration.LOG, "disabled", False)
    level = integration.LOG.level
    integration.LOG.setLevel(logging.INFO)  # setLevel, not the attribute: it clears the loggers' cached levels
    integration.LOG.addHandler(handler)
    config = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            use_cpu=True, report_to=[], bf16=False)  # TRL's default: gradient_checkpointing=True
    try:
        trainer = DTAGRPOTrainer(model=model_dir, reward_funcs=reward_t9, args=config,
                                 train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                 processing_class=AutoTokenizer.from_pretrained(model_dir))
    finally:
        integration.LOG.removeHandler(handler)
        integration.LOG.setLevel(level)
    assert any("recomputes" in record.getMessage() for record in records), records
    assert trainer.dta_engine.activation == "recompute" and not trainer.args.gradient_checkpointing


@pytest.mark.long
def test_a_short_run_learns(model_dir, tmp_path):
    """The toy task (more t9 tokens is better) with DTAGRPOTrainer: the mean reward of the last 5 of 30 steps
    beats the first 5 on every seed (margins measured: see BENCHMARKS.md)."""
    margins = []
    for seed in (1, 2, 3):
        trainer, _ = run(DTAGRPOTrainer, model_dir, tmp_path / str(seed), exact=False, steps=30, seed=seed,
                         learning_rate=3e-2, per_device_train_batch_size=16, num_generations=8)
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        assert len(rewards) == 30
        margins.append(sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5)
        print(f"seed {seed}: first 5 {sum(rewards[:5]) / 5:.3f}, last 5 {sum(rewards[-5:]) / 5:.3f}")
    assert min(margins) > 0.1, margins
