"""``PolicyLoss.from_verl(actor, algorithm)`` against verl 0.9.1's own code, float64.

For each setting the same configs go to ``from_verl`` and to verl: ``rollout_corr_helper``'s
``compute_rollout_correction_and_rejection_mask`` (the importance weights and the rejected ``response_mask``, as
the trainer computes them before the update), then ``workers.utils.losses.ppo_loss`` (policy loss, entropy and KL,
``agg_loss`` with the trainer's ``global_batch_size`` = every row and the mini-batch's token count) on the padded
batch, with log-probs and entropies from our model; our tree walk runs the converted loss. Loss and every
parameter's gradient agree to 1e-9. The advantages: ``compute_grpo_outcome_advantage`` and
``compute_gae_advantage_return`` (with ``masked_whiten``) against ours. Skipped without verl
(``bash scripts/install_parity.sh``).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl is not installed: bash "
                                 "scripts/install_parity.sh (its --no-deps install is not a pip extra)")

from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import lightning_dta as dta  # noqa: E402
from lightning_dta.core.advantages import advantage_sums, gae_advantages, whiten_advantages  # noqa: E402
from lightning_dta.core.generation import GenerationBatches  # noqa: E402
from tests.parity.harness import (  # noqa: E402
    assert_same,
    grads,
    logp_and_entropy,
    make_batch,
    rollouts,
    rows_of,
    sgd_update,
    subset,
    tiny_model,
    tree_step,
)

CORRECTION = ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold")
SETTINGS = {  # (actor settings, algorithm.rollout_correction settings)
    "defaults (vanilla, dual clip 3, token-mean)": ({}, None),
    "dual clip binding": (dict(clip_ratio_c=1.1), None),
    "seq-mean-token-mean": (dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_high=0.28), None),
    "seq-mean-token-sum": (dict(loss_agg_mode="seq-mean-token-sum"), None),
    "seq-mean-token-sum-norm": (dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=8), None),
    "token-sum": (dict(loss_agg_mode="token-sum"), None),
    "gspo": (dict(policy_loss={"loss_mode": "gspo"}, clip_ratio_low=0.03, clip_ratio_high=0.04,
                  loss_agg_mode="seq-mean-token-mean"), None),
    "cispo": (dict(policy_loss={"loss_mode": "cispo"}, clip_ratio_high=0.28), None),
    "entropy and low_var_kl": (dict(entropy_coeff=0.02, use_kl_loss=True, kl_loss_coef=0.05,
                                    loss_agg_mode="seq-mean-token-mean"), None),
    "k3+": (dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3+"), None),
    "rollout_is token (TIS)": ({}, dict(rollout_is="token", rollout_is_threshold=1.2)),
    "rollout_is token IcePop": (dict(loss_agg_mode="seq-mean-token-sum"),
                                dict(rollout_is="token", rollout_is_threshold="0.8_1.25")),
    "rollout_is sequence (product)": ({}, dict(rollout_is="sequence", rollout_is_threshold=2.0)),
    "gspo x token TIS": (dict(policy_loss={"loss_mode": "gspo"}, clip_ratio_low=0.05, clip_ratio_high=0.05),
                         dict(rollout_is="token", rollout_is_threshold=1.2)),
    "rollout_rs token_k1 two-sided": ({}, dict(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.3")),
    "rollout_rs token_k1 one number + IS": (dict(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01),
                                            dict(rollout_is="token", rollout_is_threshold=1.5,
                                                 rollout_rs="token_k1", rollout_rs_threshold=1.25)),
    "rollout_rs sequence k2/k3, several": (dict(use_kl_loss=True, kl_loss_coef=0.05),
                                           dict(rollout_rs="seq_mean_k3,token_k2,seq_max_k2",
                                                rollout_rs_threshold="0.03,0.06,0.2")),
    "rollout_rs seq_sum_k1 + sequence IS": (dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=8),
                                            dict(rollout_is="sequence", rollout_is_threshold=3.0,
                                                 rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")),
}


def actor_config(settings: dict) -> ActorConfig:
    kwargs = dict(settings)
    policy = PolicyLossConfig(**kwargs.pop("policy_loss", {}))
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1, policy_loss=policy, **kwargs)


def verl_loss(model, batch, config: ActorConfig, correction: dict | None, advantages: torch.Tensor | None = None
              ) -> tuple[float, dict]:
    """verl's pipeline on the padded batch: rollout correction, then the actor's ppo_loss (``advantages``: per
    token, else the batch's per row)."""
    mask = batch.mask
    weights = None
    if correction:
        proto, mask, _ = compute_rollout_correction_and_rejection_mask(
            old_log_prob=batch.recomputed, rollout_log_prob=batch.behaviour, response_mask=batch.mask,
            rollout_is=correction.get("rollout_is"), rollout_is_threshold=correction.get("rollout_is_threshold", 2.0),
            rollout_rs=correction.get("rollout_rs"), rollout_rs_threshold=correction.get("rollout_rs_threshold"))
        weights = None if proto is None else proto.batch["rollout_is_weights"]
    rows, width = batch.completions.shape
    prompt = 2  # verl's packing only needs each row's prompt and response lengths
    lengths = torch.tensor(batch.lengths)
    attention = torch.cat([torch.ones(rows, prompt, dtype=torch.long),
                           (torch.arange(width)[None] < lengths[:, None]).long()], 1)
    fields = {"prompts": torch.ones(rows, prompt, dtype=torch.long), "responses": batch.completions,
              "attention_mask": attention, "response_mask": mask.long(), "old_log_probs": batch.recomputed,
              "advantages": batch.advantages[:, None] * mask if advantages is None else advantages,
              "ref_log_prob": batch.ref}
    if weights is not None:
        fields["rollout_is_weights"] = weights
    data = TensorDict(fields, batch_size=[rows])
    # the trainer's global batch: every row of the mini-batch, its (rejection-masked) tokens, one rank
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=rows)

    def packed(x: torch.Tensor) -> torch.Tensor:  # verl's model output: prompt + response, shifted left by one
        return torch.cat([torch.cat([torch.zeros(prompt - 1, dtype=x.dtype), x[i, :n], torch.zeros(1, dtype=x.dtype)])
                          for i, n in enumerate(batch.lengths)])

    model.zero_grad(set_to_none=True)
    logp, entropy = logp_and_entropy(model, batch)
    output = {"log_probs": packed(logp)}
    if config.entropy_coeff:
        output["entropy"] = packed(entropy)
    loss, _ = ppo_loss(config, output, data)
    loss.backward()
    return float(loss.detach()), grads(model)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_converted_loss_equals_verls_own(name):
    actor, correction = SETTINGS[name]
    config = actor_config(actor)
    algorithm = {"adv_estimator": "grpo", "rollout_correction": correction}
    converted = dta.PolicyLoss.from_verl(config, algorithm)
    model = tiny_model()
    batch = make_batch(model, seed=5)
    theirs = verl_loss(model, batch, config, correction)
    ours = tree_step(model, rollouts(batch, converted.rollout_fields), converted)
    assert_same(ours, theirs)


def test_rejection_really_rejects_and_changes_the_normaliser():
    """On this batch the rejection settings above drop some tokens, not all, and verl's loss then differs from
    the same weights kept in the normaliser (what importance_weight_mode='mask' would be)."""
    model = tiny_model()
    batch = make_batch(model, seed=5)
    for name in ("rollout_rs token_k1 two-sided", "rollout_rs sequence k2/k3, several"):
        _, correction = SETTINGS[name]
        _, kept, _ = compute_rollout_correction_and_rejection_mask(
            old_log_prob=batch.recomputed, rollout_log_prob=batch.behaviour, response_mask=batch.mask,
            rollout_rs=correction["rollout_rs"], rollout_rs_threshold=correction["rollout_rs_threshold"])
        assert 0 < kept.sum() < batch.mask.sum(), name
    converted = dta.PolicyLoss.from_verl({}, {"adv_estimator": "grpo",
                                              "rollout_correction": SETTINGS["rollout_rs token_k1 two-sided"][1]},
                                         {"n": 4})
    rule = converted.loss.rejection[0]
    kept_in_normaliser = dta.PolicyLoss(importance_weight_cap=rule.upper, importance_weight_floor=rule.lower,
                                        importance_weight_mode="mask", dual_clip=3.0)
    as_mask = tree_step(model, rollouts(batch, converted.rollout_fields), dta.core.conversions.Converted(
        loss=kept_in_normaliser))
    rejected = tree_step(model, rollouts(batch, converted.rollout_fields), converted)
    assert abs(as_mask[0] - rejected[0]) > 1e-4


def test_grpo_advantages_equal_verls():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.25, 0.0, 1.0], dtype=torch.float64)
    rewards = torch.zeros(8, 3, dtype=torch.float64)
    rewards[:, -1] = scores
    index = np.array(["a"] * 4 + ["b"] * 4, dtype=object)
    for norm in (True, False):
        theirs, _ = core_algos.compute_grpo_outcome_advantage(rewards, torch.ones(8, 3, dtype=torch.float64), index,
                                                              epsilon=1e-6, norm_adv_by_std_in_grpo=norm)
        converted = dta.PolicyLoss.from_verl({}, {"adv_estimator": "grpo", "norm_adv_by_std_in_grpo": norm},
                                             {"n": 4})
        step = [dta.Rollout(input_ids=[1, 2, 3], reward=float(s), group_id=str(index[i]))
                for i, s in enumerate(scores)]
        ours = dta.core.advantages.estimate_advantages(step, converted.advantage_estimator,
                                                       converted.advantage_options)
        assert [r.advantages for r in ours] == pytest.approx(theirs[:, 0].tolist(), rel=1e-12, abs=1e-15)


def test_gae_and_whitening_equal_verls():
    """compute_gae_advantage_return (reward on the last response token, masked positions skipped, masked_whiten
    over the batch) against gae_advantages + the step-wide whitening PPOCritic(whiten=True) applies. The returns
    to 1e-12; the whitened advantages to 1e-7: masked_var's Bessel factor mask_sum / (mask_sum - 1) divides two
    integer tensors, which torch does in float32."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    # long, as the trainer's response_mask (a float mask would add 1e-8 to masked_mean's count)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0], [1, 1, 1, 0, 0]])
    last = [4, 3, 2]
    token_rewards = torch.zeros(3, 5, dtype=torch.float64)
    scores = [1.0, -0.5, 0.25]
    for i, t in enumerate(last):
        token_rewards[i, t] = scores[i]
    converted = dta.PolicyLoss.from_verl({}, {"adv_estimator": "gae", "gamma": 0.9, "lam": 0.8})
    critic = converted.critic
    theirs, returns = core_algos.compute_gae_advantage_return(token_rewards, values, mask, gamma=critic["gamma"],
                                                              lam=critic["lam"])
    prompt = 2
    step = []
    for i in range(3):
        n = last[i] + 1
        step.append(dta.Rollout(input_ids=list(range(1, prompt + n + 1)),
                                loss_mask=[0] * prompt + mask[i, :n].long().tolist(), reward=scores[i],
                                old_values=[0.0] * prompt + values[i, :n].tolist()))
    ours = gae_advantages(step, critic["gamma"], critic["lam"])
    total, count = advantage_sums(ours)
    squares, _ = advantage_sums(ours, center=total / count)
    assert critic["whiten"]
    whitened = whiten_advantages(ours, total / count, squares / count * (count / (count - 1)))
    for i in range(3):
        trained = [prompt + t for t in range(last[i] + 1) if mask[i, t]]
        assert [whitened[i].advantages[t] for t in trained] == pytest.approx(
            theirs[i][mask[i] > 0].tolist(), rel=1e-7, abs=1e-12)
        assert [ours[i].returns[t] for t in trained] == pytest.approx(returns[i][mask[i] > 0].tolist(), rel=1e-12)


def test_gae_over_a_batch_of_mini_batches_equals_verls():
    """verl's GAE with whitening, data.train_batch_size=12, ppo_mini_batch_size=6 (rollout.n=1,
    trainer.balance_batch=false): verl's trainer runs ``compute_gae_advantage_return`` (masked_whiten over all 12
    rollouts) once, then the actor cuts the batch into mini-batches (``tensordict_utils.make_iterator``). The
    converter gives 2 steps per generation batch, split into whole groups in order: verl's own mini-batches. Our
    GAE (``gae_advantages``, whitened over the whole batch) equals verl's, and the gradients of the first two steps
    equal verl's ``ppo_loss`` on its mini-batches with its advantages (one SGD step between them). The whitened
    advantages to 1e-7 (masked_var's Bessel factor in float32, as above); measured 3e-8, gradients 1e-8 relative. The
    critic's part (its values taken once before the first update, GAE per generation batch in the training step)
    is the data module's and is not run here: the advantages are estimated by the functions PPOCritic uses."""
    converted = dta.PolicyLoss.from_verl({"ppo_mini_batch_size": 6}, {"adv_estimator": "gae", "gamma": 0.9,
                                                                       "lam": 0.8}, {"n": 1},
                                         {"train_batch_size": 12}, {"balance_batch": False})
    assert converted.generation == {"steps_per_generation": 2, "epochs": 1, "split": "groups"}
    assert converted.critic == {"gamma": 0.9, "lam": 0.8, "whiten": True}
    model = tiny_model()
    batch = make_batch(model, seed=5, groups=12, per_group=1)
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(batch.mask.shape, generator=gen, dtype=torch.float64) * batch.mask
    scores = torch.randn(batch.rows, generator=gen, dtype=torch.float64).tolist()
    token_rewards = torch.zeros_like(values)
    for i, n in enumerate(batch.lengths):
        token_rewards[i, n - 1] = scores[i]  # verl's reward sits on the last response token
    theirs_adv, _ = core_algos.compute_gae_advantage_return(token_rewards, values, batch.mask.long(),
                                                            gamma=0.9, lam=0.8)
    step = [dataclasses.replace(r, reward=scores[i], old_values=[0.0] * len(batch.prompts[i]) +
                                values[i, :batch.lengths[i]].tolist())
            for i, r in enumerate(rollouts(batch, converted.rollout_fields))]
    ours = gae_advantages(step, converted.critic["gamma"], converted.critic["lam"])
    total, count = advantage_sums(ours)
    squares, _ = advantage_sums(ours, center=total / count)
    whitened = whiten_advantages(ours, total / count, squares / count * (count / (count - 1)))
    for i, r in enumerate(whitened):
        trained = [len(batch.prompts[i]) + t for t in range(batch.lengths[i]) if batch.mask[i, t]]
        assert [r.advantages[t] for t in trained] == pytest.approx(theirs_adv[i][batch.mask[i] > 0].tolist(),
                                                                   rel=1e-7, abs=1e-12)
    steps = GenerationBatches.resolve(converted.generation).split_batch(whitened, 0, 0, "the batch")
    rows = TensorDict({"row": torch.arange(12)}, batch_size=[12])
    theirs_split = [mini["row"].tolist() for mini in tu.make_iterator(rows, mini_batch_size=6, epochs=1, seed=42,
                                                                       dataloader_kwargs={"shuffle": False})]
    assert [rows_of(s, batch) for s in steps] == theirs_split
    config = actor_config({})
    for k in range(2):
        index = theirs_split[k]
        theirs = verl_loss(model, subset(batch, index), config, None, theirs_adv[index] * batch.mask[index])
        assert_same(tree_step(model, steps[k], converted), theirs, rtol=1e-7)
        sgd_update(model, theirs[1], lr=2.0)
