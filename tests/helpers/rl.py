"""Shared pieces of the RL tests: tiny Llamas sized for the toy tokenizers, and a scripted generator."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
from lightning.pytorch import Callback
from torch import nn

from lightning_dta.distributed.collectives import rank
from lightning_dta.lightning.module import build_causal_lm
from lightning_dta.rl import ReverseDigits
from lightning_dta.rl.generation import Completion, Generator, HFGenerator
from tests.helpers.float64 import without_float32_islands


def tiny_policy(vocab_size: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32, scale: float = 1.0,
                max_positions: int = 128) -> nn.Module:
    """A 2-layer Llama; ``scale`` > 1 sharpens its random logits (so samples and log-probs are not uniform). In
    float64 with no float32 step inside (tests/helpers/float64.py), so that float64 tests can hold it to rounding."""
    torch.manual_seed(seed)
    model = build_causal_lm(dict(model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=max_positions))
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(scale)
    model = model.to(dtype)
    return without_float32_islands(model) if dtype == torch.float64 else model


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


class RolloutRecorder(Callback):
    """Saves, per rank, the rollouts this rank trained in each step and the source's step info, to
    ``{out_dir}/rank{r}.pt`` when training ends (added from the command line in the multi-process tests)."""

    def __init__(self, out_dir: str, steps: int = 3) -> None:
        self.out_dir, self.steps = out_dir, steps
        self.rollouts: list[list[tuple]] = []
        self.infos: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if len(self.rollouts) < self.steps:
            mine = [] if batch.tree is None else batch.tree.rollouts
            self.rollouts.append(sorted((tuple(r.input_ids), tuple(r.loss_mask), tuple(r.old_logprobs),
                                         r.advantages, r.reward) for r in mine))
        source = trainer.datamodule.source
        info = source.last_step
        self.infos.append({"index": info.index, "policy_version": info.policy_version,
                           "trained_version": info.trained_version, "reward_mean": info.reward_mean,
                           "prox_set": batch.tree is None or all(r.prox_logprobs is not None
                                                                  for r in batch.tree.rollouts)})

    def on_train_end(self, trainer, pl_module) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        weights = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}
        torch.save({"rollouts": self.rollouts, "infos": self.infos, "world_size": trainer.world_size,
                    "weights": weights}, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


class FailingReverseDigits(ReverseDigits):
    """``ReverseDigits`` whose ``reset`` raises on rank ``fail_rank`` from prompt ``fail_from`` on: a tool or
    environment that crashes on one rank in the middle of a run."""

    def __init__(self, fail_rank: int = 1, fail_from: int = 40, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_rank, self.fail_from = fail_rank, fail_from

    def reset(self, index: int):
        if rank() == self.fail_rank and index >= self.fail_from:
            raise ZeroDivisionError(f"the tool crashed on prompt {index}")
        return super().reset(index)


class PerturbedHFGenerator(HFGenerator):
    """``HFGenerator`` whose recorded log-probs are off by ``-offset * (position % 3)``: a generator whose numerics
    are not the trainer's (the samples are still the policy's)."""

    def __init__(self, offset: float = 0.1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.offset = offset

    def generate(self, prompts: Sequence[Sequence[int]], seed) -> list[Completion]:
        completions = super().generate(prompts, seed)
        for completion in completions:
            completion.logprobs = [lp - self.offset * (i % 3) for i, lp in enumerate(completion.logprobs)]
        return completions


class UnsyncedHFGenerator(HFGenerator):
    """``HFGenerator`` whose weight sync does nothing: with a private copy (async mode) it keeps sampling from the
    weights it was attached with, as a server whose weight sync silently fails."""

    def update_weights(self, policy: nn.Module, version: int) -> None:
        self.version = version


class SlowSyncHFGenerator(HFGenerator):
    """``HFGenerator`` whose weight sync takes ``sync_sec`` more: a stand-in for a server's weight reload."""

    def __init__(self, sync_sec: float = 0.2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sync_sec = sync_sec

    def update_weights(self, policy: nn.Module, version: int) -> None:
        time.sleep(self.sync_sec)
        super().update_weights(policy, version)
