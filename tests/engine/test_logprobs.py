"""tree_logprobs equals a plain forward per rollout, for every rollout and position."""

from __future__ import annotations

import random

import pytest
import torch

import lightning_dta as dta
from tests.helpers.models import make_model, random_tree_rollouts


def per_rollout_logprobs(model, rollout: dta.Rollout) -> torch.Tensor:
    ids = torch.tensor([rollout.input_ids])
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return log_probs[torch.arange(len(rollout) - 1), ids[0, 1:]]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("options", [dict(), dict(chunk_size=3), dict(sibling_batch_tokens=None),
                                     dict(prefix_attention=False),
                                     dict(prefix_attention=True, prefix_attention_backend="reference", chunk_size=4)])
def test_tree_logprobs_match_plain_forward(family, options):
    model = make_model(family)
    rollouts = random_tree_rollouts(random.Random(11), num_rollouts=12)
    got = dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(rollouts), **options)
    assert len(got) == len(rollouts)
    for i, (rollout, logp) in enumerate(zip(rollouts, got)):
        expected = per_rollout_logprobs(model, rollout)
        assert logp.shape == expected.shape, f"rollout {i}"
        torch.testing.assert_close(logp.double(), expected, rtol=1e-9, atol=1e-9, msg=f"rollout {i}")


def test_tree_logprobs_keeps_no_graph():
    model = make_model("llama", torch.float32)
    rollouts = random_tree_rollouts(random.Random(12), num_rollouts=4)
    out = dta.tree_logprobs(model, dta.PrefixTree.from_rollouts(rollouts))
    assert all(not t.requires_grad for t in out)
    assert all(p.grad is None for p in model.parameters())
