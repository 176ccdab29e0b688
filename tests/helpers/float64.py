"""The test models' float32 islands, computed in float64 instead, so that float64 exactness tests can mean exact.

Hugging Face models compute some steps in float32 whatever the model's dtype: Llama-style RMSNorms cast the hidden
state to float32, Gemma's norm computes in float32, the rotary embeddings build cos/sin from a float32
``inv_freq``, eager attention and MoE routers take their softmax in float32, DiffLlama its lambdas. In a float64
model such a step rounds a float64 value to float32: two computations of the same gradient whose float64 inputs
differ in the last bits (the engine's batching and the per-rollout reference sum in different orders) come out
~1e-7 apart, which forced the exactness tests to allow 1e-5 relative, enough to hide a small real error.

:func:`without_float32_islands` gives each of these modules a forward that computes the same definition in the
input's dtype (an attention module keeps its own forward, with the reductions it asks for in float32 run in
float64 for float64 inputs). The library is untouched, and so is the engine's own code: an island of its own would
show. A norm or rotary embedding of a kind it does not know is an error rather than an island left in place. (The
rotary's float32 cos/sin are a function of the position alone, so they round alike in both computations on this
CPU; they are rewritten anyway, so that exactness does not rest on every vectorised sin/cos rounding alike.)
"""

from __future__ import annotations

import types

import torch
from torch.overrides import TorchFunctionMode


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _llama_rms_norm(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` (Llama, Qwen2/3, Mistral, Doge, DiffLlama)."""
    return self.weight * _rms(hidden_states, self.variance_epsilon)


# Qwen3.5's text rotary embedding interleaves three position grids (multimodal RoPE): left as it is
MULTIMODAL_ROTARIES = frozenset({"Qwen3_5TextRotaryEmbedding", "Qwen3_5MoeTextRotaryEmbedding"})
GEMMA_STYLE_NORMS = frozenset({"GemmaRMSNorm", "Qwen3_5RMSNorm", "Qwen3NextRMSNorm"})  # weight stored minus one


def _gemma_rms_norm(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``(1 + weight) * x / sqrt(mean(x^2) + eps)`` (Gemma, Qwen3.5, Qwen3-Next: the weight is stored minus one)."""
    return _rms(x, self.eps) * (1.0 + self.weight)


def _rotary(self: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The default RoPE's cos/sin, ``inv_freq_i = theta^(-2i/dim)``, in ``x``'s dtype."""
    dim = 2 * self.inv_freq.numel()
    exponents = torch.arange(0, dim, 2, dtype=x.dtype, device=x.device) / dim
    inv_freq = 1.0 / self.config.rope_parameters["rope_theta"] ** exponents
    freqs = position_ids[..., None].to(x.dtype) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


class _Float64Reductions(TorchFunctionMode):
    """``softmax(x, dtype=torch.float32)``, ``sum(x, dtype=torch.float32)``, ... of a float64 ``x`` in float64."""

    def __torch_function__(self, func, kinds, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") == torch.float32 and args and isinstance(args[0], torch.Tensor) \
                and args[0].dtype == torch.float64:
            kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


def _attention_without_float32_reductions(self: torch.nn.Module, *args, **kwargs) -> tuple:
    """The module's own forward (eager attention's softmax, DiffLlama's lambdas, a router's softmax) with float64
    reductions."""
    with _Float64Reductions():
        return type(self).forward(self, *args, **kwargs)


def _has_float32_reductions(module: torch.nn.Module) -> bool:
    """A module that asks for float32 reductions: eager attention (its softmax), DiffLlama's (lambda), an MoE router
    (Qwen3-MoE's softmax over the experts)."""
    if type(module).__name__.endswith("Router"):
        return True
    if not type(module).__name__.endswith("Attention"):
        return False
    config = getattr(module, "config", None)
    return hasattr(module, "lambda_q1") or getattr(config, "_attn_implementation", None) == "eager"


def without_float32_islands(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its RMSNorms, rotary embeddings and attention's reductions computing in their input's dtype
    (in place)."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in GEMMA_STYLE_NORMS:
            module.forward = types.MethodType(_gemma_rms_norm, module)
        elif kind.endswith("RMSNorm") and kind != "RMSNorm":  # torch.nn.RMSNorm computes in the input's dtype
            if not hasattr(module, "variance_epsilon"):
                raise NotImplementedError(f"{name}: {kind} is not a Llama-style RMSNorm; add its definition here")
            module.forward = types.MethodType(_llama_rms_norm, module)
        elif kind in MULTIMODAL_ROTARIES:
            continue  # float32 cos/sin of the position alone: they round alike in both computations (docstring)
        elif kind.endswith("RotaryEmbedding"):
            if module.rope_type != "default":
                raise NotImplementedError(f"{name}: {kind} uses RoPE type {module.rope_type!r}; add it here")
            module.forward = types.MethodType(_rotary, module)
        elif _has_float32_reductions(module):
            module.forward = types.MethodType(_attention_without_float32_reductions, module)
    return model
