"""Generation batches: one round of generation feeds several optimizer steps (PPO's mini-batches and epochs).

Every RL trainer users come from lets one generation batch feed several optimizer steps (TRL's
``steps_per_generation`` and ``num_iterations``, verl's ``ppo_mini_batch_size`` and ``ppo_epochs``, AReaL's
``ppo_n_minibatches``): from the second step on the policy has moved away from the one that generated the rollouts,
which is where PPO's ratio and clip do their work. Those trainers estimate rewards and advantages (group
normalisation, a batch-wide std) ONCE over the whole generation batch and only then split it; estimating per step
instead normalises over a different set of rollouts and silently changes the advantages. So a source here estimates
over the generation batch and then asks :meth:`GenerationBatches.split` for its steps.

The default split keeps the tree: a step holds whole groups (every rollout sharing a ``group_id``: a prompt's samples
and each call of their multi-turn episodes), so each step's prefix tree keeps the sharing a group brings. It depends
only on the batch (and, shuffled, on the seed and the batch's index), never on a rank: N ranks split as 1 rank does.

What the training side computes once per generation batch, with the weights before the batch's first update (a
critic's values and GAE over the whole batch, :class:`~lightning_dta.PPOCritic`), it learns from the step's
:class:`GenerationContext`: the source tells each step where it stands in its batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from lightning_dta.core.errors import ConfigError
from lightning_dta.core.rollout import Rollout

Split = Literal["groups", "shuffled"]


@dataclass(frozen=True)
class GenerationBatches:
    """How one generation batch becomes optimizer steps. The defaults (one step, one pass) train each generation
    batch as one step: the behaviour before this option existed, bitwise."""

    steps_per_generation: int = 1
    """Optimizer steps one generation batch is split into (TRL ``steps_per_generation``, verl ``train_batch_size /
    ppo_mini_batch_size``, AReaL ``ppo_n_minibatches``). A generation batch holds this many steps' rollouts (a file
    source: ``rollouts_per_step`` x this; the online source: ``prompts_per_step`` x this prompts); its advantages are
    estimated once over all of them, before the split."""

    epochs: int = 1
    """Passes over the generation batch (TRL ``num_iterations``, verl ``ppo_epochs``): each pass trains the same steps
    in the same order, so one generation batch feeds ``steps_per_generation * epochs`` optimizer steps."""

    split: Split = "groups"
    """"groups": each step holds whole groups (rollouts sharing a ``group_id``), consecutive in the batch's order,
    cut where the steps' rollout counts come closest to equal (exactly equal when the groups allow it, e.g. groups of
    one size), so each step's prefix tree keeps its sharing; a batch with fewer groups than steps is refused.
    "shuffled" (TRL's way): the rollouts are permuted (seeded by the source's seed and
    the generation batch's index, the same on every rank) and cut into equal steps; groups are broken up and the
    steps' compression ratio (``compression_ratio`` in the step metrics) drops."""

    def __post_init__(self) -> None:
        for name, counts in (("steps_per_generation", "optimizer steps per generation batch"),
                             ("epochs", "passes over each generation batch")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"generation.{name}={value!r}: it counts {counts}. "
                                  "Fix: an int >= 1 (1: as without the option)")
        if self.split not in ("groups", "shuffled"):
            raise ConfigError(f"generation.split={self.split!r}. Fix: 'groups' (whole groups per step, the tree keeps "
                              "its sharing) or 'shuffled' (rollouts permuted across steps, as TRL does)")

    @classmethod
    def resolve(cls, generation: GenerationBatches | Mapping[str, Any] | None) -> GenerationBatches:
        """``generation``, a mapping of its fields (Python callers, a checkpoint's hyper-parameters) or ``None`` (the
        default: one step per generation batch)."""
        if generation is None:
            return cls()
        if isinstance(generation, Mapping):
            unknown = sorted(set(generation) - {field.name for field in dataclasses.fields(cls)})
            if unknown:
                raise ConfigError(f"generation has no option {unknown}. Fix: steps_per_generation, epochs, split")
            return cls(**generation)
        if not isinstance(generation, cls):
            raise ConfigError(f"generation={generation!r}. Fix: a GenerationBatches, a mapping of its fields, or null")
        return generation

    @property
    def steps_per_batch(self) -> int:
        """The optimizer steps one generation batch feeds, all passes together."""
        return self.steps_per_generation * self.epochs

    @property
    def is_default(self) -> bool:
        """One step per generation batch: the batch is the step."""
        return self.steps_per_batch == 1

    def split_batch(self, rollouts: Sequence[Rollout], seed: int, index: int, label: str) -> list[list[Rollout]]:
        """The ``steps_per_batch`` steps of one generation batch, in training order (the passes one after the other).

        ``rollouts`` already carry the advantages estimated over the whole batch; ``index`` numbers the batch in its
        source (with ``seed``, it draws a shuffled split); ``label`` names the batch in errors.
        """
        if self.is_default:
            return [list(rollouts)]
        count = self.steps_per_generation
        if self.split == "shuffled":
            if len(rollouts) % count:
                raise ConfigError(f"{label}: its {len(rollouts)} rollouts cannot be cut into steps_per_generation="
                                  f"{count} equal steps. Fix: a generation batch of a multiple of {count} rollouts")
            order = np.random.default_rng([seed, index]).permutation(len(rollouts))
            size = len(rollouts) // count
            parts = [sorted(int(i) for i in order[k * size:(k + 1) * size]) for k in range(count)]
        else:
            units = _groups(rollouts)
            if len(units) < count:
                raise ConfigError(f"{label}: its {len(units)} groups (rollouts sharing a group_id; a rollout without "
                                  f"one is a group alone) cannot fill steps_per_generation={count} steps of whole "
                                  f"groups. Fix: at least {count} groups per generation batch (more prompts or "
                                  "rollouts per step), fewer steps_per_generation, or generation.split: shuffled")
            edges = _cuts([len(unit) for unit in units], count)
            parts = [sorted(i for unit in units[a:b] for i in unit) for a, b in zip(edges, edges[1:])]
        steps = [[rollouts[i] for i in part] for part in parts]
        return [step for _ in range(self.epochs) for step in steps]

    def to_dict(self) -> dict:
        """The fields as plain data (for checkpoints and hyperparameters)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class GenerationContext:
    """Where a step stands in its generation batch (a source of several steps per batch hands it with each step,
    :attr:`~lightning_dta.core.batch.StepBatch.generation`): what a training-side estimate made ONCE per batch, before
    its first update, needs to know."""

    label: str
    """names the batch in errors."""

    position: int
    """the step's place among the batch's ``steps_per_batch`` steps (0: the first, trained before any update on the
    batch; the passes follow one another)."""

    batch: tuple[Rollout, ...] | None = None
    """at the first step (``position == 0``): the whole generation batch, its advantages estimated, the same on every
    rank; ``None`` at the later steps (their estimates were made at the first; a source resumed in the middle of a
    batch no longer holds the rollouts already trained)."""


def _cuts(sizes: list[int], count: int) -> list[int]:
    """Group indices ``0 = e_0 < e_1 < ... < e_count = len(sizes)`` that cut the groups into ``count`` non-empty runs
    whose rollout counts come closest to equal: ``e_k`` is the boundary whose cumulative count is nearest ``k / count``
    of the total (the earlier one on a tie), leaving a group for each later run. Exact integers: no rounding."""
    total, edges = sum(sizes), [0]
    cumulative = [sum(sizes[:b]) for b in range(len(sizes) + 1)]
    for k in range(1, count):
        candidates = range(edges[-1] + 1, len(sizes) - (count - k) + 1)
        edges.append(min(candidates, key=lambda b: abs(count * cumulative[b] - k * total)))
    return [*edges, len(sizes)]


def _groups(rollouts: Sequence[Rollout]) -> list[list[int]]:
    """The rollouts' indices by group, groups in the order of their first rollout (no group_id: a group alone)."""
    groups: dict[Hashable, list[int]] = {}
    for index, rollout in enumerate(rollouts):
        key = ("alone", index) if rollout.group_id is None else ("group", rollout.group_id)
        groups.setdefault(key, []).append(index)
    return list(groups.values())
