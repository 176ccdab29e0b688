"""The gradient of one DFS step over every rank, with no framework: what Lightning, Accelerate and plain loops share.

The order is fixed by exactness, not taste:

1. all-reduce (SUM) every rank's loss normaliser, so each rank divides by the normaliser of the WHOLE step
   and 1 rank and N ranks compute the same gradient;
2. one DFS over this rank's trees (``tree_backward``), adding to ``.grad``;
3. sum the gradients over ranks once (flattened buckets; FSDP2: one reduce-scatter per unit), plus the metric sums
   in one small collective.

Clipping and the optimizer step are the caller's (:func:`lightning_dta.lightning.step.dfs_training_step` for a
manual-optimization ``LightningModule``, :func:`lightning_dta.accelerate.accelerate_tree_backward` for Accelerate).
The sums run over the data-parallel group of the :class:`~lightning_dta.contracts.ParallelLayout` the caller hands
in (default: every rank).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_dta.contracts import Objective, ParallelLayout
from lightning_dta.core.batch import StepBatch
from lightning_dta.core.losses import PolicyLoss
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.collectives import (
    all_gather_floats,
    all_reduce_sum,
    collective_device,
    sum_gradients,
    synchronize,
)
from lightning_dta.distributed.sharding import is_sharded, local_tensor, reduce_gradients, unsharded
from lightning_dta.engine import TreeBackwardOutput, tree_backward, tree_loss_normalizer
from lightning_dta.engine.options import EngineOptions

_COUNTS = ("num_rollouts", "logical_tokens", "tree_tokens")


@dataclass
class StepOutput:
    """What one DFS step did, over ALL ranks (every rank holds the same values).

    ``metrics`` has the step loss, the loss metrics (clip fraction, approx KL, entropy, ...), and the token
    counts: ``logical_tokens`` (every rollout counted in full), ``tree_tokens`` (shared tokens once per rank's
    tree) and their ratio ``compression_ratio``. ``local`` is this rank's own engine output (``None`` when the
    rank had no tree). ``rank_seconds`` is every rank's DFS time (the engine alone, without collectives), index =
    rank: the measured load balance. ``grad_norm`` is the total norm of the summed gradient before clipping (set
    by :func:`~lightning_dta.lightning.step.dfs_training_step`).
    """

    loss: float
    metrics: dict[str, float]
    normalizer: tuple[float, ...]
    local: TreeBackwardOutput | None = field(default=None, repr=False)
    rank_seconds: list[float] = field(default_factory=list)
    grad_norm: float | None = None
    skipped: bool = False  # the loss or the gradient norm was not finite: no optimizer step (every rank alike)
    nonfinite_rollouts: list[int] = field(default_factory=list)  # this rank's tree: rollouts with non-finite terms

    @property
    def finite(self) -> bool:
        """Whether the step's loss and gradient norm are finite (both step-wide: every rank sees the same)."""
        return math.isfinite(self.loss) and (self.grad_norm is None or math.isfinite(self.grad_norm))


def batch_tree(batch: StepBatch | PrefixTree | None) -> PrefixTree | None:
    """This rank's tree from a :class:`StepBatch`, a bare :class:`PrefixTree`, or ``None`` (nothing this step)."""
    if batch is None or isinstance(batch, PrefixTree):
        return batch
    if isinstance(batch, StepBatch):
        return batch.tree
    raise TypeError(f"expected a StepBatch, a PrefixTree or None as the step's batch, got {type(batch).__name__}")


def step_normalizer(tree: PrefixTree | None, loss_fn: Objective, device: torch.device | str = "cpu",
                    layout: ParallelLayout | None = None) -> tuple[float, ...]:
    """The loss normalisers of the whole step: this rank's counts summed elementwise over the data-parallel ranks
    (one collective). A rank without a tree adds zeros (it asks the objective for the counts of no rollouts)."""
    local = loss_fn.normalizer([]) if tree is None else tree_loss_normalizer(tree, loss_fn)
    return tuple(all_reduce_sum(list(local), device, group=(layout or ParallelLayout()).data_parallel_group))


def tree_step_backward(model: nn.Module, tree: PrefixTree | None, loss_fn: Objective | None = None, *,
                       engine: EngineOptions | None = None, layout: ParallelLayout | None = None) -> StepOutput:
    """Add the gradient of the WHOLE step's loss to ``.grad`` on every rank (steps 1-3 above).

    Call it on every rank, also on one with ``tree=None``: it still joins each collective. The gradients
    already in ``.grad`` are summed over ranks too, so zero them first. ``loss_fn``: any objective (default
    ``PolicyLoss()``, the plain policy gradient); ``engine``: the :class:`~lightning_dta.EngineOptions` of
    :func:`~lightning_dta.tree_backward`; ``layout``: the ranks' layout (default: every rank walks its own tree).
    """
    loss_fn = loss_fn or PolicyLoss()
    layout = layout or ParallelLayout()
    group = layout.data_parallel_group
    device = collective_device(model)
    normalizer = step_normalizer(tree, loss_fn, device, layout)
    local = None
    seconds = 0.0
    with unsharded(model):  # sharded: one all-gather per unit now, no collective during this rank's own walk
        if tree is not None and tree.stats.num_rollouts > 0:
            synchronize(device)
            start = time.perf_counter()
            local = tree_backward(model, tree, loss_fn, engine=engine, normalizer=normalizer)
            synchronize(device)
            seconds = time.perf_counter() - start
    names = loss_fn.metric_sums
    values = [0.0] * (1 + len(names) + len(_COUNTS))
    if local is not None:
        values = [local.loss] + [local.sums.get(k, 0.0) for k in names] + \
            [float(getattr(local.stats, k)) for k in _COUNTS]
    ranks = all_gather_floats([*values, seconds], device, group=group)  # one collective: sums and every rank's time
    if is_sharded(model):
        reduce_gradients(model)  # one reduce-scatter per unit: each rank keeps the SUM of its shard
    else:
        sum_gradients(model.parameters(), bucket_mb=layout.bucket_mb, group=group)
    values = [sum(rank[i] for rank in ranks) for i in range(len(values))]  # the same order on every rank
    loss, sums, counts = values[0], dict(zip(names, values[1:])), dict(zip(_COUNTS, values[-len(_COUNTS):]))
    metrics = {"loss": loss, **loss_fn.metrics(sums), **counts,
               "compression_ratio": counts["logical_tokens"] / max(counts["tree_tokens"], 1.0)}
    return StepOutput(loss=loss, metrics=metrics, normalizer=normalizer, local=local,
                      rank_seconds=[rank[-1] for rank in ranks])


def gradient_norm(parameters: Iterable[nn.Parameter], layout: ParallelLayout | None = None) -> float:
    """Total 2-norm of the gradients (in float32, or float64 for float64 gradients), the figure clipping compares
    with ``gradient_clip_val``.

    Sharded gradients (FSDP2 DTensors) hold one shard per rank: their squares are summed over ranks (one
    all-reduce, every rank calls it); replicated gradients are the same on every rank and need none."""
    grads = [p.grad for p in parameters if p.grad is not None]

    def squares(tensors: list[torch.Tensor]) -> float:  # one host sync for the whole list
        # float32 at least (bf16 gradients are summed in float32); a float64 gradient keeps its precision
        norms = [torch.linalg.vector_norm(t, dtype=torch.promote_types(t.dtype, torch.float32)) for t in tensors]
        return float(torch.stack(norms).square().sum()) if norms else 0.0

    sharded = [local_tensor(g) for g in grads if local_tensor(g) is not g]
    replicated = [g for g in grads if local_tensor(g) is g]
    total = all_reduce_sum([squares(sharded)], collective_device(grads[0]),
                           group=(layout or ParallelLayout()).data_parallel_group)[0] if sharded else 0.0
    return (total + squares(replicated)) ** 0.5
