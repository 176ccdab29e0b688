"""Generate ``data/tiny_rollouts.jsonl``: a small, seeded rollout file for CPU smoke training and tests.

No tokenizer and no network: token ids are drawn from a seeded ``random.Random`` for a model with
``vocab_size=256`` and ``max_position_embeddings=512``. The file has the two shapes the prefix tree is for:

- GRPO: 8 prompts (64-128 tokens) each answered by a group of 8 or 4 responses (16-64 tokens); the group
  shares its prompt. 48 rollouts.
- Multi-turn agent: 2 tasks x 2 episodes x 4 LLM calls. All episodes share one system prompt; each call is a
  rollout holding the previous turns, so call k is a prefix of call k+1 (a rollout that ends inside another's
  path) in episodes that keep the history, and a branch in episodes that drop earlier "thinking" (as the
  tau^2-bench rollouts of AReaL-DTA do). Each call trains only its own new response. 16 rollouts.

Groups are contiguous and every group boundary falls on a multiple of 8 rollouts, so ``rollouts_per_step``
of 8, 16, 32 or 64 never splits a group. ``loss_mask`` is 0 on context and 1 on the response; ``reward`` is in
[0, 1] (one per agent episode, shared by its calls); ``old_logprobs`` are near ``log(1/256) = -5.5`` with
noise, all <= 0 (entry 0 is 0.0). Run ``python scripts/make_tiny_rollouts.py`` to rewrite the file; the same
seed gives the same bytes.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lightning_dta import PrefixTree, Rollout, validate_rollouts, write_rollouts  # noqa: E402

VOCAB_SIZE = 256
MAX_POSITIONS = 512
GROUP_SIZES = (8, 4, 4, 8, 8, 8, 4, 4)  # 48 rollouts; every multiple of 8 is a group boundary
DEFAULT_OUTPUT = REPO / "data" / "tiny_rollouts.jsonl"
DEFAULT_SEED = 1234


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(2, VOCAB_SIZE) for _ in range(count)]


def _logprobs(rng: random.Random, count: int) -> list[float]:
    """Behaviour log-probs around log(1/256); entry 0 (no context) is 0.0."""
    return [0.0] + [round(min(-0.01, rng.gauss(-5.5, 0.7)), 4) for _ in range(count - 1)]


def _rollout(rng: random.Random, context: list[int], response: list[int], reward: float,
             group_id: str) -> Rollout:
    input_ids = context + response
    return Rollout(input_ids=input_ids, loss_mask=[0] * len(context) + [1] * len(response),
                   old_logprobs=_logprobs(rng, len(input_ids)), reward=reward, group_id=group_id)


def grpo_rollouts(rng: random.Random, group_sizes: tuple[int, ...] = GROUP_SIZES) -> list[Rollout]:
    """One prompt per group, answered ``size`` times; each prompt has its own success rate."""
    rollouts = []
    for group, size in enumerate(group_sizes):
        prompt = _tokens(rng, rng.randint(64, 128))
        success = rng.random()
        for _ in range(size):
            response = _tokens(rng, rng.randint(16, 64))
            reward = round(min(1.0, max(0.0, success + rng.gauss(0.0, 0.25))), 3)
            rollouts.append(_rollout(rng, prompt, response, reward, f"prompt-{group}"))
    return rollouts


def agent_rollouts(rng: random.Random, tasks: int = 2, episodes: int = 2, calls: int = 4) -> list[Rollout]:
    """Multi-turn episodes: call k sees the system prompt, the task and turns 1..k-1, and answers turn k.

    Odd episodes drop each earlier answer's "thinking" (its first part) from later contexts, so their calls
    branch off one another instead of extending each other.
    """
    system = _tokens(rng, 80)
    rollouts = []
    for task in range(tasks):
        task_tokens = _tokens(rng, rng.randint(24, 40))
        for episode in range(episodes):
            reward = round(rng.random(), 3)
            history = system + task_tokens
            drop_thinking = episode % 2 == 1
            for _ in range(calls):
                history = history + _tokens(rng, rng.randint(12, 24))  # observation / tool output
                thinking, answer = _tokens(rng, rng.randint(10, 20)), _tokens(rng, rng.randint(12, 24))
                rollouts.append(_rollout(rng, history, thinking + answer, reward, f"task-{task}"))
                history = history + (answer if drop_thinking else thinking + answer)
    return rollouts


def build_rollouts(seed: int = DEFAULT_SEED) -> list[Rollout]:
    """The whole file's rollouts, in file order (GRPO groups first, then the agent tasks)."""
    rng = random.Random(seed)
    rollouts = grpo_rollouts(rng) + agent_rollouts(rng)
    validate_rollouts(rollouts, vocab_size=VOCAB_SIZE, max_positions=MAX_POSITIONS)
    return rollouts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    rollouts = build_rollouts(args.seed)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_rollouts(args.output, rollouts)
    print(f"{args.output}: {PrefixTree.from_rollouts(rollouts)}, {args.output.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
