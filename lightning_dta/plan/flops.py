"""FLOPs of a forward, from the model's shape: linear layers per token, attention per (query, key) pair, the LM head
per scored position. A backward costs two forwards; recompute and activation checkpointing add one body forward
of what they re-run. Multiply-accumulates count as two FLOPs.

A hybrid (recurrent layers next to attention) has the same three terms: its recurrent layers cost a fixed amount
per token (projections, convolution, the chunked scan: :mod:`.mixers`), so they join the per-token term, and only
its attention layers attend pairs."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_dta.core.tree import PrefixTree, attention_pairs, causal_pairs
from lightning_dta.engine.layer_kinds import is_recurrent, model_layer_kinds
from lightning_dta.plan.mixers import (
    attention_layers,
    holds_experts,
    layer_macs_per_token,
    meta_model,
    mixer_projections,
)


def _latent_pair_macs(text) -> int | None:
    """q.k and p.v per head for one pair in multi-head latent attention, whose keys (``qk_head_dim``) and values
    (``v_head_dim``) are not ``head_dim`` wide; ``None`` for other attention."""
    # optional config fields: only multi-head latent attention families have them
    key_dim, value_dim = getattr(text, "qk_head_dim", None), getattr(text, "v_head_dim", None)
    return key_dim + value_dim if key_dim and value_dim else None


@dataclass(frozen=True)
class ModelShape:
    """The sizes that FLOPs and the key/value buffers depend on (grouped-query attention included)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    vocab_shards: int = 1  # a vocabulary-parallel head computes 1/vocab_shards of the logits on each rank
    # hybrids (read off the layers, :mod:`.mixers`); ``None``: every layer is attention and a gated MLP
    attention_layers: int | None = None
    layer_macs: int | None = None  # all decoder layers' multiply-accumulates per token
    recurrent_core_macs: int = 0  # of which the recurrent cores (the chunked scans)
    # q.k and p.v per head for one pair where keys and values have other dims than ``head_dim`` (multi-head latent
    # attention: DeepSeek-V2/V3, Kimi Linear; ``qk_head_dim`` and ``v_head_dim``); ``None``: ``2 * head_dim``
    pair_macs_per_head: int | None = None

    @classmethod
    def from_config(cls, config, tensor_parallel: int = 1) -> ModelShape:
        """The shape of ``config``: with ``tensor_parallel`` > 1, ``config`` is one rank's
        (:func:`tensor_parallel_config`), and the head's logits (and a hybrid's mixer projections) are split over
        ``tensor_parallel`` ranks."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if is_recurrent(model_layer_kinds(text)):
            return cls._hybrid(config, text, tensor_parallel)
        heads = text.num_attention_heads
        return cls(layers=text.num_hidden_layers, hidden=text.hidden_size, heads=heads,
                   # optional config fields: not every model family has them
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   # optional config fields: not every model family has them
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                   intermediate=text.intermediate_size, vocab=text.vocab_size, vocab_shards=tensor_parallel,
                   pair_macs_per_head=_latent_pair_macs(text))

    @classmethod
    def _hybrid(cls, config, text, tensor_parallel: int) -> ModelShape:
        """A model with recurrent layers: its layers' costs read off the model built on the meta device (one
        rank's under tensor parallelism: each recurrent mixer whole, its projections split;
        :func:`tensor_parallel_config`)."""
        layer_macs, cores = layer_macs_per_token(meta_model(config), config, tensor_parallel)
        # optional config fields: a pure state-space model (mamba2) has no attention heads
        heads = getattr(text, "num_attention_heads", None) or 0
        return cls(layers=text.num_hidden_layers, hidden=text.hidden_size, heads=heads,
                   # optional config fields: not every model family has them
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   # optional config fields: not every model family has them
                   head_dim=getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0),
                   # optional config field: not every model family has it
                   intermediate=getattr(text, "intermediate_size", None) or 0, vocab=text.vocab_size,
                   vocab_shards=tensor_parallel, attention_layers=attention_layers(config), layer_macs=layer_macs,
                   recurrent_core_macs=cores, pair_macs_per_head=_latent_pair_macs(text))

    @property
    def linear_macs_per_token(self) -> int:
        """q, k, v and o projections and the gated MLP (gate, up, down) of every layer (a hybrid: every layer's
        projections, convolutions, experts visited and recurrent cores, :mod:`.mixers`)."""
        if self.layer_macs is not None:
            return self.layer_macs
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def attention_macs_per_pair(self) -> int:
        """q.k and p.v of every head of every attention layer for one (query, key) pair."""
        layers = self.layers if self.attention_layers is None else self.attention_layers
        per_head = 2 * self.head_dim if self.pair_macs_per_head is None else self.pair_macs_per_head
        return layers * self.heads * per_head

    @property
    def head_macs_per_position(self) -> int:
        return self.hidden * self.vocab // self.vocab_shards

    def forward_flops(self, tokens: float, pairs: float, positions: float) -> float:
        """One forward of ``tokens`` computed tokens, ``pairs`` attended (query, key) pairs and ``positions``
        positions projected to the vocabulary."""
        return 2.0 * (tokens * self.linear_macs_per_token + pairs * self.attention_macs_per_pair
                      + positions * self.head_macs_per_position)


def speedup_limit(shape: ModelShape, tree: PrefixTree, head_positions: int | None) -> float:
    """The speed-up perfect kernels would give: per-rollout FLOPs / tree FLOPs of the same forwards (the backward
    multiplies both by the same factor). Linear layers scale with computed tokens (logical vs tree), attention with
    (query, key) pairs (per-rollout causal squares vs each node's queries against its prefix). ``head_positions``:
    training projects the LM head only on the trained tokens, the same number in both (the tree does not share
    them); ``None`` (forward-only log-probs) projects every position, which the tree shares like the linear layers."""
    lengths = [len(tokens) for tokens in tree.token_tensors]
    logical, tree_tokens = sum(lengths), tree.stats.tree_tokens
    vanilla = shape.forward_flops(logical, sum(causal_pairs(0, n) for n in lengths),
                                  logical if head_positions is None else head_positions)
    walked = shape.forward_flops(tree_tokens, attention_pairs(tree),
                                 tree_tokens if head_positions is None else head_positions)
    return vanilla / walked


@dataclass
class WorkCount:
    """What a step computes, accumulated forward by forward."""

    tokens: int = 0
    pairs: int = 0
    positions: int = 0
    recomputed_tokens: int = 0  # body forwards run a second time (recompute, checkpointing)
    recomputed_pairs: int = 0

    def training_flops(self, shape: ModelShape) -> float:
        """Forward and backward (two forwards) of everything, plus the re-run body forwards."""
        return (3 * shape.forward_flops(self.tokens, self.pairs, self.positions)
                + shape.forward_flops(self.recomputed_tokens, self.recomputed_pairs, 0))


def tensor_parallel_config(config, size: int):
    """The shape one rank of a tensor-parallel group of ``size`` computes, as a model config: attention heads, key/
    value heads and the MLP width divided by ``size``, the hidden size (the residual stream: no sequence parallelism)
    and the vocabulary (the head's logits are gathered whole) unchanged. Its activation rates and path buffers are
    that rank's; its FLOPs too, with the head's divided by ``size`` (``ModelShape.from_config(..., size)``).

    A hybrid's recurrent mixers stay whole, as the walk runs them (:mod:`lightning_dta.distributed.tensor_parallel`:
    a mixer cannot be split by heads): their convolution windows and scan states, and the activations of their
    gathered projections, are the whole model's on every rank; only the projections' FLOPs are split
    (:func:`~lightning_dta.plan.mixers.layer_macs_per_token`). Raises ``ValueError`` when ``size`` does not divide
    what it splits (the strategy refuses the same)."""
    import copy

    if size == 1:
        return config
    local = copy.deepcopy(config)
    text = local.get_text_config() if hasattr(local, "get_text_config") else local
    hybrid = is_recurrent(model_layer_kinds(text))
    # optional config fields: a pure state-space model (mamba2) has no attention and no MLP
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads  # optional config field (MHA models lack it)
    if hybrid and getattr(text, "block_auto_adjust_ff_dim", False):  # LFM2 derives its MLP width: fix it first
        text.intermediate_size, text.block_auto_adjust_ff_dim = _lfm2_mlp_width(text), False
    intermediate = getattr(text, "intermediate_size", None)  # optional config field (mamba2 has none)
    for what, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                        ("intermediate_size", intermediate), ("vocab_size", text.vocab_size)):
        if count is not None and count % size:
            raise ValueError(f"tensor parallelism of {size} does not divide {what}={count}")
    if heads is not None:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads  # optional config field
        text.num_attention_heads, text.num_key_value_heads = heads // size, kv_heads // size
        text.head_dim = head_dim
    if intermediate is not None:
        text.intermediate_size = intermediate // size
    if hybrid:
        _check_rank_split(config, local, size)
    return local


def _lfm2_mlp_width(text) -> int:
    """The width LFM2's MLP derives from its config (transformers 5.24, ``Lfm2MLP``: 2/3 of ``intermediate_size``,
    times ``block_ffn_dim_multiplier`` rounded up to ``block_multiple_of``), so that the rank's config can divide it."""
    width = int(2 * text.intermediate_size / 3)
    if text.block_ffn_dim_multiplier is not None:
        width = int(text.block_ffn_dim_multiplier * width)
        width = text.block_multiple_of * ((width + text.block_multiple_of - 1) // text.block_multiple_of)
    return width


def _check_rank_split(config, local, size: int) -> None:
    """The rank's hybrid, built on the meta device beside the whole one, is split as the walk splits it: every linear
    layer outside the recurrent mixers (attention, MLP) holds 1/``size`` of the whole one's weights, every mixer
    is unchanged and its projections divide by ``size`` (split by output columns, then gathered). A family whose
    config the division does not reach (a derived width, experts) is refused by name rather than mispriced."""
    whole, rank = meta_model(config), meta_model(local)
    whole_projections, rank_projections = mixer_projections(whole), mixer_projections(rank)
    head = whole.get_output_embeddings()
    rank_modules = dict(rank.named_modules())
    for name, module in whole.named_modules():
        if module is head or not any(True for _ in module.parameters(recurse=False)):
            continue
        if holds_experts(module):
            raise ValueError(f"tensor parallelism of {size}: {name} ({type(module).__name__}) is a mixture of "
                             "experts, which the walk does not split over ranks (transformers' packed expert "
                             "styles are refused). Fix: plan it with tensor parallelism 1")
        if not isinstance(module, nn.Linear):  # norms, convolutions, embeddings, a mixer's per-head parameters
            continue  # whole on every rank
        other = rank_modules.get(name)
        weights, rank_weights = module.weight.numel(), other.weight.numel() if other is not None else None
        expected = weights if name in whole_projections else weights // size
        if name in whole_projections and module.out_features % size:
            raise ValueError(f"tensor parallelism of {size} does not divide the {module.out_features} output "
                             f"features of the recurrent mixer's projection {name}")
        if rank_weights != expected or (name in whole_projections) != (name in rank_projections):
            raise ValueError(f"tensor parallelism of {size}: the planner cannot derive what one rank of "
                             f"{type(whole).__name__} computes ({name}: {rank_weights} weights on a rank, expected "
                             f"{expected}). Fix: plan it with tensor parallelism 1")
