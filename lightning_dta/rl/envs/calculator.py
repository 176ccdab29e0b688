"""``CalculatorEnv``: a multi-turn tool-use episode with a checkable answer, small enough for a CPU.

The policy is asked an arithmetic question it cannot reliably compute itself and may call a calculator tool
before answering::

    <bos>tools: calc(a*b) returns the value. answer with ans(n).
    q: 47*86
    calc(47*86)<eos>= 4042
    ans(4042)<eos>

Each line the policy writes is one LLM call; the environment answers a tool call with its result, anything it
cannot parse with ``error``, and ends the episode at ``ans(...)`` or after ``max_turns`` calls. Every call's
rollout contains the shared system prompt, the question and the whole history, so the calls of a step form a
deep prefix tree: the episode shape DFS training is for.
"""

from __future__ import annotations

import random
import re

from transformers import PreTrainedTokenizerFast

from lightning_dta.core.errors import ConfigError
from lightning_dta.rl.environment import Action, Environment, Observation, StepResult
from lightning_dta.rl.tasks import RewardFn, exact_match
from lightning_dta.rl.tokenizer import make_char_tokenizer

SYSTEM_PROMPT = "tools: calc(a*b) returns the value. answer with ans(n).\n"
_CALL = re.compile(r"calc\((-?\d{1,9})([+\-*])(-?\d{1,9})\)")
_ANSWER = re.compile(r"ans\((-?\d{1,19})\)")


def calculate(left: int, operator: str, right: int) -> int:
    """The tool: one binary operation on integers (no ``eval`` of model output)."""
    if operator == "+":
        return left + right
    if operator == "-":
        return left - right
    return left * right


class CalculatorEnv(Environment):
    """Answer ``a op b`` with the help of a ``calc(...)`` tool; reward ``reward_fn(answer_text, true_answer)``.

    Args:
        max_turns: the most LLM calls per episode (a tool call, then the answer, needs 2).
        low, high: the operands' range (inclusive).
        operators: the operators questions use.
        seed: the question set: prompt ``index`` is the same question for the same seed.
        reward_fn: scores the text inside ``ans(...)`` against the true value (``exact_match`` by default); an
            episode without an answer gets 0.
    """

    ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*=(),.:?\n"

    def __init__(self, max_turns: int = 3, low: int = 10, high: int = 99, operators: str = "+*", seed: int = 0,
                 reward_fn: RewardFn = exact_match) -> None:
        if max_turns < 1 or low > high or not operators or set(operators) - set("+-*"):
            raise ConfigError("need max_turns >= 1, low <= high and operators made of '+', '-', '*'")
        self.max_turns, self.low, self.high, self.operators, self.seed = max_turns, low, high, operators, seed
        self.reward_fn = reward_fn
        self.question: tuple[int, str, int] | None = None
        self.tool_calls = 0

    def make_question(self, index: int) -> tuple[int, str, int]:
        rng = random.Random(f"calculator:{self.seed}:{index}")
        return rng.randint(self.low, self.high), rng.choice(self.operators), rng.randint(self.low, self.high)

    @staticmethod
    def prompt(question: tuple[int, str, int]) -> Observation:
        """The first observation of an episode (also what the warm-start demonstration starts from)."""
        left, operator, right = question
        return f"{SYSTEM_PROMPT}q: {left}{operator}{right}\n"

    @property
    def answer(self) -> int:
        if self.question is None:
            raise RuntimeError("CalculatorEnv: reset() must come first")
        return calculate(*self.question)

    def reset(self, index: int) -> Observation:
        self.question = self.make_question(index)
        self.tool_calls = 0
        return self.prompt(self.question)

    def step(self, action: Action) -> StepResult:
        text = action.text.strip()
        answer = _ANSWER.fullmatch(text)
        if answer:
            reward = self.reward_fn(answer.group(1), str(self.answer))
            return StepResult(reward=reward, done=True, info={"correct": int(answer.group(1)) == self.answer,
                                                              "tool_calls": self.tool_calls})
        call = _CALL.fullmatch(text)
        if call:
            self.tool_calls += 1
            return StepResult(observation=f"= {calculate(int(call.group(1)), call.group(2), int(call.group(3)))}\n",
                              info={"correct": False, "tool_calls": self.tool_calls})
        return StepResult(observation="error\n", info={"correct": False, "tool_calls": self.tool_calls})

    def default_tokenizer(self) -> PreTrainedTokenizerFast:
        return make_char_tokenizer(self.ALPHABET)

    def demonstration(self, index: int) -> list[tuple[Observation, str]]:
        question = self.make_question(index)
        left, operator, right = question
        value = calculate(*question)
        return [(self.prompt(question), f"calc({left}{operator}{right})"), (f"= {value}\n", f"ans({value})")]
