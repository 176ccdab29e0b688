"""What a hybrid's layers cost: multiply-accumulates per token of every decoder layer, and the fixed-size state
each recurrent layer hands from a node to its children.

A hybrid's layers differ by kind (Gated DeltaNet, KDA, Mamba2 or a short convolution instead of attention; an MLP, a
mixture of experts or nothing after it), so the costs are read off the layers themselves, built on the meta device
(no memory, no weights): every ``nn.Linear`` costs ``in x out`` per token, a ``Conv1d`` its weight's size per output
position (a depthwise convolution: channels x kernel), a mixture of experts its experts' weights times the share of
experts a token visits (``num_experts_per_tok / num_experts``). What no layer's weights show is the recurrent core
(the scan over the chunk), counted per kind from its definition by :func:`core_macs_per_token`. Elementwise work
(gates, norms, decays, activations) is left out, as for attention-only models (:mod:`.flops`).

The state per recurrent layer is what :mod:`~lightning_dta.engine.recurrent_state` stores at a chunk's end: the
convolution window ``[channels, kernel]`` in the model's dtype and, for the scan mixers, the scan's state in float32
(transformers' Gated DeltaNet, Kimi Delta Attention and Mamba2 cores compute and return it in float32 whatever the
model's dtype).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from lightning_dta.engine.layer_kinds import ATTENTION, LAYER_KINDS, MIXER_KINDS, model_layer_kinds

# the chunk of transformers' torch_chunk_gated_delta_rule / chunk_kimi_delta_attention and of fla's kernels
DELTA_RULE_CHUNK = 64
DELTA_RULE_KINDS = ("Gated DeltaNet", "Kimi Delta Attention")
PRICED_KINDS = (*DELTA_RULE_KINDS, "Mamba2", "short convolution")  # the mixer kinds whose core and state are priced
SCAN_STATE_DTYPE = torch.float32


class UnpricedModelError(ValueError):
    """A layer the planner cannot price (an unknown recurrent mixer, a mixture of experts without its top-k)."""


def meta_model(config) -> nn.Module:
    """The model of ``config`` on the meta device: its modules and their sizes, no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def mixer_kind(module: nn.Module) -> str | None:
    """The kind of a recurrent mixer (:data:`~lightning_dta.engine.layer_kinds.MIXER_KINDS`), ``None`` for other
    modules. transformers' recurrent mixers carry their layer's ``layer_type``; attention modules do not."""
    # transformers' recurrent mixers carry their layer's kind; other modules do not
    if not LAYER_KINDS.get(getattr(module, "layer_type", None), ATTENTION).states:
        return None
    name = type(module).__name__
    kind = next((kind for suffix, kind in MIXER_KINDS.items() if name.endswith(suffix)), None)
    if kind not in PRICED_KINDS:  # a kind the engine walks but the planner does not price would cost nothing
        raise UnpricedModelError(f"recurrent mixer {name} is of a kind the planner does not price (it prices "
                                 f"{sorted(PRICED_KINDS)}). Fix: plan an attention-only model of the same size")
    return kind


def core_macs_per_token(mixer: nn.Module, kind: str) -> int:
    """The recurrent core's multiply-accumulates per token (the projections and the convolution are counted from
    their weights), from the chunked algorithms' definitions.

    Gated DeltaNet (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, the chunkwise form of section 3.3,
    as transformers' ``torch_chunk_gated_delta_rule`` and fla's ``chunk_gated_delta_rule`` run it), per value head
    with key dim ``dk``, value dim ``dv``, chunk ``C`` = 64, per token: ``K_b K^T`` and ``Q K^T`` within the chunk
    (``2 C dk``); the two unit-lower-triangular solves of the UT transform, against ``V_b`` and the decayed ``K_b``
    (``C/2 (dv + dk)``); the reads of the chunk's start state ``K_cum S`` and ``Q S`` (``2 dk dv``); the masked
    intra-chunk product with the new values (``C dv``); the state update ``K^T V_new`` (``dk dv``).

    Mamba2's SSD (Dao and Gu, "Transformers are SSMs", ICML 2024, section 6 and its Listing 1; ``C B^T`` once per
    group as mamba_ssm's ``ssd_combined`` does), with ``H`` heads of dim ``P``, state ``N``, ``G`` groups, chunk
    ``Q``, per token: ``C B^T`` within the chunk (``G Q N``); the masked product with the inputs (``H Q P``); the
    chunk's state ``B^T X`` (``H N P``) and the output from the chunk's start state ``C h`` (``H N P``). The passing
    of states between chunks (``H N P`` per chunk, ``1/Q`` of a state term) is left out.

    Kimi Delta Attention (Kimi Linear) is the same chunked delta rule with a decay per channel instead of per head
    (elementwise, not counted), ``dk = dv`` = its head dim, chunk 64 (``chunk_kimi_delta_attention``).

    A short convolution (LFM2) has no core: its gates are elementwise, its convolution is counted from its weight."""
    if kind in DELTA_RULE_KINDS:
        heads, dk, dv = _delta_rule_heads(mixer, kind)
        chunk = DELTA_RULE_CHUNK
        per_head = 2 * chunk * dk + chunk * (dv + dk) // 2 + 2 * dk * dv + chunk * dv + dk * dv
        return heads * per_head
    if kind == "Mamba2":
        heads, dim, state, chunk = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.chunk_size
        return mixer.n_groups * chunk * state + heads * chunk * dim + 2 * heads * state * dim
    return 0


def _delta_rule_heads(mixer: nn.Module, kind: str) -> tuple[int, int, int]:
    """A delta-rule mixer's heads and their key and value dims (Gated DeltaNet: per value head; KDA: one dim)."""
    if kind == "Gated DeltaNet":
        return mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    return mixer.num_heads, mixer.head_dim, mixer.head_dim


def _convolution(mixer: nn.Module) -> nn.Conv1d:
    convs = [m for m in mixer.modules() if isinstance(m, nn.Conv1d)]
    if len(convs) != 1:
        raise UnpricedModelError(f"recurrent mixer {type(mixer).__name__} has {len(convs)} convolutions, not one. "
                                 "Fix: plan an attention-only model of the same size")
    return convs[0]


def holds_experts(module: nn.Module) -> bool:
    """A mixture of experts' weights: 3-D parameters ``[num_experts, ...]`` (transformers' fused experts)."""
    return hasattr(module, "num_experts") and any(p.dim() == 3 for p in module.parameters(recurse=False))


def mixer_projections(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear projections inside the recurrent mixers, by name: under tensor parallelism they are split by
    output columns and their outputs gathered (transformers' plan for Qwen3.5's Gated DeltaNet,
    :mod:`lightning_dta.distributed.tensor_parallel`), while the mixer itself runs whole on every rank."""
    out = {}
    for name, module in model.named_modules():
        if mixer_kind(module) is not None:
            out |= {f"{name}.{n}": m for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    return out


def layer_macs_per_token(model: nn.Module, config, tensor_parallel: int = 1) -> tuple[int, int]:
    """Multiply-accumulates per token of all decoder layers (not the LM head), and of that the recurrent cores.
    ``model`` is one rank's model (its attention and MLP already divided, :func:`~lightning_dta.plan.flops.
    tensor_parallel_config`); with ``tensor_parallel`` > 1 a rank computes 1/``tensor_parallel`` of each recurrent
    mixer's projections (its output columns, then gathered) and the mixer's convolution and scan whole."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head = model.get_output_embeddings()
    split = {id(m) for m in mixer_projections(model).values()}
    total = cores = 0
    for module in model.modules():
        if module is head:
            continue
        if isinstance(module, nn.Linear):
            macs = module.in_features * module.out_features
            total += macs // tensor_parallel if id(module) in split else macs
        elif isinstance(module, nn.Conv1d):
            total += module.weight.numel()
        elif holds_experts(module):
            # optional config field: only mixture-of-experts families have it
            top_k = getattr(text, "num_experts_per_tok", None)
            if not top_k:
                raise UnpricedModelError(f"{type(module).__name__} holds {module.num_experts} experts, and the config "
                                         "has no num_experts_per_tok to say how many a token visits. Fix: set "
                                         "num_experts_per_tok in the config")
            weights = sum(p.numel() for p in module.parameters(recurse=False) if p.dim() == 3)
            total += weights * top_k // module.num_experts
        kind = mixer_kind(module)
        if kind is not None:
            core = core_macs_per_token(module, kind)
            total, cores = total + core, cores + core
    return total, cores


def recurrent_state_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The states one node hands to its children, over all recurrent layers (module docstring): the convolution
    window in ``dtype`` and the scan's state in float32."""
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for module in model.modules():
        kind = mixer_kind(module)
        if kind is None:
            continue
        conv = _convolution(module)
        total += conv.weight.shape[0] * conv.kernel_size[0] * element
        if kind in DELTA_RULE_KINDS:
            heads, dk, dv = _delta_rule_heads(module, kind)
            scan = heads * dk * dv
        elif kind == "Mamba2":
            scan = module.num_heads * module.head_dim * module.ssm_state_size
        else:
            scan = 0
        total += scan * SCAN_STATE_DTYPE.itemsize
    return total


def attention_layers(config) -> int:
    """Layers that attend (keep keys/values); every layer where the config names no kinds."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = model_layer_kinds(text)
    if kinds is None:
        return text.num_hidden_layers
    return sum(LAYER_KINDS.get(k, ATTENTION).keys_values for k in kinds)
