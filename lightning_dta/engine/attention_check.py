"""The device self-check: no one trains on a prefix-attention kernel that has not been checked on this device.

Flash kernels change between PyTorch and flash-attn releases (argument order, log-sum-exp layout, what a
causal mask aligns to), and a kernel that is wrong in one of these ways still returns tensors of the right
shape. So once per (backend, device, attention shape, dtype), before the first step, packed siblings over a
prefix go forward and backward through the chosen backend and the same inputs through the model's own
attention path (scaled-dot-product attention over the concatenated keys with an explicit causal mask, as the
KV-cache path computes it, on the same device and dtype). A difference beyond the dtype's tolerance (or a
kernel that raises) is reported with the measured figure and prefix attention falls back to the model's
attention: exact, only slower and heavier.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from lightning_dta.engine.attention_backends import AttentionBackend
from lightning_dta.engine.device import expected_sync
from lightning_dta.engine.prefix_attention import AttentionShape, PackedLayout, PrefixCausalAttention, Spans

# Largest relative difference (Frobenius norm) from the model's attention, per tensor. Two correct kernels
# differ by rounding (measured on the CPU with these cases: 4.2e-3 in bfloat16, 5.5e-4 in float16, 6e-7 in
# float32); a wrong scale, merge or layout by 1e-2 to O(1). float32 matmuls in TF32 round like bfloat16.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
CASES = (((5, 1, 11), 37), ((9,), 0))  # (chunk lengths, prefix length): several spans incl. a 1-token one
TENSORS = ("query gradient", "prefix key gradient", "prefix value gradient", "key gradient",
           "value gradient")

_CHECKED: dict[tuple, str | None] = {}
_WARNED: set[str] = set()


class KernelCheckWarning(RuntimeWarning):
    """Prefix attention's kernels disagreed with the model's attention on this device; the model's attention
    is used instead."""


def fall_back(reason: str) -> str:
    """Warn (once per reason) that prefix attention falls back to the model's attention; returns ``reason``."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"{reason}. Prefix attention falls back to the model's own attention (exact, but every "
                      "sibling row gets a copy of the prefix). Fix: prefix_attention_backend= another backend, or "
                      "report the figures above", KernelCheckWarning, stacklevel=3)
    return reason


def check_kernels(backend: AttentionBackend, device: torch.device, shape: AttentionShape) -> str | None:
    """Why ``backend`` must not be used for attention calls of ``shape`` on ``device`` (``None``: it agrees
    with the model's attention). Cached; a failure warns once."""
    key = (type(backend), backend.name, str(device), shape)
    if key not in _CHECKED:
        reason = _check(backend, device, shape)
        _CHECKED[key] = fall_back(reason) if reason else None
    return _CHECKED[key]


def model_attention(query, prefix_keys, prefix_values, keys, values, spans: Spans, scale: float) -> torch.Tensor:
    """What the KV-cache path computes: each chunk's queries over [prefix, own keys] with an explicit causal
    mask (``[1, H, T, D]`` inputs, ``[1, T, H, D]`` output)."""
    groups = query.shape[1] // keys.shape[1]
    outs = []
    for a, n in spans:
        k, v = keys[:, :, a:a + n], values[:, :, a:a + n]
        prefix = 0
        if prefix_keys is not None:
            k, v = torch.cat([prefix_keys, k], 2), torch.cat([prefix_values, v], 2)
            prefix = prefix_keys.shape[2]
        mask = torch.ones(n, prefix + n, dtype=torch.bool, device=query.device).tril(prefix)
        outs.append(F.scaled_dot_product_attention(query[:, :, a:a + n], k.repeat_interleave(groups, 1),
                                                   v.repeat_interleave(groups, 1), attn_mask=mask, scale=scale))
    return torch.cat(outs, 2).transpose(1, 2)


def _relative(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    got, want = got.detach().double(), want.detach().double()
    return (got - want).norm() / want.norm().clamp_min(1e-30)


def _case(backend: AttentionBackend, device: torch.device, shape: AttentionShape, lengths: tuple[int, ...],
          prefix_length: int) -> list[tuple[str, float]]:
    """Relative difference from the model's attention of each output and gradient, for chunks of ``lengths``
    over a prefix of ``prefix_length``."""
    gen = torch.Generator().manual_seed(len(lengths))
    total, heads, kv_heads, dim = sum(lengths), shape.heads, shape.kv_heads, shape.head_dim

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=shape.dtype)

    query, keys, values = (rand(1, h, total, dim).requires_grad_() for h in (heads, kv_heads, kv_heads))
    prefix = tuple(rand(1, kv_heads, prefix_length, dim).requires_grad_() for _ in range(2)) if prefix_length \
        else (None, None)
    grad_out = rand(1, total, heads, dim)
    spans = tuple((sum(lengths[:i]), n) for i, n in enumerate(lengths))
    names, inputs = zip(*[(n, t) for n, t in zip(TENSORS, (query, *prefix, keys, values)) if t is not None])
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        got = PrefixCausalAttention.apply(query, *prefix, keys, values, PackedLayout.of(spans, prefix_length, device),
                                          shape.scale, backend)
        got_grads = torch.autograd.grad(got, inputs, grad_out)
        want = model_attention(query, *prefix, keys, values, spans, shape.scale)
        want_grads = torch.autograd.grad(want, inputs, grad_out)
    with expected_sync(device):
        errors = [float(_relative(g, w)) for g, w in zip((got, *got_grads), (want, *want_grads))]
    return [(name, math.inf if math.isnan(e) else e) for name, e in zip(("output", *names), errors)]


def _check(backend: AttentionBackend, device: torch.device, shape: AttentionShape) -> str | None:
    tolerance = TOLERANCE.get(shape.dtype, TOLERANCE[torch.bfloat16])
    if shape.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        tolerance = TOLERANCE[torch.bfloat16]
    worst, where = 0.0, ""
    for lengths, prefix_length in CASES:
        try:
            errors = _case(backend, device, shape, lengths, prefix_length)
        except Exception as error:  # a kernel that raises is as unusable as a wrong one
            return f"prefix attention's {backend.name!r} kernels failed on {device} {shape.dtype}: {error}"
        for name, error in errors:
            if error > worst:
                worst, where = error, f"{name}, {len(lengths)} chunk(s) over a {prefix_length}-token prefix"
    if worst > tolerance:
        return (f"prefix attention's {backend.name!r} kernels differ from the model's attention on {device} "
                f"{shape.dtype} by {worst:.2e} relative ({where}; tolerance {tolerance:.0e})")
    return None
