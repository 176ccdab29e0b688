"""``RolloutDataModule``: rollouts in, one :class:`~lightning_dta.core.batch.StepBatch` per optimizer step out.

Every rank reads the same steps, computes the same advantages over the whole step and the same partition,
and keeps its own share. No ``DistributedSampler`` is involved: a sampler would give each rank different
*steps*, while here every rank must see every step and differ only in its share of the rollouts.

Sources (exactly one):

- ``path``: a JSONL rollout file, cut into consecutive steps of ``rollouts_per_step`` rollouts (``None``: the
  whole file is one step). A last, smaller chunk is kept as a smaller step, not dropped. With an advantage
  estimator, a cut between two rollouts of the same ``group_id`` is refused: the group would be normalised in
  two halves. One epoch is one pass over the steps (in a seeded random order with ``shuffle``).
- ``source``: an iterable that yields one step at a time, each a sequence of :class:`~lightning_dta.Rollout`,
  or a callable returning such an iterable (called once per epoch, so that a fresh pass can start; this is
  where an online rollout generator plugs in, e.g. ``lightning_dta.rl.OnlineRolloutSource``). A plain iterator
  or generator object can be read once: one epoch. Each step is validated when it arrives. A source with a
  ``len`` (a list of steps, an online source) gives the epoch that many steps, and Lightning then does not
  prefetch a step ahead of training.

Resuming. ``state_dict`` records the epoch and how many of its steps were trained; Lightning saves it in the
checkpoint and a resumed run starts at the next step (an iterable source is re-read from the start of the
epoch and the trained steps are skipped). Under a Trainer a step counts as trained when Lightning hands it
to the training step (``on_before_batch_transfer``), so batches that Lightning prefetched but did not train
are not counted; standalone, a step counts as soon as it is yielded.

Device transfer. The datamodule's ``transfer_batch_to_device`` hands a ``StepBatch`` over unchanged: the
tree's token tensors stay in host memory, where the engine indexes them cheaply, and the engine moves each
chunk's data to the model's device itself. (Lightning's default would rebuild the dataclass field by
field.) If the LightningModule overrides the same hook, Lightning uses the datamodule's and warns.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_dta.core.advantages import check_advantage_estimator, estimate_advantages
from lightning_dta.core.balance import CostCalibrator, CostModel, check_partition_method, partition, partition_report
from lightning_dta.core.batch import StepBatch
from lightning_dta.core.rollout import Rollout, RolloutError, read_rollout_lines, validate_rollouts
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine.model_info import model_limits

StepSource = Iterable[Sequence[Rollout]] | Callable[[], Iterable[Sequence[Rollout]]]


def make_step_batch(rollouts: Sequence[Rollout], rank: int, world_size: int, *,
                    advantage_estimator: str | None = None, partition_method: str = "contiguous",
                    cost_model: CostModel | None = None) -> StepBatch:
    """This rank's share of one step: advantages over the whole step, then the partition, then the rank's tree.

    Deterministic: every rank calling it on the same step gets the same partition. The rollouts must already
    be validated (the datamodule validates at its boundary).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    rollouts = estimate_advantages(rollouts, advantage_estimator)
    step_tree = PrefixTree.from_rollouts(rollouts, validate=False)
    cost_model = cost_model or CostModel()
    assignment = partition(step_tree, world_size, partition_method, cost_model)
    report = partition_report(step_tree, assignment, cost_model)
    mine = assignment[rank]
    return StepBatch(tree=step_tree.subset(mine) if mine else None, rank=rank, world_size=world_size,
                     step_stats=step_tree.stats, rank_costs=report.rank_costs,
                     partition_logical_tokens=report.rank_logical_tokens,
                     partition_tree_tokens=report.rank_tree_tokens, rank_features=report.rank_features)


@contextlib.contextmanager
def _located(where: str) -> Iterator[None]:
    """Prefix a RolloutError with the step it comes from: its index counts within that step."""
    try:
        yield
    except RolloutError as error:
        error.args = (f"{where}: {error.args[0]}",)
        raise


def _warn_about_file(path: Path, steps: list[list[Rollout]], size: int, critic_estimates: bool = False) -> None:
    """Warn (once each, with the count) about a file that trains on less than it seems to."""
    rollouts = [rollout for step in steps for rollout in step]
    untrained = sum(1 for rollout in rollouts if not any(rollout.mask()))
    if untrained:
        warnings.warn(f"{untrained} of {len(rollouts)} rollouts in {path} train no token (their loss_mask is all 0): "
                      "they add nothing to the loss", UserWarning, stacklevel=3)
    if len(steps[-1]) < size:
        warnings.warn(f"the last step of {path} has {len(steps[-1])} rollouts, not rollouts_per_step={size}: its "
                      "loss is normalised over fewer rollouts", UserWarning, stacklevel=3)
    flat = [step for step in steps if not any(_has_advantage(rollout) for rollout in step)]
    if flat and not critic_estimates:  # with "gae" the critic writes the advantages in the step
        warnings.warn(f"{len(flat)} of {len(steps)} steps of {path} have every advantage 0: their policy gradient is "
                      "0 (and so is the loss without KL or entropy terms). Fix: set advantage_estimator (e.g. grpo) "
                      "or write advantages into the file", UserWarning, stacklevel=3)


def _has_advantage(rollout: Rollout) -> bool:
    """Whether a trained token of ``rollout`` has a non-zero advantage."""
    mask = rollout.mask()
    if isinstance(rollout.advantages, Sequence):
        return any(value != 0 for value, trained in zip(rollout.advantages, mask) if trained)
    return rollout.advantages != 0 and any(mask)


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
        rollouts_per_step: file sources only: consecutive chunks of this many rollouts form a step.
        advantage_estimator: ``None`` (keep the rollouts' advantages) or a name in ``ADVANTAGE_ESTIMATORS``
            (``"grpo"``, ``"grpo-no-std"``, ``"reinforce-baseline"``), applied to each whole step, or ``"gae"``
            (the rewards pass through and ``DTAModule(critic=...)`` estimates advantages in the step).
        partition_method: ``"contiguous"`` (lexicographic cut, default) or ``"greedy"`` (whole trees, LPT).
        cost_model: the partition's :class:`~lightning_dta.core.balance.CostModel` (its start, when calibrated).
        calibrate_cost_model: fit the cost model to the run's measured DFS time of every rank, every step
            (:meth:`observe_step`, which ``DTAModule`` calls), so the partition learns what this model and
            hardware actually spend on tokens, attention and forward calls.
        shuffle: file sources only: visit the steps in a random order, a new one each epoch.
        seed: the shuffle seed; it must be the same on every rank (all ranks must agree on the step).
        max_steps_per_epoch: stop an epoch after this many steps (``None``: the whole file or source).
        vocab_size, max_positions: the model's limits, checked on every rollout at the boundary (default: taken
            from the model when training starts, see :meth:`connect_model`).
        rank, world_size: override the Trainer's ``global_rank`` / ``world_size`` (tests, custom launchers).
            Without a Trainer and without overrides: rank 0 of 1.
    """

    def __init__(self, path: str | Path | None = None, source: StepSource | None = None,
                 rollouts_per_step: int | None = None, advantage_estimator: str | None = None,
                 partition_method: str = "contiguous", cost_model: CostModel | None = None,
                 calibrate_cost_model: bool = True,
                 shuffle: bool = False, seed: int = 0, max_steps_per_epoch: int | None = None,
                 vocab_size: int | None = None, max_positions: int | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        super().__init__()
        if (path is None) == (source is None):
            raise ValueError("give exactly one of `path` (a JSONL rollout file) and `source` (an iterable of steps)")
        if source is not None and (rollouts_per_step is not None or shuffle):
            raise ValueError("`rollouts_per_step` and `shuffle` apply to a `path` source; an iterable `source` "
                             "yields whole steps in its own order")
        if rollouts_per_step is not None and rollouts_per_step < 1:
            raise ValueError(f"rollouts_per_step={rollouts_per_step} must be >= 1 (or None: one step per file)")
        if max_steps_per_epoch is not None and max_steps_per_epoch < 1:
            raise ValueError(f"max_steps_per_epoch={max_steps_per_epoch} must be >= 1 (or None)")
        check_advantage_estimator(advantage_estimator)
        check_partition_method(partition_method)
        # Plain values only: checkpoints are loaded with torch.load(weights_only=True), which refuses a Path.
        self.save_hyperparameters({
            "path": None if path is None else str(path), "rollouts_per_step": rollouts_per_step,
            "advantage_estimator": advantage_estimator, "partition_method": partition_method,
            "calibrate_cost_model": calibrate_cost_model, "shuffle": shuffle, "seed": seed,
            "max_steps_per_epoch": max_steps_per_epoch, "vocab_size": vocab_size, "max_positions": max_positions})
        self.path = None if path is None else Path(path)
        self.source = source
        self.rollouts_per_step = rollouts_per_step
        self.advantage_estimator = advantage_estimator
        self.partition_method = partition_method
        self.cost_model = cost_model or CostModel()
        self.calibrator = CostCalibrator() if calibrate_cost_model else None
        self.shuffle = shuffle
        self.seed = seed
        self.max_steps_per_epoch = max_steps_per_epoch
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self._rank = rank
        self._world_size = world_size
        self._steps: list[list[Rollout]] | None = None  # file source, loaded in setup()
        self._lines: list[int] = []  # the file's line of each rollout, for errors
        # Progress: the epoch being trained and how many of its steps are done (`finished`: all of them).
        self._epoch = 0
        self._trained = 0
        self._finished = False
        self._epoch_end: int | None = None  # position where the current pass ended (known once it has)
        self._pending: collections.deque[tuple[int, int]] = collections.deque()  # (epoch, position) handed out

    # ------------------------------------------------------------------ rank and data

    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        return self.trainer.global_rank if self.trainer is not None else 0

    @property
    def world_size(self) -> int:
        if self._world_size is not None:
            return self._world_size
        return self.trainer.world_size if self.trainer is not None else 1

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read and validate the file and estimate its advantages (every rank does: each needs every step)."""
        if self.path is None or self._steps is not None:
            return
        rollouts, self._lines = read_rollout_lines(self.path, self.vocab_size, self.max_positions)
        size = self.rollouts_per_step or len(rollouts)
        if self.advantage_estimator is not None:
            for cut in range(size, len(rollouts), size):
                group = rollouts[cut].group_id
                if group is not None and rollouts[cut - 1].group_id == group:
                    raise RolloutError(cut, "group_id", f"group {group!r} is split between steps {cut // size - 1} "
                                       f"and {cut // size} (rollouts_per_step={size}), so its advantages would be "
                                       "estimated in two halves", "make rollouts_per_step a multiple of the "
                                       "group size, or keep each group's rollouts together in the file",
                                       self._location(cut))
        steps = []
        for number, start in enumerate(range(0, len(rollouts), size)):
            step = rollouts[start:start + size]
            try:
                steps.append(estimate_advantages(step, self.advantage_estimator))  # once, and errors surface now
            except RolloutError as fault:  # the index counts within the step: name the file's rollout and line
                index = start + (fault.index or 0)
                raise RolloutError(index, fault.field, f"{fault.problem} (step {number})", fault.fix,
                                   self._location(index)) from None
        self._steps = steps
        _warn_about_file(self.path, steps, size, critic_estimates=self.advantage_estimator == "gae")

    def _location(self, index: int) -> str:
        return f"{self.path}:{self._lines[index]}"

    def connect_model(self, model: nn.Module) -> None:
        """Check rollouts against ``model``'s limits (vocabulary, positions) from now on, where they were not given
        explicitly. ``DTAModule`` calls it when fitting starts, so a config states the limits once: in the model."""
        vocab_size, max_positions = model_limits(model)
        self.vocab_size = self.vocab_size if self.vocab_size is not None else vocab_size
        self.max_positions = self.max_positions if self.max_positions is not None else max_positions
        if self._steps is not None:  # a file already read: check it now, before the first step
            rollouts = [rollout for step in self._steps for rollout in step]
            validate_rollouts(rollouts, self.vocab_size, self.max_positions, source=str(self.path),
                              locations=[self._location(index) for index in range(len(rollouts))])

    @property
    def steps_per_epoch(self) -> int | None:
        """Number of steps in one epoch: ``len(source)`` for a source with a length (a list of steps, an online
        rollout source), ``None`` for other iterable sources (unknown in advance).

        A known length matters beyond progress bars: Lightning prefetches one batch from a loader without a
        length, so an online source would generate step k+1 before step k is trained (one step off policy).
        """
        if self.source is not None:
            if not isinstance(self.source, Sized):
                return None
            steps = len(self.source)
        else:
            self.setup()
            assert self._steps is not None
            steps = len(self._steps)
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

    def _step_rollouts(self, epoch: int) -> Iterator[tuple[str, list[Rollout]]]:
        """The steps of one epoch from its start, each with a label for error messages, validated."""
        if self.source is None:
            assert self._steps is not None
            order = np.arange(len(self._steps))
            if self.shuffle:  # the same permutation on every rank: it depends only on (seed, epoch)
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self._steps))
            yield from ((f"step {i} of {self.path}", self._steps[i]) for i in order)
            return
        steps = self.source() if callable(self.source) else self.source
        for number, step in enumerate(steps):
            if isinstance(step, Rollout):
                raise TypeError("the source yielded a single Rollout; it must yield one sequence of rollouts per "
                                "step (group a flat stream into steps first)")
            step = list(step)
            label = f"step {number} of the source (epoch {epoch})"
            with _located(label):
                validate_rollouts(step, vocab_size=self.vocab_size, max_positions=self.max_positions)
            yield label, step

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
        steps = itertools.islice(self._step_rollouts(epoch), self.max_steps_per_epoch)
        if not self._source_resumes_itself:  # read the epoch again from its start, skipping the trained steps
            steps = itertools.islice(steps, start, None)
        end = start
        estimator = self.advantage_estimator if self.source is not None else None  # a file's are estimated
        for position, (label, rollouts) in enumerate(steps, start=start):
            with _located(label):
                batch = make_step_batch(rollouts, rank, world_size, advantage_estimator=estimator,
                                        partition_method=self.partition_method, cost_model=self.cost_model)
                prepare = getattr(self.source, "prepare_batch", None)
                if callable(prepare):  # e.g. the online source's log-probs on this rank's share only
                    prepare(batch)
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

    @property
    def _source_resumes_itself(self) -> bool:
        """A source with its own state (the online source) continues where it stopped: nothing to skip, and nothing
        generated again just to be skipped."""
        return callable(getattr(self.source, "load_state_dict", None))

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
        """The epoch and the number of its steps already trained (Lightning stores it in checkpoints)."""
        state = {"epoch": self._epoch, "trained_steps": self._trained, "epoch_finished": self._finished,
                 "steps_per_epoch": self.steps_per_epoch, "seed": self.seed,
                 "cost_model": dataclasses.asdict(self.cost_model)}
        if self._source_resumes_itself:
            state["source"] = self.source.state_dict()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume: the next epoch iterated starts at the first step not yet trained."""
        if state_dict.get("steps_per_epoch") != self.steps_per_epoch or state_dict.get("seed") != self.seed:
            warnings.warn(f"resuming RolloutDataModule from a state with steps_per_epoch="
                          f"{state_dict.get('steps_per_epoch')} and seed={state_dict.get('seed')}, but now "
                          f"steps_per_epoch={self.steps_per_epoch} and seed={self.seed}: the steps skipped on "
                          "resume may not be the ones trained before", stacklevel=2)
        self._epoch = int(state_dict["epoch"])
        self._trained = int(state_dict["trained_steps"])
        self._finished = bool(state_dict["epoch_finished"])
        self._pending.clear()
        if "cost_model" in state_dict:
            self.cost_model = CostModel(**state_dict["cost_model"])
        if self._source_resumes_itself and "source" in state_dict:
            self.source.load_state_dict(state_dict["source"])
