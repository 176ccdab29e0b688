"""Seeded workload generators with the shapes of real RL post-training steps.

Token ids are random (the model is random too); what matters for speed is the tree shape: which tokens are
shared, which are trained, and how long each piece is.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from lightning_dta.core.rollout import Rollout, read_rollouts


def _tokens(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def _length(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def _logprobs(rng: random.Random, n: int, vocab: int) -> list[float]:
    """Behaviour log-probs near a random model's own (-log vocab): ratios near 1, some clipped, as in a real
    step. (Values far from the model's would clip every token with a negative advantage and shrink the rest:
    the gradient, and the bench's gradient-error column, would be mostly zeros.)"""
    return [0.0] + [-math.log(vocab) + rng.gauss(0.0, 0.2) for _ in range(n - 1)]


@dataclass
class GRPOWorkload:
    """Groups of sampled responses that share their prompt (one level of sharing)."""

    num_prompts: int = 2
    group_size: int = 8
    prompt_len: tuple[int, int] = (380, 420)
    response_len: tuple[int, int] = (64, 192)

    def generate(self, vocab: int, seed: int) -> list[Rollout]:
        rng = random.Random(seed)
        rollouts = []
        for group in range(self.num_prompts):
            prompt = _tokens(rng, vocab, _length(rng, self.prompt_len))
            for _ in range(self.group_size):
                response = _tokens(rng, vocab, _length(rng, self.response_len))
                ids = prompt + response
                rollouts.append(Rollout(input_ids=ids, loss_mask=[0] * len(prompt) + [1] * len(response),
                                        advantages=rng.gauss(0.0, 1.0), old_logprobs=_logprobs(rng, len(ids), vocab),
                                        reward=rng.random(), group_id=group))
        return rollouts


@dataclass
class AgentWorkload:
    """Multi-turn agent episodes where every LLM call is a rollout with its full context.

    Call ``k`` sees the system prompt, the task, and turns ``1..k-1`` with their *answers* but without their
    *thinking* (dropped from later history, as reasoning models do), then produces thinking and an answer.
    Calls of one episode share the history; episodes share the system prompt. This is the shape behind the
    reference system's 9.43x compression on tau^2-bench.
    """

    num_episodes: int = 2
    turns: int = 5
    system_len: int = 1024
    task_len: tuple[int, int] = (40, 120)
    observation_len: tuple[int, int] = (40, 160)
    thinking_len: tuple[int, int] = (60, 200)
    answer_len: tuple[int, int] = (20, 60)

    def generate(self, vocab: int, seed: int) -> list[Rollout]:
        rng = random.Random(seed)
        system = _tokens(rng, vocab, self.system_len)
        rollouts = []
        for episode in range(self.num_episodes):
            history = system + _tokens(rng, vocab, _length(rng, self.task_len))
            for turn in range(self.turns):
                if turn > 0:
                    history = history + _tokens(rng, vocab, _length(rng, self.observation_len))
                thinking = _tokens(rng, vocab, _length(rng, self.thinking_len))
                answer = _tokens(rng, vocab, _length(rng, self.answer_len))
                ids = history + thinking + answer
                mask = [0] * len(history) + [1] * (len(thinking) + len(answer))
                rollouts.append(Rollout(input_ids=ids, loss_mask=mask, advantages=rng.gauss(0.0, 1.0),
                                        old_logprobs=_logprobs(rng, len(ids), vocab), group_id=episode))
                history = history + answer  # the next call sees the answer, not the thinking
        return rollouts


@dataclass
class TreeSearchWorkload:
    """Rollouts that branch at several depths (tree search / multi-sample continuation)."""

    prompt_len: int = 256
    branching: tuple[int, ...] = (3, 3, 2)
    segment_len: tuple[int, int] = (32, 96)

    def generate(self, vocab: int, seed: int) -> list[Rollout]:
        rng = random.Random(seed)
        prompt = _tokens(rng, vocab, self.prompt_len)
        paths = [prompt]
        for width in self.branching:
            paths = [p + _tokens(rng, vocab, _length(rng, self.segment_len)) for p in paths for _ in range(width)]
        rollouts = []
        for ids in paths:
            mask = [0] * self.prompt_len + [1] * (len(ids) - self.prompt_len)
            rollouts.append(Rollout(input_ids=ids, loss_mask=mask, advantages=rng.gauss(0.0, 1.0),
                                    old_logprobs=_logprobs(rng, len(ids), vocab)))
        return rollouts


@dataclass
class FileWorkload:
    """Rollouts read from a user's JSONL file."""

    path: str

    def generate(self, vocab: int, seed: int) -> list[Rollout]:
        return read_rollouts(self.path)


@dataclass
class LongSequenceWorkload:
    """A few long rollouts with no sharing, for the memory of chunked recompute vs per-rollout training."""

    num_rollouts: int = 2
    length: int = 3072

    def generate(self, vocab: int, seed: int) -> list[Rollout]:
        rng = random.Random(seed)
        return [Rollout(input_ids=_tokens(rng, vocab, self.length), advantages=rng.gauss(0.0, 1.0))
                for _ in range(self.num_rollouts)]



# Named steps with their default sizes (``lightning-dta plan --workload``). The tau2 shapes follow AReaL-DTA's
# tau^2-bench setting: a 4.8K-token system prompt, 8 LLM calls per episode, thinking dropped from later history;
# 32 episodes a step (4 per rank on 8 ranks, where each rank's tree compresses ~9.4x), 16K-token context for
# "tau2-long" (the last call of an episode sees ~16K tokens).
WORKLOADS = {
    "grpo": GRPOWorkload(),
    "agent": AgentWorkload(),
    "tree-search": TreeSearchWorkload(),
    "tau2-like": AgentWorkload(num_episodes=32, turns=8, system_len=4800, task_len=(50, 150),
                               observation_len=(100, 300), thinking_len=(100, 300), answer_len=(30, 90)),
    "tau2-long": AgentWorkload(num_episodes=32, turns=8, system_len=4800, task_len=(50, 150),
                               observation_len=(800, 1600), thinking_len=(300, 900), answer_len=(100, 300)),
}
