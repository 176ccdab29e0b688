"""The benchmark model: a Llama-, Qwen3- or Qwen3.5-shaped causal LM built from a config (random weights, nothing
downloaded). ``qwen3_5`` is a hybrid: Gated DeltaNet layers with one full-attention layer in four (its config's
own default pattern), its Gated DeltaNet heads sized like its attention heads (:func:`model_config`)."""

from __future__ import annotations

import torch
from transformers import (
    AutoConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                 "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM)}

# Shapes of real checkpoints, for the GPU benchmark (random weights are fine for speed).
PRESETS = {
    "qwen3-0.6b": dict(arch="qwen3", layers=28, hidden=1024, heads=16, kv_heads=8, intermediate=3072, vocab=151936,
                       head_dim=128),
    "qwen3-1.7b": dict(arch="qwen3", layers=28, hidden=2048, heads=16, kv_heads=8, intermediate=6144, vocab=151936,
                       head_dim=128, tie=True),
    "qwen3-8b": dict(arch="qwen3", layers=36, hidden=4096, heads=32, kv_heads=8, intermediate=12288, vocab=151936,
                     head_dim=128),
    "qwen3-32b": dict(arch="qwen3", layers=64, hidden=5120, heads=64, kv_heads=8, intermediate=25600, vocab=151936,
                      head_dim=128),
    "llama-70b": dict(arch="llama", layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672, vocab=128256,
                      head_dim=128),  # Llama 3 70B's shape
}

# Hybrid shapes for the planner: transformers' own config defaults of the family (``Qwen3_5TextConfig()``: 32
# layers, 3 Gated DeltaNet : 1 full attention, 16 key / 32 value heads of 128; ``NemotronHConfig()``: Mamba2, MoE,
# attention and MLP blocks), with the planner's 40960 positions.
HYBRID_PRESETS = {"qwen3.5-like": "qwen3_5_text", "nemotron-h-like": "nemotron_h"}


def hybrid_preset_config(name: str, max_positions: int = 40960):
    """The config of a :data:`HYBRID_PRESETS` shape."""
    config = AutoConfig.for_model(HYBRID_PRESETS[name], max_position_embeddings=max_positions)
    config._attn_implementation = "sdpa"
    return config


def model_config(layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int | None = None,
                 intermediate: int | None = None, vocab: int = 2048, max_positions: int = 32768,
                 attn_implementation: str = "sdpa", arch: str = "llama", head_dim: int | None = None,
                 tie: bool = False):
    """The config of a bench model (the defaults: the default bench model; a ``PRESETS`` entry: a real shape)."""
    config_cls, _ = ARCHITECTURES[arch]
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or int(hidden * 8 / 3),
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                  max_position_embeddings=max_positions, tie_word_embeddings=tie)
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if arch == "qwen3_5":  # Gated DeltaNet heads like the attention's: as many value heads, half as many key heads
        dim = head_dim or hidden // heads
        kwargs.update(linear_num_value_heads=heads, linear_num_key_heads=max(heads // 2, 1), linear_key_head_dim=dim,
                      linear_value_head_dim=dim)
    config = config_cls(**kwargs)
    config._attn_implementation = attn_implementation
    return config


def build_model(dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, **shape) -> torch.nn.Module:
    """A bench model with random weights: :func:`model_config` of ``shape``, in ``dtype`` on ``device``."""
    config = model_config(**shape)
    _, model_cls = ARCHITECTURES[shape.get("arch", "llama")]
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    model = model.to(dtype=dtype)
    model.train()  # dropout is 0 in these configs; train mode as in real training
    return model
