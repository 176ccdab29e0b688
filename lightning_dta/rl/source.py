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
import dataclasses
import math
import queue
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_dta.advantages import check_advantage_estimator, estimate_advantages
from lightning_dta.engine import tree_logprobs
from lightning_dta.rl.environment import Environment, Episode, run_episodes
from lightning_dta.rl.generation import Generator, HFGenerator
from lightning_dta.rollout import Rollout
from lightning_dta.tree import PrefixTree

MODES = ("sync", "async")
_POLL_SEC = 0.05  # how often a waiting thread looks at the stop flag and the other thread's health


@dataclass
class StepInfo:
    """What the source knows about one step it handed out, for logging and for the staleness check.

    Times are wall-clock seconds. ``generation_sec``: generating and scoring the step (in async mode it overlaps
    training). ``wait_sec``: how long the trainer waited for the step (in sync mode, the generation itself).
    ``prepare_sec``: advantages and the forward-only walks for ``prox``/``ref`` log-probs. ``requested_at``:
    ``time.perf_counter()`` when the trainer asked for the step (start of its end-to-end time).
    """

    index: int
    policy_version: int  # the version of the weights that generated the step
    trained_version: int  # the trainer's version when the step was handed out
    rewards: list[float]  # one per episode
    response_tokens: list[int]  # generated tokens per episode (all its calls)
    calls: int
    logical_tokens: int
    tree_tokens: int
    correct: list[bool] = field(default_factory=list)  # episodes whose info says "correct" (when reported)
    finishes: dict[str, int] = field(default_factory=dict)
    generation_sec: float = 0.0
    wait_sec: float = 0.0
    prepare_sec: float = 0.0
    requested_at: float = 0.0

    @property
    def staleness(self) -> int:
        return self.trained_version - self.policy_version

    @property
    def compression_ratio(self) -> float:
        return self.logical_tokens / max(self.tree_tokens, 1)

    @property
    def reward_mean(self) -> float:
        return statistics.fmean(self.rewards)

    @property
    def reward_std(self) -> float:
        return statistics.pstdev(self.rewards)


@dataclass
class _Generated:
    index: int
    version: int
    episodes: list[Episode]
    seconds: float


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
        mode: ``"sync"`` or ``"async"``.
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
            (default): the exact decoupled-PPO loss of DESIGN.md section 4.
        ref_logprobs: compute ``ref_logprobs`` with a frozen copy of the policy taken at :meth:`attach` (after
            any warm start), for ``kl_coef > 0``.
        seed: prompts and sampling: step ``i`` uses prompt indices ``[i * prompts_per_step, ...)`` and a seed
            derived from ``(seed, i)``.
        add_bos: start every context with the tokenizer's BOS token.
        max_context: the model's maximum positions (default: the policy config's ``max_position_embeddings``).
    """

    def __init__(self, env: Environment, generator: Generator | None = None,
                 tokenizer: PreTrainedTokenizerBase | str | None = None, prompts_per_step: int = 8,
                 samples_per_prompt: int = 4, steps_per_epoch: int = 1000, mode: str = "sync",
                 max_staleness: int = 1, advantage_estimator: str | None = "grpo", decoupled: bool = True,
                 importance_weight_cap: float | None = None, ref_logprobs: bool = False, seed: int = 0,
                 add_bos: bool = True, max_context: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; choose one of {MODES}")
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
        self.mode, self.max_staleness = mode, max_staleness
        self.advantage_estimator, self.decoupled = advantage_estimator, decoupled
        self.importance_weight_cap = importance_weight_cap
        self.ref_logprobs = ref_logprobs
        self.seed, self.add_bos, self.max_context = seed, add_bos, max_context
        self.policy: nn.Module | None = None
        self.ref_model: nn.Module | None = None
        self.last_step: StepInfo | None = None
        self.history: list[StepInfo] = []  # every step handed out, in order
        self._base_version = 0  # the policy version at attach(): steps are counted from there
        self._version = 0  # the latest version given to update_policy (or attach)
        self._next_index = 0  # the next step to hand out
        self._first_index = 0  # async: the first step the background thread generates (the count at attach())
        # async machinery
        self._condition = threading.Condition()
        self._queue: queue.Queue[_Generated] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._producer_error: BaseException | None = None
        self._producer_waiting_for: int | None = None  # the version the producer waits for (None: not waiting)
        self._generation_lock = threading.Lock()  # held while generating; weight copies wait for it
        self.discarded_steps = 0  # async: steps generated but never trained (counted at close())

    # ------------------------------------------------------------------ the RolloutDataModule protocol

    def __len__(self) -> int:
        """Steps per epoch. Having a length stops Lightning from prefetching a step (see module docstring)."""
        return self.steps_per_epoch

    def __call__(self) -> Iterator[list[Rollout]]:
        """One epoch: ``steps_per_epoch`` steps, generated (or taken from the background thread) on demand."""
        return (self.next_step() for _ in range(self.steps_per_epoch))

    # ------------------------------------------------------------------ the training loop's side

    def attach(self, policy: nn.Module, version: int = 0) -> None:
        """Connect to the trainer's policy before the first step; ``version`` is its current optimizer step.

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
        self._base_version = self._version = version
        self.generator.attach(policy, eos_token_id=self.tokenizer.eos_token_id,
                              pad_token_id=self.tokenizer.pad_token_id, share_weights=self.mode == "sync")
        if self.ref_logprobs:
            self.ref_model = copy.deepcopy(policy).requires_grad_(False).eval()
        if self.mode == "async":
            self._stop.clear()
            self._producer_error = None
            self._first_index = self._next_index  # a second attach() (another fit) continues the step count
            self._queue = queue.Queue(maxsize=self.max_staleness + 1)
            self._thread = threading.Thread(target=self._produce, name="lightning-dta-rollouts", daemon=True)
            self._thread.start()

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
        with self._generation_lock:  # weights and their version change together, between two generations
            self.generator.update_weights(policy, version)
            with self._condition:
                self._version = version
                self._condition.notify_all()

    def close(self) -> None:
        """Stop the background thread (if any) and wait for it; steps generated but not trained are counted in
        ``discarded_steps``. Safe to call more than once."""
        self._stop.set()
        with self._condition:
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
            if self._thread.is_alive():
                raise RuntimeError("the rollout generation thread did not stop within 60 s")
            self._thread = None
        self.discarded_steps = self._queue.qsize() if self._queue is not None else 0
        self._queue = None
        self.policy = None

    def __enter__(self) -> OnlineRolloutSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def policy_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ producing steps

    def next_step(self) -> list[Rollout]:
        """The next step's rollouts, ready to train (advantages and, in async mode, prox log-probs set)."""
        if self.policy is None:
            raise RuntimeError("OnlineRolloutSource has no policy: it must be attached to the model being trained "
                               "before the first step. With Lightning add lightning_dta.rl.OnlineRLCallback to the "
                               "Trainer's callbacks; in a plain loop call source.attach(model) first, and "
                               "source.update_policy(model, version) after every optimizer step")
        requested = time.perf_counter()
        if self.mode == "sync":
            generated = self._generate(self._next_index, self._version)
        else:
            generated = self._take()
        waited = time.perf_counter() - requested
        if generated.index != self._next_index:
            raise RuntimeError(f"step {generated.index} arrived where step {self._next_index} was expected")
        self._next_index += 1
        staleness = self._version - generated.version
        if staleness > (self.max_staleness if self.mode == "async" else 0):
            raise RuntimeError(f"step {generated.index} was generated with policy version {generated.version} and "
                               f"would be trained at version {self._version}: staleness {staleness} exceeds "
                               f"max_staleness={self.max_staleness}. This is a bug in the rollout source")
        start = time.perf_counter()
        rollouts = self._prepare(generated.episodes)
        tree = PrefixTree.from_rollouts(rollouts, validate=False)
        info = StepInfo(
            index=generated.index, policy_version=generated.version, trained_version=self._version,
            rewards=[e.reward for e in generated.episodes],
            response_tokens=[e.generated_tokens for e in generated.episodes], calls=len(rollouts),
            logical_tokens=tree.stats.logical_tokens, tree_tokens=tree.stats.tree_tokens,
            correct=[bool(e.info["correct"]) for e in generated.episodes if "correct" in e.info],
            finishes=dict(Counter(e.finish for e in generated.episodes)), generation_sec=generated.seconds,
            wait_sec=waited, requested_at=requested)
        if self.mode == "async" and self.decoupled:
            self._set_logprobs(rollouts, tree, self.policy, "prox_logprobs")
            if self.importance_weight_cap is not None:
                floor = math.log(self.importance_weight_cap)
                for r in rollouts:
                    r.old_logprobs = [max(o, p - floor) if m else o
                                      for o, p, m in zip(r.old_logprobs, r.prox_logprobs, r.loss_mask)]
        if self.ref_model is not None:
            self._set_logprobs(rollouts, tree, self.ref_model, "ref_logprobs")
        info.prepare_sec = time.perf_counter() - start
        self.last_step = info
        self.history.append(info)
        return rollouts

    def _step_seed(self, index: int) -> int:
        return random.Random(f"online-rollouts:{self.seed}:{index}").getrandbits(63)

    def _generate(self, index: int, version: int) -> _Generated:
        start = time.perf_counter()
        first = index * self.prompts_per_step
        episodes = run_episodes(self.env, self.generator, self.tokenizer, range(first, first + self.prompts_per_step),
                                self.samples_per_prompt, self._step_seed(index), add_bos=self.add_bos,
                                max_context=self.max_context)
        without_calls = [e for e in episodes if not e.calls]
        if without_calls:  # run_episodes refuses prompts too long for a first call; this cannot happen silently
            raise RuntimeError(f"{len(without_calls)} episode(s) of step {index} made no LLM call")
        return _Generated(index, version, episodes, time.perf_counter() - start)

    def _prepare(self, episodes: list[Episode]) -> list[Rollout]:
        """Advantages per episode (one entry per episode in its group), copied to every call of the episode."""
        if self.advantage_estimator is None:
            return [call for episode in episodes for call in episode.calls]
        stand_ins = [Rollout(input_ids=[0, 0], reward=e.reward, group_id=e.prompt_index) for e in episodes]
        estimated = estimate_advantages(stand_ins, self.advantage_estimator)
        return [dataclasses.replace(call, advantages=estimate.advantages)
                for episode, estimate in zip(episodes, estimated) for call in episode.calls]

    @staticmethod
    def _set_logprobs(rollouts: list[Rollout], tree: PrefixTree, model: nn.Module, field_name: str) -> None:
        """Fill ``field_name`` with ``model``'s log-probs from one forward-only walk over the step's tree.

        ``tree_logprobs`` gives entry ``t-1`` = log p(x_t | x_<t); the rollout field has one entry per token
        with entry 0 unused, hence the leading 0.0.
        """
        with torch.no_grad():
            logprobs = tree_logprobs(model, tree)
        for rollout, values in zip(rollouts, logprobs):
            setattr(rollout, field_name, [0.0] + values.double().cpu().tolist())

    # ------------------------------------------------------------------ async: the background thread

    def _produce(self) -> None:
        """Generate step after step, each once the policy version allows it, until close()."""
        try:
            index = self._first_index
            while not self._stop.is_set():
                needed = self._base_version + (index - self._first_index) - self.max_staleness
                with self._condition:
                    while self._version < needed and not self._stop.is_set():
                        self._producer_waiting_for = needed
                        self._condition.wait(_POLL_SEC)
                    self._producer_waiting_for = None
                if self._stop.is_set():
                    return
                with self._generation_lock:
                    generated = self._generate(index, self._version)
                while not self._stop.is_set():
                    try:
                        self._queue.put(generated, timeout=_POLL_SEC)
                        break
                    except queue.Full:
                        continue
                index += 1
        except BaseException as error:  # handed to the trainer's thread by _take()
            self._producer_error = error

    def _take(self) -> _Generated:
        """The next generated step from the background thread; its failure or a stalled loop raises here."""
        while True:
            if self._producer_error is not None:
                raise RuntimeError(f"the rollout generation thread failed: {self._producer_error}") \
                    from self._producer_error
            try:
                return self._queue.get(timeout=_POLL_SEC)
            except queue.Empty:
                pass
            with self._condition:
                waiting_for = self._producer_waiting_for
                stalled = waiting_for is not None and self._queue.empty() and self._producer_error is None
                if stalled and self._version < waiting_for:
                    raise RuntimeError(
                        f"the trainer wants step {self._next_index} but the generation thread waits for policy "
                        f"version {waiting_for} and the policy is at version {self._version}: update_policy() is "
                        "not being called after each optimizer step. With Lightning add "
                        "lightning_dta.rl.OnlineRLCallback to the Trainer's callbacks; in a plain loop call "
                        "source.update_policy(model, version) after every optimizer.step()")
            if self._thread is None or not self._thread.is_alive():
                if self._producer_error is None:
                    raise RuntimeError("the rollout generation thread has stopped (was the source closed?)")
