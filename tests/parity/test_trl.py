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
    generation_steps,
    grads,
    logp_and_entropy,
    make_batch,
    rollouts,
    save_model_dir,
    sgd_update,
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

    config = trl.GRPOConfig(**{"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "num_generations": 4,
                               "use_cpu": True, "report_to": [], "bf16": False, "fp16": False, "logging_steps": 1,
                               "model_init_kwargs": {"dtype": torch.float64},
                               **{k: v for k, v in settings.items() if k != "use_vllm"}})
    tr = trl.GRPOTrainer(model=model_dir, reward_funcs=reward, args=config,
                         train_dataset=Dataset.from_dict({"prompt": ["t5 t6"]}),
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by Trainer's loop
    if settings.get("use_vllm"):  # the loss only reads these; vLLM itself is not needed for it
        tr.use_vllm, tr.vllm_importance_sampling_correction = True, True
    return tr, config


def reward(completion_ids, **_) -> list[float]:
    """A reward of each completion's tokens, in quarters (exact in TRL's float32)."""
    return [0.25 * (sum(ids) % 5) for ids in completion_ids]


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


GENERATION = {  # one generation batch of 16 completions (4 prompts x 4), gradient_accumulation_steps=2
    "grpo, scale_rewards batch, 4 steps per generation": dict(scale_rewards="batch", steps_per_generation=8,
                                                               per_device_train_batch_size=2),
    "grpo, scale_rewards group, 4 steps per generation": dict(scale_rewards="group", steps_per_generation=8,
                                                               per_device_train_batch_size=2),
    "grpo, scale_rewards batch, num_iterations 2": dict(scale_rewards="batch", steps_per_generation=2,
                                                         per_device_train_batch_size=8, num_iterations=2),
}


def trl_micro_batch(rows: dict, index: list[int], model) -> tuple[dict, tuple]:
    """The rows ``index`` of TRL's generation batch as a micro-batch of its ``_compute_loss`` inputs, with our
    float64 log-probs and entropies of them (TRL's kernel accumulates in float32)."""
    from tests.parity.harness import PaddedBatch

    pick = {k: v[index] for k, v in rows.items() if torch.is_tensor(v) and v.dim() > 0}
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(pick["prompt_ids"], pick["prompt_mask"])]
    mask = pick["completion_mask"].to(torch.float64)
    batch = PaddedBatch(prompts, pick["completion_ids"], [int(n) for n in mask.sum(1)], mask,
                        pick["advantages"].to(torch.float64), mask, mask, mask, [0] * len(index))
    inputs = {**pick, "old_per_token_logps": pick["old_per_token_logps"].to(torch.float64),
              "advantages": pick["advantages"].to(torch.float64), "num_items_in_batch": rows["num_items_in_batch"]}
    return inputs, logp_and_entropy(model, batch)


@pytest.mark.parametrize("name", list(GENERATION))
def test_a_generation_batch_equals_trls_own(name, model_dir, tmp_path):
    """TRL's ``_generate_and_score_completions`` generates, scores and estimates the advantages of one generation
    batch (steps_per_generation micro-batches, gradient_accumulation_steps=2); the converted settings run
    the same completions through our iterable source (estimated over the whole batch, cut into steps). Every
    advantage equals TRL's, and so do the gradients of the first two optimizer steps (TRL's ``_compute_loss`` summed
    over each step's two micro-batches; after the first, one SGD step on both sides, so the second step's ratio
    departs from 1 and the clip binds). TRL shuffles with its own torch.randperm, which the converter does not
    reproduce: TRL's loss runs on the rows of our steps, with TRL's advantages. To 1e-6: TRL's advantages are
    float32 (its rewards, mean and std); measured 6e-8 on the advantages, 4e-8 relative on the gradients."""
    settings = dict(loss_type="grpo", gradient_accumulation_steps=2, max_completion_length=6, **GENERATION[name])
    tr, config = trainer(model_dir, tmp_path, **settings)
    converted = dta.PolicyLoss.from_trl(config.to_dict())
    assert converted.generation["split"] == "shuffled"
    torch.manual_seed(0)
    prompts = [f"t{5 + p} t{9 + p} t{13 + p}" for p in range(4)]
    assert config.generation_batch_size == 16
    rows = tr._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(4)])
    assert rows["old_per_token_logps"] is not None
    mask = rows["completion_mask"]
    ours_in, keys = [], []
    for i in range(16):
        prompt = rows["prompt_ids"][i][rows["prompt_mask"][i].bool()].tolist()
        n = int(mask[i].sum())
        ids = prompt + rows["completion_ids"][i, :n].tolist()
        keys.append((i // 4, tuple(ids)))
        ours_in.append(dta.Rollout(input_ids=ids, loss_mask=[0] * len(prompt) + [1] * n, group_id=i // 4,
                                   reward=reward([rows["completion_ids"][i, :n].tolist()])[0],
                                   old_logprobs=[0.0] * len(prompt) + rows["old_per_token_logps"][i, :n].tolist()))
    steps = generation_steps(ours_in, converted)
    assert len(steps) == converted.generation["steps_per_generation"] * converted.generation["epochs"]
    theirs_by_key: dict = {}
    for i, key in enumerate(keys):
        theirs_by_key.setdefault(key, []).append(i)
    first_pass = steps[:converted.generation["steps_per_generation"]]
    assert sorted(key for step in first_pass for key in ((r.group_id, tuple(r.input_ids)) for r in step)) == \
        sorted(keys)
    ours_adv = {(r.group_id, tuple(r.input_ids)): r.advantages for step in first_pass for r in step}
    gap = max(abs(ours_adv[key] - float(rows["advantages"][i])) for i, key in enumerate(keys))
    assert gap <= 1e-6 * max(float(rows["advantages"].abs().max()), 1.0), gap
    model = tiny_model()
    tr.current_gradient_accumulation_steps = 2
    moved = 0.0
    for k in range(2):
        index = [theirs_by_key[(r.group_id, tuple(r.input_ids))][0] for r in steps[k]]
        model.zero_grad(set_to_none=True)
        total = 0.0
        half = len(index) // 2  # TRL's two micro-batches of the step
        for micro in (index[:half], index[half:]):
            inputs, logps = trl_micro_batch(rows, micro, model)
            tr._get_per_token_logps_and_entropies = lambda *args, _l=logps, **kwargs: (*_l, None)
            loss = tr._compute_loss(tr.model, inputs)
            loss.backward()
            total += float(loss.detach())
            ratio = (logps[0].detach() - inputs["old_per_token_logps"]).exp()[inputs["completion_mask"].bool()]
            moved = max(moved, float((ratio - 1).abs().max()))
        theirs = (total, grads(model))
        # the loss of a whole batch cancels to ~1e-9 (zero-sum advantages): to 1e-6 absolute, as the advantages
        assert_same(tree_step(model, steps[k], converted), theirs, rtol=1e-6, atol=1e-6)
        sgd_update(model, theirs[1], lr=2.0)
    assert moved > 0.2  # in the second step the policy has moved past TRL's clip (epsilon 0.2)
