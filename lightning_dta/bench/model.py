"""The benchmark model: a Llama-shaped causal LM built from a config (random weights, nothing downloaded)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build_model(layers: int = 4, hidden: int = 256, heads: int = 4, kv_heads: int | None = None,
                intermediate: int | None = None, vocab: int = 4096, max_positions: int = 8192,
                dtype: torch.dtype = torch.float32, device: str = "cpu", attn_implementation: str = "sdpa",
                seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or int(hidden * 8 / 3),
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads or heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=False)
    config._attn_implementation = attn_implementation
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    model.train()  # dropout is 0 in Llama configs; train mode as in real training
    return model
