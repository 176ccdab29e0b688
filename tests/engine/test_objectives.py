"""The RL objectives beyond token-level PPO, exact on trees: every PolicyLoss option against the per-rollout
reference written from docs/losses.md (tests/helpers/reference.py), float64 with no float32 step
(tests/helpers/float64.py), <= 1e-12 per parameter and loss: rounding only.

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
from tests.helpers.reference import RTOL64, assert_grads_close, engine_grads, reference_grads

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
    # TRL's use_bias_correction_kl, verl's k3+ and clamped low_var_kl
    "kl-ratio-weighted": dta.PolicyLoss(kl_coef=0.1, kl_ratio_weighted=True, agg="seq-mean-token-mean",
                                        agg_rollouts="all"),
    "k3+": dta.PolicyLoss(kl_coef=0.1, kl_estimator="k3+", clip_eps=0.1),
    "low-var-kl": dta.PolicyLoss(kl_coef=0.1, kl_estimator="low_var_kl", kl_ratio_weighted=True),
    # sequence weights in product form, both bounds (TRL sequence_*, verl rollout_is: sequence)
    "tis-product": dta.PolicyLoss(importance_level="sequence-product", importance_weight_cap=2.0,
                                  importance_weight_floor=0.5),
    "mis-product": dta.PolicyLoss(importance_level="sequence-product", importance_weight_cap=2.0,
                                  importance_weight_floor=0.5, importance_weight_mode="mask", agg="seq-mean-token-sum",
                                  agg_rollouts="all"),
    "mis-token-floor": dta.PolicyLoss(importance_weight_cap=1.2, importance_weight_floor=0.8,
                                      importance_weight_mode="mask"),
    # rejection out of the loss and its normaliser (verl rollout_rs), token and sequence, one- and two-sided
    "reject-token-two-sided": dta.PolicyLoss(rejection=(dta.Rejection(lower=0.8, upper=1.25),), entropy_coef=0.01,
                                             importance_level="none"),
    "reject-sequence": dta.PolicyLoss(rejection=(dta.Rejection(metric="k3", level="sequence-mean", upper=0.03),),
                                      agg="seq-mean-token-mean", agg_rollouts="all", importance_weight_cap=1.5),
    "reject-combined": dta.PolicyLoss(rejection=(dta.Rejection(level="sequence-sum", upper=3.0),
                                                 dta.Rejection(metric="k2", level="sequence-max", upper=0.1),
                                                 dta.Rejection(metric="k2", upper=0.05)),
                                      kl_coef=0.05, agg="seq-mean-token-sum-norm", agg_norm_length=24),
    # AReaL: GSPO with sequence-mean advantages, rejection that keeps the normaliser
    "gspo-sequence-advantage": dta.PolicyLoss(loss_mode="gspo", clip_eps=0.03, advantage_level="sequence-mean",
                                              rejection=(dta.Rejection(upper=1.3),), rejection_keeps_normalizer=True),
    # TRL's entropy bonus: a token mean whatever the loss's aggregation
    "entropy-token-mean": dta.PolicyLoss(agg="seq-mean-token-mean", entropy_coef=0.05, entropy_agg="token-mean",
                                         agg_rollouts="all"),
}


def near_policy_rollouts(model: torch.nn.Module, seed: int) -> list[dta.Rollout]:
    """Random trees whose behaviour (old) and proximal log-probs sit near the model's own (noise of 0.25 nats
    each): some ratios clip and some importance weights exceed the caps, not all. The last rollout trains no
    token (a masked-out truncated completion): counted or not by ``agg_rollouts``."""
    rng = random.Random(seed)
    rollouts = random_tree_rollouts(rng, num_rollouts=10)
    untrained = rollouts[1]
    rollouts.append(dta.Rollout(input_ids=list(untrained.input_ids), loss_mask=[0] * len(untrained.input_ids),
                                advantages=0.5))
    current = dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(rollouts))
    for rollout, logp in zip(rollouts, current):
        old = [0.0] + [min(0.0, float(v) + rng.gauss(0, 0.25)) for v in logp]
        rollout.old_logprobs = old
        rollout.prox_logprobs = [0.0] + [min(0.0, v + rng.gauss(0, 0.25)) for v in old[1:]]
    return rollouts


def check(model, rollouts, loss_fn, config):
    ref_loss, ref = reference_grads(model, rollouts, loss_fn)
    out, got = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, **config)
    assert out.loss == pytest.approx(ref_loss, rel=RTOL64, abs=1e-12), f"{config}: loss {out.loss} vs {ref_loss}"
    assert_grads_close(got, ref, RTOL64, what=f"{loss_fn} {config}")
    return out


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {family: make_model(family, torch.float64) for family in ("llama", "qwen2")}


# The objectives of the first release run on two families; the later ones (from "kl-ratio-weighted" on) change only
# the loss on the grid and what is decided before the walk, which no model family touches: one family keeps CI cheap.
FIRST_FAMILY_ONLY = set(list(OBJECTIVES)[list(OBJECTIVES).index("kl-ratio-weighted"):])
MATRIX = [(family, objective, config) for family in ("llama", "qwen2") for objective in OBJECTIVES
          for config in CONFIGS if family == "llama" or objective not in FIRST_FAMILY_ONLY]


@pytest.mark.parametrize("family, objective, config_name", MATRIX, ids=["-".join(m) for m in MATRIX])
def test_objective_is_exact_on_trees(objective, config_name, family, models):
    model, loss_fn = models[family], OBJECTIVES[objective]
    rollouts = near_policy_rollouts(model, seed=7)
    out = check(model, rollouts, loss_fn, CONFIGS[config_name])
    metrics = out.metrics
    if loss_fn.importance_weight_cap is not None:  # the bounds act on some tokens, not all
        assert 0 < metrics["capped_fraction"] < 1, metrics
    else:
        assert metrics["capped_fraction"] == 0
    given = sum(int(m.sum()) for m in dta.PrefixTree.from_rollouts(rollouts).loss_masks)
    if loss_fn.rejection:  # the rules reject some (token, rollout) pairs, not all
        assert 0 < metrics["trained_tokens"] < given, (metrics["trained_tokens"], given)
    else:
        assert metrics["trained_tokens"] == given
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


def test_the_ratio_metrics_are_its_mean_and_spread_over_the_trained_pairs(models):
    """``ratio_mean`` and ``ratio_std`` (population) of exp(logp - prox) over every trained (token, rollout) pair,
    from the definition with the model's own log-probs (float64)."""
    model = models["llama"]
    rollouts = near_policy_rollouts(model, seed=5)
    current = dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(rollouts))
    ratios = torch.cat([torch.exp(logp.double() - torch.tensor(r.prox_logprobs[1:], dtype=torch.float64))[
        torch.tensor(r.loss_mask[1:]) > 0] for r, logp in zip(rollouts, current)])
    out, _ = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), dta.PolicyLoss(clip_eps=0.2))
    assert out.metrics["ratio_mean"] == pytest.approx(float(ratios.mean()), rel=1e-9)
    assert out.metrics["ratio_std"] == pytest.approx(float(ratios.std(unbiased=False)), rel=1e-9)
    assert out.metrics["ratio_std"] > 0.1  # noise of 0.25 nats: the spread is far from rounding


def test_the_counting_options_act_on_this_data(models):
    """The switches the matrix checks change the loss on its data, so the matrix would catch them ignored: the
    untrained rollout in the mean, the entropy's own aggregation, the ratio-weighted KL, k3+ vs low_var_kl vs k3."""
    model = models["llama"]
    tree = dta.PrefixTree.from_rollouts(near_policy_rollouts(model, seed=7))

    def loss(**kw):
        return engine_grads(model, tree, dta.PolicyLoss(**kw))[0].loss

    assert loss(agg="seq-mean-token-mean") != pytest.approx(loss(agg="seq-mean-token-mean", agg_rollouts="all"))
    assert loss(agg="seq-mean-token-mean", entropy_coef=0.05) != pytest.approx(
        loss(agg="seq-mean-token-mean", entropy_coef=0.05, entropy_agg="token-mean"))
    assert loss(kl_coef=0.1) != pytest.approx(loss(kl_coef=0.1, kl_ratio_weighted=True))
    assert loss(kl_coef=0.1, kl_estimator="k3+") == pytest.approx(loss(kl_coef=0.1, kl_estimator="low_var_kl"))
    assert loss(kl_coef=0.1, kl_estimator="low_var_kl") != pytest.approx(loss(kl_coef=0.1))  # the clamp binds


def test_k3_plus_has_k2s_gradient_and_low_var_kls_value():
    """verl's k3+ on one token: value clamp(exp(d) - d - 1, -10, 10), gradient d k2 / d logp = logp - ref."""
    logp = torch.tensor([[-5.0]], dtype=torch.float64, requires_grad=True)
    nan = torch.full((1, 1), float("nan"), dtype=torch.float64)
    data = dta.core.losses.TokenData(mask=torch.ones(1, 1, dtype=torch.float64),
                                     advantages=torch.zeros(1, 1, dtype=torch.float64), old=nan, prox=nan,
                                     ref=torch.tensor([[-1.0]], dtype=torch.float64), any_ref=True,
                                     weight=torch.ones(1, 1, dtype=torch.float64))
    value = dta.PolicyLoss(kl_coef=1.0, kl_estimator="k3+")(logp, None, data, dta.core.losses.empty_sums())
    value.backward()
    assert float(value) == pytest.approx(10.0)  # exp(4) - 4 - 1 = 49.6, clamped to 10
    assert float(logp.grad) == pytest.approx(-4.0)  # logp - ref


def test_rejection_changes_the_normaliser_and_n_ranks_equal_one(models):
    """Rejection decided before the walk leaves the normaliser: the step over the whole tree equals the sum of
    'rank' shares, each walked with the step's summed normalisers (what tree_step_backward does over ranks).
    mode='vanilla', where the walks of different trees round alike (1e-16), so 1e-12 checks the normalisers
    themselves; the modes' agreement is the matrix's job."""
    model = models["qwen2"]
    rollouts = near_policy_rollouts(model, seed=5)
    loss_fn = dta.PolicyLoss(rejection=(dta.Rejection(level="sequence-mean", lower=0.9, upper=1.1),
                                        dta.Rejection(upper=1.4)), agg="seq-mean-token-mean", entropy_coef=0.02,
                             entropy_agg="token-mean")
    whole = dta.PrefixTree.from_rollouts(rollouts)
    given = dta.PolicyLoss(agg="seq-mean-token-mean").normalizer(whole.loss_masks)
    assert dta.tree_loss_normalizer(whole, loss_fn)[0] < given[0]  # rejected tokens left the normaliser
    out, expected = engine_grads(model, whole, loss_fn, mode="vanilla")
    shares = [dta.PrefixTree.from_rollouts(rollouts[i::3]) for i in range(3)]
    total = [sum(n) for n in zip(*(dta.tree_loss_normalizer(t, loss_fn) for t in shares))]
    assert total == list(dta.tree_loss_normalizer(whole, loss_fn))
    summed, loss = {}, 0.0
    for share in shares:
        part, grads = engine_grads(model, share, loss_fn, normalizer=total, mode="vanilla")
        loss += part.loss
        for name, g in grads.items():
            summed[name] = summed.get(name, 0) + g
    assert loss == pytest.approx(out.loss, rel=1e-12)
    assert_grads_close(summed, expected, 1e-12, what="3 shares vs one tree")


@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_policy_temperature_reaches_every_mode(config_name, models):
    """Log-probs and entropies of softmax(logits / T) in every engine mode, the GSPO pre-pass included."""
    model = models["llama"]
    rollouts = near_policy_rollouts(model, seed=2)
    loss_fn = dta.PolicyLoss(loss_mode="gspo", clip_eps=0.05, kl_coef=0.05, entropy_coef=0.01)
    ref_loss, ref = reference_grads(model, rollouts, loss_fn, temperature=0.7)
    out, got = engine_grads(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn, policy_temperature=0.7,
                            **CONFIGS[config_name])
    assert out.loss == pytest.approx(ref_loss, rel=RTOL64, abs=1e-12)
    assert_grads_close(got, ref, RTOL64, what=f"temperature 0.7 {config_name}")
    _, plain = reference_grads(model, rollouts, loss_fn)
    with pytest.raises(AssertionError):
        assert_grads_close(got, plain, RTOL64)


def test_tree_logprobs_score_the_tempered_policy(models):
    model = models["llama"]
    rollouts = near_policy_rollouts(model, seed=2)
    tree = dta.PrefixTree.from_rollouts(rollouts)
    for r, logp in zip(rollouts, dta.tree_logprobs(model, tree, policy_temperature=1.5)):
        with torch.no_grad():
            log_probs = torch.log_softmax(model(input_ids=torch.tensor([r.input_ids])).logits[0] / 1.5, -1)
        expected = log_probs[torch.arange(len(r.input_ids) - 1), torch.tensor(r.input_ids[1:])]
        torch.testing.assert_close(logp, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad, match", [
    (dict(agg="seq-mean-token-sum-norm"), "agg_norm_length is required"),
    (dict(agg_norm_length=10), "agg_norm_length is required"),
    (dict(dual_clip=1.0), "dual_clip"),
    (dict(dual_clip=3.0, loss_mode="gspo"), "dual_clip"),
    (dict(importance_weight_cap=0.5), "importance_weight_cap"),
    (dict(loss_mode="grpo"), "loss_mode"),
    (dict(importance_level="rollout"), "importance_level"),
    (dict(importance_weight_floor=1.5), "importance_weight_floor"),
    (dict(importance_level="none", importance_weight_cap=2.0), "bound nothing"),
    (dict(kl_estimator="k1"), "kl_estimator"),
    (dict(entropy_agg="mean"), "entropy_agg"),
    (dict(agg_rollouts="some"), "agg_rollouts"),
    (dict(entropy_agg="seq-mean-token-sum-norm"), "agg_norm_length is required"),
    (dict(rejection_keeps_normalizer=True), "no rejection rule"),
    (dict(rejection=({"metric": "k2", "lower": 0.5, "upper": 1.0},)), "upper bound only"),
    (dict(rejection=({"metric": "ratio"},)), "needs lower, upper"),
    (dict(rejection=({"lower": 2.0, "upper": 1.0},)), "lower=2.0 must be <= upper"),
])
def test_bad_options_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        dta.PolicyLoss(**bad)


def test_sequence_weights_need_behaviour_logprobs_where_prox_is_given(models):
    rollouts = near_policy_rollouts(models["llama"], seed=1)
    rollouts[2].old_logprobs = None
    loss_fn = dta.PolicyLoss(importance_weight_cap=2.0, importance_level="sequence")
    with pytest.raises(dta.RolloutError, match="rollout index 2, field 'old_logprobs'"):
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
