"""Running a Hugging Face causal LM on one sibling batch, with the path's keys/values as its prefix.

Two ways of attending to the prefix, chosen per model by :func:`~lightning_dta.engine.model_info.inspect_model`:

- prefix attention (:mod:`~lightning_dta.engine.prefix_attention`): the chunks packed into one row, the model's
  attention turned into prefix attention by the attention switch for this forward;
- the model's own attention over a KV cache. The contract with transformers (measured on 5.24, see
  ``docs/traps.md``): the cache argument is called ``cache`` (``past_key_values`` before 5.24), keys are cached
  after RoPE so positions are always explicit, and an explicit attention mask is always passed.
  :class:`RecordingCache` records the chunks' new keys/values as they are handed to the cache, without a copy.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lightning_dta.contracts import Objective
from lightning_dta.engine.device import to_device
from lightning_dta.engine.errors import ModelNotSupportedError
from lightning_dta.engine.kv import KV, KVRecorder
from lightning_dta.engine.layer_kinds import ATTENTION, LAYER_KINDS, cache_layer_classes
from lightning_dta.engine.model_info import ModelInfo
from lightning_dta.engine.prefix_attention import attention_switch
from lightning_dta.engine.recurrent_state import StateAndKVLayer, StateLayer, States
from lightning_dta.engine.sibling_batch import SiblingBatch
from lightning_dta.engine.time_step_limit import clamped_one_token_updates
from lightning_dta.engine.token_scores import token_scores


class RecordingCache(DynamicCache):
    """A ``DynamicCache`` pre-filled with the path's keys/values that records each layer's new ones. For a model
    with layers of other kinds (``kinds``: recurrent layers, layers without a mixer), each layer gets its kind's cache
    layer: a :class:`~lightning_dta.engine.recurrent_state.StateLayer` per recurrent layer (a
    :class:`~lightning_dta.engine.recurrent_state.StateAndKVLayer` where the layer also attends) continues from the
    path's states (``states``) and records the chunk's end states."""

    def __init__(self, past: KV | None, kinds: tuple[str, ...] | None = None, states: States | None = None) -> None:
        super().__init__()
        self.new_kv = KVRecorder()
        self.state_layers: list[StateLayer] = []
        if not kinds or all(LAYER_KINDS[kind] == ATTENTION for kind in kinds):  # attention only: layer i is past[i]
            if past:
                self.layers = [_prefilled(DynamicLayer(), keys, values) for keys, values in past]
            return
        # past[j] is the j-th attention layer's, states[j] the j-th recurrent layer's: lay every layer out by its kind
        past_kv, past_states = iter(past or ()), iter(states or ())
        _, dummy_layer = cache_layer_classes()
        layers = []
        for kind_name in kinds:
            kind = LAYER_KINDS[kind_name]
            if kind.states:
                initial = next(past_states) if states else None
                layer = StateAndKVLayer(kind, initial) if kind.keys_values else StateLayer(kind, initial)
                self.state_layers.append(layer)
            else:
                layer = DynamicLayer() if kind.keys_values else dummy_layer()
            if kind.keys_values and past:
                _prefilled(layer, *next(past_kv))
            layers.append(layer)
        self.layers = layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.new_kv.record(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def new_states(self) -> States | None:
        """Every recurrent layer's state at the chunk's end (``None``: a mixer did not hand over all of its)."""
        finals = [layer.final() for layer in self.state_layers]
        return None if any(f is None for f in finals) else finals


def _prefilled(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values  # no copy: the first update concatenates
    return layer


def forward_batch(model: nn.Module, info: ModelInfo, batch: SiblingBatch, past: KV | None,
                  columns: list[torch.Tensor] | None, states: States | None = None
                  ) -> tuple[list[torch.Tensor], KV, States]:
    """Forward a sibling batch at positions ``batch.start ..`` after a prefix of that length.

    ``past`` holds each attention layer's prefix keys/values ``[1, kv_heads, start, dim]`` and ``states`` each
    recurrent layer's state at ``start`` (rows first, one row), both shared by all chunks. Returns each chunk's
    logits at its ``columns`` ``[C_i, V]`` (all its positions if ``None``), the new keys/values of every attention
    layer (read a chunk's part with ``batch.row``) and every recurrent layer's state at the end of each row (a
    row's own end only if it is the batch's longest: :class:`~lightning_dta.engine.walk.TreeWalk` batches chunks
    that hand a state on by length), attached to the graph when grad is enabled.
    """
    device = info.device
    input_ids, positions = to_device(batch.input_ids(), device), to_device(batch.positions(), device)
    kept = None if columns is None else batch.keep(columns)
    kwargs = {}
    if info.logits_to_keep and kept is not None:
        kwargs["logits_to_keep"] = to_device(kept, device)
    if info.packs_siblings:
        with attention_switch(info.prefix_attention_configs, info.attention_backend, past, batch.spans) as switched:
            logits = model(input_ids=input_ids, position_ids=positions, use_cache=False, **kwargs).logits
        recorder, new_states = switched.new_kv, []  # prefix attention never runs on models with recurrent layers
    else:
        rows = input_ids.shape[0]
        if past and rows > 1:
            past = [(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)) for k, v in past]
        if states and rows > 1:  # siblings start from the same state
            states = [tuple(t.expand(rows, *t.shape[1:]) for t in layer) for layer in states]
        cache = RecordingCache(past, info.layer_kinds, states)
        # An explicit all-ones mask: transformers then builds the lower-right causal mask over cache + chunks.
        attention_mask = torch.ones(rows, batch.start + input_ids.shape[1], dtype=torch.long, device=device)
        with clamped_one_token_updates(info.time_step_limits):  # a chunk of one token as longer ones
            logits = model(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask,
                           **{info.cache_arg: cache, "use_cache": True}, **kwargs).logits
        recorder = cache.new_kv
        new_states = cache.new_states()
        if new_states is None:
            raise ModelNotSupportedError(
                f"a recurrent layer of {type(model).__name__} did not hand its new state to the cache in a forward "
                "(it updated it in place or kept it), so the state at a node's end cannot be handed to its children. "
                "Fix: use mode='vanilla'.")
    _check_layers(model, info, recorder)
    if kept is None:  # every position
        return batch.split_all(logits), recorder.kv(), new_states
    if not info.logits_to_keep:
        logits = logits[:, to_device(kept, logits.device)]
    return batch.split_logits(logits, kept, columns), recorder.kv(), new_states


def forward_cousins(model: nn.Module, info: ModelInfo, batch, levels: list) -> tuple[list[torch.Tensor], KV]:
    """Forward a cousin batch (:class:`~lightning_dta.engine.cousins.CousinBatch`) under prefix attention, each
    chunk over its ancestor ``levels``, without a graph. Returns each chunk's logits at all its positions and the
    new keys/values of every layer (chunk ``i``'s are ``[:, :, offset_i : offset_i + length_i]``)."""
    device = info.device
    input_ids, positions = to_device(batch.input_ids(), device), to_device(batch.positions(), device)
    deepest = max(c.start for c in batch.chunks)
    with attention_switch(info.prefix_attention_configs, info.attention_backend, None, batch.spans, levels,
                          deepest) as switched:
        logits = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
    _check_layers(model, info, switched.new_kv)
    return list(logits[0].split(batch.lengths)), switched.new_kv.kv()


def _check_layers(model: nn.Module, info: ModelInfo, recorder) -> None:
    if info.kv_layers is not None and len(recorder) != info.kv_layers:
        raise ModelNotSupportedError(
            f"{type(model).__name__} handed over keys/values of {len(recorder)} of its {info.kv_layers} layers with "
            "attention in a forward; the tree engine needs every such layer's (a layer that mixes tokens outside the "
            "cache, such as a custom attention path or a recurrent layer that config.layer_types does not declare, "
            "cannot take a shared prefix this way). Fix: use mode='vanilla'"
            + (", or prefix_attention=False if the model's attention bypasses the attention interface"
               if info.packs_siblings else "") + ".")


def score(logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype, with_entropy: bool,
          entropy_grad: bool, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` ``[R, C]`` under ``softmax(logits [C, V] / temperature)``, and the entropy of each
    column ``[1, C]``.

    One normaliser per position serves every rollout through it; rows only gather different targets. The
    work runs in blocks of positions (:mod:`token_scores`), so no full-vocabulary float32 copy is kept.
    """
    logp, entropy = token_scores(logits, targets, dtype, temperature=temperature)
    if not with_entropy:
        return logp, None
    if not entropy_grad:
        entropy = entropy.detach()
    return logp, entropy[None, :]


def loss_inputs(loss_fn: Objective, logits: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``loss_fn`` takes from a chunk's head outputs ``[C, V]`` for the targets ``[R, C]``: the targets'
    log-probs and the entropies under ``logits / temperature`` (policy), or the value head's output at each
    position for every row (critic; the temperature does not apply)."""
    if loss_fn.head == "values":
        return logits[:, 0].to(dtype)[None, :].expand(targets.shape), None
    return score(logits, targets, dtype, with_entropy=True, entropy_grad=loss_fn.needs_entropy_grad,
                 temperature=temperature)


def forward_plain(model: nn.Module, info: ModelInfo, input_ids: torch.Tensor, columns: torch.Tensor | None,
                  position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """An ordinary forward without any cache (the baselines): logits of ``columns`` ``[B, C, V]``."""
    batch, length = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
    kwargs = {"use_cache": False} if info.cache_arg is not None else {}  # a model without a cache takes no flag
    if columns is not None and info.logits_to_keep:
        kwargs["logits_to_keep"] = to_device(columns, input_ids.device)
    output = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **kwargs)
    logits = output if isinstance(output, torch.Tensor) else output.logits  # a user's model may return the logits
    if columns is not None and not info.logits_to_keep:
        logits = logits[:, to_device(columns, logits.device)]
    return logits
