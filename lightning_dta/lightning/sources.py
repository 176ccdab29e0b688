"""The step sources ``RolloutDataModule`` reads: a JSONL file (:class:`FileSteps`) and a Python iterable
(:class:`IterableSteps`); online generation (:class:`~lightning_dta.rl.OnlineRolloutSource`) is the third.

Each implements :class:`~lightning_dta.contracts.StepSource`: it hands out whole steps, validated against the
model's limits and with their advantages already estimated, over the WHOLE step (every rank reads every step), so
a group is never normalised in parts. The source is the one owner of advantage estimation (a critic's GAE is the
critic's, in the training step), and it says which estimator it applies (``advantage_estimator``).

With :class:`~lightning_dta.core.generation.GenerationBatches` (``generation``) a unit of the file or the iterable is
a generation batch rather than a step: its advantages are estimated over all of it, then it is split into
``steps_per_generation * epochs`` steps. A position (``start``) counts optimizer steps, so a run resumed in the middle
of a generation batch continues at the same step of the same split, with the same advantages (both are computed
from the data alone). Each step's :class:`~lightning_dta.core.generation.GenerationContext` (set on its
``StepBatch`` by ``prepare_batch``) tells a critic where the step stands in its batch, so that it takes its values and
GAE once over the whole batch, at the batch's first step.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Any

import numpy as np

from lightning_dta.contracts import ModelLimits
from lightning_dta.core.advantages import check_advantage_estimator, estimate_advantages
from lightning_dta.core.batch import StepBatch
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.generation import GenerationBatches, GenerationContext
from lightning_dta.core.rollout import Rollout, RolloutError, read_rollout_lines, validate_rollouts

StepIterable = Iterable[Sequence[Rollout]] | Callable[[], Iterable[Sequence[Rollout]]]


@contextlib.contextmanager
def located(where: str) -> Iterator[None]:
    """Prefix a RolloutError with the step it comes from: its index counts within that step."""
    try:
        yield
    except RolloutError as error:
        error.args = (f"{where}: {error.args[0]}",)
        raise


def validated_step(step: Iterable[Rollout], label: str, limits: ModelLimits) -> list[Rollout]:
    """One step from an iterable, as a list, validated (errors name the step)."""
    if isinstance(step, Rollout):
        raise TypeError("the source yielded a single Rollout; it must yield one sequence of rollouts per step (group "
                        "a flat stream into steps first)")
    step = list(step)
    with located(label):
        validate_rollouts(step, vocab_size=limits.vocab_size, max_positions=limits.max_positions)
    return step


class FileSteps:
    """A JSONL rollout file cut into consecutive steps of ``rollouts_per_step`` rollouts (``None``: one step).

    Read and validated once (:meth:`load`: every faulty line in one error, ``PATH:LINE``), advantages estimated per
    step then, so that errors surface before training. A last, smaller chunk is kept as a smaller step, not dropped.
    With an advantage estimator that uses groups (every one but ``"gae"``), a ``group_id`` whose rollouts fall into
    two steps is refused, with a line of each: the group would be normalised in parts. The file is not reordered
    (training sees its lines in their order); a group's lines need not be adjacent, only within one step.
    ``shuffle`` visits the steps in an order drawn from ``(seed, epoch)``: the same on every rank.

    With ``generation`` (module docstring) the chunks are generation batches of ``rollouts_per_step *
    steps_per_generation`` rollouts (``None``: the whole file): what is said above of a step holds for a generation
    batch (advantages, groups, the last chunk, ``shuffle``'s order), and each is then split into its steps, at load.
    """

    def __init__(self, path: str | Path, rollouts_per_step: int | None = None, advantage_estimator: str | None = None,
                 shuffle: bool = False, seed: int = 0, advantage_options: dict[str, Any] | None = None,
                 generation: GenerationBatches | None = None) -> None:
        if rollouts_per_step is not None and not (isinstance(rollouts_per_step, int) and rollouts_per_step >= 1):
            raise ConfigError(f"data.rollouts_per_step={rollouts_per_step!r}: the rollouts of one optimizer step. Fix: "
                              "an int >= 1 (a multiple of the group size), or null for one step per file")
        check_advantage_estimator(advantage_estimator, advantage_options)
        self.path = Path(path)
        if not self.path.is_file():
            what = "is a directory" if self.path.is_dir() else "does not exist"
            raise ConfigError(f"data.path={str(path)!r} {what}. Fix: the path of a JSONL rollout file (one rollout "
                              "object per line)")
        self.rollouts_per_step = rollouts_per_step
        self.advantage_estimator = advantage_estimator
        self.advantage_options = advantage_options
        self.shuffle, self.seed = shuffle, seed
        self.generation = GenerationBatches.resolve(generation)
        self._batches: list[list[Rollout]] = []  # the generation batches (the steps, by default), estimated
        self._steps: list[list[list[Rollout]]] | None = None  # each generation batch's steps
        self._lines: list[int] = []  # the file's line of each rollout, for errors
        self._context: GenerationContext | None = None  # the step handed out last: its place in its batch

    def load(self, limits: ModelLimits = ModelLimits()) -> None:  # noqa: B008 (frozen)
        """Read, validate and estimate (once; later calls only re-check the limits, see :meth:`check_limits`)."""
        if self._steps is not None:
            self.check_limits(limits)
            return
        rollouts, self._lines = read_rollout_lines(self.path, limits.vocab_size, limits.max_positions)
        per_batch = self.generation.steps_per_generation
        size = self.rollouts_per_step * per_batch if self.rollouts_per_step else len(rollouts)
        unit = "step" if self.generation.is_default else "generation batch"
        if self.advantage_estimator not in (None, "gae"):
            self._check_groups_within_steps(rollouts, size, unit)
        batches = []
        for number, start in enumerate(range(0, len(rollouts), size)):
            batch = rollouts[start:start + size]
            try:
                # once, and errors surface now
                batches.append(estimate_advantages(batch, self.advantage_estimator, self.advantage_options))
            except RolloutError as fault:  # the index counts within the batch: name the file's rollout and line
                index = start + (fault.index or 0)
                raise RolloutError(index, fault.field, f"{fault.problem} ({unit} {number})", fault.fix,
                                   self._location(index)) from None
        self._batches = batches
        self._steps = [self.generation.split_batch(batch, self.seed, number,
                                                   f"{unit} {number} (from {self._location(number * size)})")
                       for number, batch in enumerate(batches)]
        _warn_about_file(self.path, self._lines, batches, size, self.advantage_estimator, unit)

    def _check_groups_within_steps(self, rollouts: list[Rollout], size: int, unit: str) -> None:
        """Refuse a group whose rollouts fall into two steps (or generation batches: ``unit``), naming a line in
        each (class docstring)."""
        first: dict = {}  # group -> index of its first rollout
        what = "rollouts_per_step" if unit == "step" else "rollouts_per_step x steps_per_generation"
        for index, rollout in enumerate(rollouts):
            group = rollout.group_id
            if group is None:
                continue
            start = first.setdefault(group, index)
            if start // size != index // size:
                raise RolloutError(index, "group_id", f"group {group!r} is in {unit} {start // size} (its first "
                                   f"rollout, {self._location(start)}) and in {unit} {index // size} ({what}="
                                   f"{size}), so its advantages would be estimated in parts",
                                   f"keep each group's rollouts within one {unit}: group the file by group_id, with "
                                   "rollouts_per_step a multiple of the group size", self._location(index))

    def check_limits(self, limits: ModelLimits) -> None:
        """Check the loaded rollouts against ``limits`` (the model's, known once training starts)."""
        self._loaded()
        rollouts = [rollout for batch in self._batches for rollout in batch]  # in the file's order
        validate_rollouts(rollouts, limits.vocab_size, limits.max_positions, source=str(self.path),
                          locations=[self._location(index) for index in range(len(rollouts))])

    def _loaded(self) -> list[list[list[Rollout]]]:
        if self._steps is None:
            self.load()
        assert self._steps is not None
        return self._steps

    def _location(self, index: int) -> str:
        return f"{self.path}:{self._lines[index]}"

    def __len__(self) -> int:
        return len(self._loaded()) * self.generation.steps_per_batch

    def steps(self, epoch: int, start: int, limits: ModelLimits) -> Iterator[tuple[str, list[Rollout]]]:
        batches = self._loaded()
        order = np.arange(len(batches))
        if self.shuffle:  # the same permutation on every rank: it depends only on (seed, epoch)
            order = np.random.default_rng([self.seed, epoch]).permutation(len(batches))
        each = self.generation.steps_per_batch
        for position in range(start, len(batches) * each):
            i, k = order[position // each], position % each
            label = f"step {i} of {self.path}" if each == 1 else \
                f"step {k} of generation batch {i} of {self.path}"
            self._context = None if each == 1 else GenerationContext(
                f"generation batch {i} of {self.path}", int(k), tuple(self._batches[i]) if k == 0 else None)
            yield label, batches[i][k]

    def prepare_batch(self, batch: StepBatch) -> None:
        """The step's place in its generation batch (the file holds every other field)."""
        batch.generation = self._context

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "generation": self.generation.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the data module's position, the seed and ``generation`` decide the steps (a checkpoint
        of other generation batches is refused)."""
        check_same_generation(state, self.generation)


class IterableSteps:
    """Steps from a Python iterable: each item one step (a sequence of rollouts), or a callable returning such an
    iterable (called once per epoch, so that a fresh pass can start). A plain iterator or generator can be read
    once: one epoch. Each step is validated and its advantages estimated when it arrives. A resumed run reads the
    epoch again from its start and skips the trained steps.

    With ``generation`` each item is a generation batch, estimated whole and split into its steps (the shuffled
    split seeded by ``seed`` and the item's index)."""

    def __init__(self, source: StepIterable, advantage_estimator: str | None = None,
                 advantage_options: dict[str, Any] | None = None, generation: GenerationBatches | None = None,
                 seed: int = 0) -> None:
        check_advantage_estimator(advantage_estimator, advantage_options)
        self.source = source
        self.advantage_estimator = advantage_estimator
        self.advantage_options = advantage_options
        self.generation = GenerationBatches.resolve(generation)
        self.seed = seed
        self._context: GenerationContext | None = None  # the step handed out last: its place in its batch

    def __len__(self) -> int:
        if not isinstance(self.source, Sized):  # Lightning's sized_len treats TypeError as "no length"
            raise TypeError("the number of steps of an iterable source is not known in advance")
        return len(self.source) * self.generation.steps_per_batch

    def steps(self, epoch: int, start: int, limits: ModelLimits) -> Iterator[tuple[str, list[Rollout]]]:
        batches = self.source() if callable(self.source) else self.source
        each = self.generation.steps_per_batch
        for number, batch in enumerate(batches):
            label = f"step {number} of the source (epoch {epoch})" if each == 1 else \
                f"generation batch {number} of the source (epoch {epoch})"
            batch = validated_step(batch, label, limits)
            if (number + 1) * each <= start:
                continue
            with located(label):
                batch = estimate_advantages(batch, self.advantage_estimator, self.advantage_options)
            steps = self.generation.split_batch(batch, self.seed, number, label)
            for k in range(max(start - number * each, 0), each):
                self._context = None if each == 1 else GenerationContext(label, k, tuple(batch) if k == 0 else None)
                yield (label if each == 1 else f"step {k} of {label}"), steps[k]

    def prepare_batch(self, batch: StepBatch) -> None:
        """The step's place in its generation batch."""
        batch.generation = self._context

    def state_dict(self) -> dict[str, Any]:
        return {"generation": self.generation.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the epoch is read again and the trained steps skipped (a checkpoint of other
        generation batches is refused)."""
        check_same_generation(state, self.generation)


def check_same_generation(state: dict[str, Any], generation: GenerationBatches) -> None:
    """Refuse to resume a checkpoint whose generation batches were split otherwise: its position counts other steps.
    (A checkpoint from before the option had the default.)"""
    saved = state.get("generation", GenerationBatches().to_dict())
    if saved != generation.to_dict():
        raise ConfigError(f"the checkpoint's source split its generation batches as {saved}, this one as "
                          f"{generation.to_dict()}: the resumed run would skip to another step. Fix: resume with the "
                          "same generation settings")


def _warn_about_file(path: Path, lines: list[int], steps: list[list[Rollout]], size: int,
                     estimator: str | None, unit: str = "step") -> None:
    """Warn (once each, with the count) about a file that trains on less than it seems to. The warnings point at
    the rollout file and the line of the first rollout concerned (not at the code that happened to read it).
    ``steps`` are the file's chunks: its steps, or its generation batches (``unit``)."""

    def warn(index: int, message: str) -> None:
        warnings.warn_explicit(message, UserWarning, filename=str(path), lineno=lines[index])

    rollouts = [rollout for step in steps for rollout in step]
    untrained = [i for i, rollout in enumerate(rollouts) if not any(rollout.mask())]
    if untrained:
        warn(untrained[0], f"{len(untrained)} of {len(rollouts)} rollouts in {path} train no token (their loss_mask "
             "is all 0): they add nothing to the loss")
    if len(steps[-1]) < size:
        what = "rollouts_per_step" if unit == "step" else "rollouts_per_step x steps_per_generation"
        warn(len(rollouts) - len(steps[-1]), f"the last {unit} of {path} has {len(steps[-1])} rollouts, not "
             f"{what}={size}: its loss is normalised over fewer rollouts")
    if estimator not in (None, "gae"):
        members = collections.Counter(rollout.group_id for rollout in rollouts if rollout.group_id is not None)
        alone = [i for i, rollout in enumerate(rollouts) if members.get(rollout.group_id) == 1]
        if alone:
            warn(alone[0], f"{len(alone)} group(s) of {path} have a single rollout (the first: group "
                 f"{rollouts[alone[0]].group_id!r}): with advantage_estimator={estimator!r} a rollout alone in its "
                 "group has no baseline but itself, so its advantage is 0. Fix: several rollouts per group_id")
    flat = [number for number, step in enumerate(steps) if not any(_has_advantage(rollout) for rollout in step)]
    if flat and estimator != "gae":  # with "gae" the critic writes the advantages in the step
        first = sum(len(step) for step in steps[:flat[0]])
        if estimator:
            why = f"after advantage_estimator={estimator!r} (each of their groups has one rollout or equal rewards)"
            fix = "groups of several rollouts with different rewards"
        else:
            why, fix = "(no advantage_estimator is set)", "set advantage_estimator (e.g. grpo) or write advantages"
        warn(first, f"{len(flat)} of {len(steps)} {unit}s of {path} have every advantage 0 {why}: their policy "
             f"gradient is 0 (and so is the loss without KL or entropy terms). Fix: {fix}")


def _has_advantage(rollout: Rollout) -> bool:
    """Whether a trained token of ``rollout`` has a non-zero advantage."""
    mask = rollout.mask()
    if isinstance(rollout.advantages, Sequence):
        return any(value != 0 for value, trained in zip(rollout.advantages, mask) if trained)
    return rollout.advantages != 0 and any(mask)
