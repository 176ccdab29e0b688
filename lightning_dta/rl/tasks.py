"""Reward functions (plain callables) and the built-in single-turn toy task, ``ReverseDigits``.

A reward function is any callable ``reward_fn(response: str, answer: str) -> float``; environments take one as
an argument, so a YAML config names it by import path (``reward_fn: lightning_dta.rl.tasks.exact_match``) or
builds a callable class with ``class_path``/``init_args``. It must return a finite float for every response,
including unparsable ones (return 0.0 there): a NaN is refused with the prompt and the response named.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from transformers import PreTrainedTokenizerFast

from lightning_dta.core.errors import ConfigError
from lightning_dta.rl.environment import Action, Environment, Observation, StepResult
from lightning_dta.rl.tokenizer import make_char_tokenizer

RewardFn = Callable[[str, str], float]


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response is exactly the answer (surrounding whitespace ignored), else 0.0."""
    return float(response.strip() == answer.strip())


def position_match(response: str, answer: str) -> float:
    """Partial credit: the fraction of positions where response and answer agree, over the longer of the two.

    Why partial credit: with 0/1 rewards a barely trained policy gets a reward of 0 in every sample of a group,
    so GRPO sees no signal; counting correct positions gives groups a spread from the first steps on. Dividing by
    the longer length makes extra or missing characters cost as much as wrong ones (1.0 only for the answer).
    """
    length = max(len(response), len(answer))
    if length == 0:
        return 1.0
    return sum(a == b for a, b in zip(response, answer)) / length


class ReverseDigits(Environment):
    """Write a digit string backwards: prompt ``"<bos>3071>"``, correct response ``"1703<eos>"``.

    A task a 2-layer model learns in minutes on a CPU, with a checkable answer and a dense partial-credit
    reward. Single turn: the first action ends the episode.

    Args:
        min_digits, max_digits: the length range of the digit strings (uniform).
        seed: the prompt set: prompt ``index`` is the same string for the same seed.
        reward_fn: ``reward_fn(response, answer)``; :func:`position_match` by default.
    """

    ALPHABET = "0123456789>"

    def __init__(self, min_digits: int = 3, max_digits: int = 5, seed: int = 0,
                 reward_fn: RewardFn = position_match) -> None:
        if not 1 <= min_digits <= max_digits:
            raise ConfigError(f"need 1 <= min_digits <= max_digits, got {min_digits} and {max_digits}")
        self.min_digits, self.max_digits, self.seed = min_digits, max_digits, seed
        self.reward_fn = reward_fn
        self.answer: str | None = None

    def question(self, index: int) -> str:
        rng = random.Random(f"reverse-digits:{self.seed}:{index}")
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_digits, self.max_digits)))

    @staticmethod
    def prompt(digits: str) -> Observation:
        """The episode's only observation (also what the warm-start demonstration starts from)."""
        return digits + ">"

    def reset(self, index: int) -> Observation:
        digits = self.question(index)
        self.answer = digits[::-1]
        return self.prompt(digits)

    def step(self, action: Action) -> StepResult:
        if self.answer is None:
            raise RuntimeError("ReverseDigits.step before reset()")
        reward = self.reward_fn(action.text, self.answer)
        return StepResult(reward=reward, done=True, info={"correct": action.text == self.answer})

    def default_tokenizer(self) -> PreTrainedTokenizerFast:
        return make_char_tokenizer(self.ALPHABET)

    def demonstration(self, index: int) -> list[tuple[Observation, str]]:
        digits = self.question(index)
        return [(self.prompt(digits), digits[::-1])]
