"""The online rollout source: generate with the current policy, score, estimate advantages, hand steps to training.

``OnlineRolloutSource`` plugs into :class:`~lightning_dta.lightning.data.RolloutDataModule` as its ``source``: calling
it
starts an epoch, an iterator of steps, each the whole step's list of :class:`~lightning_dta.Rollout`. A step is
``prompts_per_step`` prompts x ``samples_per_prompt`` episodes; every LLM call of every episode is one rollout
(:mod:`lightning_dta.rl.environment`).

One step on N ranks (every rank runs this; ``docs/rl.md`` has the diagram):

1. **generate**, by placement. ``"colocated"`` (the default for the in-process ``HFGenerator``, as verl's hybrid
   engine): the step's prompts are cut into ``generation_blocks`` consecutive blocks; rank ``r`` generates blocks
   ``r, r + N, ...`` with its own generator, and the blocks are all-gathered. ``"disaggregated"`` (the default for
   an ``OpenAICompatibleGenerator``, as AReaL's system): rank 0 alone talks to the inference server and
   broadcasts the step. Prompts come from the step index, and every call samples with a seed derived from
   ``(seed, step, prompt, sample, turn)``, never from a rank: N ranks generate the rollouts one rank generates
   (bitwise, when ``generation_blocks`` is fixed: every block is then the same computation on any rank);
2. on every rank, the same deterministic pipeline: rewards -> advantages over the whole step (GRPO groups are
   never split before their statistics are taken) -> the step's tree -> the data module's partition -> this
   rank's tree;
3. :meth:`prepare_batch`: decoupled-PPO proximal (and reference) log-probs with the forward-only tree walk, on the
   rank that trains the rollouts only.

Generation batches (``generation``, :mod:`lightning_dta.core.generation`): what is generated and estimated above is
then a generation batch of ``steps_per_generation`` steps' prompts, split into its optimizer steps (whole prompts
each, by default) after the advantages; step 3 runs per optimizer step, except the proximal log-probs: decoupled PPO
(AReaL) takes them ONCE per generation batch, with the weights before its first update, so they are walked over the
whole batch when its first step is handed out (the ranks share the walk and gather it,
:func:`~lightning_dta.distributed.batch_walk.walk_batch`) and every later step of the batch keeps them. The batch's
rollouts keep the log-probs of the policy that generated them (``old_logprobs``), so the steps after the first are
trained off policy by the optimizer steps between: the ratio is against the behaviour log-probs (sync), or against
the batch's proximal ones with the behaviour weight ``exp(prox - old)`` (async, decoupled). Each step's
:class:`~lightning_dta.core.generation.GenerationContext` tells a critic where it stands in its batch.

Two rollout modes:

- ``"sync"`` (default): a step is generated when the trainer asks for it, with the weights of the previous
  optimizer step; in-process generation shares the trainer's module. Strictly on-policy.
- ``"async"``: a background thread generates steps ahead while the trainer trains, with a private copy of the
  weights that :meth:`update_policy` refreshes after each optimizer step. Staleness counts generation batches:
  generation batch ``i`` (counted from :meth:`attach`) is generated with the weights that trained batch
  ``i - max_staleness`` first, exactly (:mod:`lightning_dta.rl.producer`), so every rank agrees on the version of
  every batch and the bound holds; the loss is decoupled PPO (the rollouts keep the behaviour log-probs as
  ``old_logprobs`` and get ``prox_logprobs`` recomputed on the weights of the batch's first step).

The source has a length (``steps_per_epoch``), which matters: Lightning prefetches one batch ahead from a loader
without a length, which would generate step ``k+1`` before step ``k`` is trained, i.e. silently one step off
policy. With a length there is no prefetch and "sync" really is on-policy. It also has a ``state_dict``: a run
resumed from a checkpoint continues at the next step, with the prompts and seeds it would have used.

Used with Lightning, :class:`~lightning_dta.rl.callback.OnlineRLCallback` calls :meth:`attach`,
:meth:`update_policy` and :meth:`close`; in a plain loop call them yourself (see ``examples/online_rl.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Iterator
from typing import Any, Literal

from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_dta.contracts import ModelLimits, ParallelLayout
from lightning_dta.core.advantages import check_advantage_estimator
from lightning_dta.core.batch import StepBatch
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.generation import GenerationBatches, GenerationContext
from lightning_dta.core.rollout import Rollout
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.batch_walk import walk_batch
from lightning_dta.distributed.collectives import all_gather_objects, broadcast_object, rank
from lightning_dta.distributed.peers import check_peers_agree
from lightning_dta.distributed.sharding import is_sharded, sharded_copy, unsharded
from lightning_dta.engine import EngineOptions, tree_logprobs
from lightning_dta.lightning.sources import check_same_generation, validated_step
from lightning_dta.rl.environment import Environment, run_episodes
from lightning_dta.rl.gap import check_max_logprob_gap
from lightning_dta.rl.generation import Generator, HFGenerator, derive_seed
from lightning_dta.rl.prepare import StepInfo, episode_rollouts, fill_logprobs, step_info
from lightning_dta.rl.producer import AsyncProducer, Generated

RolloutMode = Literal["sync", "async"]
Placement = Literal["colocated", "disaggregated"]


class OnlineRolloutSource:
    """Rollouts generated online by the policy being trained; a ``RolloutDataModule`` source (module docstring).

    Args:
        env: the environment (a single-turn task is one too), e.g. ``ReverseDigits()`` or ``CalculatorEnv()``.
        generator: samples the calls; default ``HFGenerator()`` (in-process ``model.generate``).
        tokenizer: a tokenizer, a local path or hub name (loaded at :meth:`attach`, not when a config is
            parsed), or ``None``: the environment's ``default_tokenizer()``.
        prompts_per_step, samples_per_prompt: a step has ``prompts_per_step`` GRPO groups of
            ``samples_per_prompt`` episodes.
        steps_per_epoch: the length of one epoch in optimizer steps (the data module's epoch; training length is
            the Trainer's ``max_steps``; a generation batch may straddle two epochs).
        rollout_mode: ``"sync"`` or ``"async"``.
        max_staleness: async only, in generation batches: batch ``i`` is generated with the weights that start
            training batch ``i - max_staleness`` (0 = with the latest weights, in the background), so at most
            ``max_staleness * steps_per_generation * epochs`` optimizer steps lie between the weights that generate
            a batch and those of its first step (the logged ``rl/staleness`` counts optimizer steps).
        placement: ``"colocated"`` (every rank generates its blocks) or ``"disaggregated"`` (rank 0 generates the
            whole step, e.g. through a server, and broadcasts it); ``None``: the generator's own ``placement``.
        generation_blocks: colocated: the generation batch's prompts are cut into this many blocks of consecutive
            prompts, one ``generate`` batch each, and rank ``r`` generates blocks ``r, r + N, ...``. ``None``: one
            block per rank. A fixed number makes every block the same computation on any number of ranks, so runs
            on 1, 2 or 8 ranks generate bitwise the same rollouts; ``None`` keeps the sampling seeds but lets batch
            sizes, hence float rounding, follow the number of ranks.
        advantage_estimator: ``"grpo"``, ``"grpo-no-std"``, ``"reinforce-baseline"``, ``"gae"`` or ``None``. The
            first three are estimated per *episode* (one reward per episode, its group = its prompt) over the whole
            step and given to each of its calls, so an episode with more calls does not weigh more in its group's
            baseline. ``"gae"``: each call carries its episode's reward and ``DTAModule(critic=...)`` estimates
            the advantages in the training step from its critic's values. Leave the data module's own
            ``advantage_estimator`` unset (the data module refuses both).
        advantage_options: the estimator's keyword arguments (e.g. ``{std_unbiased: true}``; per episode, so
            ``weighting: token`` is refused).
        decoupled: async only: recompute ``prox_logprobs`` on the current weights (decoupled PPO). ``False``
            keeps plain PPO against the behaviour log-probs.
        ref_logprobs: compute ``ref_logprobs`` with a frozen copy of the policy taken at :meth:`attach` (after
            any warm start), for ``kl_coef > 0``.
        seed: prompts and sampling: generation batch ``i`` uses prompt indices ``[i * prompts_per_step *
            steps_per_generation, ...)`` and seeds derived from ``(seed, i)``; a shuffled split is drawn from them too.
        add_bos: start every context with the tokenizer's BOS token.
        max_context: the model's maximum positions (default: the policy config's ``max_position_embeddings``).
        generation: :class:`~lightning_dta.core.generation.GenerationBatches`: one generation batch of
            ``prompts_per_step * steps_per_generation`` prompts, generated with one version of the weights, its
            advantages estimated over all of it, feeds ``steps_per_generation * epochs`` optimizer steps (the
            default split: whole prompts, with every call of their episodes, ``prompts_per_step`` each when every
            prompt has as many calls; otherwise cut where the steps' calls come closest to equal). The rollouts
            keep the generating policy's log-probs as ``old_logprobs``, so from the second step on the PPO ratio
            departs from 1 and the clip binds. Default: one step per generation batch.
        max_logprob_gap: stop the run when a step trained with the weights that generated it (staleness 0) has a
            sampled token whose trainer log-prob is further than this from the generator's
            (:mod:`lightning_dta.rl.gap`; checked by :class:`~lightning_dta.rl.OnlineRLCallback`). ``None``
            (default): no bound, the gap is still logged every step. No value is safe for every engine: a float32
            in-process generator is at float rounding (at most 2.7e-5 measured on the toy task), a bf16 server beside a
            float32 trainer is expected to differ by much more on its rarest tokens; ``1e-3`` suits float32 engines
            (``docs/rl.md``, "The log-prob gap").

    The forward-only walks (``prox``/``ref`` log-probs) use the :class:`~lightning_dta.EngineOptions` given to
    :meth:`attach`: the training module's, so one engine block in a config serves every engine call of a step.
    """

    def __init__(self, env: Environment, generator: Generator | None = None,
                 tokenizer: PreTrainedTokenizerBase | str | None = None, prompts_per_step: int = 8,
                 samples_per_prompt: int = 4, steps_per_epoch: int = 1000, rollout_mode: RolloutMode = "sync",
                 max_staleness: int = 1, placement: Placement | None = None, generation_blocks: int | None = None,
                 advantage_estimator: str | None = "grpo", decoupled: bool = True,
                 ref_logprobs: bool = False, seed: int = 0,
                 add_bos: bool = True, max_context: int | None = None,
                 advantage_options: dict[str, Any] | None = None,
                 generation: GenerationBatches | None = None, max_logprob_gap: float | None = None) -> None:
        generation = GenerationBatches.resolve(generation)
        check_max_logprob_gap(max_logprob_gap)
        if rollout_mode not in ("sync", "async"):
            raise ConfigError(f"rollout_mode={rollout_mode!r}; choose 'sync' or 'async'")
        if placement not in (None, "colocated", "disaggregated"):
            raise ConfigError(f"placement={placement!r}; choose 'colocated', 'disaggregated' or None (the generator's)")
        for name, value in (("prompts_per_step", prompts_per_step), ("samples_per_prompt", samples_per_prompt),
                            ("steps_per_epoch", steps_per_epoch)):
            if value < 1:
                raise ConfigError(f"{name}={value} must be >= 1")
        prompts_per_generation = prompts_per_step * generation.steps_per_generation
        if generation_blocks is not None and not 1 <= generation_blocks <= prompts_per_generation:
            raise ConfigError(f"generation_blocks={generation_blocks} must be between 1 and the generation batch's "
                             f"{prompts_per_generation} prompts (or None: one block per rank)")
        if max_staleness < 0:
            raise ConfigError(f"max_staleness={max_staleness} must be >= 0")
        check_advantage_estimator(advantage_estimator, advantage_options)
        if (advantage_options or {}).get("weighting", "rollout") != "rollout":
            raise ConfigError("advantage_options.weighting='token': the online source estimates advantages per "
                             "episode (one reward each), whose calls have no single token count. Fix: "
                             "weighting: rollout")
        self.advantage_options = advantage_options
        self.env = env
        self.generator = generator if generator is not None else HFGenerator()
        self._tokenizer_spec = tokenizer
        self.tokenizer: PreTrainedTokenizerBase | None = tokenizer if isinstance(tokenizer,
                                                                                  PreTrainedTokenizerBase) else None
        self.prompts_per_step, self.samples_per_prompt = prompts_per_step, samples_per_prompt
        self.generation, self.prompts_per_generation = generation, prompts_per_generation
        self.steps_per_epoch = steps_per_epoch
        self.rollout_mode, self.max_staleness = rollout_mode, max_staleness
        self.placement: Placement = placement or self.generator.placement
        self.generation_blocks = generation_blocks
        self.advantage_estimator, self.decoupled = advantage_estimator, decoupled
        self.ref_logprobs = ref_logprobs
        self.max_logprob_gap = max_logprob_gap
        self.seed, self.add_bos, self.max_context = seed, add_bos, max_context
        self.policy: nn.Module | None = None
        self.ref_model: nn.Module | None = None
        self.engine = EngineOptions()  # the forward-only walks' options (attach() takes the trainer's)
        self.last_step: StepInfo | None = None  # the last generation batch (by default: the last step)
        self.last_step_logical_tokens = 0  # the last optimizer step handed out (a part of last_step's batch)
        self.history: list[StepInfo] = []  # every step handed out, in order
        self.last_weight_sync_sec = 0.0  # how long the latest weight hand-over took (copy or server sync)
        self._version = 0  # the latest version given to update_policy (or attach)
        self._next_index = 0  # the next generation batch to generate
        self._steps_left: list[list[Rollout]] = []  # the current generation batch's steps not handed out yet
        self._batch_info: StepInfo | None = None  # the current generation batch's statistics
        self._context: GenerationContext | None = None  # the step handed out last: its place in its batch
        self._rank, self._world_size = 0, 1  # among the data-parallel ranks (attach() reads the layout)
        self._global_rank = 0
        self._group = None  # the data-parallel group the colocated blocks are gathered over
        self._peers = None  # the tensor-parallel peers that generate this rank's blocks alike (None: no TP)
        self._syncs_weights = True  # whether this rank's generator receives the weights (attach() decides)
        self._producer: AsyncProducer | None = None  # async: the background generation thread
        self.discarded_steps = 0  # async: steps generated but never trained (counted at close())

    # ------------------------------------------------------------------ the RolloutDataModule protocol

    def __len__(self) -> int:
        """Steps per epoch. Having a length stops Lightning from prefetching a step (see module docstring)."""
        return self.steps_per_epoch

    def steps(self, epoch: int, start: int, limits: ModelLimits) -> Iterator[tuple[str, list[Rollout]]]:
        """The rest of the current epoch: whole steps (advantages set; :meth:`prepare_batch` adds the log-probs
        on each rank's share), generated (or taken from the background thread) on demand. The source keeps its own
        position (:meth:`state_dict`), so a resumed run continues where it stopped and ``start`` adds nothing."""
        handed = self._next_index * self.generation.steps_per_batch - len(self._steps_left)
        for _ in range(handed, (handed // self.steps_per_epoch + 1) * self.steps_per_epoch):
            label, rollouts = self._take_step()
            yield label, validated_step(rollouts, label, limits)

    def _take_step(self) -> tuple[str, list[Rollout]]:
        """The next optimizer step: the current generation batch's next one, generating a new batch when none is
        left (its advantages over the whole batch, then its split, and with decoupled PPO its proximal log-probs)."""
        batch = None
        if not self._steps_left:
            batch = self.next_rollouts()
            index = self._next_index - 1
            label = f"generation batch {index} of the online source"
            self._steps_left = self.generation.split_batch(batch, self.seed, index, label)
            self._batch_info = self.last_step
        elif self._batch_info is not None:  # a later step of the batch: the batch's content, this step's times and
            # version (its staleness counts the optimizer steps since the batch was generated)
            self.last_step = dataclasses.replace(self._batch_info, trained_version=self._version, generation_sec=0.0,
                                                 wait_sec=0.0, prepare_sec=0.0, requested_at=time.perf_counter())
        each = self.generation.steps_per_batch
        position = each - len(self._steps_left)
        index = self._next_index - 1
        label = f"step {index} of the online source" if each == 1 else \
            f"step {position} of generation batch {index} of the online source"
        if each > 1:
            self._context = GenerationContext(f"generation batch {index} of the online source", position,
                                              None if batch is None else tuple(batch))
            if batch is not None and self._decoupled:
                self._batch_prox(batch)
        step = self._steps_left.pop(0)
        self.last_step_logical_tokens = sum(len(rollout.input_ids) for rollout in step)
        return label, step

    def prepare_batch(self, batch: StepBatch) -> None:
        """Complete this rank's share of the step: proximal and reference log-probs on its tree only (the proximal
        ones of a generation batch of several steps are the batch's, already set), and the step's place in its
        generation batch. Every rank calls it, also one without a tree (a sharded model is unsharded collectively
        for the walks)."""
        self.prepare(batch.tree)
        batch.generation = self._context

    @property
    def _decoupled(self) -> bool:
        """Whether the loss gets proximal log-probs (decoupled PPO, async mode)."""
        return self.rollout_mode == "async" and self.decoupled

    def _batch_prox(self, batch: list[Rollout]) -> None:
        """Decoupled PPO over a generation batch of several steps: every rollout's ``prox_logprobs`` with the current
        weights (those of the batch's first step), one walk shared by the ranks (module docstring)."""
        start = time.perf_counter()
        with unsharded(self.policy, training=False):
            walked = walk_batch(batch, lambda tree: tree_logprobs(self.policy, tree, engine=self.engine), self._group)
        for rollout, logprobs in zip(batch, walked):
            rollout.prox_logprobs = [0.0, *logprobs]
        self.last_step.prepare_sec += time.perf_counter() - start

    def state_dict(self) -> dict[str, Any]:
        """The next generation batch (a resumed run continues there, with the same prompts and seeds), and the steps
        of the current one not trained yet: stopped in the middle of a generation batch, the run resumes at its
        next step with the same rollouts, advantages and split (the weights that generated them are gone)."""
        return {"next_index": self._next_index, "seed": self.seed, "prompts_per_step": self.prompts_per_step,
                "generation": self.generation.to_dict(),
                "steps_left": [[rollout.to_dict() for rollout in step] for step in self._steps_left],
                "batch_info": dataclasses.asdict(self._batch_info) if self._steps_left and self._batch_info else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._producer is not None:
            raise RuntimeError("load_state_dict() on a running async source; restore before attach()")
        if (state.get("seed"), state.get("prompts_per_step")) != (self.seed, self.prompts_per_step):
            raise ConfigError(f"the checkpoint's rollout source had seed={state.get('seed')} and prompts_per_step="
                             f"{state.get('prompts_per_step')}, this one has seed={self.seed} and prompts_per_step="
                             f"{self.prompts_per_step}: the resumed run would draw other prompts. Fix: resume with "
                             "the same source settings")
        check_same_generation(state, self.generation)
        self._next_index = int(state["next_index"])
        self._steps_left = [[Rollout.from_dict(data) for data in step] for step in state.get("steps_left", [])]
        info = state.get("batch_info")
        self._batch_info = None if info is None else StepInfo(**info)

    # ------------------------------------------------------------------ the training loop's side

    def attach(self, policy: nn.Module, version: int = 0, engine: EngineOptions | None = None,
               layout: ParallelLayout | None = None) -> None:
        """Connect to the trainer's policy before the first step; ``version`` is its current optimizer step,
        ``engine`` the trainer's :class:`~lightning_dta.EngineOptions` (for the forward-only walks) and ``layout`` the
        strategy's :class:`~lightning_dta.contracts.ParallelLayout` (default: every rank its own data-parallel rank).

        Loads the tokenizer if a name was given, hands the policy to the generator (shared in sync mode, copied
        in async mode; disaggregated: on rank 0 only), freezes a reference copy when ``ref_logprobs`` is on, and
        starts the background thread in async mode. Every rank calls it. Colocated blocks are cut over the
        data-parallel ranks: the tensor-parallel peers of a rank generate its blocks alike (the same weights and
        seeds), the blocks are gathered over the data-parallel group, and the peers compare a digest of the step
        they hold (:mod:`lightning_dta.distributed.peers`), stopping where generation diverged.
        """
        if self.policy is not None:
            raise RuntimeError("OnlineRolloutSource.attach() was called twice; close() it first, or build a new "
                               "source for a new run")
        self.tokenizer = self.resolve_tokenizer()
        if self.tokenizer.eos_token_id is None:
            raise ConfigError(f"the tokenizer {type(self.tokenizer).__name__} has no eos_token_id: generation could "
                             "not stop and the policy could not learn to stop. Fix: set tokenizer.eos_token (or "
                             "pass stop_token_ids to the generator and an eos to the tokenizer)")
        # a user's model: not every nn.Module carries a Hugging Face config
        vocab = getattr(getattr(policy, "config", None), "vocab_size", None)
        if vocab is not None and len(self.tokenizer) > vocab:
            raise ConfigError(f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocab_size is {vocab}; "
                             f"set the model's vocab_size to at least {len(self.tokenizer)}")
        if self.max_context is None:
            # a user's model: not every nn.Module carries a Hugging Face config
            self.max_context = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        layout = layout or ParallelLayout()
        self._group = layout.data_parallel_group
        self._peers = layout.tensor_parallel_group
        self._rank, self._world_size = layout.data_parallel_rank, layout.data_parallel_size
        self._global_rank = rank()
        self.policy = policy
        self.engine = EngineOptions.resolve(engine)
        if self.engine.policy_temperature != 1.0:
            raise ValueError(f"engine.policy_temperature={self.engine.policy_temperature}: the generators record the "
                             "temperature-1 log-probs of what they sample (the policy the loss trains by default), "
                             "so a tempered loss would compare different policies. Fix: policy_temperature: 1 for "
                             "online RL (sample at any temperature; the loss trains the model's own distribution)")
        self._version = version
        sharded = is_sharded(policy)
        # A sharded policy's weights are gathered collectively, so every rank takes part in each weight copy (the
        # generator of a rank that does not generate only receives them); it is never shared (its forwards would
        # all-gather a different number of times on every rank).
        self._syncs_weights = self._generates or sharded
        if self._syncs_weights:
            self.generator.attach(policy, eos_token_id=self.tokenizer.eos_token_id,
                                  pad_token_id=self.tokenizer.pad_token_id,
                                  share_weights=self.rollout_mode == "sync" and not sharded)
        if self.ref_logprobs:
            self.ref_model = sharded_copy(policy) if sharded else copy.deepcopy(policy).requires_grad_(False).eval()
        if self.rollout_mode == "async" and self._generates:  # a second attach() continues the step count
            self._producer = AsyncProducer(self._generate, self.max_staleness, self.generation.steps_per_batch)
            self._producer.start(self._next_index, version, steps_before=len(self._steps_left))

    @property
    def _generates(self) -> bool:
        """Whether this rank generates (colocated: every rank; disaggregated: rank 0)."""
        return self.placement == "colocated" or self._global_rank == 0

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
        """Call after every optimizer step, on every rank: the generator follows ``policy``'s weights, tagged
        ``version`` (in-process copy, or the server's weight sync). The hand-over's own time is
        ``last_weight_sync_sec`` (in async mode, not the wait for the generation thread before it).

        In async mode this first waits until the background thread has generated the generation batches pinned to
        the weights it holds, so a copy never mixes two versions into one generation and every batch gets its
        pinned version.
        """
        if self.policy is None:
            raise RuntimeError("update_policy() before attach()")
        if version < self._version:
            raise ConfigError(f"policy version {version} must not go back (the policy is at version {self._version}); "
                             "pass the optimizer step count, e.g. trainer.global_step")

        def load() -> None:
            start = time.perf_counter()
            if self._syncs_weights:
                self.generator.update_weights(policy, version)
            self.last_weight_sync_sec = time.perf_counter() - start

        if self._producer is None:
            load()
        else:
            self._producer.publish(version, load)
        self._version = version

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
        """The next whole step, ready to train (advantages and, in async mode, prox log-probs set): what a plain
        training loop takes. (The data module takes :meth:`steps` and prepares each rank's share.)"""
        _, rollouts = self._take_step()
        self.prepare(PrefixTree.from_rollouts(rollouts, validate=False))
        return rollouts

    def next_rollouts(self) -> list[Rollout]:
        """The next generation batch's rollouts on every rank, with advantages over the whole batch, not split (no
        proximal or reference log-probs yet: :meth:`prepare` adds them). Every rank must call it for every
        generation batch (it gathers)."""
        if self.policy is None:
            raise RuntimeError("OnlineRolloutSource has no policy: it must be attached to the model being trained "
                               "before the first step. With Lightning add lightning_dta.rl.OnlineRLCallback to the "
                               "Trainer's callbacks; in a plain loop call source.attach(model) first, and "
                               "source.update_policy(model, version) after every optimizer step")
        requested = time.perf_counter()
        local = None
        if self._generates:
            local = self._generate(self._next_index, self._version) if self._producer is None \
                else self._producer.take(self._next_index)
        shares = self._gather(local)
        waited = time.perf_counter() - requested
        index, version = self._check_shares(shares)
        self._next_index += 1
        staleness = self._version - version  # optimizer steps; max_staleness counts generation batches
        bound = self.max_staleness * self.generation.steps_per_batch if self.rollout_mode == "async" else 0
        if staleness > bound:
            raise RuntimeError(f"generation batch {index} was generated with policy version {version} and would "
                               f"start training at version {self._version}: {staleness} optimizer steps, more than "
                               f"max_staleness={self.max_staleness} generation batches of "
                               f"{self.generation.steps_per_batch} steps. This is a bug in the rollout source")
        episodes = sorted((e for share in shares for e in share.content), key=lambda e: (e.prompt_index, e.sample))
        rollouts = episode_rollouts(episodes, self.advantage_estimator, self.advantage_options)
        if self.placement == "colocated":  # each peer generated its blocks itself (disaggregated: one broadcast)
            check_peers_agree(rollouts, self._peers, f"step {index} of the online source, as each tensor-parallel "
                                                     "peer generated it")
        info = step_info(index, version, self._version, episodes, PrefixTree.from_rollouts(rollouts, validate=False))
        info.generation_sec = local.seconds if local is not None else 0.0
        info.wait_sec, info.requested_at = waited, requested
        self.last_step = info
        self.history.append(info)
        return rollouts

    def prepare(self, tree: PrefixTree | None) -> None:
        """Decoupled PPO (async): ``prox_logprobs`` of the current weights on ``tree``'s rollouts (the loss's
        ``importance_weight_cap`` bounds the weight ``exp(prox - old)``; a generation batch of several steps has
        its own, set at its first step); ``ref_logprobs`` of the frozen reference when ``ref_logprobs`` is on. Adds
        its time to the step's ``prepare_sec``. ``tree=None``: a rank without rollouts in this step (it still joins a
        sharded model's all-gathers)."""
        start = time.perf_counter()
        if self._decoupled and self.generation.is_default:
            with unsharded(self.policy, training=False):
                if tree is not None:
                    fill_logprobs(tree, self.policy, "prox_logprobs", self.engine)
        if self.ref_model is not None:
            with unsharded(self.ref_model, training=False):
                if tree is not None:
                    fill_logprobs(tree, self.ref_model, "ref_logprobs", self.engine)
        if self.last_step is not None:
            self.last_step.prepare_sec += time.perf_counter() - start

    def _gather(self, local: Generated | None) -> list[Generated]:
        """Every generating rank's share of the step (colocated: all-gathered; disaggregated: rank 0's, broadcast)."""
        if self.placement == "colocated":
            return all_gather_objects(local, group=self._group)
        return [broadcast_object(local, src=0)]

    def _check_shares(self, shares: list[Generated]) -> tuple[int, int]:
        indices, versions = {s.index for s in shares}, {s.version for s in shares}
        if indices != {self._next_index} or len(versions) != 1:
            raise RuntimeError(f"the ranks handed over steps {sorted(indices)} generated with policy versions "
                               f"{sorted(versions)} where step {self._next_index} of one version was expected: the "
                               "ranks' rollout sources are out of step (were they attached or updated differently?)")
        return self._next_index, versions.pop()

    def _step_seed(self, index: int) -> int:
        return derive_seed("online-rollouts", self.seed, index)

    def _blocks(self) -> list[range]:
        """This rank's blocks of the step's prompt positions (module docstring)."""
        prompts = self.prompts_per_generation
        if self.placement == "disaggregated":
            return [range(prompts)]
        count = self.generation_blocks or min(self._world_size, prompts)
        edges = [b * prompts // count for b in range(count + 1)]
        return [range(edges[b], edges[b + 1]) for b in range(self._rank, count, self._world_size)]

    def _generate(self, index: int, version: int) -> Generated:
        """Generate this rank's share of step ``index`` (an empty list when it has no block)."""
        start = time.perf_counter()
        first = index * self.prompts_per_generation
        episodes = []
        for block in self._blocks():
            episodes += run_episodes(self.env, self.generator, self.tokenizer, [first + p for p in block],
                                     self.samples_per_prompt, self._step_seed(index), add_bos=self.add_bos,
                                     max_context=self.max_context)
        without_calls = [e for e in episodes if not e.calls]
        if without_calls:  # run_episodes refuses prompts too long for a first call; this cannot happen silently
            raise RuntimeError(f"{len(without_calls)} episode(s) of step {index} made no LLM call")
        return Generated(index, version, episodes, time.perf_counter() - start)
