"""Tensor parallelism for the tree walk: a Hugging Face causal LM sharded over a group whose ranks walk the SAME tree.

Why: under FSDP every data-parallel rank walks its own tree, so collectives inside a forward cannot line up and the
walk holds the whole unsharded model (``lightning_dta.distributed.sharding``: gather once, reduce once). Ranks of one
tensor-parallel group walk the same tree instead: every forward and every backward of the walk happens on every
peer in the same order, so the collectives inside each layer (the all-reduce after a row-parallel linear, forward
and backward) line up by construction, and each rank holds only its slice of the attention heads, the MLP and the
vocabulary. Every engine mode is then exact: the keys/values the walk keeps on its path, and the ones prefix
attention reads, are this rank's own heads.

Four pieces:

- :func:`tp_plan` translates the model's own transformers plan (``model._tp_plan``: the class plan, e.g.
  ``{"lm_head": "colwise_gather_output"}``, the config's ``base_model_tp_plan`` under the base model's prefix and
  the vocabulary-parallel input embedding transformers adds) into torch's ``ColwiseParallel`` / ``RowwiseParallel``
  with one concrete module path per layer, ready for ``parallelize_module``. Whatever torch's styles cannot express
  exactly is refused, naming the module, the style and the fix (:data:`STYLES`).
- Parameters that stay replicated but only see this rank's heads (Qwen3's per-head ``q_norm``/``k_norm``: plan
  style ``replicated_with_grad_allreduce``) get a partial gradient on each rank. transformers sums ``p.grad`` over
  the group in a post-accumulate-grad hook, i.e. it re-sums the already accumulated gradient after every backward:
  wrong as soon as a step runs more than one backward, and a tree step runs one per pop. Here each backward's
  gradient is summed before it is accumulated (a tensor hook on the parameter object the forward uses, so it also
  follows FSDP2's unsharded parameters).
- Hybrids: a recurrent mixer (Gated DeltaNet, short convolution, Mamba2) runs whole on every rank, its projections
  split with gathered outputs (transformers' own plan for Qwen3.5) or replicated, so the states the walk hands from
  chunk to chunk are the same whole tensors on every peer; a head split of a mixer is refused
  (:func:`_check_recurrent` says why).
- Every weight comes from the group's first rank: torch's styles scatter the sharded ones from it, and the ones the
  plan leaves whole are broadcast from it, so peers that built the model unseeded still compute alike.
The step's sums run over the data-parallel group only (:class:`~lightning_dta.contracts.ParallelLayout`), and the
gradient norm reduces each DTensor over its own mesh (:func:`lightning_dta.distributed.step.gradient_norm`): summing
local squares over every rank would count a tensor-parallel group's replicated shards once per peer.

Usage (every rank of the TP group, the same tree on each)::

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    tensor_parallel(model, mesh["tensor_parallel"])      # then, optionally, fully_shard over mesh["data_parallel"]
    dta.tree_backward(model, tree, loss_fn, engine=..., normalizer=...)

Under Lightning, ``DTAFSDPStrategy(tensor_parallel_size=N)`` builds that mesh and ``DTAModule.configure_model`` applies
both through :func:`~lightning_dta.distributed.parallelize.parallelize_model`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_dta.contracts import TENSOR_PARALLEL
from lightning_dta.core.errors import UsageError
from lightning_dta.distributed.collectives import broadcast_tensors
from lightning_dta.engine.layer_kinds import ATTENTION, LAYER_KINDS, is_recurrent, model_layer_kinds

TP_DIM = TENSOR_PARALLEL  # the mesh dimension's name (Lightning's ModelParallelStrategy and torchtitan use it too)


class TensorParallelError(UsageError, ValueError):
    """A model or plan that tensor parallelism cannot run exactly; the message names what and ends with the fix."""


# transformers 5.24's style names (transformers/distributed/tensor_parallel.py, ALL_PARALLEL_STYLES) -> torch.
# A value is (factory of the torch style, what it shards: "out"/"in" features, "vocab"/"hidden" of an embedding),
# None for a style that needs no torch style, or a string: why it is refused.
_COLWISE = (lambda: ColwiseParallel(), "out")  # output Shard(-1), local: this rank's heads / MLP columns
_COLWISE_REP = (lambda: ColwiseParallel(output_layouts=Replicate()), "out")  # output all-gathered
_ROWWISE = (lambda: RowwiseParallel(), "in")  # input Shard(-1), output all-reduced (forward) / Replicate
_ROWWISE_REP = (lambda: RowwiseParallel(input_layouts=Replicate()), "in")  # replicated input, split locally
STYLES: dict[str, tuple | str | None] = {
    "colwise": _COLWISE,
    "rowwise": _ROWWISE,
    "colwise_rep": _COLWISE_REP,
    "colwise_gather_output": _COLWISE_REP,
    "rowwise_rep": _ROWWISE_REP,
    "rowwise_split_input": _ROWWISE_REP,
    # nn.Embedding: torch's RowwiseParallel shards the vocabulary (weight Shard(0), masked lookup, all-reduce);
    # ColwiseParallel shards the hidden dimension (Shard(1)); transformers gathers both to Replicate.
    "embedding_rowwise": (lambda: RowwiseParallel(input_layouts=Replicate()), "vocab"),
    "embedding_colwise": (lambda: ColwiseParallel(output_layouts=Replicate()), "hidden"),
    "replicated_with_grad_allreduce": None,  # replicated, gradient summed per backward (see module docstring)
    "replicate": None,  # every rank keeps the whole parameter and sees replicated inputs
    "sequence_parallel": "it shards activations along the sequence between layers; the tree walk forwards chunks "
                         "of any length (down to one token) over a replicated KV path, and its neighbours' styles "
                         "would need sequence-sharded layouts that transformers' colwise/rowwise do not declare. "
                         "Fix: drop the entry (plan_overrides={name: 'replicate'}): the norm stays replicated",
    "packed_colwise": "a fused projection (gate and up, or experts, packed in one weight) is sharded with a strided "
                      "layout that torch's ColwiseParallel does not express. Fix: a model with separate projections",
    "packed_rowwise": "a fused projection is sharded with a strided layout that torch's RowwiseParallel does not "
                      "express. Fix: a model with separate projections",
    "moe_tp_experts": "mixture-of-experts layers are not supported by this translation. Fix: a dense model",
    "moe_identity_expert": "mixture-of-experts layers are not supported by this translation. Fix: a dense model",
    "mla_kv_a_proj": "multi-head latent attention (a shared key/value projection split after the fact) is not "
                     "supported by this translation. Fix: a model with per-head q/k/v projections",
    "all_reduce": "it all-reduces a module's output without sharding its input, which needs transformers' own "
                  "hooks. Fix: a dense model without shared experts",
    "local_params": "it runs a whole module on local tensors, which needs transformers' own hooks. Fix: a model "
                    "without this entry",
    # expert parallelism (transformers' base_model_ep_plan), registered beside the tensor-parallel styles
    "grouped_gemm": "it shards mixture-of-experts weights for expert parallelism. Fix: a dense model",
    "ep_dispatch_experts": "it dispatches tokens to experts on other ranks (expert parallelism). Fix: a dense model",
}
# Style names of earlier transformers releases (4.5x), gone in 5.24: their semantics are not this version's.
_LEGACY = ("local_colwise", "local_rowwise", "local", "gather", "local_packed_rowwise", "isolated", "ep_router",
           "sequence_parallel_colwise")
# Projections that hold several operands in one weight: column-sharding it hands q to one rank and k to another.
FUSED = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack", "qkv", "gate_up_proj", "c_fc_gate_up")
_SHARDED_OUTPUT = ("colwise",)  # styles whose output stays sharded (this rank's heads / columns)
_SHARDED_INPUT = ("rowwise",)  # styles that take a sharded input
_PARTIAL_GRAD = "replicated_with_grad_allreduce"


@dataclass(frozen=True)
class TensorParallelPlan:
    """The translated plan: torch styles per concrete module path, and the modules whose replicated parameters see
    only this rank's heads (their gradient is summed over the group in every backward)."""

    styles: dict[str, ParallelStyle]
    partial_gradients: tuple[str, ...]
    source: dict[str, str]  # concrete module path -> the transformers style it came from


def model_plan(model: nn.Module) -> dict[str, str]:
    """The model's own transformers plan, keys relative to ``model`` (``*`` for layer numbers).

    ``model._tp_plan`` (transformers 5.24 builds it at init: the class plan, e.g. ``{"lm_head": ...}``, the config's
    ``base_model_tp_plan`` under the base model's prefix and ``embed_tokens: embedding_rowwise``), else the same
    assembled from the config and the class."""
    # transformers' plan attributes on the user's model, its config and its class (absent on other models)
    plan = getattr(model, "_tp_plan", None)
    if plan:
        return dict(plan)
    config = getattr(model, "config", None)  # a Hugging Face model's config (a user's object)
    # the config's and the class's plans (optional transformers attributes)
    base = getattr(config, "base_model_tp_plan", None) or getattr(model, "base_model_tp_plan", None)
    if not base:
        return dict(getattr(type(model), "_tp_plan", None) or {})  # the class plan (optional attribute)
    # the base model's prefix and the base model (transformers attributes of the user's model)
    prefix = getattr(model, "base_model_prefix", "")
    base_model = getattr(model, prefix, None) if prefix else None
    scope = f"{prefix}." if base_model is not None and base_model is not model else ""
    plan = {f"{scope}{k}": v for k, v in base.items()}
    # transformers adds the vocabulary-parallel input embedding to every plan (an attribute of the user's model)
    if isinstance(getattr(base_model if scope else model, "embed_tokens", None), nn.Embedding):
        plan.setdefault(f"{scope}embed_tokens", "embedding_rowwise")
    return {**dict(getattr(type(model), "_tp_plan", None) or {}), **plan}  # the class plan (optional attribute)


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def _name_of(model: nn.Module, module: nn.Module | None) -> str | None:
    for name, m in model.named_modules():
        if m is module:
            return name
    return None


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)  # a Hugging Face model's config (a user's object)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def translate(model: nn.Module, tp_size: int | None = None, *, vocab_parallel: bool = True,
              plan_overrides: Mapping[str, str] | None = None) -> TensorParallelPlan:
    """:func:`tp_plan` with the partial-gradient modules and the source styles (see there)."""
    plan = {**model_plan(model), **dict(plan_overrides or {})}
    if not plan:
        raise TensorParallelError(
            f"{type(model).__name__} declares no tensor-parallel plan (no model._tp_plan, config.base_model_tp_plan "
            "or class _tp_plan). Fix: pass plan_overrides={'layers.*.self_attn.q_proj': 'colwise', ...} with the "
            "model's projections, or use FSDP (strategy='dta_fsdp') instead")
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters())
    config = getattr(model, "config", None)  # a Hugging Face model's config (a user's object)
    embedding = _name_of(model, model.get_input_embeddings()) if hasattr(model, "get_input_embeddings") else None
    head = _name_of(model, model.get_output_embeddings()) if hasattr(model, "get_output_embeddings") else None
    critic = bool(getattr(config, "is_value_model", False))  # set by dta.value_model on the user's config
    vocabulary = {n for n in (embedding, head) if n}

    source: dict[str, str] = {}
    for key, style in plan.items():
        pattern = _pattern(key)
        if style in _LEGACY:
            raise TensorParallelError(f"plan entry {key!r}: style {style!r} is a name of an earlier transformers "
                                      "release, not one of 5.24's. Fix: plan_overrides with a 5.24 style "
                                      f"({', '.join(sorted(STYLES))})")
        if style not in STYLES:
            raise TensorParallelError(f"plan entry {key!r}: unknown style {style!r}. Fix: plan_overrides with one of "
                                      f"{', '.join(sorted(STYLES))}")
        matched = [n for n in modules if n and pattern.fullmatch(n)]
        matched_params = [n for n in parameters if pattern.fullmatch(n)]
        if isinstance(STYLES[style], str) and (matched or matched_params):
            name = (matched or matched_params)[0]
            kind = type(modules[name]).__name__ if name in modules else "a parameter"
            raise TensorParallelError(f"{name} ({kind}): style {style!r} (plan entry {key!r}) is refused: "
                                      f"{STYLES[style]}")
        if not matched and matched_params and style != "replicate":
            raise TensorParallelError(f"plan entry {key!r} names a parameter, not a module (style {style!r}); torch's "
                                      "styles shard whole modules. Fix: a model whose plan names its linear layers")
        for name in matched:
            if name in vocabulary and (not vocab_parallel or (critic and name == head)):
                continue  # kept replicated (a critic's scalar head cannot be split by vocabulary)
            source[name] = style

    styles: dict[str, ParallelStyle] = {}
    partial: list[str] = []
    for name, style in source.items():
        module, spec = modules[name], STYLES[style]
        if spec is None:
            if style == _PARTIAL_GRAD:
                partial.append(name)
            continue
        factory, sharded = spec
        leaf = name.rsplit(".", 1)[-1]
        if leaf in FUSED and style != "embedding_rowwise":
            raise TensorParallelError(
                f"{name} ({type(module).__name__}, style {style!r}) is a fused projection: it holds several operands "
                "(q, k and v, or gate and up) in one weight, so a column shard hands different operands to different "
                "ranks, and a gathered one replicates all of attention. Fix: a model with separate q/k/v (gate/up) "
                "projections, or FSDP (strategy='dta_fsdp')")
        kind = nn.Embedding if sharded in ("vocab", "hidden") else nn.Linear
        if not isinstance(module, kind):
            raise TensorParallelError(f"{name} is a {type(module).__name__}, but style {style!r} translates to torch's "
                                      f"{type(factory()).__name__} on an nn.{kind.__name__}. Fix: plan_overrides="
                                      f"{{{name!r}: 'replicate'}} keeps it whole, if its inputs are replicated")
        # the sharded dimension of an nn.Linear / nn.Embedding (the type was checked above)
        size = {"out": module.out_features, "in": module.in_features} if kind is nn.Linear else \
            {"vocab": module.num_embeddings, "hidden": module.embedding_dim}
        size = size[sharded]
        if tp_size is not None and size % tp_size:
            what = {"out": "output features", "in": "input features", "vocab": "vocabulary entries",
                    "hidden": "embedding dimensions"}[sharded]
            fix = "vocab_parallel=False (the embedding and head stay replicated), or pad the vocabulary" \
                if name in vocabulary else f"a tensor-parallel size that divides {size}"
            raise TensorParallelError(f"{name} ({style!r}) has {size} {what}, not divisible by the tensor-parallel "
                                      f"size {tp_size}: ranks would hold shards of different sizes and could take "
                                      f"different engine decisions. Fix: {fix}")
        styles[name] = factory()

    if not styles:
        raise TensorParallelError(f"the tensor-parallel plan of {type(model).__name__} matched no module to shard "
                                  f"(plan keys {sorted(plan)[:4]}...). Fix: plan_overrides with this model's module "
                                  "paths")
    _check_heads(model, source, tp_size)
    _check_recurrent(model, source)
    _check_pairs(model, source)
    _check_tied(model, source, embedding, head)
    return TensorParallelPlan(styles, tuple(partial), source)


def tp_plan(model: nn.Module, tp_size: int | None = None, *, vocab_parallel: bool = True,
            plan_overrides: Mapping[str, str] | None = None) -> dict[str, ParallelStyle]:
    """The model's transformers plan as torch parallel styles, one concrete module path each (``model.layers.3.
    self_attn.q_proj``), for ``parallelize_module(model, tp_mesh, tp_plan(model, tp_size))``.

    ``vocab_parallel``: shard the input embedding and the LM head by vocabulary (``embedding_rowwise`` and
    ``colwise_gather_output``: the head's logits are all-gathered, the engine sees the whole vocabulary); ``False``
    keeps both replicated. ``plan_overrides`` replaces or adds entries (transformers style names). With ``tp_size``
    every sharded dimension and the attention heads must divide by it. Refuses (:class:`TensorParallelError`) what
    the translation cannot run exactly. The partial-gradient fix is not a torch style: :func:`tensor_parallel`
    installs it (parallelizing with this plan alone leaves ``replicated_with_grad_allreduce`` parameters partial).
    """
    return translate(model, tp_size, vocab_parallel=vocab_parallel, plan_overrides=plan_overrides).styles


def _check_heads(model: nn.Module, source: dict[str, str], tp_size: int | None) -> None:
    """Attention split by heads: q, k and v column-parallel with every rank holding whole heads, GQA groups intact."""
    if tp_size is None:
        return
    text = _text_config(model)
    # optional config fields: not every model family has them
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads  # optional config field (MHA models lack it)
    split = [n for n, s in source.items() if s in _SHARDED_OUTPUT and n.rsplit(".", 1)[-1] in ("q_proj", "k_proj",
                                                                                                "v_proj")]
    if not split:
        return
    for what, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count is None or count % tp_size:
            raise TensorParallelError(
                f"{split[0]} is column-parallel (its heads split over ranks), but {what}={count} is not divisible by "
                f"the tensor-parallel size {tp_size}: a rank would hold part of a head (or of a GQA group). Fix: a "
                f"tensor-parallel size that divides both num_attention_heads ({heads}) and num_key_value_heads "
                f"({kv_heads})")


def _check_recurrent(model: nn.Module, source: dict[str, str]) -> None:
    """A recurrent mixer (Gated DeltaNet, short convolution, Mamba2) runs whole on every rank: its projections may be
    split with their outputs gathered (transformers' own plan for Qwen3.5 and Qwen3-Next: ``colwise_gather_output``
    on every projection), so the mixer, its convolution window and its scan state, the states the walk hands from
    chunk to chunk, are the same whole tensors on every peer. A head split (an output left sharded) is refused: the
    mixers' fused projections do not split by heads into contiguous shards."""
    kinds = model_layer_kinds(_text_config(model))
    if not is_recurrent(kinds):
        return
    recurrent = {kind for kind in kinds if LAYER_KINDS.get(kind, ATTENTION).states}
    # transformers' recurrent mixers carry their layer's kind; other modules do not
    mixers = {n: m for n, m in model.named_modules() if getattr(m, "layer_type", None) in recurrent}
    for name, style in sorted(source.items()):
        mixer = next((m for m in mixers if name.startswith(f"{m}.")), None)
        if mixer is None or style not in (*_SHARDED_OUTPUT, *_SHARDED_INPUT, _PARTIAL_GRAD):
            continue
        raise TensorParallelError(
            f"{name} (style {style!r}) is in the recurrent mixer {mixer} ({type(mixers[mixer]).__name__}), which "
            "cannot be split by heads: its input projection holds several operands for all heads one after another "
            "(Qwen3.5's in_proj_qkv: every head's q, then every head's k, then v; LFM2's in_proj: B, C, x), so a "
            "contiguous shard hands one rank all of q and part of k; its depthwise convolution runs over those "
            "channels in the same order, its per-head parameters (A_log, dt_bias) sit on the mixer itself, and it "
            "splits its activations by the model's whole sizes. Fix: keep the projection whole per rank, outputs "
            "gathered (plan_overrides={" f"{name!r}" ": 'colwise_gather_output'}, transformers' own plan for the "
            "Gated DeltaNet projections) or replicated ('replicate'); the mixer and the states the walk hands over "
            "are then whole on every rank")


def _check_pairs(model: nn.Module, source: dict[str, str]) -> None:
    """A block whose column-parallel outputs stay sharded must end in a row-parallel projection, and every module
    with parameters beside them must be declared (it may see only this rank's heads)."""
    children: dict[str, list[str]] = defaultdict(list)
    for name in source:
        parent = name.rpartition(".")[0]
        children[parent].append(name)
    for parent, names in children.items():
        styles = {source[n] for n in names}
        out_sharded, in_sharded = styles & set(_SHARDED_OUTPUT), styles & set(_SHARDED_INPUT)
        partial = [n for n in names if source[n] == _PARTIAL_GRAD]
        if partial and not out_sharded:
            raise TensorParallelError(
                f"{partial[0]} is 'replicated_with_grad_allreduce', but no projection beside it in {parent} keeps a "
                "sharded output: it sees every head, its gradient is whole, and summing it over the group would count "
                f"it once per rank. Fix: plan_overrides={{{partial[0]!r}: 'replicate'}}")
        if bool(out_sharded) != bool(in_sharded):
            raise TensorParallelError(
                f"{parent or type(model).__name__}: {sorted(names)} have styles {sorted(styles)}; a column-parallel "
                "output that stays sharded must meet a row-parallel projection in the same block (and vice versa), "
                "or the block computes on half its features. Fix: plan_overrides making q/k/v (gate/up) 'colwise' "
                "and o (down) 'rowwise', or all of them 'colwise_gather_output'/'rowwise_split_input'")
        if not out_sharded:
            continue
        block = model.get_submodule(parent) if parent else model
        own = [n for n, _ in block.named_parameters(recurse=False)]
        if own:
            raise TensorParallelError(
                f"{parent} holds parameters {own} itself, beside column-parallel projections: they may act on this "
                "rank's heads only (per-head biases, sinks, lambdas) and no style covers them. Fix: a model without "
                "them, or FSDP (strategy='dta_fsdp')")
        for child_name, child in block.named_children():
            full = f"{parent}.{child_name}" if parent else child_name
            if full in source or not any(True for _ in child.parameters()):
                continue
            raise TensorParallelError(
                f"{full} ({type(child).__name__}) holds parameters and sits in {parent} beside column-parallel "
                "projections, without a plan entry: if it sees only this rank's heads its gradient is partial. Fix: "
                f"plan_overrides={{{full!r}: 'replicated_with_grad_allreduce'}} if it acts on sharded activations "
                f"(per-head norms), or {{{full!r}: 'replicate'}} if its inputs are replicated")


def _check_tied(model: nn.Module, source: dict[str, str], embedding: str | None, head: str | None) -> None:
    """Tied input/output embeddings stay one parameter: both vocabulary-parallel (both Shard(0)) or neither."""
    if not (embedding and head):
        return
    if model.get_input_embeddings().weight is not model.get_output_embeddings().weight:
        return
    styles = (source.get(embedding), source.get(head))
    if styles == (None, None) or (styles[0] == "embedding_rowwise" and styles[1] in ("colwise_rep",
                                                                                     "colwise_gather_output")):
        return
    raise TensorParallelError(f"{embedding} and {head} share one weight (tied embeddings), but their styles {styles} "
                              "shard it differently. Fix: vocab_parallel=True with the default plan (both split by "
                              "vocabulary) or vocab_parallel=False (both replicated)")


def tensor_parallel(model: nn.Module, tp_mesh, *, vocab_parallel: bool = True,
                    plan_overrides: Mapping[str, str] | None = None) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` (every rank of it must call this, and then walk the same
    trees): the translated plan (:func:`tp_plan`), tied embeddings tied again, every weight taken from the group's
    first rank (sharded ones by torch, replicated ones broadcast here), and the partial gradients of
    ``replicated_with_grad_allreduce`` parameters summed over the group in every backward. Apply
    FSDP2 (``fully_shard`` over the data-parallel mesh) after this, never before."""
    if tp_mesh.ndim != 1 or tp_mesh.mesh_dim_names != (TP_DIM,):
        raise TensorParallelError(f"tensor_parallel takes the 1-D mesh named {TP_DIM!r} (got dimensions "
                                  f"{tp_mesh.mesh_dim_names}). Fix: init_device_mesh(..., mesh_dim_names=("
                                  f"'data_parallel', {TP_DIM!r})) and pass mesh[{TP_DIM!r}]")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise TensorParallelError("this model's weights are DTensors already (tensor-parallel or FSDP-sharded). "
                                  "Fix: call tensor_parallel once, on the plain model, before fully_shard")
    plan = translate(model, tp_mesh.size(), vocab_parallel=vocab_parallel, plan_overrides=plan_overrides)
    tied = hasattr(model, "get_input_embeddings") and hasattr(model, "get_output_embeddings") and \
        model.get_output_embeddings() is not None and \
        model.get_input_embeddings().weight is model.get_output_embeddings().weight
    parallelize_module(model, tp_mesh, plan.styles)
    if tied:  # parallelize_module gave each module its own DTensor: tie them again (same placement, Shard(0))
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    group = tp_mesh.get_group()
    _broadcast_replicated(model, group)
    for name in plan.partial_gradients:
        for module in model.get_submodule(name).modules():
            names = tuple(n for n, _ in module.named_parameters(recurse=False))
            if names:
                module.register_forward_pre_hook(_SumGradientsPerBackward(names, group))
    return model


def _broadcast_replicated(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Copy the parameters and buffers the plan leaves whole (norms; the embedding and head with
    ``vocab_parallel=False``) from the group's first rank to its peers. The sharded ones are scattered from that rank
    already (torch's styles distribute with ``src_data_rank=0``); without this, a model built unseeded on each rank
    would keep different replicated weights on each peer, and the peers would compute different activations (and
    generate different rollouts) from the same inputs. A model on the meta device is skipped: the checkpoint loaded
    into it later is the same on every rank."""
    tensors = [t.data for t in (*model.parameters(), *model.buffers()) if not isinstance(t, DTensor) and not t.is_meta]
    broadcast_tensors(tensors, src=dist.get_global_rank(group, 0), group=group)


class _SumGradientsPerBackward:
    """Forward pre-hook: the parameters this forward uses get a tensor hook that sums each backward's gradient over
    the group before it is accumulated (once per parameter object: FSDP2 swaps in its unsharded parameters)."""

    def __init__(self, names: tuple[str, ...], group) -> None:
        self.names = names
        self.group = group

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=self.group)
        return grad

    def __call__(self, module: nn.Module, args) -> None:
        if not torch.is_grad_enabled():
            return
        for name in self.names:
            param = module._parameters.get(name)
            # our own mark on the parameter object: hooked once (FSDP2 swaps in a new object when it unshards)
            if param is None or not param.requires_grad or getattr(param, "_lightning_dta_grad_sum", None) is self:
                continue
            if isinstance(param, DTensor):
                raise TensorParallelError(f"{type(module).__name__}.{name} is a DTensor; 'replicated_with_grad_"
                                          "allreduce' expects a plain replicated parameter. Fix: do not shard it")
            param.register_hook(self._sum)
            param._lightning_dta_grad_sum = self
