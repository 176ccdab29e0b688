"""Advantage estimators: GRPO and a mean baseline over a whole step, with errors that name the rollout."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dta import Rollout, RolloutError
from lightning_dta.core.advantages import (
    ADVANTAGE_ESTIMATORS,
    estimate_advantages,
    grpo_advantages,
    reinforce_baseline_advantages,
)


def make(rewards, groups):
    return [Rollout(input_ids=[1, 2, 3], reward=r, group_id=g) for r, g in zip(rewards, groups)]


def advantages(rollouts):
    return [r.advantages for r in rollouts]


def test_grpo_matches_torch_population_std():
    rewards = [0.1, 0.9, 0.4, 0.4, 1.0, 0.0, 0.25, 0.75, 0.5]
    groups = ["a", "a", "a", "a", 7, 7, "b", "b", "b"]
    out = advantages(grpo_advantages(make(rewards, groups), eps=1e-6))
    for members in ([0, 1, 2, 3], [4, 5], [6, 7, 8]):
        r = torch.tensor([rewards[i] for i in members], dtype=torch.float64)
        expected = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
        assert [out[i] for i in members] == pytest.approx(expected.tolist(), rel=1e-12, abs=1e-12)


def test_grpo_hand_example_and_no_std_variant():
    rollouts = make([1.0, 0.0, 0.0, 1.0], [0, 0, 0, 0])  # mean 0.5, population std 0.5
    assert advantages(grpo_advantages(rollouts, eps=0.0)) == [1.0, -1.0, -1.0, 1.0]
    assert advantages(estimate_advantages(rollouts, "grpo-no-std")) == [0.5, -0.5, -0.5, 0.5]


def test_estimators_return_new_rollouts_and_leave_inputs_alone():
    rollouts = make([1.0, 0.0], ["g", "g"])
    rollouts[0].advantages = [9.0, 9.0, 9.0]
    out = grpo_advantages(rollouts)
    assert out[0] is not rollouts[0]
    assert rollouts[0].advantages == [9.0, 9.0, 9.0] and rollouts[1].advantages == 0.0
    assert all(isinstance(r.advantages, float) for r in out)  # per-token values replaced by the scalar
    assert out[0].input_ids == rollouts[0].input_ids and out[0].group_id == "g" and out[0].reward == 1.0


def test_missing_reward_names_the_rollout_and_field():
    rollouts = make([1.0, 0.5, None], ["g", "g", "g"])
    for method in ADVANTAGE_ESTIMATORS:
        with pytest.raises(RolloutError, match=r"rollout index 2, field 'reward'") as info:
            estimate_advantages(rollouts, method)
        assert info.value.index == 2 and info.value.field == "reward"


def test_grpo_refuses_rollouts_without_group():
    with pytest.raises(RolloutError, match=r"rollout index 1, field 'group_id'"):
        grpo_advantages(make([1.0, 0.5], ["g", None]))


def test_singleton_and_constant_groups_get_exactly_zero():
    rollouts = make([0.7, 0.1, 0.1, 0.1, 1.0, 0.0], ["alone", "same", "same", "same", "x", "x"])
    for eps in (1e-6, 0.0):
        out = advantages(grpo_advantages(rollouts, eps=eps))
        assert out[:4] == [0.0, 0.0, 0.0, 0.0]  # no signal, not rounding noise / eps
        assert out[4:] == pytest.approx([1.0, -1.0], rel=1e-5)
    assert advantages(reinforce_baseline_advantages(rollouts))[0] == 0.0


def test_reinforce_baseline_uses_the_step_mean_without_groups():
    out = advantages(reinforce_baseline_advantages(make([1.0, 0.0, 0.5, 0.5], [None] * 4)))
    assert out == pytest.approx([0.5, -0.5, 0.0, 0.0], abs=1e-15)


def test_reinforce_baseline_groups_and_ungrouped_rest():
    out = advantages(reinforce_baseline_advantages(make([1.0, 0.0, 0.2, 0.6, 3.0], ["g", "g", None, None, "h"])))
    assert out == pytest.approx([0.5, -0.5, -0.2, 0.2, 0.0], abs=1e-15)


def test_none_keeps_the_rollouts_own_advantages_and_unknown_is_refused():
    rollouts = make([None, None], [None, None])
    rollouts[0].advantages = [0.0, 1.5, -2.0]
    kept = estimate_advantages(rollouts, None)
    assert kept == rollouts and kept is not rollouts  # no reward needed, nothing changed
    with pytest.raises(ValueError, match="grpo"):
        estimate_advantages(rollouts, "ppo-gae")


group_of = st.lists(st.integers(0, 100).map(lambda k: k / 100), min_size=1, max_size=6)  # rewards in [0, 1]


@settings(max_examples=60, deadline=None)
@given(st.lists(group_of, min_size=1, max_size=5), st.randoms(use_true_random=False))
def test_grpo_properties_any_order(groups, rng):
    rewards = [r for g in groups for r in g]
    ids = [k for k, g in enumerate(groups) for _ in g]
    order = list(range(len(rewards)))
    rng.shuffle(order)
    out = advantages(grpo_advantages(make([rewards[i] for i in order], [ids[i] for i in order]), eps=0.0))
    by_position = dict(zip(order, out))  # input order must not matter
    reference = advantages(grpo_advantages(make(rewards, ids), eps=0.0))
    assert [by_position[i] for i in range(len(rewards))] == pytest.approx(reference, abs=1e-12)
    for k, g in enumerate(groups):
        values = [reference[i] for i in range(len(rewards)) if ids[i] == k]
        assert math.fsum(values) == pytest.approx(0.0, abs=1e-9)  # centred
        if max(g) > min(g):
            std = math.sqrt(math.fsum(v * v for v in values) / len(values))
            assert std == pytest.approx(1.0, rel=1e-9)  # unit population std
        else:
            assert values == [0.0] * len(g)


def _naive_grpo(rewards, eps=1e-6):
    """The definition, computed as written (it overflows from about 1e154)."""
    mean = math.fsum(rewards) / len(rewards)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


def test_group_centring_is_safe_for_any_finite_reward_and_bitwise_for_ordinary_ones():
    ordinary = [0.25, 3.7, -1.2, 0.5]
    rollouts = [Rollout(input_ids=[1, 2], reward=r, group_id=0) for r in ordinary]
    assert [r.advantages for r in grpo_advantages(rollouts)] == _naive_grpo(ordinary)  # bitwise: a power-2 scale
    for huge in ([1e200, -3e199, 5e199], [1.7e308, 1.0e308, -1.7e308]):
        rollouts = [Rollout(input_ids=[1, 2], reward=r, group_id="g") for r in huge]
        advantages = [r.advantages for r in grpo_advantages(rollouts)]
        scaled = [r / max(abs(v) for v in huge) for r in huge]  # the same group in ordinary units
        assert all(math.isfinite(a) for a in advantages), advantages
        assert advantages == pytest.approx(_naive_grpo(scaled, eps=0.0), rel=1e-12, abs=1e-300)
    tiny = grpo_advantages([Rollout(input_ids=[1, 2], reward=r, group_id="g") for r in (1e-320, 3e-320, 0.0)])
    assert all(abs(r.advantages) < 1e-300 for r in tiny)  # eps (1e-6) outweighs a spread of 1e-320
    baseline = reinforce_baseline_advantages([Rollout(input_ids=[1, 2], reward=r) for r in (1e300, -1e300)])
    assert [r.advantages for r in baseline] == [1e300, -1e300]
    with pytest.raises(RolloutError, match="field 'reward'.*overflows a float"):
        reinforce_baseline_advantages([Rollout(input_ids=[1, 2], reward=r) for r in (1.7e308, -1.7e308, -1.7e308)])


def test_grpo_options_match_torch_per_convention():
    """TRL/verl's unbiased std (torch.std), TRL's scale_rewards='batch' (one std of the whole step around its
    mean, group means as baselines), a step-wide mean, and AReaL's token weighting, each against torch."""
    rewards = [0.1, 0.9, 0.4, 0.3, 1.0, 0.0, 0.25, 0.75]
    groups = ["a", "a", "a", "a", "b", "b", "c", "c"]
    r = torch.tensor(rewards, dtype=torch.float64)
    by_group = {"a": r[:4], "b": r[4:6], "c": r[6:]}
    group_mean = torch.cat([by_group[g].mean().expand(len(by_group[g])) for g in "abc"])
    group_std = torch.cat([by_group[g].std().expand(len(by_group[g])) for g in "abc"])  # unbiased
    out = advantages(grpo_advantages(make(rewards, groups), eps=1e-4, std_unbiased=True))
    assert out == pytest.approx(((r - group_mean) / (group_std + 1e-4)).tolist(), rel=1e-12)
    out = advantages(grpo_advantages(make(rewards, groups), eps=1e-4, std_unbiased=True, std_over="step"))
    assert out == pytest.approx(((r - group_mean) / (r.std() + 1e-4)).tolist(), rel=1e-12)
    out = advantages(grpo_advantages(make(rewards, groups), mean_over="step", std_over="step", eps=0.0))
    assert out == pytest.approx(((r - r.mean()) / r.std(unbiased=False)).tolist(), rel=1e-12)
    lengths = [2, 5, 3, 4, 6, 2, 3, 3]  # trained tokens per rollout
    rollouts = [Rollout(input_ids=list(range(1, n + 2)), reward=x, group_id=g)
                for n, x, g in zip(lengths, rewards, groups)]
    tokens = torch.repeat_interleave(r, torch.tensor(lengths))  # AReaL: one advantage per trained token
    owner = torch.repeat_interleave(torch.arange(len(rewards)), torch.tensor(lengths))
    expected = []
    for i, g in enumerate(groups):
        members = torch.tensor([j for j, h in enumerate(groups) if h == g])
        x = tokens[torch.isin(owner, members)]
        expected.append(float((r[i] - x.mean()) / (x.std() + 1e-5)))
    out = advantages(grpo_advantages(rollouts, eps=1e-5, std_unbiased=True, weighting="token"))
    assert out == pytest.approx(expected, rel=1e-12)


def test_estimator_options_pass_through_and_bad_ones_are_refused():
    step = make([1.0, 0.0, 0.5, 0.5], ["g", "g", "h", "h"])
    assert advantages(estimate_advantages(step, "grpo", {"std_unbiased": True})) == \
        advantages(grpo_advantages(step, std_unbiased=True))
    with pytest.raises(ValueError, match="do not fit advantage_estimator='grpo'"):
        estimate_advantages(step, "grpo", {"unbiased": True})
    with pytest.raises(ValueError, match="takes none"):
        estimate_advantages(step, None, {"std_unbiased": True})


def test_whitening_is_verls_masked_whiten():
    """(A - mean) / sqrt(var + 1e-8) over every trained (token, rollout) pair, var unbiased; untrained tokens and
    the returns untouched."""
    from lightning_dta.core.advantages import advantage_sums, whiten_advantages

    rollouts = [Rollout(input_ids=[1, 2, 3, 4], loss_mask=[0, 1, 0, 1], advantages=[9.0, 0.5, 7.0, -1.0]),
                Rollout(input_ids=[1, 2, 3], advantages=[0.0, 2.0, 0.25])]
    values = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)
    total, count = advantage_sums(rollouts)
    assert count == 4 and total == pytest.approx(float(values.sum()))
    squares, _ = advantage_sums(rollouts, center=total / count)
    out = whiten_advantages(rollouts, total / count, squares / count * count / (count - 1))
    expected = ((values - values.mean()) / torch.sqrt(values.var() + 1e-8)).tolist()
    assert [out[0].advantages[1], out[0].advantages[3], out[1].advantages[1], out[1].advantages[2]] == \
        pytest.approx(expected, rel=1e-12)
    assert out[0].advantages[0] == 9.0 and out[0].advantages[2] == 7.0  # untrained
