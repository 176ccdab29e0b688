"""Attention of a chunk over its shared prefix without copying, masking or expanding the prefix.

A chunk's queries attend to two blocks of keys: the path's prefix (every query sees all of it) and the
chunk's own keys (causally). The model's own attention gets them as one concatenated key tensor per row plus
an explicit lower-right causal mask, which copies the prefix into every batch row, materialises the mask and
keeps the kernel from skipping masked blocks. Here the two blocks run as two varlen flash-attention calls and
are merged with their log-sum-exps, as in cascade / shared-prefix attention kernels:

- sibling chunks are packed one after another into a single row (no padding; the linear layers see one long
  sequence), and the prefix block runs once for all of them (all ``T`` queries against the ``P`` prefix keys),
  so the gradient that reaches the shared keys/values is already summed;
- the own block is one causal varlen call whose sequences are the chunks (each chunk its own causal square),
  so packed chunks never see each other.

Backward calls each block's flash backward with the *merged* output and log-sum-exp, which gives that
block's exact share of the gradient (the softmax normaliser and ``rowsum(dO * O)`` are the full row's).

The kernels are a backend (:mod:`~lightning_dta.engine.attention_backends`: CPU flash, CUDA varlen flash,
flash-attn, or the pure-PyTorch reference). It plugs into transformers as an attention implementation that
the *attention switch* (:func:`attention_switch`, through the adapter of :mod:`~lightning_dta.engine.hf_attention`)
turns on only for the duration of one sibling batch's forward; the chunks' new keys/values (after RoPE) are
recorded on the way (:class:`~lightning_dta.engine.kv.KVRecorder`), so no KV cache object is involved.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_dta.engine.attention_backends import AttentionBackend, Varlen
from lightning_dta.engine.errors import ModelNotSupportedError
from lightning_dta.engine.hf_attention import AttentionSwitch, attention_configs
from lightning_dta.engine.kv import KV, KVRecorder

ATTENTION_NAME = "lightning_dta_prefix"

Spans = tuple[tuple[int, int], ...]  # (offset, length) of each sibling chunk packed into one row


@dataclass(frozen=True)
class PackedLayout:
    """The varlen offsets of one forward (shared by all layers): the packed chunks (``spans``, each its own
    causal sequence) and, when there is a prefix, all queries as one sequence (``queries``) over it
    (``prefix``)."""

    spans: Varlen
    queries: Varlen | None = None
    prefix: Varlen | None = None

    @classmethod
    def of(cls, spans: Spans, prefix_length: int, device: torch.device) -> PackedLayout:
        lengths = tuple(n for _, n in spans)
        if prefix_length == 0:
            return cls(Varlen.of(lengths, device))
        return cls(Varlen.of(lengths, device), Varlen.of((sum(lengths),), device), Varlen.of((prefix_length,), device))


def tokens_first(t: torch.Tensor) -> torch.Tensor:
    """``[1, heads, tokens, dim]`` (transformers' layout) as the varlen ``[tokens, heads, dim]``, a view."""
    return t[0].transpose(0, 1)


def merge(out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two key blocks from each block's output ``[T, H, D]`` and log-sum-exp ``[H, T]``."""
    merged = torch.logaddexp(lse, other_lse)
    weight, other_weight = torch.exp(lse - merged).t()[..., None], torch.exp(other_lse - merged).t()[..., None]
    return (out * weight + other * other_weight).to(out.dtype), merged


@dataclass(frozen=True)
class AncestorLevel:
    """Level ``d`` of a cousin batch: the queries of the chunks deeper than ``d`` (``index`` into the batch's
    tokens, ``None``: all of them, in order), grouped by their ancestor at ``d`` (``queries``), and those ancestors'
    keys/values, concatenated once per layer (``kv``; ``keys`` their lengths)."""

    index: torch.Tensor | None
    queries: Varlen
    keys: Varlen
    kv: KV


def cousin_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Varlen, levels: list[AncestorLevel],
                     layer: int, backend: AttentionBackend, scale: float) -> torch.Tensor:
    """``[T, H, D]`` attention of packed chunks (``spans``) over their own keys (causal) and their ancestors
    (``levels``), merged by log-sum-exp. Forward only."""
    out, lse = backend.forward(q, k, v, spans, spans, True, scale)
    for level in levels:
        keys, values = level.kv[layer]
        if level.index is None:
            other, other_lse = backend.forward(q, tokens_first(keys), tokens_first(values), level.queries, level.keys,
                                               False, scale)
            out, lse = merge(out, lse, other, other_lse)
            continue
        other, other_lse = backend.forward(q.index_select(0, level.index), tokens_first(keys), tokens_first(values),
                                           level.queries, level.keys, False, scale)
        merged, merged_lse = merge(out.index_select(0, level.index), lse.index_select(1, level.index), other,
                                   other_lse)
        out, lse = out.index_copy(0, level.index, merged), lse.index_copy(1, level.index, merged_lse)
    return out


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1)[None]


class PrefixCausalAttention(torch.autograd.Function):
    """softmax over [prefix keys, own keys (causal within each span)] for packed sibling chunks.

    ``query`` ``[1, H, T, D]`` holds the chunks one after another (``layout.spans``); the prefix ``[1, Hkv, P,
    D]`` is shared by all of them; own keys/values ``[1, Hkv, T, D]``. Returns ``[1, T, H, D]``. Two calls of
    ``backend``: one causal varlen call for all spans, one call of all queries over the prefix; merged by
    log-sum-exp, and each block's backward is called with the merged output and log-sum-exp.
    """

    @staticmethod
    def forward(ctx, query, prefix_keys, prefix_values, keys, values, layout: PackedLayout, scale: float,
                backend: AttentionBackend):
        q, k, v = tokens_first(query), tokens_first(keys), tokens_first(values)
        out, lse = backend.forward(q, k, v, layout.spans, layout.spans, True, scale)
        if prefix_keys is not None:
            shared, shared_lse = backend.forward(q, tokens_first(prefix_keys), tokens_first(prefix_values),
                                                 layout.queries, layout.prefix, False, scale)
            out, lse = merge(out, lse, shared, shared_lse)
        ctx.save_for_backward(query, keys, values, out, lse)
        # The prefix is a view of the path buffers, which are written beyond it while this graph is alive
        # (siblings' subtrees); positions below the chunks' start never change before their pop, so it is
        # kept by reference instead of through the version-checked saved-tensor mechanism.
        ctx.prefix = (prefix_keys, prefix_values)
        ctx.layout, ctx.scale, ctx.backend = layout, scale, backend
        return out[None]

    @staticmethod
    def backward(ctx, grad_out):
        query, keys, values, out, lse = ctx.saved_tensors
        prefix_keys, prefix_values = ctx.prefix
        layout, scale, backend = ctx.layout, ctx.scale, ctx.backend
        q, k, v = tokens_first(query), tokens_first(keys), tokens_first(values)
        grad_out = grad_out[0].contiguous()
        grad_q, grad_k, grad_v = backend.backward(grad_out, q, k, v, out, lse, layout.spans, layout.spans, True,
                                                  scale)
        grad_prefix_keys = grad_prefix_values = None
        if prefix_keys is not None:
            grad_shared_q, grad_prefix_keys, grad_prefix_values = backend.backward(
                grad_out, q, tokens_first(prefix_keys), tokens_first(prefix_values), out, lse, layout.queries,
                layout.prefix, False, scale)
            grad_q = grad_q + grad_shared_q
            grad_prefix_keys, grad_prefix_values = _heads_first(grad_prefix_keys), _heads_first(grad_prefix_values)
        return (_heads_first(grad_q), grad_prefix_keys, grad_prefix_values, _heads_first(grad_k),
                _heads_first(grad_v), None, None, None)


@dataclass(frozen=True)
class AttentionShape:
    """What one attention call of the model looks like (the self-check runs the kernels on these shapes)."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scale: float


@dataclass
class SwitchedForward:
    """One forward under the attention switch: the kernels, the prefix each layer attends to, the packed spans,
    the record of the new keys/values each layer produced, and (from its first call) the attention shape."""

    backend: AttentionBackend
    past: KV | None
    spans: Spans
    levels: list | None = None  # a cousin batch's ancestor levels (forward only, :mod:`.cousins`) instead of past
    deepest_start: int = 0  # a cousin batch's largest start position (the sliding-window check)
    new_kv: KVRecorder = field(default_factory=KVRecorder)
    shape: AttentionShape | None = None
    _layout: PackedLayout | None = None

    def layout(self, prefix_length: int, device: torch.device) -> PackedLayout:
        """The varlen offsets, built (and copied to the device) once per forward, not once per layer."""
        if self._layout is None:
            self._layout = PackedLayout.of(self.spans, prefix_length, device)
        return self._layout


_ACTIVE: ContextVar[SwitchedForward | None] = ContextVar("lightning_dta_prefix_attention", default=None)

# Keyword arguments that attention modules pass and that do not change what attention computes here. Anything
# else (sinks, soft-capping, position biases, sparse indices, ...) makes prefix attention refuse the model.
# (transformers 5.0 and 5.1 hand the output_* flags a model forward gets, as from PEFT, down to every attention call.)
ALLOWED_KWARGS = frozenset({"position_ids", "use_cache", "sliding_window", "output_router_logits",
                            "output_attentions", "output_hidden_states", "cache_position"})


class UnsupportedAttention(ModelNotSupportedError):
    """An attention call that prefix attention would not compute exactly."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"prefix attention cannot run this model: {reason}. Fix: "
                         "tree_backward(..., prefix_attention=False) uses the model's own attention")


def _unsupported_call(module: nn.Module, forward: SwitchedForward, prefix_length: int,
                      attention_mask: torch.Tensor | None, dropout: float, kwargs: dict) -> str | None:
    name = type(module).__name__
    # transformers' attention modules carry one; other modules do not
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


class KernelError(RuntimeError):
    """The prefix-attention backend failed on a call (the model's set-up was fine)."""


def prefix_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-implementation signature; returns ``[B, L, H, D]`` like ``sdpa``."""
    forward = _ACTIVE.get()
    if forward is None:
        raise RuntimeError(f"attn_implementation={ATTENTION_NAME!r} only runs inside lightning_dta's tree engine")
    # transformers' attention modules carry one; other modules do not
    layer = getattr(module, "layer_idx", None)
    past = forward.past[layer] if forward.past and layer is not None else (None, None)
    if torch.is_autocast_enabled(query.device.type):
        # Mixed precision: the model's own attention (SDPA, an autocast op) computes in the autocast dtype, whatever
        # dtype its inputs have (a Llama's keys leave RoPE in float32, its values leave the projection in bfloat16).
        # A custom kernel is not an autocast op: cast as SDPA would, so the kernels get one dtype.
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        past = tuple(t.to(dtype) if t is not None else None for t in past)
    prefix_length = past[0].shape[2] if past[0] is not None else forward.deepest_start
    reason = _unsupported_call(module, forward, prefix_length, attention_mask, dropout, kwargs)
    if reason is None and query.shape[0] != 1:
        reason = "the batch has more than one row (prefix attention takes chunks packed into one row)"
    reason = reason or forward.backend.unsupported_shape(query.shape[-1]) or \
        forward.backend.unsupported(query.device, query.dtype)
    if reason is not None:
        raise UnsupportedAttention(reason)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if forward.shape is None:
        forward.shape = AttentionShape(query.shape[1], key.shape[1], query.shape[-1], query.dtype, scale)
    forward.new_kv.record(layer, key, value)
    layout = forward.layout(prefix_length if forward.levels is None else 0, query.device)
    try:
        if forward.levels is not None:
            if torch.is_grad_enabled():
                raise RuntimeError("a cousin batch is forward only (its ancestors' keys/values carry no gradient)")
            out = cousin_attention(tokens_first(query), tokens_first(key), tokens_first(value), layout.spans,
                                   forward.levels, layer, forward.backend, scale)[None]
            return out, None
        out = PrefixCausalAttention.apply(query, past[0], past[1], key, value, layout, scale, forward.backend)
    except Exception as error:
        raise KernelError(f"prefix attention's {forward.backend.name!r} kernels failed: {error}") from error
    return out, None


SWITCH = AttentionSwitch(ATTENTION_NAME, prefix_attention_forward)


def original_implementation(config) -> str | None:
    """The model's own attention implementation, also while the engine has it switched."""
    return SWITCH.original(config)


REPLACEABLE = frozenset({"sdpa", "eager", "flash_attention_2", "flash_attention_3"})  # plain softmax attention


def unsupported_reason(model: nn.Module, configs: tuple) -> str | None:
    """Why the model's configuration rules prefix attention out (``None``: nothing does; :func:`probe` decides).
    ``configs``: :func:`attention_configs` of the model.

    Decided here, before the walk, from every attention module and every config they read: a sliding window only
    shows at a call whose keys outrun it, which the 2-token probe never makes, and a refusal in the middle of a
    walk cannot fall back to the model's attention (``prefix_attention=None`` promises that it does)."""
    if not configs:
        return "no attention module has a layer_idx"
    implementations = {original_implementation(c) for c in configs}
    if not implementations <= REPLACEABLE:
        return (f"attn_implementation={sorted(map(str, implementations))} (prefix attention replaces "
                f"{sorted(REPLACEABLE)})")
    # a user's model: not every nn.Module carries a Hugging Face config
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for each in {id(c): c for c in (text, *configs) if c is not None}.values():
        if reason := _config_reason(each):
            return reason
    for module in model.modules():
        # transformers' attention modules carry a layer_idx, and the window they pass to attention (the config's
        # field, or None for a full-attention layer: Qwen3-MoE reads the field whatever use_sliding_window says)
        window = getattr(module, "sliding_window", None) if getattr(module, "layer_idx", None) is not None else None
        if window is not None:
            return f"{type(module).__name__} of layer {module.layer_idx} has a {window}-token sliding window"
    return None


def _config_reason(config) -> str | None:
    """Why one config rules prefix attention out (``None``: it does not)."""
    # optional config fields: not every model family has them
    layer_types = getattr(config, "layer_types", None)
    if any(kind != "full_attention" for kind in layer_types or ()):
        return "the model has sliding-window or other non-full attention layers"
    # Where layer_types say which layers slide (Qwen2, Qwen3), use_sliding_window=False leaves a window unused;
    # without them the forward reads the window alone (Qwen3-MoE's mask and attention, Mistral's), whatever the flag.
    # optional config fields: not every model family has them
    window, flag = getattr(config, "sliding_window", None), getattr(config, "use_sliding_window", True)
    if window is not None and (not layer_types or flag):
        return "the model uses a sliding attention window"
    # optional config fields: not every model family has them
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "the model soft-caps attention logits"
    return None


@dataclass(frozen=True)
class ProbeResult:
    """What the probe forward found: why prefix attention cannot run (``None``: it can), whether the kernels
    themselves failed (rather than the model's set-up), and the shape of the model's attention calls."""

    reason: str | None
    kernel_failed: bool = False
    shape: AttentionShape | None = None


_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(training, dtype, backend): result}


def probe(model: nn.Module, num_layers: int | None, backend: AttentionBackend, dtype: torch.dtype) -> ProbeResult:
    """Run one 2-token forward under prefix attention with ``backend``, checking every attention call (masks,
    dropout, extra arguments, layers called twice or not at all). Cached per model, train/eval mode, compute
    ``dtype`` and backend; every later call is checked the same way and raises if something changed."""
    results = _PROBED.setdefault(model, {})
    key = (model.training, dtype, type(backend), backend.name)
    if key not in results:
        device = next(model.parameters()).device
        try:
            # fork_rng: the probe must not shift the random stream of training (dropout, router noise)
            with torch.random.fork_rng(devices=[]), torch.no_grad(), \
                    attention_switch(attention_configs(model), backend, None, ((0, 2),)) as forward:
                model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
                      position_ids=torch.arange(2, device=device)[None], use_cache=False)
            result = ProbeResult(None, shape=forward.shape)
            if num_layers is not None and len(forward.new_kv) != num_layers:
                result = ProbeResult(f"only {len(forward.new_kv)} of its {num_layers} layers call the attention "
                                     "interface")
        except UnsupportedAttention as error:
            result = ProbeResult(error.reason)
        except KernelError as error:
            result = ProbeResult(str(error), kernel_failed=True)
        results[key] = result
    return results[key]


@contextmanager
def attention_switch(configs: tuple, backend: AttentionBackend, past: KV | None, spans: Spans,
                     levels: list | None = None, deepest_start: int = 0) -> Iterator[SwitchedForward]:
    """The attention switch: run the model's attention as prefix attention (``backend``'s kernels) over
    ``past`` (or, for a forward-only cousin batch, its ancestor ``levels``) for one forward of the packed chunks
    ``spans``; yields the forward's record (its ``new_kv``). The
    switch is undone on exit, even on error. Another thread using the same model meanwhile would run prefix
    attention too and fail loudly: a model being trained is not for concurrent use."""
    forward = SwitchedForward(backend, past, spans, levels, deepest_start)
    token = _ACTIVE.set(forward)
    try:
        with SWITCH.on(configs):
            yield forward
    finally:
        _ACTIVE.reset(token)
