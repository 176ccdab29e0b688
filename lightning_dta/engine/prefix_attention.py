"""Attention of a segment over its shared prefix without copying, masking or expanding the prefix.

A tree segment's queries attend to two blocks of keys: the path's prefix (every query sees all of it) and
the segment's own keys (causally). The model's own attention gets them as one concatenated key tensor per
row plus an explicit lower-right causal mask, which copies the prefix into every batch row, materialises the
mask and keeps the kernel from skipping masked blocks. Here the two blocks run as two flash-attention calls
and are merged with their log-sum-exps, as in cascade / shared-prefix attention kernels:

- the prefix block runs once for all sibling rows, with their queries stacked into one long query sequence
  (``[1, heads, rows x length, dim]`` against ``[1, kv_heads, prefix, dim]``), so the gradient that reaches
  the shared keys/values is already summed over the rows;
- the own block is a square causal attention per row (``is_causal=True``, which skips masked blocks).

Backward calls each block's flash backward with the *merged* output and log-sum-exp, which gives that
block's exact share of the gradient (the softmax normaliser and ``rowsum(dO * O)`` are the full row's).

It plugs into transformers as an attention implementation that is switched on only for the duration of a
segment's forward (:func:`segment_attention`); the segment's new keys/values (after RoPE) are recorded on
the way, so no KV cache object is involved. The kernels are PyTorch's CPU flash attention; on other devices
the engine keeps the model's own attention with a KV cache and a mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface

ATTENTION_NAME = "lightning_dta_prefix"
KV = list[tuple[torch.Tensor, torch.Tensor]]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _stack_rows(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, ...]`` -> ``[1, H, B*L, ...]``: every row's queries as one sequence over a shared prefix."""
    return t.transpose(0, 1).reshape(1, t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:])


def _unstack_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.reshape(t.shape[1], rows, t.shape[2] // rows, *t.shape[3:]).transpose(0, 1)


class PrefixCausalAttention(torch.autograd.Function):
    """softmax over [prefix keys, own keys (causal)] for ``query`` ``[B, H, L, D]``; prefix ``[1, Hkv, P, D]``
    shared by the ``B`` rows, own keys/values ``[B, Hkv, L, D]``. Grouped-query heads are native."""

    @staticmethod
    def forward(ctx, query, prefix_keys, prefix_values, keys, values, scale):
        rows = query.shape[0]
        own, own_lse = _flash(query, keys, values, 0.0, True, scale=scale)
        if prefix_keys is None:
            out, lse = own, own_lse
        else:
            shared, shared_lse = _flash(_stack_rows(query), prefix_keys, prefix_values, 0.0, False, scale=scale)
            shared, shared_lse = _unstack_rows(shared, rows), _unstack_rows(shared_lse, rows)
            lse = torch.logaddexp(shared_lse, own_lse)
            out = (shared * torch.exp(shared_lse - lse)[..., None]
                   + own * torch.exp(own_lse - lse)[..., None]).to(query.dtype)
        ctx.save_for_backward(query, keys, values, out, lse)
        # The prefix is a view of the path buffers, which are written beyond it while this graph is alive
        # (siblings' subtrees); positions below the segment's start never change before its pop, so it is
        # kept by reference instead of through the version-checked saved-tensor mechanism.
        ctx.prefix = (prefix_keys, prefix_values)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, keys, values, out, lse = ctx.saved_tensors
        prefix_keys, prefix_values = ctx.prefix
        grad_out = grad_out.contiguous()
        grad_query, grad_keys, grad_values = _flash_backward(grad_out, query, keys, values, out, lse, 0.0, True,
                                                             scale=ctx.scale)
        grad_prefix_keys = grad_prefix_values = None
        if prefix_keys is not None:
            rows = query.shape[0]
            grad_shared_query, grad_prefix_keys, grad_prefix_values = _flash_backward(
                _stack_rows(grad_out), _stack_rows(query), prefix_keys, prefix_values, _stack_rows(out),
                _stack_rows(lse), 0.0, False, scale=ctx.scale)
            grad_query = grad_query + _unstack_rows(grad_shared_query, rows)
        return grad_query, grad_prefix_keys, grad_prefix_values, grad_keys, grad_values, None


@dataclass
class SegmentAttention:
    """The prefix each layer attends to during one segment's forward, and the new keys/values it produced."""

    past: KV | None
    new_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def new_kv(self) -> KV:
        return [self.new_states[i] for i in sorted(self.new_states)]


_ACTIVE: ContextVar[SegmentAttention | None] = ContextVar("lightning_dta_segment", default=None)


def prefix_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-implementation signature; returns ``[B, L, H, D]`` like ``sdpa``."""
    segment = _ACTIVE.get()
    if segment is None:
        raise RuntimeError(f"attn_implementation={ATTENTION_NAME!r} only runs inside lightning_dta's tree engine")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} has no layer_idx; lightning_dta cannot tell its layers apart")
    past = segment.past[layer] if segment.past else (None, None)
    total = (past[0].shape[2] if past[0] is not None else 0) + query.shape[2]
    window = kwargs.get("sliding_window")
    if dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or \
            (window is not None and window < total):
        raise RuntimeError(f"{type(module).__name__} uses attention dropout, soft-capping, sinks or a sliding window; "
                           "the engine should have used the model's own attention (bug in lightning_dta)")
    segment.new_states[layer] = (key, value)
    out = PrefixCausalAttention.apply(query, past[0], past[1], key, value, scaling)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION_NAME, prefix_attention_forward)


def unsupported_reason(model: nn.Module, device: torch.device, attn_implementation: str | None) -> str | None:
    """Why this model cannot use prefix attention (``None`` when it can)."""
    if device.type != "cpu":
        return f"its kernels are PyTorch's CPU flash attention and the model is on {device.type}"
    if attn_implementation not in ("sdpa", "eager"):
        return f"attn_implementation={attn_implementation!r} (prefix attention replaces 'sdpa' or 'eager')"
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(kind != "full_attention" for kind in getattr(text, "layer_types", None) or ()):
        return "the model has sliding-window or other non-full attention layers"
    if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
        return "the model uses a sliding attention window"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "the model soft-caps attention logits"
    if model.training and (getattr(text, "attention_dropout", 0.0) or getattr(text, "attn_pdrop", 0.0)):
        return "attention dropout is active"
    if not any(getattr(m, "layer_idx", None) is not None for m in model.modules()):
        return "no attention module has a layer_idx"
    return None


def attention_configs(model: nn.Module) -> tuple:
    """The config objects the attention modules read their implementation from."""
    configs = {id(m.config): m.config for m in model.modules()
               if getattr(m, "layer_idx", None) is not None and hasattr(m, "config")}
    return tuple(configs.values())


@contextmanager
def segment_attention(configs: tuple, past: KV | None) -> Iterator[SegmentAttention]:
    """Run the model's attention as prefix attention over ``past`` for one forward; yields the record of the
    segment's new keys/values. The implementation switch is undone on exit, even on error."""
    segment = SegmentAttention(past)
    token = _ACTIVE.set(segment)
    previous = [c._attn_implementation_internal for c in configs]
    for c in configs:
        c._attn_implementation_internal = ATTENTION_NAME
    try:
        yield segment
    finally:
        for c, name in zip(configs, previous):
            c._attn_implementation_internal = name
        _ACTIVE.reset(token)
