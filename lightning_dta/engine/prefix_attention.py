"""Attention of a chunk over its shared prefix without copying, masking or expanding the prefix.

A chunk's queries attend to two blocks of keys: the path's prefix (every query sees all of it) and the
chunk's own keys (causally). The model's own attention gets them as one concatenated key tensor per row plus
an explicit lower-right causal mask, which copies the prefix into every batch row, materialises the mask and
keeps the kernel from skipping masked blocks. Here the two blocks run as two flash-attention calls and are
merged with their log-sum-exps, as in cascade / shared-prefix attention kernels:

- sibling chunks are packed one after another into a single row (no padding; the linear layers see one long
  sequence), and the prefix block runs once for all of them (``[1, heads, tokens, dim]`` against
  ``[1, kv_heads, prefix, dim]``), so the gradient that reaches the shared keys/values is already summed;
- the own block is a square causal attention per chunk (``is_causal=True``, which skips masked blocks), so
  packed chunks never see each other.

Backward calls each block's flash backward with the *merged* output and log-sum-exp, which gives that
block's exact share of the gradient (the softmax normaliser and ``rowsum(dO * O)`` are the full row's).

It plugs into transformers as an attention implementation that the *attention switch*
(:func:`attention_switch`) turns on only for the duration of one sibling batch's forward; the chunks' new
keys/values (after RoPE) are recorded on the way (:class:`~lightning_dta.engine.kv.KVRecorder`), so no KV
cache object is involved. The kernels are PyTorch's CPU flash attention; on other devices the engine keeps
the model's own attention with a KV cache and a mask.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface

from lightning_dta.engine.errors import ModelNotSupportedError
from lightning_dta.engine.kv import KV, KVRecorder

ATTENTION_NAME = "lightning_dta_prefix"

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


Spans = tuple[tuple[int, int], ...]  # (offset, length) of each sibling chunk packed into one row


class PrefixCausalAttention(torch.autograd.Function):
    """softmax over [prefix keys, own keys (causal within each span)] for packed sibling chunks.

    ``query`` ``[1, H, T, D]`` holds the chunks one after another (``spans``); the prefix ``[1, Hkv, P, D]`` is
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
        # (siblings' subtrees); positions below the chunks' start never change before their pop, so it is
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
    """Causal attention within each span (packed chunks do not see each other): output and log-sum-exp."""
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
class SwitchedForward:
    """One forward under the attention switch: the prefix each layer attends to, the packed spans, and the
    record of the new keys/values each layer produced."""

    past: KV | None
    spans: Spans
    new_kv: KVRecorder = field(default_factory=KVRecorder)


_ACTIVE: ContextVar[SwitchedForward | None] = ContextVar("lightning_dta_prefix_attention", default=None)

# Keyword arguments that attention modules pass and that do not change what attention computes here. Anything
# else (sinks, soft-capping, position biases, sparse indices, ...) makes prefix attention refuse the model.
ALLOWED_KWARGS = frozenset({"position_ids", "use_cache", "sliding_window", "output_router_logits",
                            "output_attentions", "cache_position"})


class UnsupportedAttention(ModelNotSupportedError):
    """An attention call that prefix attention would not compute exactly."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"prefix attention cannot run this model: {reason}. Fix: "
                         "tree_backward(..., prefix_attention=False) uses the model's own attention")


def _unsupported_call(module: nn.Module, forward: SwitchedForward, prefix_length: int,
                      attention_mask: torch.Tensor | None, dropout: float, kwargs: dict) -> str | None:
    name = type(module).__name__
    layer = getattr(module, "layer_idx", None)
    window = kwargs.get("sliding_window")
    unknown = sorted(set(kwargs) - ALLOWED_KWARGS)
    if layer is None:
        return f"{name} has no layer_idx, so its layers cannot be told apart"
    if layer in forward.new_kv:
        return f"{name} calls attention more than once per layer"
    if attention_mask is not None:
        return f"{name} passes its own attention mask or bias"
    if dropout:
        return f"{name} applies attention dropout"
    if unknown:
        return f"{name} passes {unknown} to its attention"
    if kwargs.get("output_attentions"):
        return "attention weights are requested (output_attentions)"
    if window is not None and window < prefix_length + max(n for _, n in forward.spans):
        return f"{name} has a {window}-token sliding window"
    return None


def prefix_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-implementation signature; returns ``[B, L, H, D]`` like ``sdpa``."""
    forward = _ACTIVE.get()
    if forward is None:
        raise RuntimeError(f"attn_implementation={ATTENTION_NAME!r} only runs inside lightning_dta's tree engine")
    layer = getattr(module, "layer_idx", None)
    past = forward.past[layer] if forward.past and layer is not None else (None, None)
    prefix_length = past[0].shape[2] if past[0] is not None else 0
    reason = _unsupported_call(module, forward, prefix_length, attention_mask, dropout, kwargs)
    if reason is None and query.shape[0] != 1:
        reason = "the batch has more than one row (prefix attention takes chunks packed into one row)"
    if reason is not None:
        raise UnsupportedAttention(reason)
    forward.new_kv.record(layer, key, value)
    out = PrefixCausalAttention.apply(query, past[0], past[1], key, value, forward.spans, scaling)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION_NAME, prefix_attention_forward)

# Which configs are switched, and what they held before: the switch is counted per config so that
# overlapping engine runs on one model (threads) restore the model's own implementation exactly once.
_SWITCH_LOCK = threading.Lock()
_SWITCHED: dict[int, list] = {}  # id(config) -> [implementation before the first switch, active switches]


def original_implementation(config) -> str | None:
    """The model's own attention implementation, also while the engine has it switched."""
    with _SWITCH_LOCK:
        entry = _SWITCHED.get(id(config))
        return entry[0] if entry else getattr(config, "_attn_implementation", None)


def attention_configs(model: nn.Module) -> tuple:
    """The config objects the attention modules read their implementation from."""
    configs = {id(m.config): m.config for m in model.modules()
               if getattr(m, "layer_idx", None) is not None and hasattr(m, "config")}
    return tuple(configs.values())


def unsupported_reason(model: nn.Module, device: torch.device, configs: tuple) -> str | None:
    """Why the model's configuration rules prefix attention out (``None``: nothing does; :func:`probe` decides).
    ``configs``: :func:`attention_configs` of the model."""
    if device.type != "cpu":
        return f"its kernels are PyTorch's CPU flash attention and the model is on {device.type}"
    if not configs:
        return "no attention module has a layer_idx"
    implementations = {original_implementation(c) for c in configs}
    if not implementations <= {"sdpa", "eager"}:
        return f"attn_implementation={sorted(map(str, implementations))} (prefix attention replaces 'sdpa' or 'eager')"
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(kind != "full_attention" for kind in getattr(text, "layer_types", None) or ()):
        return "the model has sliding-window or other non-full attention layers"
    if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
        return "the model uses a sliding attention window"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "the model soft-caps attention logits"
    return None


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {training: reason or None}


def probe(model: nn.Module, num_layers: int | None) -> str | None:
    """Run one 2-token forward under prefix attention, checking every attention call (masks, dropout, extra
    arguments, layers called twice or not at all); the reason it cannot be used, or ``None``. Cached per model
    and train/eval mode; every later call is checked the same way and raises if something changed."""
    results = _PROBED.setdefault(model, {})
    if model.training not in results:
        device = next(model.parameters()).device
        reason = None
        try:
            # fork_rng: the probe must not shift the random stream of training (dropout, router noise)
            with torch.random.fork_rng(devices=[]), torch.no_grad(), \
                    attention_switch(attention_configs(model), None, ((0, 2),)) as forward:
                model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
                      position_ids=torch.arange(2, device=device)[None], use_cache=False)
            if num_layers is not None and len(forward.new_kv) != num_layers:
                reason = f"only {len(forward.new_kv)} of its {num_layers} layers call the attention interface"
        except UnsupportedAttention as error:
            reason = error.reason
        results[model.training] = reason
    return results[model.training]


@contextmanager
def attention_switch(configs: tuple, past: KV | None, spans: Spans) -> Iterator[SwitchedForward]:
    """The attention switch: run the model's attention as prefix attention over ``past`` for one forward of the
    packed chunks ``spans``; yields the forward's record (its ``new_kv``). The switch is undone on exit, even on
    error. Another thread using the same model meanwhile would run prefix attention too and fail loudly: a
    model being trained is not for concurrent use."""
    forward = SwitchedForward(past, spans)
    token = _ACTIVE.set(forward)
    with _SWITCH_LOCK:
        for c in configs:
            entry = _SWITCHED.setdefault(id(c), [c._attn_implementation_internal, 0])
            entry[1] += 1
            c._attn_implementation_internal = ATTENTION_NAME
    try:
        yield forward
    finally:
        with _SWITCH_LOCK:
            for c in configs:
                entry = _SWITCHED[id(c)]
                entry[1] -= 1
                if entry[1] == 0:
                    c._attn_implementation_internal = entry[0]
                    del _SWITCHED[id(c)]
        _ACTIVE.reset(token)
