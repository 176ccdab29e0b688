"""What the engine needs to know about a model, checked once per call before anything is trained.

:func:`inspect_model` reads the forward signature (the cache argument's name, ``logits_to_keep``), the model's
limits (vocabulary, positions), its dtype, device and dropout, refuses set-ups that would silently train on
something else (no KV cache, transformers gradient checkpointing, layers without keys/values) and decides
whether prefix attention runs (its configuration rules and a probe forward, see
:mod:`~lightning_dta.engine.prefix_attention`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import transformers
from packaging.version import Version
from torch import nn

from lightning_dta.contracts import TENSOR_PARALLEL
from lightning_dta.engine.attention_backends import AttentionBackend, choose_backend
from lightning_dta.engine.attention_check import check_kernels, fall_back
from lightning_dta.engine.errors import ModelNotSupportedError
from lightning_dta.engine.layer_kinds import (
    ATTENTION,
    LAYER_KINDS,
    check_layer_kinds,
    is_recurrent,
    model_layer_kinds,
    recurrent_mixers,
)
from lightning_dta.engine.prefix_attention import (
    attention_configs,
    original_implementation,
    probe,
    unsupported_reason,
)
from lightning_dta.engine.recurrent_check import check_recurrent_kernels
from lightning_dta.engine.time_step_limit import Limits, time_step_limits


@dataclass(frozen=True)
class ModelInfo:
    cache_arg: str | None  # "cache" (transformers >= 5.24) or "past_key_values"; None: none (mode='vanilla' only)
    logits_to_keep: bool  # whether forward accepts an index tensor of positions to project
    vocab_size: int | None
    max_positions: int | None
    dtype: torch.dtype
    device: torch.device
    has_active_dropout: bool
    attn_implementation: str | None
    # configs whose attention the attention switch turns into prefix attention during a forward (empty: the
    # model's own attention with a KV cache and a causal mask)
    prefix_attention_configs: tuple = ()
    attention_backend: AttentionBackend | None = None  # prefix attention's kernels (with the configs above)
    num_layers: int | None = None  # decoder layers
    layer_kinds: tuple[str, ...] | None = None  # each decoder layer's kind (layer_kinds.LAYER_KINDS), if given
    # the Mamba2 mixers' time-step limits that the engine applies to their one-token updates (time_step_limit.py)
    time_step_limits: Limits = ()

    @property
    def packs_siblings(self) -> bool:
        """Sibling chunks go into one packed row (prefix attention) rather than padded rows."""
        return bool(self.prefix_attention_configs)

    @property
    def packs_cousins(self) -> bool:
        """The forward-only walks pack cousins (pending chunks of any parent in one row, :mod:`.cousins`): under
        prefix attention, and never with recurrent layers. A packed row would run each recurrent layer's scan and
        convolution across its chunks, while each chunk must start from its own parent's state: transformers 5.24's
        PyTorch mixers keep no boundaries inside a row (given ``cu_seq_lens`` the Gated DeltaNet refuses, LFM2's
        short convolution and Mamba2 ignore them, 0.25 to 1.2 relative error measured; given ``seq_idx`` all
        refuse without the CUDA kernels), and they start every row from one state. A hybrid's forward-only walk
        batches siblings instead (they start from one state), as its training walk does."""
        return self.packs_siblings and not self.recurrent

    @property
    def recurrent(self) -> bool:
        """Some layers hand a recurrent state from chunk to chunk (a hybrid or state-space model)."""
        return is_recurrent(self.layer_kinds)

    @property
    def kv_layers(self) -> int | None:
        """The layers that must hand over their new keys/values in every forward."""
        if self.layer_kinds is None:
            return self.num_layers
        return sum(LAYER_KINDS.get(kind, ATTENTION).keys_values for kind in self.layer_kinds)


def _forward_parameters(model: nn.Module) -> dict[str, inspect.Parameter]:
    """The keyword arguments ``model`` accepts. Wrappers such as PEFT (LoRA) declare ``**kwargs`` and pass them
    to the wrapped model, so its arguments (``cache``, ``logits_to_keep``) count too."""
    params = dict(inspect.signature(model.forward).parameters)
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if takes_kwargs and hasattr(model, "get_base_model"):
        params.update(inspect.signature(model.get_base_model().forward).parameters)
    return params


def text_config(model: nn.Module):
    """The config that describes the language model (the text part of a multimodal config), or ``None``."""
    # a user's model: not every nn.Module carries a Hugging Face config
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_limits(model: nn.Module) -> tuple[int | None, int | None]:
    """The model's vocabulary size and maximum positions (``None`` where the config does not say)."""
    text = text_config(model)
    # optional config fields: not every model family has them
    vocab_size = getattr(text, "vocab_size", None)
    # optional config fields: not every model family has them
    max_positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return vocab_size, max_positions


# transformers 5.18 made Doge's sdpa path causal (huggingface/transformers#48821: ``allow_is_causal_skip=False``).
DOGE_CAUSAL_SDPA = Version("5.18.0")


def dynamic_mask_reason(model: nn.Module, configs: tuple) -> str | None:
    """Why a model whose attention adds its own dynamic mask (Doge's ``prepare_dynamic_mask``) is not causal in
    its own forward, so that no prefix tree can reproduce it (``None``: it is causal). ``prepare_dynamic_mask``
    folds the causal mask into its bias only when it gets one (``modeling_doge.py``: ``if attention_mask is not
    None``) and always passes the bias on as the mask; under sdpa before 5.18 ``create_causal_mask`` returns
    ``None`` for an unpadded call over an empty cache (the per-rollout forward, a tree's root chunk), and sdpa
    turns ``is_causal`` off because a mask was given: every token attends to later tokens. Under flex attention
    the causal mask is a ``BlockMask``, which the fold skips (still so in 5.24). Doge's MoE router splits its
    logits over the token dimension (``.view(2, bsz * seq_len, -1)``), mixing tokens."""
    if not any(hasattr(m, "prepare_dynamic_mask") for m in model.modules()):
        return None
    name = type(model).__name__
    # optional config field: only Doge's config has it
    if getattr(text_config(model), "is_moe", False):
        return (f"{name}'s MoE router mixes the routing logits of different tokens (its own forward is not causal), "
                "so a shared prefix cannot stand for it. Fix: mode='vanilla'")
    implementations = {original_implementation(c) for c in configs}
    causal = {"eager", "sdpa"} if Version(transformers.__version__) >= DOGE_CAUSAL_SDPA else {"eager"}
    if implementations <= causal:
        return None
    return (f"{name} adds its own dynamic mask, which under attn_implementation={sorted(map(str, implementations))} "
            f"with transformers {transformers.__version__} drops the causal mask (its own forward attends to later "
            "tokens). Fix: load the model with attn_implementation='eager'"
            + ("" if "sdpa" in causal else " (or 'sdpa' with transformers >= 5.18)") + ", or use mode='vanilla'")


def compute_dtype(model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention runs in: the autocast dtype under autocast (mixed precision), else the model's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return model_dtype


def choose_prefix_attention(model: nn.Module, device: torch.device, dtype: torch.dtype, num_layers: int | None,
                            backend_name: str | None) -> tuple[tuple, AttentionBackend | None, str | None]:
    """The configs to switch and the kernels of prefix attention, or why it cannot run: the model's
    configuration, a backend for the device and dtype, the probe forward and the kernels' self-check."""
    configs = attention_configs(model)
    reason = unsupported_reason(model, configs)
    if reason:
        return (), None, reason
    backend, reason = choose_backend(backend_name, device, dtype)
    if backend is None:
        return (), None, reason
    result = probe(model, num_layers, backend, dtype)
    if result.reason:
        return (), None, fall_back(result.reason) if result.kernel_failed else result.reason
    reason = check_kernels(backend, device, result.shape)
    return ((), None, reason) if reason else (configs, backend, None)


def inspect_model(model: nn.Module, uses_cache: bool, prefix_attention: bool | None,
                  prefix_attention_backend: str | None) -> ModelInfo:
    """Check that ``model`` can take a KV cache and is not in a mode that silently drops it.

    ``uses_cache=False`` (the per-rollout baseline) allows transformers gradient checkpointing, which is then
    harmless: it only drops caches, and that mode passes none. ``prefix_attention``: ``None`` uses
    :mod:`prefix_attention` where the model supports it, ``True`` requires it, ``False`` never uses it; its
    kernels are ``prefix_attention_backend`` (``None``: the device's default).
    """
    params = _forward_parameters(model)
    if "cache" in params:
        cache_arg = "cache"
    elif "past_key_values" in params:
        cache_arg = "past_key_values"
    elif not uses_cache:  # the per-rollout forward passes no cache
        cache_arg = None
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
            "and use activation='recompute' with chunk_size=... instead.")
    # a user's model: not every nn.Module carries a Hugging Face config
    config = getattr(model, "config", None)
    text = text_config(model)
    vocab_size, max_positions = model_limits(model)
    first = next(model.parameters())
    dropout = model.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    attn_implementation = original_implementation(config) if config is not None else None
    # optional config fields: not every model family has them
    num_layers = getattr(text, "num_hidden_layers", None)
    kinds = model_layer_kinds(text)
    limits = ()
    if uses_cache:
        check_layer_kinds(model, kinds)
        if is_recurrent(kinds):
            limits = time_step_limits(type(model).__name__, recurrent_mixers(model, kinds))
    if uses_cache and (reason := dynamic_mask_reason(model, attention_configs(model))):
        raise ModelNotSupportedError(f"{reason}.")
    if uses_cache and is_recurrent(kinds) and first.device.type == "cuda":  # the mixers may call CUDA kernels
        check_recurrent_kernels(model, kinds, first.device, first.dtype)
    configs, backend = (), None
    if uses_cache and prefix_attention and is_recurrent(kinds):
        raise ModelNotSupportedError(
            f"prefix_attention=True, but {type(model).__name__} has recurrent layers: prefix attention packs sibling "
            "chunks (and, in tree_logprobs / tree_values, cousins) into one row, and a recurrent layer would run one "
            "scan across them, each of which must start from its own parent's state. Fix: pass "
            "prefix_attention=None (the engine then uses the model's own attention over a cache) or "
            "prefix_attention=False.")
    if uses_cache and prefix_attention is not False and not is_recurrent(kinds):
        configs, backend, reason = choose_prefix_attention(
            model, first.device, compute_dtype(first.dtype, first.device), num_layers, prefix_attention_backend)
        if not _agreed_by_tensor_parallel_peers(model, reason is None):
            configs, backend = (), None
            reason = reason or "a tensor-parallel peer cannot run it (its kernels failed their check)"
        if reason and prefix_attention:
            raise ModelNotSupportedError(f"prefix_attention=True, but {reason}. Fix: pass prefix_attention=None "
                                         "(use it where possible) or prefix_attention=False.")
    return ModelInfo(cache_arg, "logits_to_keep" in params, vocab_size, max_positions, first.dtype, first.device,
                     dropout, attn_implementation, configs, backend, num_layers, kinds, limits)


def _agreed_by_tensor_parallel_peers(model: nn.Module, usable: bool) -> bool:
    """Whether every peer of ``model``'s tensor-parallel group can use prefix attention: the peers walk one tree in
    lockstep, so they must all take the same attention path (one tiny collective; ``usable`` without a group)."""
    mesh = tensor_parallel_mesh(model)
    if mesh is None:
        return usable
    flag = torch.tensor([1.0 if usable else 0.0], device=next(model.parameters()).device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=mesh.get_group())
    return bool(flag.item())


def tensor_parallel_mesh(model: nn.Module):
    """The 1-D mesh named ``"tensor_parallel"`` that ``model``'s weights are DTensors on, or ``None``. Under FSDP2
    the weights are 2-D DTensors between walks and tensor-parallel ones while a walk runs unsharded. Read from the
    weights, not from an attribute, so only a walk finds the mesh: the engine needs it where the peers of a group
    must take the same decisions (``activation="auto"``'s measured rates, prefix attention's verdict) and where a
    rank's share differs from the config's (the path's key/value heads)."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == (TENSOR_PARALLEL,):
            return p.device_mesh
    return None


def loss_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Log-softmax and the loss run in float32 for half-precision models (float64 models keep float64)."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def check_model(model: nn.Module, engine) -> None:
    """Refuse ``model`` under ``engine`` (:class:`~lightning_dta.EngineOptions`) for what its structure alone decides
    (no KV cache, layers without keys/values, transformers gradient checkpointing, a mask that is not causal),
    without a forward: a trainer calls it before anything runs, so that a refusal comes before the first step."""
    inspect_model(model, uses_cache=engine.mode != "vanilla", prefix_attention=False, prefix_attention_backend=None)
