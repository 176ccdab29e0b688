"""Running a Hugging Face causal LM on one tree segment, with the ancestors' keys/values as its cache.

The contract with transformers (measured on 5.24; see DESIGN.md section 6): the cache argument is called
``cache`` (``past_key_values`` before 5.24), keys are cached after RoPE so positions are always explicit,
and an explicit attention mask is always passed. The cache subclass below records the segment's own new
keys/values as they are handed to the cache, so the engine gets them without any extra copy.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lightning_dta.engine.errors import ModelNotSupportedError
from lightning_dta.engine.prefix_attention import (
    attention_configs,
    original_implementation,
    probe,
    segment_attention,
    unsupported_reason,
)
from lightning_dta.engine.token_scores import token_scores
from lightning_dta.tree import PrefixTree, TreeNode

KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # layer types that cache keys/values


@dataclass(frozen=True)
class ModelInfo:
    cache_arg: str  # "cache" (transformers >= 5.24) or "past_key_values"
    logits_to_keep: bool  # whether forward accepts an index tensor of positions to project
    vocab_size: int | None
    max_positions: int | None
    dtype: torch.dtype
    device: torch.device
    has_active_dropout: bool
    attn_implementation: str | None
    # configs whose attention is switched to prefix attention during a segment's forward (empty: the model's
    # own attention with a KV cache and a causal mask)
    prefix_attention_configs: tuple = ()
    num_layers: int | None = None  # decoder layers, each of which must hand over its new keys/values

    @property
    def packs_siblings(self) -> bool:
        """Sibling segments go into one packed row (prefix attention) rather than padded rows."""
        return bool(self.prefix_attention_configs)


def _forward_parameters(model: nn.Module) -> dict[str, inspect.Parameter]:
    """The keyword arguments ``model`` accepts. Wrappers such as PEFT (LoRA) declare ``**kwargs`` and pass them
    to the wrapped model, so its arguments (``cache``, ``logits_to_keep``) count too."""
    params = dict(inspect.signature(model.forward).parameters)
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if takes_kwargs and hasattr(model, "get_base_model"):
        params.update(inspect.signature(model.get_base_model().forward).parameters)
    return params


def inspect_model(model: nn.Module, uses_cache: bool = True, prefix_attention: bool | None = None) -> ModelInfo:
    """Check that ``model`` can take a KV cache and is not in a mode that silently drops it.

    ``uses_cache=False`` (the per-rollout baseline) allows transformers gradient checkpointing, which is then
    harmless: it only drops caches, and that mode passes none. ``prefix_attention``: ``None`` uses
    :mod:`prefix_attention` where the model supports it, ``True`` requires it, ``False`` never uses it.
    """
    params = _forward_parameters(model)
    if "cache" in params:
        cache_arg = "cache"
    elif "past_key_values" in params:
        cache_arg = "past_key_values"
    else:
        raise ModelNotSupportedError(
            f"{type(model).__name__}.forward takes no KV cache (no 'cache' or 'past_key_values' argument); "
            "prefix-tree training feeds the ancestors' keys/values as the cache. Fix: use a Hugging Face causal "
            "LM with KV-cache support (Llama, Qwen2/3, Mistral, Gemma, GPT-2, ...) or mode='vanilla'.")
    checkpointing_flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    if uses_cache and getattr(model, checkpointing_flag, False):
        raise ModelNotSupportedError(
            "transformers gradient checkpointing is enabled; it drops the KV cache during training (with only a "
            "warning), which would train on different inputs. Fix: call model.gradient_checkpointing_disable() "
            "and use tree_backward(..., activation='recompute', chunk_size=...) instead.")
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab_size = getattr(text_config, "vocab_size", None)
    max_positions = getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None)
    first = next(model.parameters())
    dropout = model.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    attn_implementation = original_implementation(config) if config is not None else None
    num_layers = getattr(text_config, "num_hidden_layers", None)
    cacheless = sorted({kind for kind in getattr(text_config, "layer_types", None) or () if kind not in KV_LAYER_TYPES})
    if uses_cache and cacheless:
        raise ModelNotSupportedError(
            f"{type(model).__name__} has layers of type {cacheless}, which keep no keys/values: a shared prefix "
            "cannot be handed to them as a cache, and a tree mask does not reach them. Fix: mode='vanilla'.")
    configs = ()
    if uses_cache and prefix_attention is not False:
        candidates = attention_configs(model)
        reason = unsupported_reason(model, first.device, candidates) or probe(model, num_layers)
        if reason is None:
            configs = candidates
        elif prefix_attention:
            raise ModelNotSupportedError(f"prefix_attention=True, but {reason}. Fix: pass prefix_attention=None "
                                         "(use it where possible) or False.")
    return ModelInfo(cache_arg, "logits_to_keep" in params, vocab_size, max_positions, first.dtype, first.device,
                     dropout, attn_implementation, configs, num_layers)


def loss_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Log-softmax and the loss run in float32 for half-precision models (float64 models keep float64)."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


class SegmentCache(DynamicCache):
    """A ``DynamicCache`` pre-filled with the ancestors' keys/values that records each layer's new states."""

    def __init__(self, past: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        super().__init__()
        self.new_states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if past:
            layers = []
            for keys, values in past:
                layer = DynamicLayer()
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values  # no copy: the first update concatenates
                layers.append(layer)
            self.layers = layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.new_states[layer_idx] = (key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class SegmentBatch:
    """Sibling segments that start at the same position, forwarded together over their shared prefix.

    Packed (prefix attention): the segments lie one after another in a single row, no padding. Padded (the
    model's own attention): one row per segment, right-padded to the longest; padding never reaches real
    tokens under causal attention.
    """

    def __init__(self, tokens: list[torch.Tensor], start: int, packed: bool) -> None:
        self.tokens, self.start, self.packed = tokens, start, packed
        self.lengths = [len(t) for t in tokens]
        self.offsets = [0, *itertools.accumulate(self.lengths[:-1])]

    @classmethod
    def of(cls, tree: PrefixTree, items: list[tuple[TreeNode, int, int]], packed: bool) -> SegmentBatch:
        """The segments ``(node, start, end)`` of sibling items, which all start at the same position."""
        return cls([tree.tokens(node)[a - node.start:b - node.start] for node, a, b in items], items[0][1], packed)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.offsets, self.lengths))

    def input_ids(self) -> torch.Tensor:
        if self.packed:
            return torch.cat(self.tokens)[None]
        ids = torch.zeros(len(self.tokens), max(self.lengths), dtype=torch.long)
        for row, t in enumerate(self.tokens):
            ids[row, :len(t)] = t
        return ids

    def positions(self) -> torch.Tensor:
        if self.packed:
            return torch.cat([torch.arange(self.start, self.start + n) for n in self.lengths])[None]
        width = max(self.lengths)
        return torch.arange(self.start, self.start + width).expand(len(self.tokens), width)

    def row(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Segment ``i``'s part of a ``[rows, heads, length, dim]`` tensor (keys, values or their gradients)."""
        if self.packed:
            return t[:, :, self.offsets[i]:self.offsets[i] + self.lengths[i]]
        return t[i:i + 1, :, :self.lengths[i]]

    def keep(self, columns: list[torch.Tensor]) -> torch.Tensor:
        """The positions to project to logits: each segment's ``columns`` (packed), or their union (padded)."""
        if self.packed:
            return torch.cat([c + a for c, a in zip(columns, self.offsets)])
        return torch.unique(torch.cat(columns))

    def split_logits(self, logits: torch.Tensor, kept: torch.Tensor, columns: list[torch.Tensor]
                     ) -> list[torch.Tensor]:
        """Each segment's logits ``[C_i, V]`` at its own ``columns`` from the logits of ``kept`` = :meth:`keep`."""
        if self.packed:
            return list(logits[0].split([len(c) for c in columns]))
        return row_logits(logits, kept, columns)


def forward_segment(model: nn.Module, info: ModelInfo, batch: SegmentBatch,
                    past: list[tuple[torch.Tensor, torch.Tensor]] | None, columns: list[torch.Tensor] | None
                    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Forward sibling segments at positions ``batch.start ..`` after a prefix of that length.

    ``past`` holds each layer's prefix keys/values ``[1, kv_heads, start, dim]``, shared by all segments.
    Returns each segment's logits at its ``columns`` ``[C_i, V]`` (all its positions if ``None``) and the new
    keys/values of every layer (read a segment's part with ``batch.row``), attached to the graph when grad is
    enabled.
    """
    device = info.device
    input_ids, positions = batch.input_ids().to(device), batch.positions().to(device)
    kept = None if columns is None else batch.keep(columns)
    kwargs = {}
    if info.logits_to_keep and kept is not None:
        kwargs["logits_to_keep"] = kept.to(device)
    if info.packs_siblings:
        with segment_attention(info.prefix_attention_configs, past, batch.spans) as segment:
            logits = model(input_ids=input_ids, position_ids=positions, use_cache=False, **kwargs).logits
        new_kv = segment.new_kv()
    else:
        rows = input_ids.shape[0]
        if past and rows > 1:
            past = [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in past]
        cache = SegmentCache(past)
        # An explicit all-ones mask: transformers then builds the lower-right causal mask over cache + segment.
        attention_mask = torch.ones(rows, batch.start + input_ids.shape[1], dtype=torch.long, device=device)
        logits = model(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask,
                       **{info.cache_arg: cache, "use_cache": True}, **kwargs).logits
        new_kv = [cache.new_states[i] for i in sorted(cache.new_states)]
    if info.num_layers is not None and len(new_kv) != info.num_layers:
        raise ModelNotSupportedError(
            f"{type(model).__name__} handed over keys/values of {len(new_kv)} of its {info.num_layers} layers in a "
            "forward; the tree engine needs every layer's (layers without a KV cache, such as linear-attention or "
            "state-space layers, cannot take a shared prefix this way). Fix: use mode='vanilla' or 'mask'"
            + (", or prefix_attention=False if the model's attention bypasses the attention interface"
               if info.packs_siblings else "") + ".")
    if kept is None:  # every position
        rows = logits[0].split(batch.lengths) if batch.packed else [r[:n] for r, n in zip(logits, batch.lengths)]
        return list(rows), new_kv
    if not info.logits_to_keep:
        logits = logits[:, kept.to(logits.device)]
    return batch.split_logits(logits, kept, columns), new_kv


def score(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype, with_entropy: bool,
          entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` ``[R, C]`` under ``logits`` ``[C, V]``, and the entropy of each column ``[1, C]``.

    One normaliser per position serves every rollout through it; rows only gather different targets. The
    work runs in blocks of positions (:mod:`token_scores`), so no full-vocabulary float32 copy is kept.
    """
    logp, entropy = token_scores(logits, targets, dtype)
    if not with_entropy:
        return logp, None
    if not entropy_grad:
        entropy = entropy.detach()
    return logp, entropy[None, :]


def forward_plain(model: nn.Module, info: ModelInfo, input_ids: torch.Tensor, columns: torch.Tensor | None,
                  position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """An ordinary forward without any cache (the baselines): logits of ``columns`` ``[B, C, V]``."""
    batch, length = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
    kwargs = {"use_cache": False}
    if columns is not None and info.logits_to_keep:
        kwargs["logits_to_keep"] = columns.to(input_ids.device)
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **kwargs).logits
    if columns is not None and not info.logits_to_keep:
        logits = logits[:, columns.to(logits.device)]
    return logits


def row_logits(logits: torch.Tensor, columns: torch.Tensor, row_columns: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each row's logits ``[C_i, V]`` at its own columns (a subset of the batch's sorted ``columns``).

    Rows are separated with ``unbind`` so that backward assembles one gradient for the batch instead of a
    full-size zero buffer per row (which plain indexing would allocate, quadratic in the batch size).
    """
    out = []
    for row, cols in zip(logits.unbind(0), row_columns):
        if cols.numel() == columns.numel():
            out.append(row)
        else:
            out.append(row.index_select(0, torch.searchsorted(columns, cols).to(row.device)))
    return out
