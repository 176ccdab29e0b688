"""Prefix attention against plain attention over [prefix, own keys] with an explicit mask, per span.

The end-to-end exactness tests run it inside real models; these pin the kernel glue itself: packed spans
that must not see each other, grouped-query heads, no prefix, and half precision.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_dta.engine.prefix_attention import PrefixCausalAttention


def reference(query, prefix_keys, prefix_values, keys, values, spans, scale):
    """Each span alone: its queries over the prefix and its own keys, causal within the span."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    rep = heads // kv_heads
    outs = []
    for a, n in spans:
        k, v = keys[:, :, a:a + n], values[:, :, a:a + n]
        prefix = 0
        if prefix_keys is not None:
            k, v = torch.cat([prefix_keys, k], 2), torch.cat([prefix_values, v], 2)
            prefix = prefix_keys.shape[2]
        mask = torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix)
        outs.append(F.scaled_dot_product_attention(query[:, :, a:a + n], k.repeat_interleave(rep, 1),
                                                   v.repeat_interleave(rep, 1), attn_mask=mask, scale=scale))
    return torch.cat(outs, 2)


def inputs(dtype, spans, prefix_len, heads=4, kv_heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(n for _, n in spans)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    prefix = (rand(1, kv_heads, prefix_len, dim), rand(1, kv_heads, prefix_len, dim)) if prefix_len else (None, None)
    return rand(1, heads, total, dim), *prefix, rand(1, kv_heads, total, dim), rand(1, kv_heads, total, dim)


def grads(fn, tensors, grad_out):
    out = fn(*tensors)
    wanted = [t for t in tensors if t is not None]
    return out, torch.autograd.grad(out, wanted, grad_out)


@pytest.mark.parametrize("spans,prefix_len", [(((0, 5),), 7), (((0, 3), (3, 6), (9, 1)), 11),
                                              (((0, 4), (4, 4)), 0)])
def test_matches_masked_attention_in_float64(spans, prefix_len):
    tensors = inputs(torch.float64, spans, prefix_len)
    grad_out = torch.randn(tensors[0].shape, dtype=torch.float64)
    got, got_grads = grads(lambda *t: PrefixCausalAttention.apply(*t, spans, 0.3), tensors, grad_out)
    want, want_grads = grads(lambda *t: reference(*t, spans, 0.3), tensors, grad_out)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_bfloat16_close_to_float64():
    spans, prefix_len = ((0, 16), (16, 24)), 32
    exact = inputs(torch.float64, spans, prefix_len, seed=1)
    half = [t.detach().to(torch.bfloat16).requires_grad_() for t in exact]
    grad_out = torch.randn(exact[0].shape, dtype=torch.float64)
    want, want_grads = grads(lambda *t: reference(*t, spans, 0.35), exact, grad_out)
    got, got_grads = grads(lambda *t: PrefixCausalAttention.apply(*t, spans, 0.35), half, grad_out.bfloat16())
    assert got.dtype == torch.bfloat16
    for g, w in zip((got, *got_grads), (want, *want_grads)):
        error = (g.double() - w).norm() / w.norm()
        assert error < 2e-2, float(error)  # bf16 keeps ~3 significant digits; a wrong merge is off by O(1)
