"""Attention of a segment over its shared prefix without copying, masking or expanding the prefix.

A tree segment's queries attend to two blocks of keys: the path's prefix (every query sees all of it) and
the segment's own keys (causally). The model's own attention gets them as one concatenated key tensor per
row plus an explicit lower-right causal mask, which copies the prefix into every batch row, materialises the
mask and keeps the kernel from skipping masked blocks. Here the two blocks run as two flash-attention calls
and are merged with their log-sum-exps, as in cascade / shared-prefix attention kernels:

- sibling segments are packed one after another into a single row (no padding; the linear layers see one
  long sequence), and the prefix block runs once for all of them (``[1, heads, tokens, dim]`` against
  ``[1, kv_heads, prefix, dim]``), so the gradient that reaches the shared keys/values is already summed;
- the own block is a square causal attention per segment (``is_causal=True``, which skips masked blocks),
  so packed segments never see each other.

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


Spans = tuple[tuple[int, int], ...]  # (offset, length) of each sibling segment packed into one row


class PrefixCausalAttention(torch.autograd.Function):
    """softmax over [prefix keys, own keys (causal within each span)] for packed sibling segments.

    ``query`` ``[1, H, T, D]`` holds the segments one after another (``spans``); the prefix ``[1, Hkv, P, D]`` is
    shared by all of them; own keys/values ``[1, Hkv, T, D]``. Grouped-query heads are native to the kernels.
    """

    @staticmethod
    def forward(ctx, query, prefix_keys, prefix_values, keys, values, spans, scale):
        out, lse = _causal_spans(query, keys, values, spans, scale)
        if prefix_keys is not None:
            shared, shared_lse = _flash(query, prefix_keys, prefix_values, 0.0, False, scale=scale)
            merged = torch.logaddexp(shared_lse, lse)
            out = (shared * torch.exp(shared_lse - merged)[..., None]
                   + out * torch.exp(lse - merged)[..., None]).to(query.dtype)
            lse = merged
        ctx.save_for_backward(query, keys, values, out, lse)
        # The prefix is a view of the path buffers, which are written beyond it while this graph is alive
        # (siblings' subtrees); positions below the segment's start never change before its pop, so it is
        # kept by reference instead of through the version-checked saved-tensor mechanism.
        ctx.prefix = (prefix_keys, prefix_values)
        ctx.spans, ctx.scale = spans, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, keys, values, out, lse = ctx.saved_tensors
        prefix_keys, prefix_values = ctx.prefix
        grad_out = grad_out.contiguous()
        if len(ctx.spans) == 1:
            grad_query, grad_keys, grad_values = _flash_backward(grad_out, query, keys, values, out, lse, 0.0, True,
                                                                 scale=ctx.scale)
        else:
            grad_query, grad_keys, grad_values = (torch.empty_like(query), torch.empty_like(keys),
                                                  torch.empty_like(values))
            for a, n in ctx.spans:
                s = slice(a, a + n)
                grads = _flash_backward(grad_out[:, :, s], query[:, :, s], keys[:, :, s], values[:, :, s],
                                        out[:, :, s], lse[:, :, s], 0.0, True, scale=ctx.scale)
                for total, part in zip((grad_query, grad_keys, grad_values), grads):
                    total[:, :, s] = part
        grad_prefix_keys = grad_prefix_values = None
        if prefix_keys is not None:
            grad_shared_query, grad_prefix_keys, grad_prefix_values = _flash_backward(
                grad_out, query, prefix_keys, prefix_values, out, lse, 0.0, False, scale=ctx.scale)
            grad_query += grad_shared_query
        return grad_query, grad_prefix_keys, grad_prefix_values, grad_keys, grad_values, None, None


def _causal_spans(query, keys, values, spans: Spans, scale):
    """Causal attention within each span (packed segments do not see each other): output and log-sum-exp."""
    if len(spans) == 1:
        return _flash(query, keys, values, 0.0, True, scale=scale)
    out = lse = None
    for a, n in spans:
        s = slice(a, a + n)
        span_out, span_lse = _flash(query[:, :, s], keys[:, :, s], values[:, :, s], 0.0, True, scale=scale)
        if out is None:
            out = query.new_empty(query.shape)
            lse = span_lse.new_empty(query.shape[:3])
        out[:, :, s], lse[:, :, s] = span_out, span_lse
    return out, lse


@dataclass
class SegmentAttention:
    """The prefix each layer attends to during one segment's forward, and the new keys/values it produced."""

    past: KV | None
    spans: Spans
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
    longest = (past[0].shape[2] if past[0] is not None else 0) + max(n for _, n in segment.spans)
    window = kwargs.get("sliding_window")
    if dropout or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or \
            (window is not None and window < longest):
        raise RuntimeError(f"{type(module).__name__} uses attention dropout, soft-capping, sinks or a sliding window; "
                           "the engine should have used the model's own attention (bug in lightning_dta)")
    segment.new_states[layer] = (key, value)
    if query.shape[0] != 1:
        raise RuntimeError("prefix attention takes sibling segments packed into one row (bug in lightning_dta)")
    out = PrefixCausalAttention.apply(query, past[0], past[1], key, value, segment.spans, scaling)
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
def segment_attention(configs: tuple, past: KV | None, spans: Spans) -> Iterator[SegmentAttention]:
    """Run the model's attention as prefix attention over ``past`` for one forward of the packed segments
    ``spans``; yields the record of their new keys/values. The implementation switch is undone on exit, even on
    error."""
    segment = SegmentAttention(past, spans)
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
