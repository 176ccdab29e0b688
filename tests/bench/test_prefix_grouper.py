"""The PrefixGrouper bench mode (a published one-level peer) is exact on the CPU with a reference kernel.

On a GPU it runs through flash-attention 2; here the kernel is replaced by a plain implementation of the
conventions transformers' flash-attention 2 path follows with a padding mask: keys are the mask's tokens,
queries the last ``len`` columns of it, causal aligned bottom-right, padded query rows zero. What is tested
is everything around the kernel: packing, positions, PrefixGrouper's own grouping, the loss on the grid.
"""

from __future__ import annotations

import random

import pytest
import torch

import lightning_dta as dta
from lightning_dta.bench.prefix_grouper import prefix_grouper_backward, unavailable_reason
from tests.helpers.models import make_model, random_tree_rollouts
from tests.helpers.reference import assert_grads_close, reference_grads

pytest.importorskip("prefix_grouper")


def padded_causal_attention(query, key, value, padding_mask, scale):
    """[b, heads, len, dim] inputs, a [b, keys] padding mask; [b, len, heads, dim] out."""
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    out = torch.zeros(batch, length, heads, dim, dtype=query.dtype)
    for b in range(batch):
        keys_valid = padding_mask[b].bool()
        queries_valid = padding_mask[b, -length:].bool()
        k = key[b][:, keys_valid].repeat_interleave(groups, 0)
        v = value[b][:, keys_valid].repeat_interleave(groups, 0)
        q = query[b][:, queries_valid]
        n, m = q.shape[1], k.shape[1]
        visible = torch.ones(n, m, dtype=torch.bool).tril(m - n)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
        out[b, queries_valid] = attended.transpose(0, 1)
    return out


def grpo_rollouts(seed: int) -> list[dta.Rollout]:
    rng = random.Random(seed)
    rollouts = []
    for group in range(3):
        prompt = [group + 1] + [rng.randrange(48) for _ in range(rng.randint(4, 9))]
        for _ in range(4):
            response = [rng.randrange(48) for _ in range(rng.randint(1, 6))]
            old = [0.0] + [-rng.uniform(0.5, 4.0) for _ in range(len(prompt) + len(response) - 1)]
            rollouts.append(dta.Rollout(input_ids=prompt + response,
                                        loss_mask=[0] * len(prompt) + [1] * len(response),
                                        advantages=rng.gauss(0, 1), old_logprobs=old))
    return rollouts


@pytest.mark.parametrize("rollouts", [grpo_rollouts(0), random_tree_rollouts(random.Random(5), num_rollouts=9)],
                         ids=["grpo", "deeper-tree"])
def test_prefix_grouper_mode_matches_the_per_rollout_reference(rollouts):
    model = make_model("qwen2")
    loss_fn = dta.PolicyLoss(clip_eps=0.2, kl_coef=0.0, entropy_coef=0.01)
    ref_loss, ref = reference_grads(model, rollouts, loss_fn)
    model.zero_grad(set_to_none=True)
    loss = prefix_grouper_backward(model, dta.PrefixTree.from_rollouts(rollouts), loss_fn,
                                   attention=padded_causal_attention)
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert_grads_close(got, ref, 1e-5, what="prefix-grouper")
    assert model.config._attn_implementation == "sdpa"


def test_unavailable_on_the_cpu_with_the_reason():
    assert "CUDA" in unavailable_reason(torch.device("cpu"))
