"""``PolicyLoss.from_areal(actor)`` against AReaL 1.0.4's own code, float64 where AReaL allows it.

For each setting the same actor config goes to ``from_areal`` and to AReaL's ``ppo_actor_loss_fn`` (the PPO
actor's loss: decoupled weights, rejection sampling, GSPO, dual clip; normalised by the minibatch's trained
tokens) on the padded batch with log-probs from our model; our tree walk runs the converted loss. Loss and every
parameter's gradient agree to 1e-9, or to 1e-6 where AReaL computes the behaviour weight in float32 (rejection
sampling). The advantages: ``Normalization`` (``adv_norm``) against ``grpo_advantages(weighting="token")``.
Skipped without AReaL (``bash scripts/install_parity.sh``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch

areal = pytest.importorskip("areal", reason="AReaL is not installed: bash scripts/install_parity.sh (its "
                            "--no-deps install is not a pip extra)")
# areal.trainer's __init__ imports its stats loggers (swanlab, wandb, ...): a bare package stands in for it
_trainer = types.ModuleType("areal.trainer")
_trainer.__path__ = [os.path.join(os.path.dirname(areal.__file__), "trainer")]
sys.modules.setdefault("areal.trainer", _trainer)
from areal.api.cli_args import NormConfig, RejectionSamplingConfig  # noqa: E402
from areal.utils.data import Normalization  # noqa: E402
from areal.utils.functional import ppo_actor_loss_fn  # noqa: E402

import lightning_dta as dta  # noqa: E402
from tests.parity.harness import assert_same, grads, logp_and_entropy, make_batch, rollouts, tiny_model, tree_step  # noqa: E402,E501

BASE = {"kl_ctl": 0.0}
SETTINGS = {  # (actor settings, tolerance)
    "not decoupled": ({}, 1e-9),
    "clip higher, dual clip": (dict(eps_clip_higher=0.28, c_clip=1.3), 1e-9),
    "decoupled, no rejection sampling (no behaviour weight)": (dict(use_decoupled_loss=True), 1e-9),
    "decoupled, token clamp": (dict(use_decoupled_loss=True, rejection_sampling=dict(
        level="token", action="clamp", upper=1.2, lower=0.8)), 1e-6),
    "decoupled, token mask": (dict(use_decoupled_loss=True, rejection_sampling=dict(
        level="token", action="mask", upper=1.25, lower=0.8)), 1e-6),
    "decoupled, sequence clamp": (dict(use_decoupled_loss=True, rejection_sampling=dict(
        level="sequence", action="clamp", upper=1.05, lower=0.95)), 1e-6),
    "decoupled, sequence mask by the product": (dict(use_decoupled_loss=True, rejection_sampling=dict(
        level="sequence", action="mask", agg="sum", upper=1.5, lower=0.7)), 1e-6),
    "decoupled, sequence mask by the largest weight": (dict(use_decoupled_loss=True, rejection_sampling=dict(
        level="sequence", action="mask", agg="max", upper=1.4)), 1e-6),
    "gspo": (dict(importance_sampling_level="sequence", eps_clip=0.03), 1e-9),
    "gspo, decoupled, sequence mask": (dict(importance_sampling_level="sequence", eps_clip=0.05,
                                            use_decoupled_loss=True, rejection_sampling=dict(
                                                level="sequence", action="mask", agg="sum", upper=1.5)), 1e-6),
    "gspo, decoupled, sequence clamp": (dict(importance_sampling_level="sequence", eps_clip=0.05,
                                             use_decoupled_loss=True, rejection_sampling=dict(
                                                 level="sequence", action="clamp", upper=1.02)), 1e-6),
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_converted_loss_equals_areals_own(name):
    settings, rtol = SETTINGS[name]
    actor = {**BASE, **settings}
    converted = dta.PolicyLoss.from_areal(actor)
    model = tiny_model()
    batch = make_batch(model, seed=7)
    mask = batch.mask > 0
    decoupled = actor.get("use_decoupled_loss", False)
    rs = actor.get("rejection_sampling")
    model.zero_grad(set_to_none=True)
    logp, _ = logp_and_entropy(model, batch)
    loss, _ = ppo_actor_loss_fn(
        logprobs=logp, proximal_logprobs=batch.recomputed if decoupled else batch.behaviour,
        old_logprobs=batch.behaviour, advantages=batch.advantages[:, None] * batch.mask, loss_mask=mask,
        eps_clip=actor.get("eps_clip", 0.2), eps_clip_higher=actor.get("eps_clip_higher"),
        c_clip=actor.get("c_clip"), rejection_sampling=RejectionSamplingConfig(**rs) if rs and decoupled else None,
        importance_sampling_level=actor.get("importance_sampling_level", "token"))
    loss.backward()
    theirs = (float(loss.detach()), grads(model))
    ours = tree_step(model, rollouts(batch, converted.rollout_fields, batch.advantages[:, None] * batch.mask),
                     converted)
    assert_same(ours, theirs, rtol)


@pytest.mark.parametrize("levels", [("group", "group"), ("batch", "batch"), ("group", None), (None, None)])
def test_advantage_normalisation_equals_areals(levels):
    """AReaL's adv_norm over per-token advantages (every trained token carries the rollout's reward, no critic,
    discount = gae_lambda = 1) against grpo_advantages with the converted options (float32 in AReaL)."""
    mean, std = levels
    norm = None if mean is None and std is None else dict(mean_level=mean, std_level=std, group_size=4)
    converted = dta.PolicyLoss.from_areal({**BASE, "adv_norm": norm})
    lengths = [3, 5, 2, 4, 6, 1, 3, 2]
    rewards = [1.0, 0.0, 0.5, 0.25, 1.0, 1.0, 0.2, 0.9]
    width = max(lengths)
    mask = torch.zeros(8, width)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    per_token = torch.tensor(rewards)[:, None] * mask
    theirs = per_token if norm is None else Normalization(NormConfig(**norm))(per_token, mask)
    step = [dta.Rollout(input_ids=list(range(1, n + 2)), reward=r, group_id=i // 4)
            for i, (n, r) in enumerate(zip(lengths, rewards))]
    ours = dta.core.advantages.estimate_advantages(step, converted.advantage_estimator, converted.advantage_options)
    assert [r.advantages for r in ours] == pytest.approx(theirs[:, 0].tolist(), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("levels", [("batch", "batch"), ("group", "group")])
def test_a_batch_of_minibatches_equals_areals_own(levels):
    """AReaL's ``PPOActor.compute_advantages`` (adv_norm over the whole batch of 16 rollouts, 4 groups of 4) against
    our iterable source with the converted settings (estimated over the whole batch, cut into ppo_n_minibatches=4
    steps); then the gradients of the first two steps against ``ppo_actor_loss_fn`` on the same rows with AReaL's
    advantages (one SGD step between them, so the second step's ratio departs from 1). AReaL packs its minibatches
    by token count, which the converter does not reproduce: AReaL's loss runs on the rows of our group-preserving
    steps. To 1e-6: AReaL's advantages are float32; measured 2e-7 on the advantages, 1e-7 relative on the gradients."""
    from areal.api.cli_args import PPOActorConfig
    from areal.trainer.ppo.actor import PPOActor

    from tests.parity.harness import generation_steps, rows_of, sgd_update, subset

    mean, std = levels
    norm = dict(mean_level=mean, std_level=std, group_size=4)
    converted = dta.PolicyLoss.from_areal({**BASE, "adv_norm": norm, "ppo_n_minibatches": 4})
    assert converted.generation == {"steps_per_generation": 4, "epochs": 1, "split": "groups"}
    model = tiny_model()
    batch = make_batch(model, seed=7, groups=4, per_group=4)
    rewards = [0.25 * ((3 * i) % 7) for i in range(batch.rows)]  # exact in float32
    trajectories = []
    for i, prompt in enumerate(batch.prompts):
        n, p = batch.lengths[i], len(prompt)
        logp = torch.tensor([0.0] * p + batch.behaviour[i, :n].tolist(), dtype=torch.float32)[None]
        trajectories.append({"input_ids": torch.tensor([prompt + batch.completions[i, :n].tolist()]),
                             "attention_mask": torch.ones(1, p + n, dtype=torch.long),
                             "loss_mask": torch.tensor([[0] * p + batch.mask[i, :n].long().tolist()]),
                             "logprobs": logp, "prox_logp": logp, "rewards": torch.tensor([rewards[i]])})
    actor = PPOActor(PPOActorConfig(**BASE, adv_norm=NormConfig(**norm), ppo_n_minibatches=4), None)
    theirs_adv = torch.zeros(batch.rows, batch.mask.shape[1], dtype=torch.float64)
    for i, out in enumerate(actor.compute_advantages(trajectories)):  # position t: token t + 1's advantage
        p = len(batch.prompts[i])
        theirs_adv[i, :batch.lengths[i]] = out["advantages"][0, p - 1:p - 1 + batch.lengths[i]].double()
    theirs_adv *= batch.mask
    ours_in = [dataclasses.replace(r, advantages=0.0, reward=rewards[i])
               for i, r in enumerate(rollouts(batch, converted.rollout_fields))]
    steps = generation_steps(ours_in, converted)
    assert len(steps) == 4
    for step in steps:
        for r, i in zip(step, rows_of(step, batch)):
            if batch.mask[i].any():  # a rollout that trains no token has no advantage in AReaL
                got = torch.tensor(r.advantages).expand(batch.lengths[i]) * batch.mask[i, :batch.lengths[i]]
                assert got.tolist() == pytest.approx(theirs_adv[i, :batch.lengths[i]].tolist(), abs=1e-6)
    for k in range(2):
        index = rows_of(steps[k], batch)
        part = subset(batch, index)
        model.zero_grad(set_to_none=True)
        logp, _ = logp_and_entropy(model, part)
        loss, _ = ppo_actor_loss_fn(logprobs=logp, proximal_logprobs=part.behaviour, old_logprobs=part.behaviour,
                                    advantages=theirs_adv[index], loss_mask=part.mask > 0, eps_clip=0.2)
        loss.backward()
        theirs = (float(loss.detach()), grads(model))
        assert_same(tree_step(model, steps[k], converted), theirs, rtol=1e-6, atol=1e-6)
        sgd_update(model, theirs[1], lr=2.0)
