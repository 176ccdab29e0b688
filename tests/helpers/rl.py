"""Shared pieces of the RL tests: tiny Llamas sized for the toy tokenizers, and a scripted generator."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_dta.module import build_causal_lm
from lightning_dta.rl.generation import Completion, Generator


def tiny_policy(vocab_size: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 1.0,
                max_positions: int = 128) -> nn.Module:
    """A 2-layer Llama; ``scale`` > 1 sharpens its random logits (so samples and log-probs are not uniform)."""
    torch.manual_seed(seed)
    model = build_causal_lm(dict(model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=max_positions))
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(scale)
    return model.to(dtype)


class ScriptedGenerator(Generator):
    """Returns given token sequences (cycled) with log-prob -1 each; records what it was asked."""

    def __init__(self, replies: Sequence[Sequence[int]], max_new_tokens: int = 8, delay: float = 0.0) -> None:
        self.replies = [list(r) for r in replies]
        self.max_new_tokens = max_new_tokens
        self.delay = delay
        self.calls: list[tuple[list[list[int]], int]] = []
        self.versions: list[int] = []
        self.version = 0
        self.policy: nn.Module | None = None

    def attach(self, policy: nn.Module, *, eos_token_id: int | None, pad_token_id: int | None,
               share_weights: bool) -> None:
        self.policy = policy

    def generate(self, prompts: Sequence[Sequence[int]], seed: int) -> list[Completion]:
        import time

        time.sleep(self.delay)
        self.calls.append(([list(p) for p in prompts], seed))
        self.versions.append(self.version)
        out = []
        for i in range(len(prompts)):
            tokens = self.replies[(len(self.calls) + i) % len(self.replies)]
            out.append(Completion(list(tokens), [-1.0] * len(tokens), "stop"))
        return out

    def update_weights(self, policy: nn.Module, version: int) -> None:
        self.version = version
