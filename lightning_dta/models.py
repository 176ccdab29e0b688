"""A critic for PPO from any Hugging Face causal LM: the same backbone, a scalar value head instead of the LM head.

The engine's contract stays whole: the critic takes a KV cache, positions and ``logits_to_keep`` exactly as the
policy does (it is the same model class), so ``tree_backward(critic, tree, ValueLoss())`` and
``tree_values(critic, tree)`` walk the prefix tree like the policy's walks, each shared token computed once. Its
"logits" are ``[..., 1]``: the value of the state at each position (the state the next token is emitted from).
"""

from __future__ import annotations

import torch
from torch import nn


def value_model(model: nn.Module) -> nn.Module:
    """Turn ``model`` (a Hugging Face causal LM) into a critic, in place: its output embeddings become a scalar
    head (zero-initialised, so every value starts at 0) and are untied from the input embeddings. A model that is
    already a critic is returned as it is."""
    if getattr(getattr(model, "config", None), "is_value_model", False):
        return model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise TypeError(f"{type(model).__name__} has no linear LM head to replace (get_output_embeddings() is "
                        f"{type(head).__name__}); a critic needs a causal LM such as AutoModelForCausalLM")
    value_head = nn.Linear(head.in_features, 1, bias=True, device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        value_head.weight.zero_()
        value_head.bias.zero_()
    model.config.tie_word_embeddings = False
    if getattr(model.config, "get_text_config", None) is not None:
        model.config.get_text_config().tie_word_embeddings = False
    model.set_output_embeddings(value_head)
    model.config.is_value_model = True
    return model
