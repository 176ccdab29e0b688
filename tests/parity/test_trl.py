"""``PolicyLoss.from_trl(config)`` against TRL 1.16.0's own loss (``GRPOTrainer._compute_loss``), float64.

For each setting the same ``GRPOConfig`` goes to ``from_trl`` and to a ``GRPOTrainer``; TRL's ``_compute_loss``
then runs on the padded batch with its log-probs and entropies taken from our model (its
``_get_per_token_logps_and_entropies`` replaced: TRL's own kernel accumulates in float32), and our tree walk runs
the converted loss over the batch's prefix tree. Loss and every parameter's gradient must agree to 1e-9. Skipped
without TRL (``pip install -e ".[trl]"``, or ``bash scripts/install_parity.sh``).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install -e '.[trl]' (tests/parity compare "
                                        "with it)")

import lightning_dta as dta  # noqa: E402
from tests.parity.harness import (  # noqa: E402
    THEIR_NAMES,
    assert_same,
    grads,
    logp_and_entropy,
    make_batch,
    rollouts,
    save_model_dir,
    tiny_model,
    tree_step,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VLLM_KEYS = ("use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min")

SETTINGS = {
    "defaults (dapo)": {},
    "grpo": dict(loss_type="grpo"),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=9),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.05),
    "bnpo": dict(loss_type="bnpo", epsilon_high=0.28),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.03, epsilon_high=0.04),
    "cispo": dict(loss_type="cispo", epsilon_high=1.2),
    "delta": dict(epsilon_high=0.28, delta=1.4),
    "beta (bias-corrected KL, the default)": dict(beta=0.05),
    "beta without bias correction": dict(beta=0.05, use_bias_correction_kl=False, loss_type="grpo"),
    "entropy with grpo": dict(loss_type="grpo", entropy_coef=0.02),
    "vllm token_truncate": dict(use_vllm=True, vllm_importance_sampling_mode="token_truncate",
                                vllm_importance_sampling_clip_max=1.2, vllm_importance_sampling_clip_min=0.8),
    "vllm token_mask": dict(use_vllm=True, vllm_importance_sampling_mode="token_mask",
                            vllm_importance_sampling_clip_max=1.2, vllm_importance_sampling_clip_min=0.8,
                            beta=0.02),
    "vllm sequence_mask (the default mode)": dict(use_vllm=True, loss_type="grpo"),
    "vllm sequence_truncate + gspo": dict(use_vllm=True, vllm_importance_sampling_mode="sequence_truncate",
                                          vllm_importance_sampling_clip_max=1.5,
                                          vllm_importance_sampling_clip_min=0.7, importance_sampling_level="sequence",
                                          epsilon=0.05),
    "temperature": dict(temperature=0.7, beta=0.05, entropy_coef=0.01, loss_type="dr_grpo",
                        max_completion_length=8),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny model and a word-level tokenizer on disk: what GRPOTrainer loads (and its reference model)."""
    return save_model_dir(str(tmp_path_factory.mktemp("trl") / "tiny"), tiny_model())


def trainer(model_dir: str, tmp_path, **settings):
    from datasets import Dataset
    from transformers import AutoTokenizer

    config = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                            use_cpu=True, report_to=[], bf16=False, fp16=False, logging_steps=1,
                            model_init_kwargs={"dtype": torch.float64},
                            **{k: v for k, v in settings.items() if k != "use_vllm"})
    tr = trl.GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                         args=config, train_dataset=Dataset.from_dict({"prompt": ["t5 t6"]}),
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by Trainer's loop
    if settings.get("use_vllm"):  # the loss only reads these; vLLM itself is not needed for it
        tr.use_vllm, tr.vllm_importance_sampling_correction = True, True
    return tr, config


def vllm_ratio(batch, config) -> torch.Tensor:
    """TRL's importance_sampling_ratio, computed as _generate_and_score_completions does (grpo_trainer.py
    2659-2705), from the trainer's and the engine's log-probs."""
    diff = torch.nan_to_num((batch.recomputed - batch.behaviour) * batch.mask, nan=0.0)
    mode = config.vllm_importance_sampling_mode
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    low, high = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    invalid = (ratio < (low if low is not None else -math.inf)) | (ratio > (high if high is not None else math.inf))
    return ratio.masked_fill(invalid, 0.0)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_converted_loss_equals_trls_own(name, model_dir, tmp_path):
    settings = SETTINGS[name]
    tr, config = trainer(model_dir, tmp_path, **settings)
    converted = dta.PolicyLoss.from_trl({**config.to_dict(), **{k: v for k, v in settings.items()
                                                                 if k in VLLM_KEYS}})
    model = tiny_model()
    temperature = config.temperature
    batch = make_batch(model, seed=3, temperature=temperature)
    mask = batch.mask
    inputs = {"prompt_ids": torch.ones(batch.rows, 1, dtype=torch.long),
              "prompt_mask": torch.ones(batch.rows, 1, dtype=torch.long),
              "completion_ids": batch.completions, "completion_mask": mask.long(), "advantages": batch.advantages,
              "num_items_in_batch": mask.sum(), "ref_per_token_logps": batch.ref}
    if settings.get("use_vllm"):
        inputs["old_per_token_logps"] = batch.recomputed
        inputs["sampling_per_token_logps"] = batch.behaviour
        inputs["importance_sampling_ratio"] = vllm_ratio(batch, config)
    else:
        inputs["old_per_token_logps"] = batch.recomputed
    model.zero_grad(set_to_none=True)
    logp, entropy = logp_and_entropy(model, batch, temperature)
    tr._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logp, entropy, None)
    loss = tr._compute_loss(tr.model, inputs)
    loss.backward()
    theirs = (float(loss), grads(model))
    assert set(converted.rollout_fields) - {"completion_mask (x tool_mask)"} <= set(THEIR_NAMES)
    ours = tree_step(model, rollouts(batch, converted.rollout_fields), converted)
    assert_same(ours, theirs)


def test_the_settings_change_trls_loss(model_dir, tmp_path):
    """The parity above is not vacuous: on this batch TRL's loss changes with each converted switch."""
    values = {}
    for name in ("defaults (dapo)", "grpo", "beta (bias-corrected KL, the default)", "beta without bias correction"):
        tr, config = trainer(model_dir, tmp_path, **SETTINGS[name])
        converted = dta.PolicyLoss.from_trl(config)
        model = tiny_model()
        values[name] = tree_step(model, rollouts(make_batch(model, seed=3), converted.rollout_fields), converted)[0]
    assert len({round(v, 9) for v in values.values()}) == len(values), values


def test_group_advantages_equal_trls_formula():
    """TRL's advantages (grpo_trainer.py 2762-2787: group mean, trl.trainer.utils.nanstd, eps 1e-4; 'batch': one
    std over the batch) against grpo_advantages with the converted options. To 1e-7: nanstd's Bessel factor
    count / (count - 1) divides two integer tensors, which torch does in float32 (TRL's rewards are float32 too)."""
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 1.0, 1.0, 0.2, 0.9], dtype=torch.float64)
    group = 4
    mean = rewards.view(-1, group).nanmean(1).repeat_interleave(group)
    for scale in ("group", "batch", "none"):
        converted = dta.PolicyLoss.from_trl({"scale_rewards": scale})
        std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group) if scale == "group" else \
            nanstd(rewards).expand_as(rewards)
        expected = rewards - mean if scale == "none" else (rewards - mean) / (std + 1e-4)
        step = [dta.Rollout(input_ids=[1, 2, 3], reward=float(r), group_id=i // group)
                for i, r in enumerate(rewards)]
        ours = dta.core.advantages.estimate_advantages(step, converted.advantage_estimator,
                                                       converted.advantage_options)
        assert [r.advantages for r in ours] == pytest.approx(expected.tolist(), rel=1e-7, abs=1e-12), scale
