"""Episodes: an environment talks with the policy, and every LLM call becomes one rollout with its full context.

An :class:`Environment` gives the first observation (the prompt) on :meth:`~Environment.reset`, takes each of
the policy's actions on :meth:`~Environment.step`, and answers with an observation (text or token ids), a
reward and whether the episode is over. A single-turn task is an environment whose first step ends the episode.

:func:`run_episodes` plays a batch of episodes with a :class:`~lightning_dta.rl.generation.Generator`, one
batched ``generate`` per turn over all episodes still running. Call *k* of an episode is recorded as a
:class:`~lightning_dta.Rollout` whose ``input_ids`` are the whole context the model saw (prompt, earlier calls,
observations) followed by that call's tokens, with ``loss_mask = 1`` on that call's tokens only. The calls of
one episode are therefore prefixes of each other, and the episodes of one prompt share the prompt: a step's
calls form the deep prefix trees that DFS training computes once per shared token.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from lightning_dta.core.errors import UsageError
from lightning_dta.core.rollout import Rollout
from lightning_dta.rl.generation import Completion, Generator, derive_seed

Observation = str | list[int]


class RewardError(UsageError, ValueError):
    """A reward (or the environment computing it) returned something that is not a finite number."""


@dataclass
class Action:
    """What the policy produced in one call: the decoded text (special tokens removed), the token ids (the
    stop token included when there was one) and why generation stopped (``"stop"`` or ``"length"``)."""

    text: str
    token_ids: list[int]
    finish_reason: str


@dataclass
class StepResult:
    """The environment's answer to one action.

    Attributes:
        observation: appended to the context before the next call (text is tokenized without special
            tokens; a list is taken as token ids); ``None`` or empty adds nothing.
        reward: added to the episode's return.
        done: the episode is over (no further call).
        info: free-form data kept in the :class:`Episode` (e.g. whether the final answer was correct).
    """

    observation: Observation | None = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    """One episode at a time; :func:`run_episodes` clones it (``copy.deepcopy``) for every parallel episode.

    ``reset(index)`` must be deterministic in ``index``: the episodes of one GRPO group are clones reset with the
    same index, so they answer the same question and their rewards are comparable.

    Attributes:
        max_turns: the most LLM calls in one episode; an episode that reaches it ends with the return so far.
    """

    max_turns: int = 1

    @abstractmethod
    def reset(self, index: int) -> Observation:
        """Start the episode of prompt ``index`` and return the first observation (the prompt)."""

    @abstractmethod
    def step(self, action: Action) -> StepResult:
        """Apply the policy's action."""

    def default_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer the environment's texts are written for (toy environments build one locally)."""
        raise NotImplementedError(f"{type(self).__name__} has no default tokenizer: pass the model's tokenizer to "
                                  "the rollout source (tokenizer=...)")

    def demonstration(self, index: int) -> list[tuple[Observation, str]]:
        """A correct episode for prompt ``index`` as (observation, action text) pairs, for an SFT warm start."""
        raise NotImplementedError(f"{type(self).__name__} provides no demonstrations, so it cannot be used for "
                                  "an SFT warm start (set sft_warmup_steps=0)")

    def clone(self) -> Environment:
        return copy.deepcopy(self)


@dataclass
class Episode:
    """One played episode: its calls as rollouts (in order) and what happened.

    ``calls[k].reward`` and ``group_id`` are filled in (the episode's return and its prompt index); advantages
    are left at 0 for the caller to estimate over the whole step.
    """

    prompt_index: int
    sample: int
    calls: list[Rollout]
    actions: list[Action]
    reward: float
    finish: str  # "done", "max_turns" or "context_limit"
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def generated_tokens(self) -> int:
        return sum(len(a.token_ids) for a in self.actions)


def encode_observation(observation: Observation | None, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of an observation: text is tokenized without special tokens, a list is taken as ids."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return list(tokenizer.encode(observation, add_special_tokens=False))
    if isinstance(observation, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in observation):
        return list(observation)
    raise TypeError(f"an observation must be text or a list of token ids, got {type(observation).__name__}")


def _check_reward(value: object, env: Environment, episode: _Running, action: Action) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(
            f"{type(env).__name__}.step returned reward {value!r} for prompt {episode.prompt_index} (sample "
            f"{episode.sample}, call {len(episode.calls) - 1}, action {action.text!r}); a reward must be a finite "
            "number. Fix: make the reward function return a float for every response, e.g. 0.0 for one it cannot "
            "parse, instead of NaN or None")
    return float(value)


@dataclass
class _Running:
    prompt_index: int
    sample: int
    env: Environment
    context: list[int]
    calls: list[Rollout] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


def run_episodes(env: Environment, generator: Generator, tokenizer: PreTrainedTokenizerBase,
                 prompt_indices: Sequence[int], samples_per_prompt: int, seed: int, *, add_bos: bool = True,
                 max_context: int | None = None) -> list[Episode]:
    """Play ``samples_per_prompt`` episodes of every prompt in ``prompt_indices``, one batched generation per turn.

    Args:
        env: the environment (cloned for each episode).
        generator: samples the calls; its ``max_new_tokens`` bounds each call.
        tokenizer: encodes text observations and decodes actions.
        prompt_indices: the prompts of this step; ``reset(index)`` is called with each.
        samples_per_prompt: episodes per prompt (a GRPO group).
        seed: the sampling seed of the step: call ``turn`` of sample ``s`` of prompt ``p`` samples with
            ``derive_seed(seed, p, s, turn)``, whichever other episodes share its batch (or its process).
        add_bos: start every context with the tokenizer's BOS token (when it has one).
        max_context: the model's maximum positions; an episode whose next call could exceed it ends there
            (``finish="context_limit"``) with the return so far, instead of training on a truncated sequence.

    Returns:
        The episodes, grouped by prompt (in ``prompt_indices`` order), each with its calls as rollouts.
    """
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt={samples_per_prompt} must be >= 1")
    bos = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    running = []
    for index in prompt_indices:
        for sample in range(samples_per_prompt):
            clone = env.clone()
            context = bos + encode_observation(clone.reset(index), tokenizer)
            if not context:
                raise ValueError(f"{type(env).__name__}.reset({index}) returned an empty prompt and the tokenizer "
                                 "has no BOS token: the first call would have nothing to condition on")
            running.append(_Running(index, sample, clone, context))
    finished: list[Episode] = []
    active = list(running)
    for turn in range(env.max_turns):
        if max_context is not None:
            for episode in [e for e in active if len(e.context) + generator.max_new_tokens > max_context]:
                if turn == 0:
                    raise ValueError(f"prompt {episode.prompt_index} has {len(episode.context)} tokens; with "
                                     f"max_new_tokens={generator.max_new_tokens} its first call could exceed the "
                                     f"model's {max_context} positions. Fix: shorter prompts, fewer new tokens, "
                                     "or a model with more positions")
                finished.append(_finish(episode, "context_limit"))
                active.remove(episode)
        if not active:
            break
        completions = generator.generate([e.context for e in active],
                                         seed=[derive_seed(seed, e.prompt_index, e.sample, turn) for e in active])
        if len(completions) != len(active):
            raise RuntimeError(f"{type(generator).__name__}.generate returned {len(completions)} completions for "
                               f"{len(active)} prompts")
        still_active = []
        for episode, completion in zip(active, completions):
            action = _record_call(episode, completion, tokenizer)
            result = episode.env.step(action)
            episode.reward += _check_reward(result.reward, env, episode, action)
            episode.info.update(result.info)
            if result.done or turn == env.max_turns - 1:
                finished.append(_finish(episode, "done" if result.done else "max_turns"))
                continue
            episode.context = episode.context + completion.token_ids + encode_observation(result.observation,
                                                                                          tokenizer)
            still_active.append(episode)
        active = still_active
    order = {(e.prompt_index, e.sample): i for i, e in enumerate(running)}
    return sorted(finished, key=lambda e: order[(e.prompt_index, e.sample)])


def _record_call(episode: _Running, completion: Completion, tokenizer: PreTrainedTokenizerBase) -> Action:
    """Append the call as a rollout: the full context, trained only on this call's tokens."""
    if len(completion.logprobs) != len(completion.token_ids):
        raise RuntimeError(f"a completion has {len(completion.token_ids)} tokens but {len(completion.logprobs)} "
                           "log-probs; the generator must return one behaviour log-prob per generated token")
    context = episode.context
    tokens = completion.token_ids
    episode.calls.append(Rollout(
        input_ids=context + tokens,
        loss_mask=[0] * len(context) + [1] * len(tokens),
        old_logprobs=[0.0] * len(context) + [float(lp) for lp in completion.logprobs],
        group_id=episode.prompt_index,
    ))
    action = Action(tokenizer.decode(tokens, skip_special_tokens=True), list(tokens), completion.finish_reason)
    episode.actions.append(action)
    return action


def _finish(episode: _Running, finish: str) -> Episode:
    for call in episode.calls:
        call.reward = episode.reward
    return Episode(episode.prompt_index, episode.sample, episode.calls, episode.actions, episode.reward, finish,
                   episode.info)
