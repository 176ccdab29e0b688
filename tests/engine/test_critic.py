"""The critic on trees: ValueLoss and tree_values exact against a per-rollout reference written from their
definitions (float64 with no float32 step, tests/helpers/float64.py: <= 1e-12 per parameter and loss), and GAE
against its closed form."""

from __future__ import annotations

import random

import pytest
import torch

import lightning_dta as dta
from lightning_dta.core.advantages import gae_advantages
from tests.helpers.models import OBJECTIVE_CONFIGS, make_model, random_tree_rollouts
from tests.helpers.reference import RTOL64, assert_grads_close, reference_value_loss

CONFIGS = OBJECTIVE_CONFIGS
LOSSES = {
    "clipped-token-mean": dta.ValueLoss(clip_eps=0.05),
    "unclipped-seq-mean": dta.ValueLoss(clip_eps=None, agg="seq-mean-token-mean"),
    "clipped-sum-norm": dta.ValueLoss(clip_eps=0.1, agg="seq-mean-token-sum-norm", agg_norm_length=16),
}


@pytest.fixture(scope="module")
def critics() -> dict[str, torch.nn.Module]:
    out = {}
    for family in ("llama", "qwen2"):
        critic = dta.value_model(make_model(family, torch.float64))
        with torch.no_grad():  # a head that is not zero: values that differ by position
            critic.get_output_embeddings().weight.normal_(0, 0.5)
        out[family] = critic
    return out


def critic_rollouts(critic: torch.nn.Module, seed: int) -> list[dta.Rollout]:
    """Random trees; per-token returns that differ between rollouts on a shared prefix; old values near the
    critic's own (noise 0.05), so the value clip acts on part of the tokens."""
    rng = random.Random(seed)
    rollouts = random_tree_rollouts(rng, num_rollouts=10, with_logprobs=False)
    values = dta.tree_values(critic, dta.PrefixTree.from_rollouts(rollouts))
    for rollout, v in zip(rollouts, values):
        rollout.returns = [0.0] + [rng.gauss(0, 1) for _ in range(len(rollout) - 1)]
        rollout.old_values = [0.0] + [float(x) + rng.gauss(0, 0.05) for x in v]
    return rollouts


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_value_loss_is_exact_on_trees(family, loss_name, config_name, critics):
    critic, loss_fn = critics[family], LOSSES[loss_name]
    rollouts = critic_rollouts(critic, seed=5)
    critic.zero_grad(set_to_none=True)
    ref_loss = reference_value_loss(critic, rollouts, loss_fn)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}
    critic.zero_grad(set_to_none=True)
    out = dta.tree_backward(critic, dta.PrefixTree.from_rollouts(rollouts), loss_fn, **CONFIGS[config_name])
    got = {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}
    critic.zero_grad(set_to_none=True)
    assert out.loss == pytest.approx(float(ref_loss.detach()), rel=RTOL64, abs=1e-12)
    assert_grads_close(got, ref, RTOL64, what=f"{loss_fn} {config_name}")
    if loss_fn.clip_eps is not None:
        assert 0 < out.metrics["value_clip_fraction"] < 1, out.metrics


def test_value_loss_under_activation_auto(critics):
    """The budget's probe scores a critic's one-wide head as values, not as log-probs; the step stays exact."""
    critic, loss_fn = critics["llama"], LOSSES["clipped-token-mean"]
    rollouts = critic_rollouts(critic, seed=4)
    tree = dta.PrefixTree.from_rollouts(rollouts)
    results = []
    for options in (dict(), dict(activation="auto", activation_memory_budget=300_000)):
        critic.zero_grad(set_to_none=True)
        out = dta.tree_backward(critic, tree, loss_fn, **options)
        results.append((out.loss, {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}))
    critic.zero_grad(set_to_none=True)
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-9)
    assert_grads_close(results[1][1], results[0][1], RTOL64, what="auto vs keep")


@pytest.mark.parametrize("config_name", ["dfs-keep", "dfs-keep-unbatched", "dfs-model-attention"])
def test_tree_values_equal_each_rollouts_own_forward(config_name, critics):
    critic = critics["qwen2"]
    rollouts = random_tree_rollouts(random.Random(2), num_rollouts=10, with_logprobs=False)
    engine = {k: v for k, v in CONFIGS[config_name].items() if k != "mode"}
    values = dta.tree_values(critic, dta.PrefixTree.from_rollouts(rollouts), **engine)
    for rollout, got in zip(rollouts, values):
        with torch.no_grad():
            want = critic(input_ids=torch.tensor([rollout.input_ids])).logits[0, :-1, 0]
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_gae_is_the_discounted_sum_of_td_errors():
    """Against the closed form A_k = sum_j (gamma lam)^j delta_{k+j}, over the trained tokens only."""
    rng = random.Random(0)
    gamma, lam = 0.9, 0.8
    rollout = dta.Rollout(input_ids=list(range(12)), loss_mask=[0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0], reward=2.0,
                          old_values=[rng.gauss(0, 1) for _ in range(12)])
    (out,) = gae_advantages([rollout], gamma, lam)
    steps = [t for t, m in enumerate(rollout.loss_mask) if m]
    values = [rollout.old_values[t] for t in steps] + [0.0]
    rewards = [0.0] * (len(steps) - 1) + [2.0]
    deltas = [rewards[k] + gamma * values[k + 1] - values[k] for k in range(len(steps))]
    for k, t in enumerate(steps):
        want = sum((gamma * lam) ** j * deltas[k + j] for j in range(len(steps) - k))
        assert out.advantages[t] == pytest.approx(want, rel=1e-12)
        assert out.returns[t] == pytest.approx(want + values[k], rel=1e-12)
    assert all(out.advantages[t] == 0.0 for t in range(12) if t not in steps)
    (plain,) = gae_advantages([rollout])  # gamma = lam = 1: every step's advantage is reward - its value
    assert [plain.advantages[t] for t in steps] == pytest.approx([2.0 - values[k] for k in range(len(steps))])


def test_missing_fields_name_the_fix(critics):
    rollouts = random_tree_rollouts(random.Random(1), num_rollouts=4, with_logprobs=False)
    with pytest.raises(dta.RolloutError, match="field 'returns'.*advantage_estimator='gae'"):
        dta.tree_backward(critics["llama"], dta.PrefixTree.from_rollouts(rollouts), dta.ValueLoss())
    with pytest.raises(dta.RolloutError, match="field 'old_values'.*tree_values"):
        gae_advantages([dta.Rollout(input_ids=[1, 2, 3], reward=1.0)])
    with pytest.raises(TypeError, match="no linear LM head"):
        dta.value_model(torch.nn.Linear(2, 2))
