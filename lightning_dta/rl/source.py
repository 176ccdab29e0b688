"""The online rollout source: generate with the current policy, score, estimate advantages, hand steps to training.

``OnlineRolloutSource`` plugs into :class:`~lightning_dta.data.RolloutDataModule` as its ``source``: calling it
starts an epoch, an iterator of steps, each a list of :class:`~lightning_dta.Rollout`. A step is
``prompts_per_step`` prompts x ``samples_per_prompt`` episodes; every LLM call of every episode is one rollout
(:mod:`lightning_dta.rl.environment`).

Two modes:

- ``"sync"`` (default): a step is generated when the trainer asks for it, with the weights of the previous
  optimizer step; in-process generation shares the trainer's module. Strictly on-policy.
- ``"async"``: a background thread generates steps ahead while the trainer trains, with a private copy of the
  weights that :meth:`OnlineRolloutSource.update_policy` refreshes after each optimizer step. Step ``i`` (counted
  from :meth:`~OnlineRolloutSource.attach`) is only started once the policy version is at least
  ``i - max_staleness``, so a step is trained at most ``max_staleness`` optimizer steps after the weights that
  generated it; the bound is checked again when the step is handed out. The loss is then decoupled PPO: the
  rollouts keep the behaviour log-probs as ``old_logprobs`` and get ``prox_logprobs`` recomputed on the current
  weights with the forward-only tree walk :func:`lightning_dta.tree_logprobs` (one forward per shared token).

The source has a length (``steps_per_epoch``), which matters: Lightning prefetches one batch ahead from a loader
without a length, which would generate step ``k+1`` before step ``k`` is trained, i.e. silently one step off
policy. With a length there is no prefetch and "sync" really is on-policy.

Used with Lightning, :class:`~lightning_dta.rl.callback.OnlineRLCallback` calls :meth:`attach`,
:meth:`update_policy` and :meth:`close`; in a plain loop call them yourself (see ``examples/online_rl.py``).
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Iterator
from typing import Literal

from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_dta.advantages import check_advantage_estimator
from lightning_dta.engine import EngineOptions
from lightning_dta.rl.environment import Environment, run_episodes
from lightning_dta.rl.generation import Generator, HFGenerator
from lightning_dta.rl.prepare import StepInfo, cap_importance_weight, episode_rollouts, fill_logprobs, step_info
from lightning_dta.rl.producer import AsyncProducer, Generated
from lightning_dta.rollout import Rollout
from lightning_dta.tree import PrefixTree

RolloutMode = Literal["sync", "async"]


class OnlineRolloutSource:
    """Rollouts generated online by the policy being trained; a ``RolloutDataModule`` source (module docstring).

    Args:
        env: the environment (a single-turn task is one too), e.g. ``ReverseDigits()`` or ``CalculatorEnv()``.
        generator: samples the calls; default ``HFGenerator()`` (in-process ``model.generate``).
        tokenizer: a tokenizer, a local path or hub name (loaded at :meth:`attach`, not when a config is
            parsed), or ``None``: the environment's ``default_tokenizer()``.
        prompts_per_step, samples_per_prompt: a step has ``prompts_per_step`` GRPO groups of
            ``samples_per_prompt`` episodes.
        steps_per_epoch: the length of one epoch (the data module's epoch; training length is the Trainer's
            ``max_steps``).
        rollout_mode: ``"sync"`` or ``"async"``.
        max_staleness: async only: the most optimizer steps between the weights that generate a step and the
            weights that train on it (0 = generate each step with the latest weights, in the background).
        advantage_estimator: ``"grpo"``, ``"grpo-no-std"``, ``"reinforce-baseline"`` or ``None``. Estimated per
            *episode* (one reward per episode, its group = its prompt) and given to each of its calls, so an
            episode with more calls does not weigh more in its group's baseline. Leave the data module's own
            ``advantage_estimator`` unset (the callback refuses both).
        decoupled: async only: recompute ``prox_logprobs`` on the current weights (decoupled PPO). ``False``
            keeps plain PPO against the behaviour log-probs.
        importance_weight_cap: async, decoupled only: truncate the decoupled-PPO weight
            ``w = exp(prox - old)`` at this value (truncated importance sampling, as verl's TIS or AReaL's
            ``behav_imp_weight_cap``), by raising ``old_logprobs`` to ``prox - log(cap)`` where ``w`` would exceed
            it. Why: with one optimizer step per batch the PPO clip acts around ``prox`` (ratio 1) and never
            bounds ``w``, so a token whose probability jumped in the last step can dominate the gradient. ``None``
            (default): the exact decoupled-PPO loss of ``docs/losses.md``.
        ref_logprobs: compute ``ref_logprobs`` with a frozen copy of the policy taken at :meth:`attach` (after
            any warm start), for ``kl_coef > 0``.
        seed: prompts and sampling: step ``i`` uses prompt indices ``[i * prompts_per_step, ...)`` and a seed
            derived from ``(seed, i)``.
        add_bos: start every context with the tokenizer's BOS token.
        max_context: the model's maximum positions (default: the policy config's ``max_position_embeddings``).

    The forward-only walks (``prox``/``ref`` log-probs) use the :class:`~lightning_dta.EngineOptions` given to
    :meth:`attach`: the training module's, so one engine block in a config serves every engine call of a step.
    """

    def __init__(self, env: Environment, generator: Generator | None = None,
                 tokenizer: PreTrainedTokenizerBase | str | None = None, prompts_per_step: int = 8,
                 samples_per_prompt: int = 4, steps_per_epoch: int = 1000, rollout_mode: RolloutMode = "sync",
                 max_staleness: int = 1, advantage_estimator: str | None = "grpo", decoupled: bool = True,
                 importance_weight_cap: float | None = None, ref_logprobs: bool = False, seed: int = 0,
                 add_bos: bool = True, max_context: int | None = None) -> None:
        if rollout_mode not in ("sync", "async"):
            raise ValueError(f"rollout_mode={rollout_mode!r}; choose 'sync' or 'async'")
        for name, value in (("prompts_per_step", prompts_per_step), ("samples_per_prompt", samples_per_prompt),
                            ("steps_per_epoch", steps_per_epoch)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0")
        if importance_weight_cap is not None and not importance_weight_cap >= 1.0:
            raise ValueError(f"importance_weight_cap={importance_weight_cap} must be >= 1 (or None: no cap); below 1 "
                             "it would shrink the weight of every token that was not off-policy at all")
        check_advantage_estimator(advantage_estimator)
        self.env = env
        self.generator = generator if generator is not None else HFGenerator()
        self._tokenizer_spec = tokenizer
        self.tokenizer: PreTrainedTokenizerBase | None = tokenizer if isinstance(tokenizer,
                                                                                  PreTrainedTokenizerBase) else None
        self.prompts_per_step, self.samples_per_prompt = prompts_per_step, samples_per_prompt
        self.steps_per_epoch = steps_per_epoch
        self.rollout_mode, self.max_staleness = rollout_mode, max_staleness
        self.advantage_estimator, self.decoupled = advantage_estimator, decoupled
        self.importance_weight_cap = importance_weight_cap
        self.ref_logprobs = ref_logprobs
        self.seed, self.add_bos, self.max_context = seed, add_bos, max_context
        self.policy: nn.Module | None = None
        self.ref_model: nn.Module | None = None
        self.engine = EngineOptions()  # the forward-only walks' options (attach() takes the trainer's)
        self.last_step: StepInfo | None = None
        self.history: list[StepInfo] = []  # every step handed out, in order
        self._version = 0  # the latest version given to update_policy (or attach)
        self._next_index = 0  # the next step to hand out
        self._producer: AsyncProducer | None = None  # async: the background generation thread
        self.discarded_steps = 0  # async: steps generated but never trained (counted at close())

    # ------------------------------------------------------------------ the RolloutDataModule protocol

    def __len__(self) -> int:
        """Steps per epoch. Having a length stops Lightning from prefetching a step (see module docstring)."""
        return self.steps_per_epoch

    def __call__(self) -> Iterator[list[Rollout]]:
        """One epoch: ``steps_per_epoch`` steps, generated (or taken from the background thread) on demand."""
        return (self.next_step() for _ in range(self.steps_per_epoch))

    # ------------------------------------------------------------------ the training loop's side

    def attach(self, policy: nn.Module, version: int = 0, engine: EngineOptions | None = None) -> None:
        """Connect to the trainer's policy before the first step; ``version`` is its current optimizer step and
        ``engine`` the trainer's :class:`~lightning_dta.EngineOptions` (for the forward-only walks).

        Loads the tokenizer if a name was given, hands the policy to the generator (shared in sync mode, copied
        in async mode), freezes a reference copy when ``ref_logprobs`` is on, and starts the background thread
        in async mode.
        """
        if self.policy is not None:
            raise RuntimeError("OnlineRolloutSource.attach() was called twice; close() it first, or build a new "
                               "source for a new run")
        self.tokenizer = self.resolve_tokenizer()
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"the tokenizer {type(self.tokenizer).__name__} has no eos_token_id: generation could "
                             "not stop and the policy could not learn to stop. Fix: set tokenizer.eos_token (or "
                             "pass stop_token_ids to the generator and an eos to the tokenizer)")
        vocab = getattr(getattr(policy, "config", None), "vocab_size", None)
        if vocab is not None and len(self.tokenizer) > vocab:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is {vocab}; "
                             f"set the model's vocab_size to at least {len(self.tokenizer)}")
        if self.max_context is None:
            self.max_context = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        self.policy = policy
        self.engine = EngineOptions.resolve(engine)
        self._version = version
        self.generator.attach(policy, eos_token_id=self.tokenizer.eos_token_id,
                              pad_token_id=self.tokenizer.pad_token_id, share_weights=self.rollout_mode == "sync")
        if self.ref_logprobs:
            self.ref_model = copy.deepcopy(policy).requires_grad_(False).eval()
        if self.rollout_mode == "async":  # a second attach() (another fit) continues the step count
            self._producer = AsyncProducer(self._generate, self.max_staleness)
            self._producer.start(self._next_index, version)

    def resolve_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer: the one given, loaded from the given name or path, or the environment's default."""
        if self.tokenizer is None:
            if isinstance(self._tokenizer_spec, str):
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_spec)
            else:
                self.tokenizer = self.env.default_tokenizer()
        return self.tokenizer

    def update_policy(self, policy: nn.Module, version: int) -> None:
        """Call after every optimizer step: the generator follows ``policy``'s weights, tagged ``version``.

        In async mode this waits for a generation in progress to finish (the copy never mixes two versions
        into one generation), then lets the background thread start the steps the new version allows.
        """
        if self.policy is None:
            raise RuntimeError("update_policy() before attach()")
        if version < self._version:
            raise ValueError(f"policy version {version} must not go back (the policy is at version {self._version}); "
                             "pass the optimizer step count, e.g. trainer.global_step")
        if self._producer is None:
            self.generator.update_weights(policy, version)
            self._version = version
            return
        with self._producer.generation_lock:  # weights and their version change together, between generations
            self.generator.update_weights(policy, version)
            self._version = version
            self._producer.set_version(version)

    def close(self) -> None:
        """Stop the background thread (if any) and wait for it; steps generated but not trained are counted in
        ``discarded_steps``. Safe to call more than once."""
        if self._producer is not None:
            self.discarded_steps = self._producer.stop()
            self._producer = None
        self.policy = None

    def __enter__(self) -> OnlineRolloutSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def steps_ahead(self) -> int:
        """Async: steps generated by the background thread and not handed out yet (0 in sync mode)."""
        return 0 if self._producer is None else self._producer.steps_ahead

    # ------------------------------------------------------------------ producing steps

    def next_step(self) -> list[Rollout]:
        """The next step's rollouts, ready to train (advantages and, in async mode, prox log-probs set)."""
        if self.policy is None:
            raise RuntimeError("OnlineRolloutSource has no policy: it must be attached to the model being trained "
                               "before the first step. With Lightning add lightning_dta.rl.OnlineRLCallback to the "
                               "Trainer's callbacks; in a plain loop call source.attach(model) first, and "
                               "source.update_policy(model, version) after every optimizer step")
        requested = time.perf_counter()
        if self._producer is None:
            generated = self._generate(self._next_index, self._version)
        else:
            generated = self._producer.take(self._next_index)
        waited = time.perf_counter() - requested
        if generated.index != self._next_index:
            raise RuntimeError(f"step {generated.index} arrived where step {self._next_index} was expected")
        self._next_index += 1
        staleness = self._version - generated.version
        if staleness > (self.max_staleness if self.rollout_mode == "async" else 0):
            raise RuntimeError(f"step {generated.index} was generated with policy version {generated.version} and "
                               f"would be trained at version {self._version}: staleness {staleness} exceeds "
                               f"max_staleness={self.max_staleness}. This is a bug in the rollout source")
        start = time.perf_counter()
        episodes = generated.content
        rollouts = episode_rollouts(episodes, self.advantage_estimator)
        tree = PrefixTree.from_rollouts(rollouts, validate=False)
        info = step_info(generated.index, generated.version, self._version, episodes, tree)
        info.generation_sec, info.wait_sec, info.requested_at = generated.seconds, waited, requested
        if self.rollout_mode == "async" and self.decoupled:
            fill_logprobs(tree, self.policy, "prox_logprobs", self.engine)
            if self.importance_weight_cap is not None:
                cap_importance_weight(rollouts, self.importance_weight_cap)
        if self.ref_model is not None:
            fill_logprobs(tree, self.ref_model, "ref_logprobs", self.engine)
        info.prepare_sec = time.perf_counter() - start
        self.last_step = info
        self.history.append(info)
        return rollouts

    def _step_seed(self, index: int) -> int:
        return random.Random(f"online-rollouts:{self.seed}:{index}").getrandbits(63)

    def _generate(self, index: int, version: int) -> Generated:
        start = time.perf_counter()
        first = index * self.prompts_per_step
        episodes = run_episodes(self.env, self.generator, self.tokenizer, range(first, first + self.prompts_per_step),
                                self.samples_per_prompt, self._step_seed(index), add_bos=self.add_bos,
                                max_context=self.max_context)
        without_calls = [e for e in episodes if not e.calls]
        if without_calls:  # run_episodes refuses prompts too long for a first call; this cannot happen silently
            raise RuntimeError(f"{len(without_calls)} episode(s) of step {index} made no LLM call")
        return Generated(index, version, episodes, time.perf_counter() - start)
