"""Peak memory of the DFS is bounded by the longest root-to-leaf path, not by the number of leaves."""

from __future__ import annotations

import random

import pytest

import lightning_dta as dta
from lightning_dta.engine.memory import SavedTensorMeter
from tests.helpers.models import make_model


def grpo_tree(num_leaves: int, seed: int = 0) -> dta.PrefixTree:
    rng = random.Random(seed)
    prompt = [rng.randrange(48) for _ in range(40)]
    rollouts = []
    for leaf in range(num_leaves):
        # Equal lengths and distinct first tokens: every response is a leaf child of the prompt.
        response = [leaf] + [rng.randrange(48) for _ in range(11)]
        rollouts.append(dta.Rollout(input_ids=prompt + response, loss_mask=[0] * 40 + [1] * 12,
                                    advantages=rng.gauss(0, 1)))
    return dta.PrefixTree.from_rollouts(rollouts)


def peak_saved_bytes(model, tree, **kwargs) -> int:
    model.zero_grad(set_to_none=True)
    with SavedTensorMeter(model) as meter:
        dta.tree_backward(model, tree, dta.PolicyLoss(), **kwargs)
    assert meter.current_bytes == 0, "everything saved for backward must be released by the end"
    return meter.peak_bytes


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


@pytest.mark.parametrize("options", [dict(sibling_batch_tokens=None), dict(sibling_batch_tokens=48),
                                     dict(activation="recompute", chunk_size=16, sibling_batch_tokens=24)])
def test_dfs_peak_does_not_grow_with_leaves(model, options):
    peaks = {n: peak_saved_bytes(model, grpo_tree(n), mode="dfs", **options) for n in (4, 8, 16)}
    assert peaks[4] > 0
    # Activations are flat in the number of leaves. What grows is the prompt's per-(position, rollout) loss
    # grid: its last position predicts each leaf's first token, a few scalars per leaf.
    assert peaks[16] - peaks[4] <= 64 * 12, f"dfs peak grew with leaves: {peaks}"
    assert peaks[8] <= peaks[16]


def test_mask_peak_grows_with_leaves(model):
    peaks = {n: peak_saved_bytes(model, grpo_tree(n), mode="mask") for n in (4, 8, 16)}
    assert peaks[4] < peaks[8] < peaks[16], f"mask peak should grow with packed tokens: {peaks}"
    dfs = peak_saved_bytes(model, grpo_tree(16), mode="dfs", sibling_batch_tokens=None)
    assert dfs < peaks[16] / 2


def test_recompute_with_chunks_holds_less_than_keep(model):
    rng = random.Random(1)
    long = dta.Rollout(input_ids=[rng.randrange(48) for _ in range(200)])
    tree = dta.PrefixTree.from_rollouts([long])
    keep = peak_saved_bytes(model, tree, mode="dfs")
    recompute = peak_saved_bytes(model, tree, mode="dfs", activation="recompute", chunk_size=25)
    vanilla = peak_saved_bytes(model, tree, mode="vanilla")
    assert recompute < 0.5 * vanilla, f"recompute+chunks {recompute} vs per-rollout {vanilla}"
    assert keep >= 0.9 * vanilla


def test_the_meter_counts_the_result_of_a_collective_saved_as_it_is():
    """Under tensor parallelism a row-parallel layer's output is an ``AsyncCollectiveTensor`` (its all-reduce in
    flight) whose own storage is an invalid wrapper; an RMSNorm computing in the model's dtype saves it for backward
    as it is, and ``activation="auto"`` on a float32 model under TP raised "invalid python storage" (float64 tests
    hid it: HF's norm cast to float32 first, a new tensor). The meter counts the collective's result."""
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    x = AsyncCollectiveTensor(torch.randn(1000, dtype=torch.float64)).requires_grad_()
    with SavedTensorMeter() as meter:
        x.pow(2)  # saves x
    assert meter.peak_bytes == 8 * 1000
