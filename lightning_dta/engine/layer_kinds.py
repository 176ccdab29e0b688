"""What each kind of decoder layer hands from one chunk to the next: the engine's one declaration per layer kind.

A chunk continues from the state of the path at its start. For an attention layer that state is the keys/values of
every earlier position; for a recurrent layer (Gated DeltaNet, Kimi Delta Attention, Mamba2, a short convolution) it
is a fixed-size state at the path's last position: the convolution window and, for the scan mixers, the recurrent (SSM
/ delta-rule) state. transformers names the kinds in ``config.layer_types`` and its mixers read and write their states
through ``Cache.get_conv_state`` / ``get_recurrent_state`` / ``update_conv_state`` / ``update_recurrent_state``,
whatever the model family; so the engine declares what each *kind* carries (as vLLM's ``MambaBase.get_state_shape``
does per mixer kind), never what a family does, and refuses a kind it does not know by name rather than walk it
wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers
from torch import nn
from transformers import cache_utils

from lightning_dta.engine.errors import ModelNotSupportedError


@dataclass(frozen=True)
class LayerKind:
    """What a layer of one kind hands over: keys/values (attention) and/or named fixed-size states, in the order
    the path stores them (``"conv"``: the convolution window, ``"recurrent"``: the scan's state)."""

    keys_values: bool
    states: tuple[str, ...] = ()


ATTENTION = LayerKind(keys_values=True)
LAYER_KINDS: dict[str, LayerKind] = {
    "full_attention": ATTENTION,
    "sliding_attention": ATTENTION,  # the path holds every position; the model's own mask applies the window
    "chunked_attention": ATTENTION,
    "linear_attention": LayerKind(keys_values=False, states=("conv", "recurrent")),  # Gated DeltaNet, KDA, Mamba2
    # attention and a Mamba2 mixer in one layer: side by side (Falcon-H1), or a shared attention block before the
    # mixer (Zamba2); the layer's one cache layer holds both, at the decoder layer's index
    "hybrid": LayerKind(keys_values=True, states=("conv", "recurrent")),
    "conv": LayerKind(keys_values=False, states=("conv",)),  # short convolutions (LFM2)
    "mlp": LayerKind(keys_values=False),  # layers without a mixer (Nemotron-H's MLP and MoE blocks)
    "moe": LayerKind(keys_values=False),
}


# The recurrent mixers the engine walks, by the end of their class name, with their kind. One entry per mixer kind
# where the class names share a suffix (Qwen3.5's, Qwen3-Next's and OLMo-hybrid's ``...GatedDeltaNet``, the
# ``...ShortConv`` of LFM2 and LFM2-MoE, the ``...Mamba2Mixer`` of Mamba2 and Nemotron-H), and the Mamba2 mixers
# that transformers names otherwise (Bamba's, Granite-4 hybrid's, Falcon-H1's and Zamba2's: the same code, with
# multipliers or an optional gated norm around it), and Kimi Linear's Kimi Delta Attention (a Gated DeltaNet with a
# decay per channel: one convolution over q, k and v, a delta-rule state per head,
# ``chunk_kimi_delta_attention(..., initial_state=...)``). Each reads its states through the cache contract,
# continues a chunk of any length from them (its one-token decode paths write a state in place, which the engine's
# cache layer turns into a recorded update) and hands its new states back through ``update_*_state``.
# A mixer not listed is refused by name.
MIXER_KINDS: dict[str, str] = {
    "GatedDeltaNet": "Gated DeltaNet",
    "ShortConv": "short convolution",
    "Mamba2Mixer": "Mamba2",
    "BambaMixer": "Mamba2",
    "GraniteMoeHybridMambaLayer": "Mamba2",
    "FalconH1Mixer": "Mamba2",
    "Zamba2MambaMixer": "Mamba2",
    "KimiLinearDeltaAttention": "Kimi Delta Attention",
}


def cache_layer_classes() -> tuple[type, type]:
    """transformers' base class of recurrent cache layers and its cache layer of layers without a cache (``object``
    for each where this release lacks them: :func:`check_layer_kinds` then refuses recurrent models)."""
    # optional library features: transformers releases before the recurrent cache contract lack them
    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", object)
    # optional library feature, as above
    return mixin, getattr(cache_utils, "DummyLayer", object)


def model_layer_kinds(text_config) -> tuple[str, ...] | None:
    """The kind of every decoder layer, from ``config.layer_types`` (``None``: the config does not say, every
    layer is attention)."""
    # optional config field: not every model family has it
    kinds = getattr(text_config, "layer_types", None)
    return tuple(kinds) if kinds else None


def is_recurrent(kinds: tuple[str, ...] | None) -> bool:
    """Whether any layer carries a recurrent state (the model is a hybrid or a pure state-space model)."""
    return bool(kinds) and any(LAYER_KINDS.get(k, ATTENTION).states for k in kinds)


def check_layer_kinds(model: nn.Module, kinds: tuple[str, ...] | None) -> None:
    """Refuse a layer kind or a recurrent mixer the engine does not know, by name, and recurrent layers where this
    transformers release has no state contract to continue a chunk from (``Cache.get_conv_state`` and its kin)."""
    if not kinds:
        return
    model_name = type(model).__name__
    unknown = sorted({k for k in kinds if k not in LAYER_KINDS})
    if unknown:
        raise ModelNotSupportedError(
            f"{model_name} has layers of type {unknown}, which the tree engine does not know how to continue from "
            f"a shared prefix (it knows {sorted(LAYER_KINDS)}); walking them would train on something else. "
            "Fix: mode='vanilla'.")
    contract = hasattr(cache_utils.Cache, "get_conv_state") and object not in cache_layer_classes()
    if is_recurrent(kinds) and not contract:
        raise ModelNotSupportedError(
            f"{model_name} has recurrent layers, and transformers {transformers.__version__} has no cache contract "
            "for their states (Cache.get_conv_state / get_recurrent_state, as in 5.24): its mixers cannot "
            "continue a chunk from the engine's states. Fix: upgrade transformers (>= 5.24) or use mode='vanilla'.")
    if is_recurrent(kinds):
        check_mixers(model, kinds)


def recurrent_mixers(model: nn.Module, kinds: tuple[str, ...]) -> list[nn.Module]:
    """The modules that carry a recurrent layer's ``layer_type``, as transformers' mixers do."""
    recurrent = {kind for kind in kinds if LAYER_KINDS[kind].states}
    # transformers' recurrent mixers carry their layer's kind; other modules do not
    return [m for m in model.modules() if getattr(m, "layer_type", None) in recurrent]


def check_mixers(model: nn.Module, kinds: tuple[str, ...]) -> None:
    """Every recurrent layer's mixer (:func:`recurrent_mixers`) must be of a kind in :data:`MIXER_KINDS` that the
    engine walks."""
    recurrent = {kind for kind in kinds if LAYER_KINDS[kind].states}
    mixers = recurrent_mixers(model, kinds)
    name = type(model).__name__
    expected = sum(kind in recurrent for kind in kinds)
    if len(mixers) != expected:
        raise ModelNotSupportedError(
            f"{name} has {expected} recurrent layers, but the engine found {len(mixers)} mixer modules that carry a "
            "recurrent layer_type: it cannot check how they use the cache. Fix: mode='vanilla'.")
    for mixer in mixers:
        mixer_class = type(mixer).__name__
        if not any(mixer_class.endswith(suffix) for suffix in MIXER_KINDS):
            raise ModelNotSupportedError(
                f"{name}'s recurrent mixer {mixer_class} is of a kind the tree engine does not know (it walks "
                f"{sorted(set(MIXER_KINDS.values()))} mixers: {sorted(MIXER_KINDS)}); walking it could train on "
                "something else. Fix: mode='vanilla'.")
