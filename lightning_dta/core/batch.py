"""The unit of work handed from the data side to the training side: one optimizer step on one rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_dta.core.balance import TreeFeatures
from lightning_dta.core.generation import GenerationContext
from lightning_dta.core.rollout import Rollout
from lightning_dta.core.tree import PrefixTree, TreeStats


@dataclass
class StepBatch:
    """This rank's share of one optimizer step.

    Every rank builds the same partition from the same step data, so the step-wide figures below are known
    on every rank without communication. ``tree`` (a forest of this rank's rollouts) may be ``None``: that
    rank still joins every collective.
    """

    tree: PrefixTree | None  # this rank's rollouts as one forest (None: nothing for this rank this step)
    rank: int
    world_size: int
    step_stats: TreeStats  # the whole step (all ranks), before partitioning
    rank_costs: list[float] = field(default_factory=list)  # predicted cost of every rank, index = rank
    partition_logical_tokens: list[int] = field(default_factory=list)  # logical tokens of every rank
    partition_tree_tokens: list[int] = field(default_factory=list)  # tree tokens of every rank, after the cut
    rank_features: list[TreeFeatures] = field(default_factory=list)  # what every rank's cost is made of
    generation: GenerationContext | None = None  # the step's place in its generation batch (None: the step is one)

    @property
    def rollouts(self) -> list[Rollout]:
        return [] if self.tree is None else list(self.tree.rollouts)

    @property
    def imbalance(self) -> float:
        """max / mean of the predicted rank costs (1.0 = perfectly balanced)."""
        if not self.rank_costs or sum(self.rank_costs) == 0:
            return 1.0
        return max(self.rank_costs) * len(self.rank_costs) / sum(self.rank_costs)
