"""The gradient of one DFS step over every rank, with no framework: what Lightning, Accelerate and plain loops share.

The order is fixed by exactness, not taste:

1. all-reduce (SUM) every rank's loss normaliser, so each rank divides by the normaliser of the WHOLE step
   and 1 rank and N ranks compute the same gradient (in the same collective: how many rollouts of the step carry
   each field the objective's terms need, ``Objective.step_fields``; a step where none does is refused on every
   rank, rather than trained without that term);
2. one DFS over this rank's trees (``tree_backward``), adding to ``.grad``;
3. sum the gradients over ranks once (flattened buckets; FSDP2: one reduce-scatter per unit), plus the metric sums
   in one small collective (the objective's ``metric_maxima``: the largest over ranks).

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

from lightning_dta.contracts import TENSOR_PARALLEL, Objective, ParallelLayout
from lightning_dta.core.batch import StepBatch
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.losses import PolicyLoss
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.collectives import (
    all_gather_floats,
    all_reduce_sum,
    collective_device,
    mesh_device,
    sum_gradients,
    synchronize,
    world_size,
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
    rank had no tree). ``rank_seconds`` is every data-parallel rank's DFS time (the engine alone, without
    collectives), index = rank: the measured load balance. With tensor parallelism it is each group's slowest
    peer's time, so every rank holds the same list: the partition's calibration (``RolloutDataModule``) must see
    the same numbers on every peer, or the peers' partitions drift apart and they walk different trees.
    ``grad_norm`` is the total norm of the summed gradient before clipping (set by
    :func:`~lightning_dta.lightning.step.dfs_training_step`).
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


def step_totals(tree: PrefixTree | None, loss_fn: Objective, device: torch.device | str = "cpu",
                layout: ParallelLayout | None = None) -> tuple[tuple[float, ...], list[float]]:
    """The step's loss normalisers and, for each of ``loss_fn.step_fields``, the rollouts of the whole step that
    carry it: this rank's counts summed over the data-parallel ranks, in one collective. A rank without a tree adds
    zeros (it asks the objective for the counts of no rollouts)."""
    rollouts = tree.rollouts if tree is not None else []
    carried = [float(sum(1 for rollout in rollouts if getattr(rollout, name) is not None))
               for name in loss_fn.step_fields]
    local = loss_fn.normalizer([]) if tree is None else tree_loss_normalizer(tree, loss_fn)
    totals = all_reduce_sum([*local, *carried], device, group=(layout or ParallelLayout()).data_parallel_group)
    return tuple(totals[:len(local)]), totals[len(local):]


def check_step_fields(loss_fn: Objective, carried: list[float]) -> None:
    """Refuse a step in which no rollout carries a field a term of the loss needs (the same on every rank)."""
    for name, count in zip(loss_fn.step_fields, carried):
        if count == 0:
            raise ConfigError(f"no rollout of this step carries {name}, which a term of {type(loss_fn).__name__} "
                              f"needs (PolicyLoss: kl_coef > 0 needs ref_logprobs): the term would be 0 without a "
                              f"word. Fix: give the rollouts {name} (online: OnlineRolloutSource(ref_logprobs=True)), "
                              "or set the term's weight to 0 (kl_coef=0)")


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
    if group is None and world_size() > 1 and _tensor_parallel(model):
        raise ValueError(
            "the model is tensor-parallel: the peers of a tensor-parallel group walk one tree, so the step's sums "
            "over every rank would count it once per peer (the normaliser doubles, the gradient halves). Fix: "
            "tree_step_backward(..., layout=ParallelLayout(data_parallel_group=mesh['data_parallel'].get_group(), "
            "device_mesh=mesh)), as DTAFSDPStrategy(tensor_parallel_size=...) does")
    device = collective_device(model)
    normalizer, carried = step_totals(tree, loss_fn, device, layout)
    check_step_fields(loss_fn, carried)
    local = None
    seconds = 0.0
    with unsharded(model):  # sharded: one all-gather per unit now, no collective during this rank's own walk
        if tree is not None and tree.stats.num_rollouts > 0:
            synchronize(device)
            start = time.perf_counter()
            local = tree_backward(model, tree, loss_fn, engine=engine, normalizer=normalizer)
            synchronize(device)
            seconds = time.perf_counter() - start
    peers = layout.tensor_parallel_group
    if peers is not None:  # the group's time (its slowest peer's), so that every rank calibrates the same partition
        seconds = max(peer[0] for peer in all_gather_floats([seconds], device, group=peers))
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
    loss, counts = values[0], dict(zip(_COUNTS, values[-len(_COUNTS):]))
    sums = {name: (max if name in loss_fn.metric_maxima else sum)(rank[1 + i] for rank in ranks)
            for i, name in enumerate(names)}
    metrics = {"loss": loss, **loss_fn.metrics(sums), **counts,
               "compression_ratio": counts["logical_tokens"] / max(counts["tree_tokens"], 1.0)}
    return StepOutput(loss=loss, metrics=metrics, normalizer=normalizer, local=local,
                      rank_seconds=[rank[-1] for rank in ranks])


def _tensor_parallel(model: nn.Module) -> bool:
    """Whether ``model``'s weights are DTensors on a mesh with a ``tensor_parallel`` dimension (TP, or FSDP x TP)."""
    return any(local_tensor(p) is not p and TENSOR_PARALLEL in (p.device_mesh.mesh_dim_names or ())
               for p in model.parameters())


def gradient_norm(parameters: Iterable[nn.Parameter], layout: ParallelLayout | None = None) -> float:
    """Total 2-norm of the gradients (in at least float32), the figure clipping compares with ``gradient_clip_val``.

    Sharded gradients (DTensors of FSDP2, tensor parallelism or both) are reduced over their own meshes, by their
    placements: the squares of the local shards are summed over each mesh dimension the gradient is split along, and
    not over a dimension that holds replicas (one tiny all-reduce per mesh dimension and distinct placements, in the
    same order on every rank: every rank calls it). Summing local squares over one group would miscount: a
    tensor-parallel replica once per peer, the tensor-parallel half of a 2-D shard not at all. Plain gradients are
    the same on every rank (summed already) and need none. Not torch's ``clip_grad_norm_``: it stacks the norms of
    every gradient, which fails for DTensors on different meshes (FSDP's 1-D mesh beside FSDP x TP's 2-D one), and it
    computes in the gradients' own dtype (bfloat16 gradients: three digits). ``layout`` is accepted for symmetry with
    the step; the meshes are the gradients' own."""
    del layout
    squares: dict[tuple, torch.Tensor] = {}
    for p in parameters:
        grad = p.grad
        if grad is None:
            continue
        local = local_tensor(grad)
        key = (grad.device_mesh, grad.placements) if local is not grad else None
        # at least float32 (a float64 gradient keeps float64: vector_norm does not narrow)
        square = torch.linalg.vector_norm(local, dtype=torch.promote_types(local.dtype, torch.float32)).square()
        squares[key] = squares[key] + square if key in squares else square
    total = 0.0
    for key, square in squares.items():
        if key is not None:
            mesh, placements = key
            square = square.to(mesh_device(mesh))  # CPU offload: CPU gradients on a CUDA mesh (NCCL)
            for dim, placement in enumerate(placements):
                if not placement.is_replicate():  # split (or pending a sum) along this dimension
                    torch.distributed.all_reduce(square, group=mesh.get_group(dim))
        total += float(square)
    return total ** 0.5


def clip_by_norm(parameters: Iterable[nn.Parameter], max_norm: float, norm: float) -> None:
    """Scale the gradients so that their total norm ``norm`` (:func:`gradient_norm`) is at most ``max_norm``.

    By torch's factor ``min(max_norm / (norm + 1e-6), 1)``, computed from ``norm`` itself: the one figure that is
    logged is the one that clips, in at least float32 (torch's ``clip_grad_norm_`` computes its own norm in the
    gradients' dtype: bfloat16 gradients would be clipped by a three-digit norm, 0.1% off the logged one). The
    factor is a Python number, which multiplies plain tensors and DTensors of any mesh alike (a tensor factor would
    be a plain tensor beside DTensors), in the gradients' compute precision (at least float32)."""
    factor = min(max_norm / (norm + 1e-6), 1.0)
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(factor)
