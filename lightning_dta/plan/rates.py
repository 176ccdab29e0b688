"""Activation rates: the bytes a forward saves for backward, per computed token, scored position and loss entry.

Measured on transformers 5.24 with prefix attention (and the plain per-rollout forward): a forward's saved bytes
are exactly linear in its computed tokens ``T``, its scored positions ``C`` and its loss-grid entries ``G``, and do
not depend on the prefix length (the prefix keys/values are the path buffers, counted apart)::

    saved = T * (token_base + layers * token_per_layer) + C * (position_base + vocab * position_per_vocab)
            + G * grid_entry

(a forward that scores no position frees ``T * headless_tail`` of it at once: what led only to the head)

The four slopes are probed on clones of the model's config with one and two layers and two small vocabularies,
in the dtype of the run, by :func:`~lightning_dta.engine.activation_budget.measure_rates` (the probe that
``activation="auto"`` runs), so a probe of an 8B shape holds two layers' weights, not 8B of them.

A hybrid's layers save different bytes per kind (a Gated DeltaNet layer is not an attention layer): the one-layer
clone is of an attention layer (a model's mask needs one), each kind of its pattern is probed as the second layer
of a two-layer clone, and ``token_per_layer`` is the mean of those over the pattern, so that ``layers *
token_per_layer`` is the sum over its layers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from lightning_dta.core.losses import PolicyLoss
from lightning_dta.core.rollout import Rollout
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine.activation_budget import PROBE_TOKENS, measure_rates
from lightning_dta.engine.forward import forward_batch
from lightning_dta.engine.layer_kinds import ATTENTION, LAYER_KINDS, is_recurrent, model_layer_kinds
from lightning_dta.engine.memory import SavedTensorMeter
from lightning_dta.engine.model_info import inspect_model
from lightning_dta.engine.sibling_batch import SiblingBatch
from lightning_dta.engine.walk import Chunk

PROBE_VOCAB = 256


@dataclass(frozen=True)
class ActivationRates:
    """Bytes saved for backward per unit of work (module docstring); ``checkpointed_*``: the same with transformers
    activation checkpointing, which saves each layer's input and recomputes the layer in backward."""

    token_base: float
    token_per_layer: float
    position_base: float
    position_per_vocab: float
    grid_entry: float
    headless_tail: float  # per token: freed right after a forward that scores nothing (the last layer's MLP, ...)
    checkpointed_token_base: float
    checkpointed_token_per_layer: float
    layers: int
    vocab: int
    packed: bool  # prefix attention runs for this model (sibling batches packed into one row)

    @property
    def per_token(self) -> float:
        return self.token_base + self.layers * self.token_per_layer

    @property
    def per_position(self) -> float:
        return self.position_base + self.vocab * self.position_per_vocab

    def saved(self, tokens: int, positions: int, grid: int) -> float:
        """Bytes one forward with grad saves for backward."""
        return tokens * self.per_token + positions * self.per_position + grid * self.grid_entry

    def retained(self, tokens: int, positions: int, grid: int) -> float:
        """What stays saved after the forward: all of it, unless no position is scored, when the part of the graph
        that only led to the head (after the last layer's attention) is freed at once."""
        saved = self.saved(tokens, positions, grid)
        return saved if positions else saved - tokens * self.headless_tail

    def checkpointed(self, tokens: int, positions: int, grid: int) -> float:
        """The same forward under activation checkpointing: layer inputs and the head's tensors."""
        return (tokens * (self.checkpointed_token_base + self.layers * self.checkpointed_token_per_layer)
                + positions * self.per_position + grid * self.grid_entry)

    def budget_rates(self) -> tuple[float, float, float]:
        """The three rates of ``activation="auto"``'s budget (what its own probe measures on the whole model)."""
        return self.per_token, self.per_position, self.grid_entry


def clone_config(config, layers: int, vocab: int, kinds: list[str] | None = None):
    """``config`` with ``layers`` decoder layers and a ``vocab``-token vocabulary (per-layer lists cut to length;
    the layers of kinds ``kinds`` if given)."""
    clone = copy.deepcopy(config)
    text = clone.get_text_config() if hasattr(clone, "get_text_config") else clone
    text.num_hidden_layers = layers
    text.vocab_size = vocab
    if kinds is not None:
        text.layer_types = list(kinds)
    # optional config fields: not every model family has them
    elif getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types[:layers])
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(getattr(text, name, None), int) and getattr(text, name) >= vocab:
            setattr(text, name, None)
    return clone


def _clone(config, layers: int, vocab: int, dtype: torch.dtype, kinds: list[str] | None) -> torch.nn.Module:
    clone = clone_config(config, layers, vocab, kinds)
    clone._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(clone, dtype=dtype)
    return model.train()


@dataclass
class _Probe:
    body: float  # per computed token
    head: float  # per scored position
    grid: float  # per loss entry
    retained: float  # per token, after a forward that scores nothing
    checkpointed_body: float  # per token, under activation checkpointing
    packed: bool


def _probe(config, layers: int, vocab: int, dtype: torch.dtype, kinds: list[str] | None = None) -> _Probe:
    """Every rate of one clone (``layers`` layers, of ``kinds`` if given, ``vocab`` tokens)."""
    model = _clone(config, layers, vocab, dtype, kinds)
    info = inspect_model(model, uses_cache=True, prefix_attention=None, prefix_attention_backend=None)
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    body, head, grid = measure_rates(model, info, loss_dtype, PolicyLoss())
    tree = PrefixTree.from_rollouts([Rollout(input_ids=[i % vocab for i in range(PROBE_TOKENS)])])
    batch = SiblingBatch.of(tree, [Chunk.first(tree.root.children[0], None)], info.packs_siblings)
    with torch.enable_grad(), SavedTensorMeter(model) as meter:
        logits, new_kv, _ = forward_batch(model, info, batch, None, [torch.arange(0)])
        del logits
        retained = meter.current_bytes / PROBE_TOKENS
    del new_kv
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 renamed the methods
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.arange(PROBE_TOKENS)[None] % vocab
    with torch.enable_grad(), SavedTensorMeter(model) as meter:
        model.get_decoder()(input_ids=ids, use_cache=False)
    return _Probe(body, head, grid, retained, meter.peak_bytes / PROBE_TOKENS, info.packs_siblings)


def probe_rates(config, dtype: torch.dtype) -> ActivationRates:
    """The :class:`ActivationRates` of ``config`` in ``dtype`` on the CPU (probe forwards of 64 tokens on clones with
    one and two layers, per layer kind of a hybrid, and with two vocabularies)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = model_layer_kinds(text)
    if is_recurrent(kinds):
        first = next((k for k in kinds if LAYER_KINDS.get(k, ATTENTION).keys_values), kinds[0])
        pattern, anchor = list(kinds), [first]
    else:
        pattern, anchor = [None], None  # the model's own layers
    one = _probe(config, 1, PROBE_VOCAB, dtype, anchor)
    seconds = {k: _probe(config, 2, PROBE_VOCAB, dtype, None if k is None else anchor + [k])
               for k in dict.fromkeys(pattern)}
    two = seconds[None if anchor is None else anchor[0]]
    wide = _probe(config, 1, 2 * PROBE_VOCAB, dtype, anchor)
    per_vocab = (wide.head - one.head) / PROBE_VOCAB

    def per_layer(rate: str) -> float:
        """The mean over the pattern of one layer's ``rate`` (a second layer of the kind, less the first alone)."""
        return sum(getattr(seconds[k], rate) - getattr(one, rate) for k in pattern) / len(pattern)

    return ActivationRates(
        token_base=2 * one.body - two.body, token_per_layer=per_layer("body"),
        position_base=one.head - PROBE_VOCAB * per_vocab, position_per_vocab=per_vocab, grid_entry=one.grid,
        headless_tail=one.body - one.retained,
        checkpointed_token_base=2 * one.checkpointed_body - two.checkpointed_body,
        checkpointed_token_per_layer=per_layer("checkpointed_body"),
        layers=text.num_hidden_layers, vocab=text.vocab_size, packed=one.packed)
