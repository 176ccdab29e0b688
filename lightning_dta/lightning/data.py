"""``RolloutDataModule``: steps of rollouts in, one :class:`~lightning_dta.core.batch.StepBatch` per optimizer step out.

Every rank reads the same steps, with the same advantages (estimated over the whole step by the source), computes
the same partition, and keeps its own share. No ``DistributedSampler`` is involved: a sampler would give each rank
different *steps*, while here every rank must see every step and differ only in its share of the rollouts.

Where steps come from is a :class:`~lightning_dta.contracts.StepSource` (:mod:`lightning_dta.lightning.sources`):

- ``path``: a JSONL rollout file (:class:`~lightning_dta.lightning.sources.FileSteps`), cut into consecutive steps
  of ``rollouts_per_step`` rollouts, with this module's ``advantage_estimator``, ``shuffle`` and ``seed``;
- ``source``: a step source itself (online RL: ``lightning_dta.rl.OnlineRolloutSource``, which estimates its own
  advantages), or any Python iterable of steps, each a sequence of :class:`~lightning_dta.Rollout`, or a callable
  returning one (:class:`~lightning_dta.lightning.sources.IterableSteps`, with this module's ``advantage_estimator``).
  A source with a ``len`` gives the epoch that many steps, and Lightning then does not prefetch a step ahead of
  training.

Tensor parallelism. The peers of a tensor-parallel group share one data-parallel rank and must walk the same trees
(:mod:`lightning_dta.distributed.peers`): every input of the partition is the same on each of them (the step, the
cost model, and with ``calibrate_cost_model`` the measured times, which the step makes one per group), and each step
they compare a digest of the tree they are about to walk, before any walk of it (the source's log-prob walks
included), and stop where it differs, instead of pairing the collectives inside each layer wrongly.

Resuming. ``state_dict`` records the epoch and how many of its steps were trained, and the source's own state;
Lightning saves it in the checkpoint and a resumed run starts at the next step. Under a Trainer a step counts as
trained when Lightning hands it to the training step (``on_before_batch_transfer``), so batches that Lightning
prefetched but did not train are not counted; standalone, a step counts as soon as it is yielded. The position
counts optimizer steps, also when a generation batch feeds several (``generation``): a run stopped in the middle of
one resumes at its next step, with the same advantages and split.

Device transfer. The datamodule's ``transfer_batch_to_device`` hands a ``StepBatch`` over unchanged: the
tree's token tensors stay in host memory, where the engine indexes them cheaply, and the engine moves each
chunk's data to the model's device itself. (Lightning's default would rebuild the dataclass field by
field.) If the LightningModule overrides the same hook, Lightning uses the datamodule's and warns.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_dta.contracts import ModelLimits, ParallelLayout, StepSource, parallel_layout
from lightning_dta.core.balance import CostCalibrator, CostModel, check_partition_method, partition, partition_report
from lightning_dta.core.batch import StepBatch
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.generation import GenerationBatches
from lightning_dta.core.rollout import Rollout
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.peers import check_peers_agree
from lightning_dta.engine.model_info import model_limits
from lightning_dta.lightning.sources import FileSteps, IterableSteps, StepIterable, located


def make_step_batch(rollouts: Sequence[Rollout], rank: int, world_size: int, *, partition_method: str = "contiguous",
                    cost_model: CostModel | None = None) -> StepBatch:
    """This rank's share of one step: the partition of the whole step, then the rank's tree.

    Deterministic: every rank calling it on the same step gets the same partition. The rollouts must already be
    validated and their advantages estimated over the whole step (the step sources do both).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    step_tree = PrefixTree.from_rollouts(rollouts, validate=False)
    cost_model = cost_model or CostModel()
    assignment = partition(step_tree, world_size, partition_method, cost_model)
    report = partition_report(step_tree, assignment, cost_model)
    mine = assignment[rank]
    return StepBatch(tree=step_tree.subset(mine) if mine else None, rank=rank, world_size=world_size,
                     step_stats=step_tree.stats, rank_costs=report.rank_costs,
                     partition_logical_tokens=report.rank_logical_tokens,
                     partition_tree_tokens=report.rank_tree_tokens, rank_features=report.rank_features)


def _identity(batch: StepBatch) -> StepBatch:
    return batch


class _StepDataset(IterableDataset):
    """One epoch of this rank's step batches; sized when the number of steps is known (file sources)."""

    def __init__(self, datamodule: RolloutDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[StepBatch]:
        return self.datamodule._iterate_epoch()

    def __len__(self) -> int:
        steps = self.datamodule.steps_per_epoch
        if steps is None:  # Lightning's sized_len treats TypeError as "no length"
            raise TypeError("the number of steps of an iterable source is not known in advance")
        return steps


class RolloutDataModule(L.LightningDataModule):
    """Steps of rollouts for DFS tree training, partitioned across data-parallel ranks (see module docstring).

    Args:
        path: JSONL rollout file (one rollout per line).
        source: instead of a file, where steps come from: online RL (in YAML ``class_path:
            lightning_dta.rl.OnlineRolloutSource`` with its ``init_args``; ``--data.source.help
            lightning_dta.rl.OnlineRolloutSource`` lists them), or in Python any iterable of steps (each a sequence
            of rollouts) or a callable returning one.
        rollouts_per_step: file sources only: consecutive chunks of this many rollouts form a step (with
            ``generation``, ``steps_per_generation`` such chunks form a generation batch).
        advantage_estimator: ``None`` (keep the rollouts' advantages) or a name in ``ADVANTAGE_ESTIMATORS``
            (``"grpo"``, ``"grpo-no-std"``, ``"reinforce-baseline"``), applied to each whole step, or ``"gae"``
            (the rewards pass through and ``DTAModule(critic=...)`` estimates advantages in the step).
        advantage_options: the estimator's keyword arguments, e.g. ``{std_unbiased: true, eps: 1.0e-4}`` for
            ``grpo`` (what ``PolicyLoss.from_trl`` and friends return as ``advantage_options``).
        generation: file and iterable sources: :class:`~lightning_dta.core.generation.GenerationBatches`, how many
            optimizer steps (``steps_per_generation``, ``epochs``) one generation batch feeds and how it is split.
            A file's chunk (``rollouts_per_step * steps_per_generation`` rollouts) or an iterable's item is then a
            generation batch, estimated whole and split into steps. The online source takes it itself (in YAML
            ``data.source.init_args.generation``). Default: one step per generation batch.
        partition_method: ``"contiguous"`` (lexicographic cut, default) or ``"greedy"`` (whole trees, LPT).
        cost_model: the partition's :class:`~lightning_dta.core.balance.CostModel` (its start, when calibrated).
        calibrate_cost_model: fit the cost model to the run's measured DFS time of every rank, every step
            (:meth:`observe_step`, which ``DTAModule`` calls), so the partition learns what this model and
            hardware actually spend on tokens, attention and forward calls. Off by default: the split then
            depends on measured times, so the order in which rollouts' gradients are summed does too, and two runs
            (or a run and its resumption) agree to about 1e-7 instead of bitwise (``docs/lightning.md``).
        shuffle: file sources only: visit the steps in a random order, a new one each epoch.
        seed: the shuffle seed (and a shuffled ``generation.split``'s); it must be the same on every rank (all ranks
            must agree on the step).
        max_steps_per_epoch: stop an epoch after this many steps (``None``: the whole file or source).
        vocab_size, max_positions: the model's limits, checked on every rollout at the boundary (default: taken
            from the model when training starts, see :meth:`connect_model`).
        rank, world_size: override the data-parallel rank and size of the strategy (tests, custom launchers).
            Without a Trainer and without overrides: rank 0 of 1.
    """

    def __init__(self, path: str | Path | None = None, source: StepSource | StepIterable | None = None,
                 rollouts_per_step: int | None = None, advantage_estimator: str | None = None,
                 partition_method: str = "contiguous", cost_model: CostModel | None = None,
                 calibrate_cost_model: bool = False,
                 shuffle: bool = False, seed: int = 0, max_steps_per_epoch: int | None = None,
                 vocab_size: int | None = None, max_positions: int | None = None, rank: int | None = None,
                 world_size: int | None = None, advantage_options: dict[str, Any] | None = None,
                 generation: GenerationBatches | None = None) -> None:
        super().__init__()
        if (path is None) == (source is None):
            raise ConfigError("give exactly one of `path` (a JSONL rollout file) and `source` (an iterable of steps)")
        if source is not None and (rollouts_per_step is not None or shuffle):
            raise ConfigError("`rollouts_per_step` and `shuffle` apply to a `path` source; an iterable `source` "
                             "yields whole steps in its own order")
        if max_steps_per_epoch is not None and max_steps_per_epoch < 1:
            raise ConfigError(f"max_steps_per_epoch={max_steps_per_epoch} must be >= 1 (or None)")
        check_partition_method(partition_method)
        if isinstance(source, StepSource) and (advantage_estimator is not None or advantage_options):
            raise ConfigError(f"advantages would be estimated twice: by data.advantage_estimator="
                             f"{advantage_estimator!r} and by the {type(source).__name__} itself "
                             f"({source.advantage_estimator!r}). Fix: set the estimator on the source only (in YAML "
                             "data.source.init_args.advantage_estimator) and leave data.advantage_estimator unset")
        if isinstance(source, StepSource) and generation is not None:
            raise ConfigError(f"data.generation is set, but the {type(source).__name__} makes its own generation "
                              "batches. Fix: set it on the source (in YAML data.source.init_args.generation) and leave "
                              "data.generation unset")
        # Plain values only: checkpoints are loaded with torch.load(weights_only=True), which refuses a Path.
        self.save_hyperparameters({
            "path": None if path is None else str(path), "rollouts_per_step": rollouts_per_step,
            "advantage_estimator": advantage_estimator, "advantage_options": advantage_options,
            "partition_method": partition_method,
            "calibrate_cost_model": calibrate_cost_model, "shuffle": shuffle, "seed": seed,
            "max_steps_per_epoch": max_steps_per_epoch, "vocab_size": vocab_size, "max_positions": max_positions,
            "generation": None if generation is None else GenerationBatches.resolve(generation).to_dict()})
        if path is not None:
            self.source: StepSource = FileSteps(path, rollouts_per_step, advantage_estimator, shuffle, seed,
                                                advantage_options, generation)
        elif isinstance(source, StepSource):
            self.source = source
        else:
            self.source = IterableSteps(source, advantage_estimator, advantage_options, generation, seed)
        self.partition_method = partition_method
        self.cost_model = cost_model or CostModel()
        self.calibrator = CostCalibrator() if calibrate_cost_model else None
        self.seed = seed
        self.max_steps_per_epoch = max_steps_per_epoch
        self.limits = ModelLimits(vocab_size, max_positions)
        self._limits_given = self.limits
        self._rank = rank
        self._world_size = world_size
        # Progress: the epoch being trained and how many of its steps are done (`finished`: all of them).
        self._epoch = 0
        self._trained = 0
        self._finished = False
        self._epoch_end: int | None = None  # position where the current pass ended (known once it has)
        self._pending: collections.deque[tuple[int, int]] = collections.deque()  # (epoch, position) handed out

    # ------------------------------------------------------------------ rank and data

    @property
    def _layout(self) -> ParallelLayout:
        return parallel_layout(self.trainer.strategy) if self.trainer is not None else ParallelLayout()

    @property
    def rank(self) -> int:
        """This rank's place among the ranks that walk different trees (tensor-parallel peers share one)."""
        return self._rank if self._rank is not None else self._layout.data_parallel_rank

    @property
    def world_size(self) -> int:
        """The number of ranks the step is partitioned over: the data-parallel ones."""
        return self._world_size if self._world_size is not None else self._layout.data_parallel_size

    @property
    def advantage_estimator(self) -> str | None:
        """The estimator the source applies (the one place a run states it)."""
        return self.source.advantage_estimator

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read and validate a file and estimate its advantages (every rank does: each needs every step)."""
        if isinstance(self.source, FileSteps):
            self.source.load(self.limits)

    def connect_model(self, model: nn.Module) -> None:
        """Check rollouts against ``model``'s limits (vocabulary, positions) from now on, where they were not given
        explicitly. ``DTAModule`` calls it when fitting starts, so a config states the limits once: in the model."""
        vocab_size, max_positions = model_limits(model)
        given = self._limits_given
        self.limits = ModelLimits(given.vocab_size if given.vocab_size is not None else vocab_size,
                                  given.max_positions if given.max_positions is not None else max_positions)
        if isinstance(self.source, FileSteps):  # a file already read: check it now, before the first step
            self.source.load(self.limits)

    @property
    def steps_per_epoch(self) -> int | None:
        """Number of steps in one epoch: ``len(source)`` for a source with a length (a file, a list of steps, an
        online rollout source), ``None`` for other iterable sources (unknown in advance).

        A known length matters beyond progress bars: Lightning prefetches one batch from a loader without a
        length, so an online source would generate step k+1 before step k is trained (one step off policy).
        """
        try:
            steps = len(self.source)
        except TypeError:
            return None
        return steps if self.max_steps_per_epoch is None else min(steps, self.max_steps_per_epoch)

    @override
    def train_dataloader(self) -> DataLoader:
        """A loader of this rank's ``StepBatch`` objects: no batching, no collation, no worker processes.

        It wraps an ``IterableDataset``, so Lightning never injects a ``DistributedSampler`` (whatever
        ``use_distributed_sampler`` says). Lightning warns that an ``IterableDataset`` has ``__len__`` (it is
        exact here: there are no workers) and that the loader has few workers (building a step is cheap
        next to training it); both warnings are expected.
        """
        self.setup()
        return DataLoader(_StepDataset(self), batch_size=None, collate_fn=_identity, num_workers=0)

    # ------------------------------------------------------------------ iteration

    def _iterate_epoch(self) -> Iterator[StepBatch]:
        """Yield this rank's batches from the first untrained step of the current epoch to its end."""
        known_end = self.steps_per_epoch
        if self._finished or (known_end is not None and self._trained >= known_end):
            self._epoch, self._trained = self._epoch + 1, 0
        epoch, start = self._epoch, self._trained
        self._epoch_end = known_end
        self._update_finished()
        self._pending.clear()
        rank, world_size = self.rank, self.world_size
        peers = self._layout.tensor_parallel_group
        steps = self.source.steps(epoch, start, self.limits)
        if self.max_steps_per_epoch is not None:
            steps = itertools.islice(steps, max(self.max_steps_per_epoch - start, 0))
        end = start
        for position, (label, rollouts) in enumerate(steps, start=start):
            with located(label):
                batch = make_step_batch(rollouts, rank, world_size, partition_method=self.partition_method,
                                        cost_model=self.cost_model)
                check_peers_agree(batch.rollouts, peers, label)  # before any walk of the step (module docstring)
                self.source.prepare_batch(batch)  # e.g. the online source's log-probs on this rank's share only
            end = position + 1
            if self.trainer is None:
                self._trained = end  # standalone: handed out = trained
            else:
                self._pending.append((epoch, position))
            yield batch
        if end == 0:
            raise RuntimeError(f"the source yielded no step in epoch {epoch}. A generator or iterator can be read "
                               "only once: pass a callable that returns a fresh iterable for each epoch, or train "
                               "for one epoch (e.g. Trainer(max_epochs=1))")
        self._epoch_end = end  # now known for an iterable source too
        self._update_finished()

    def _update_finished(self) -> None:
        self._finished = self._epoch_end is not None and self._trained >= self._epoch_end

    def observe_step(self, batch: StepBatch, rank_seconds: Sequence[float]) -> None:
        """Every rank's measured DFS seconds for ``batch`` (the same numbers on every rank): with
        ``calibrate_cost_model`` the cost model is refitted, and the next steps are partitioned with it."""
        if self.calibrator is None or not batch.rank_features:
            return
        self.calibrator.observe(batch.rank_features, rank_seconds)
        fitted = self.calibrator.fit()
        if fitted is not None:
            self.cost_model = fitted

    # ------------------------------------------------------------------ Lightning hooks

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count the step as trained: Lightning hands it to the training step now (prefetched ones wait)."""
        if isinstance(batch, StepBatch) and self._pending:
            epoch, position = self._pending.popleft()
            if epoch == self._epoch:
                self._trained = position + 1
                self._update_finished()
        return batch

    @override
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Leave a ``StepBatch`` on the host: the engine moves each chunk's data to the model's device."""
        if isinstance(batch, StepBatch):
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The epoch and the number of its steps already trained, and the source's state (Lightning stores it in
        checkpoints)."""
        return {"epoch": self._epoch, "trained_steps": self._trained, "epoch_finished": self._finished,
                "steps_per_epoch": self.steps_per_epoch, "seed": self.seed,
                "cost_model": dataclasses.asdict(self.cost_model), "source": self.source.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the next epoch iterated starts at the first step not yet trained."""
        if state_dict.get("steps_per_epoch") != self.steps_per_epoch or state_dict.get("seed") != self.seed:
            warnings.warn(f"resuming RolloutDataModule from a state with steps_per_epoch="
                          f"{state_dict.get('steps_per_epoch')} and seed={state_dict.get('seed')}, but now "
                          f"steps_per_epoch={self.steps_per_epoch} and seed={self.seed}: the steps skipped on "
                          "resume may not be the ones trained before", stacklevel=1)
        self._epoch = int(state_dict["epoch"])
        self._trained = int(state_dict["trained_steps"])
        self._finished = bool(state_dict["epoch_finished"])
        self._pending.clear()
        if "cost_model" in state_dict:
            self.cost_model = CostModel(**state_dict["cost_model"])
        if "source" in state_dict:
            self.source.load_state_dict(state_dict["source"])
