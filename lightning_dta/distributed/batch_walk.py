"""A forward-only walk over a whole generation batch, shared out over the data-parallel ranks and gathered.

What is computed once per generation batch from a model (a critic's values for GAE, decoupled PPO's proximal
log-probs) is needed later by whichever rank trains each rollout in each of the batch's steps, and the steps are
partitioned anew each step. So every rank walks a contiguous share of the batch's tree (the partition of
:func:`~lightning_dta.core.balance.partition`, a function of the batch alone) and the per-rollout results are
all-gathered: every rank ends with the whole batch's, the work is not repeated on every rank, and N ranks hold what
1 rank computes (up to the rounding of walking other trees).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from lightning_dta.core.balance import partition
from lightning_dta.core.rollout import Rollout
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.collectives import all_gather_objects, rank, world_size

Walk = Callable[[PrefixTree], list[torch.Tensor]]


def walk_batch(rollouts: Sequence[Rollout], walk: Walk, group: dist.ProcessGroup | None = None) -> list[list[float]]:
    """``walk`` (one 1-D tensor per rollout of the tree it is given, e.g. ``tree_values`` or ``tree_logprobs``) of
    every rollout of ``rollouts``, in their order, as float64 lists: this rank walks its share and the shares are
    gathered over ``group``. Every rank of the group calls it with the same rollouts (a rank without a share still
    joins the gather)."""
    if not rollouts:
        return []
    tree = PrefixTree.from_rollouts(rollouts, validate=False)
    share = partition(tree, world_size(group))[rank(group)]
    local = [] if not share else [values.double().cpu().tolist() for values in walk(tree.subset(share))]
    out: list[list[float] | None] = [None] * len(rollouts)
    for indices, results in all_gather_objects((share, local), group=group):
        for index, values in zip(indices, results):
            out[index] = values
    return out
