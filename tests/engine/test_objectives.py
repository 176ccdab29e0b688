"""The RL objectives beyond token-level PPO, exact on trees: every PolicyLoss option against the per-rollout
reference written from docs/losses.md (tests/helpers/reference.py), float64, <= 1e-5 per parameter, loss <= 1e-6.

The data makes every non-linearity act on part of the tokens (the fractions are asserted): behaviour and proximal
log-probs near the model's own, per-token advantages that differ between rollouts sharing a prefix, multi-level
random trees with duplicates and strict prefixes.
"""

from __future__ import annotations

import random

import pytest
import torch

import lightning_dta as dta
from tests.helpers.models import OBJECTIVE_CONFIGS, make_model, random_tree_rollouts
from tests.helpers.reference import assert_grads_close, engine_grads, reference_grads

RTOL64 = 1e-5
CONFIGS = OBJECTIVE_CONFIGS
OBJECTIVES = {
    "dual-clip": dta.PolicyLoss(clip_eps=0.1, dual_clip=1.5),
    "tis-token": dta.PolicyLoss(importance_weight_cap=1.2),
    "mis-token": dta.PolicyLoss(importance_weight_cap=1.2, importance_weight_mode="mask", kl_coef=0.05),
    "tis-sequence": dta.PolicyLoss(importance_weight_cap=1.05, importance_level="sequence",
                                   agg="seq-mean-token-mean"),
    "mis-sequence": dta.PolicyLoss(importance_weight_cap=1.05, importance_level="sequence",
                                   importance_weight_mode="mask"),
    "gspo": dta.PolicyLoss(loss_mode="gspo", clip_eps=0.03, agg="seq-mean-token-mean"),
    "gspo-capped": dta.PolicyLoss(loss_mode="gspo", clip_eps=0.03, clip_eps_high=0.04, importance_weight_cap=1.2,
                                  entropy_coef=0.01),
    "cispo": dta.PolicyLoss(loss_mode="cispo", clip_eps=0.1, clip_eps_high=0.2),
    "dr-grpo": dta.PolicyLoss(agg="seq-mean-token-sum-norm", agg_norm_length=24, clip_eps=0.1),
}


def near_policy_rollouts(model: torch.nn.Module, seed: int) -> list[dta.Rollout]:
    """Random trees whose behaviour (old) and proximal log-probs sit near the model's own (noise of 0.25 nats
    each): some ratios clip and some importance weights exceed the caps, not all."""
    rng = random.Random(seed)
    rollouts = random_tree_rollouts(rng, num_rollouts=10)
    current = dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(rollouts))
    for rollout, logp in zip(rollouts, current):
        old = [0.0] + [min(0.0, float(v) + rng.gauss(0, 0.25)) for v in logp]
        rollout.old_logprobs = old
        rollout.prox_logprobs = [0.0] + [min(0.0, v + rng.gauss(0, 0.25)) for v in old[1:]]
    return rollouts


def check(model, rollouts, loss_fn, config):
    ref_loss, ref = reference_grads(model, rollouts, loss_fn)
    out, got = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, **config)
    assert out.loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-12), f"{config}: loss {out.loss} vs {ref_loss}"
    assert_grads_close(got, ref, RTOL64, what=f"{loss_fn} {config}")
    return out


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {family: make_model(family, torch.float64) for family in ("llama", "qwen2")}


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("objective", list(OBJECTIVES))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_objective_is_exact_on_trees(objective, config_name, family, models):
    model, loss_fn = models[family], OBJECTIVES[objective]
    rollouts = near_policy_rollouts(model, seed=7)
    out = check(model, rollouts, loss_fn, CONFIGS[config_name])
    metrics = out.metrics
    if loss_fn.importance_weight_cap is not None:  # the cap acts on some tokens, not all
        assert 0 < metrics["capped_fraction"] < 1, metrics
    else:
        assert metrics["capped_fraction"] == 0
    if loss_fn.loss_mode == "gspo":  # sequence-level clipping: whole rollouts clip or not
        assert 0 < metrics["clip_fraction"] < 1, metrics
    elif loss_fn.dual_clip is None:
        assert 0 < metrics["clip_fraction"] < 1, metrics


def test_dual_clip_bounds_negative_advantages():
    """Against a hand computation on one token: ratio 3, A = -1, eps 0.2, dual clip 2 -> pg = 2 (not 3)."""
    loss_fn = dta.PolicyLoss(clip_eps=0.2, dual_clip=2.0)
    logp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    data = dta.core.losses.TokenData(mask=torch.ones(1, 1, dtype=torch.float64),
                                advantages=torch.tensor([[-1.0]], dtype=torch.float64),
                                old=torch.tensor([[-1.0986122886681098]], dtype=torch.float64),  # log(1/3)
                                prox=torch.full((1, 1), float("nan"), dtype=torch.float64),
                                ref=torch.full((1, 1), float("nan"), dtype=torch.float64),
                                weight=torch.ones(1, 1, dtype=torch.float64))
    sums = dta.core.losses.empty_sums()
    value = loss_fn(logp, None, data, sums)
    assert float(value.detach()) == pytest.approx(2.0)  # min(3 * -1, 1.2 * -1) = -3, bounded below by 2 * -1
    value.backward()
    assert float(logp.grad) == 0.0  # the bound is constant: no gradient through it
    without = dta.PolicyLoss(clip_eps=0.2)(logp.detach().requires_grad_(), None, data, dta.core.losses.empty_sums())
    assert float(without) == pytest.approx(3.0)


def test_gspo_ratio_is_the_rollouts_geometric_mean_under_the_current_weights(models):
    """GSPO's ratio is exp(mean over trained tokens of (logp - prox)) of the weights being trained: with prox
    equal to the current log-probs every rollout's ratio is 1 and GSPO is the plain policy gradient."""
    model = models["llama"]
    rollouts = near_policy_rollouts(model, seed=3)
    current = dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(rollouts))
    for rollout, logp in zip(rollouts, current):
        rollout.prox_logprobs = [0.0] + [float(v) for v in logp]
        rollout.old_logprobs = list(rollout.prox_logprobs)
    gspo = dta.PolicyLoss(loss_mode="gspo", clip_eps=1e-4)
    out_gspo, g_gspo = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), gspo)
    for rollout in rollouts:
        rollout.old_logprobs = rollout.prox_logprobs = None  # on-policy: ratio 1
    out_pg, g_pg = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), dta.PolicyLoss())
    assert out_gspo.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-9)
    assert out_gspo.metrics["clip_fraction"] == 0
    assert_grads_close(g_gspo, g_pg, RTOL64, what="gspo at ratio 1 vs policy gradient")


@pytest.mark.parametrize("bad, match", [
    (dict(agg="seq-mean-token-sum-norm"), "agg_norm_length is required"),
    (dict(agg_norm_length=10), "agg_norm_length is required"),
    (dict(dual_clip=1.0), "dual_clip"),
    (dict(dual_clip=3.0, loss_mode="gspo"), "dual_clip"),
    (dict(importance_weight_cap=0.5), "importance_weight_cap"),
    (dict(loss_mode="grpo"), "loss_mode"),
    (dict(importance_level="rollout"), "importance_level"),
])
def test_bad_options_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        dta.PolicyLoss(**bad)


def test_sequence_weights_need_behaviour_logprobs_where_prox_is_given(models):
    rollouts = near_policy_rollouts(models["llama"], seed=1)
    rollouts[2].old_logprobs = None
    loss_fn = dta.PolicyLoss(importance_weight_cap=2.0, importance_level="sequence")
    with pytest.raises(dta.RolloutError, match="rollout 2, field 'old_logprobs'"):
        dta.tree_backward(models["llama"], dta.PrefixTree.from_rollouts(rollouts), loss_fn)


@pytest.mark.parametrize("config_name", ["dfs-keep", "mask"])
def test_an_extreme_value_on_an_untrained_position_changes_nothing(config_name, models):
    """Rollout B shares A's tokens but trains only its last one; its untrained positions carry a filler behaviour
    log-prob of -1e4 (valid: finite, <= 0). In the tree's grid those entries sit beside A's trained ones; they must
    not turn the step into NaN (inf x 0) nor change it: the same loss and gradient as with a harmless filler."""
    model = models["llama"]
    ids = [3, 5, 7, 9, 11, 13]
    a = dta.Rollout(input_ids=ids, loss_mask=[0, 1, 1, 1, 1, 1], advantages=1.0, old_logprobs=[0.0] + [-2.0] * 5)

    def b(filler: float) -> dta.Rollout:
        return dta.Rollout(input_ids=ids, loss_mask=[0, 0, 0, 0, 0, 1], advantages=-1.0,
                           old_logprobs=[0.0] + [filler] * 4 + [-2.0], ref_logprobs=[0.0] + [filler] * 4 + [-2.0])

    loss_fn = dta.PolicyLoss(kl_coef=0.1, importance_weight_cap=2.0)
    harmless = check(model, [a, b(-2.0)], loss_fn, CONFIGS[config_name])
    extreme = check(model, [a, b(-1e4)], loss_fn, CONFIGS[config_name])
    assert extreme.loss == pytest.approx(harmless.loss, rel=1e-12) and extreme.metrics["nonfinite_tokens"] == 0
