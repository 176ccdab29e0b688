"""The step sources ``RolloutDataModule`` reads: a JSONL file (:class:`FileSteps`) and a Python iterable
(:class:`IterableSteps`); online generation (:class:`~lightning_dta.rl.OnlineRolloutSource`) is the third.

Each implements :class:`~lightning_dta.contracts.StepSource`: it hands out whole steps, validated against the
model's limits and with their advantages already estimated, over the WHOLE step (every rank reads every step), so
a group is never normalised in parts. The source is the one owner of advantage estimation (a critic's GAE is the
critic's, in the training step), and it says which estimator it applies (``advantage_estimator``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Any

import numpy as np

from lightning_dta.contracts import ModelLimits
from lightning_dta.core.advantages import check_advantage_estimator, estimate_advantages
from lightning_dta.core.batch import StepBatch
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
    With an advantage estimator, a cut between two rollouts of the same ``group_id`` is refused: the group would be
    normalised in two halves. ``shuffle`` visits the steps in an order drawn from ``(seed, epoch)``: the same on
    every rank.
    """

    def __init__(self, path: str | Path, rollouts_per_step: int | None = None, advantage_estimator: str | None = None,
                 shuffle: bool = False, seed: int = 0, advantage_options: dict[str, Any] | None = None) -> None:
        if rollouts_per_step is not None and rollouts_per_step < 1:
            raise ValueError(f"rollouts_per_step={rollouts_per_step} must be >= 1 (or None: one step per file)")
        check_advantage_estimator(advantage_estimator, advantage_options)
        self.path = Path(path)
        self.rollouts_per_step = rollouts_per_step
        self.advantage_estimator = advantage_estimator
        self.advantage_options = advantage_options
        self.shuffle, self.seed = shuffle, seed
        self._steps: list[list[Rollout]] | None = None
        self._lines: list[int] = []  # the file's line of each rollout, for errors

    def load(self, limits: ModelLimits = ModelLimits()) -> None:  # noqa: B008 (frozen)
        """Read, validate and estimate (once; later calls only re-check the limits, see :meth:`check_limits`)."""
        if self._steps is not None:
            self.check_limits(limits)
            return
        rollouts, self._lines = read_rollout_lines(self.path, limits.vocab_size, limits.max_positions)
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
                # once, and errors surface now
                steps.append(estimate_advantages(step, self.advantage_estimator, self.advantage_options))
            except RolloutError as fault:  # the index counts within the step: name the file's rollout and line
                index = start + (fault.index or 0)
                raise RolloutError(index, fault.field, f"{fault.problem} (step {number})", fault.fix,
                                   self._location(index)) from None
        self._steps = steps
        _warn_about_file(self.path, steps, size, critic_estimates=self.advantage_estimator == "gae")

    def check_limits(self, limits: ModelLimits) -> None:
        """Check the loaded rollouts against ``limits`` (the model's, known once training starts)."""
        rollouts = [rollout for step in self._loaded() for rollout in step]
        validate_rollouts(rollouts, limits.vocab_size, limits.max_positions, source=str(self.path),
                          locations=[self._location(index) for index in range(len(rollouts))])

    def _loaded(self) -> list[list[Rollout]]:
        if self._steps is None:
            self.load()
        assert self._steps is not None
        return self._steps

    def _location(self, index: int) -> str:
        return f"{self.path}:{self._lines[index]}"

    def __len__(self) -> int:
        return len(self._loaded())

    def steps(self, epoch: int, start: int, limits: ModelLimits) -> Iterator[tuple[str, list[Rollout]]]:
        steps = self._loaded()
        order = np.arange(len(steps))
        if self.shuffle:  # the same permutation on every rank: it depends only on (seed, epoch)
            order = np.random.default_rng([self.seed, epoch]).permutation(len(steps))
        for i in order[start:]:
            yield f"step {i} of {self.path}", steps[i]

    def prepare_batch(self, batch: StepBatch) -> None:
        """Nothing to add: the file holds every field."""

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the data module's position and the seed decide the steps."""


class IterableSteps:
    """Steps from a Python iterable: each item one step (a sequence of rollouts), or a callable returning such an
    iterable (called once per epoch, so that a fresh pass can start). A plain iterator or generator can be read
    once: one epoch. Each step is validated and its advantages estimated when it arrives. A resumed run reads the
    epoch again from its start and skips the trained steps."""

    def __init__(self, source: StepIterable, advantage_estimator: str | None = None,
                 advantage_options: dict[str, Any] | None = None) -> None:
        check_advantage_estimator(advantage_estimator, advantage_options)
        self.source = source
        self.advantage_estimator = advantage_estimator
        self.advantage_options = advantage_options

    def __len__(self) -> int:
        if not isinstance(self.source, Sized):  # Lightning's sized_len treats TypeError as "no length"
            raise TypeError("the number of steps of an iterable source is not known in advance")
        return len(self.source)

    def steps(self, epoch: int, start: int, limits: ModelLimits) -> Iterator[tuple[str, list[Rollout]]]:
        steps = self.source() if callable(self.source) else self.source
        for number, step in enumerate(steps):
            label = f"step {number} of the source (epoch {epoch})"
            step = validated_step(step, label, limits)
            if number < start:
                continue
            with located(label):
                yield label, estimate_advantages(step, self.advantage_estimator, self.advantage_options)

    def prepare_batch(self, batch: StepBatch) -> None:
        """Nothing to add."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the epoch is read again and the trained steps skipped."""


def _warn_about_file(path: Path, steps: list[list[Rollout]], size: int, critic_estimates: bool = False) -> None:
    """Warn (once each, with the count) about a file that trains on less than it seems to."""
    rollouts = [rollout for step in steps for rollout in step]
    untrained = sum(1 for rollout in rollouts if not any(rollout.mask()))
    if untrained:
        warnings.warn(f"{untrained} of {len(rollouts)} rollouts in {path} train no token (their loss_mask is all 0): "
                      "they add nothing to the loss", UserWarning, stacklevel=4)
    if len(steps[-1]) < size:
        warnings.warn(f"the last step of {path} has {len(steps[-1])} rollouts, not rollouts_per_step={size}: its "
                      "loss is normalised over fewer rollouts", UserWarning, stacklevel=4)
    flat = [step for step in steps if not any(_has_advantage(rollout) for rollout in step)]
    if flat and not critic_estimates:  # with "gae" the critic writes the advantages in the step
        warnings.warn(f"{len(flat)} of {len(steps)} steps of {path} have every advantage 0: their policy gradient is "
                      "0 (and so is the loss without KL or entropy terms). Fix: set advantage_estimator (e.g. grpo) "
                      "or write advantages into the file", UserWarning, stacklevel=4)


def _has_advantage(rollout: Rollout) -> bool:
    """Whether a trained token of ``rollout`` has a non-zero advantage."""
    mask = rollout.mask()
    if isinstance(rollout.advantages, Sequence):
        return any(value != 0 for value, trained in zip(rollout.advantages, mask) if trained)
    return rollout.advantages != 0 and any(mask)
