"""One optimizer step of DFS training, reusable by any training loop.

The order is fixed by exactness, not taste:

1. all-reduce (SUM) every rank's loss normaliser, so each rank divides by the normaliser of the WHOLE step
   and 1 rank and N ranks compute the same gradient;
2. one DFS over this rank's trees (``tree_backward``), adding to ``.grad``;
3. sum the gradients over ranks once (flattened buckets), plus the metric sums in one small collective;
4. clip (the norm of the full-step gradient, identical on every rank), then step.

:func:`tree_step_backward` is steps 1-3 with no framework; :func:`dfs_training_step` adds step 4 for a
manual-optimization ``LightningModule`` and is what :class:`~lightning_dta.lightning.module.DTAModule` calls.
:class:`DFSStepMixin` gives an existing ``LightningModule`` the step as a method.

Why ``tree_backward`` and not ``manual_backward`` per node: Lightning's ``manual_backward`` fires the
``on_before_backward``/``on_after_backward`` hooks of the module and of every callback on each call, and a DFS
runs one backward per tree node. The consequence: those two hooks are NOT fired by a DFS step. Use
``on_before_optimizer_step`` (fired once per step by ``optimizer.step()``, after the cross-rank sum and the
clipping) to inspect gradients.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.optim import Optimizer

from lightning_dta.core.batch import StepBatch
from lightning_dta.core.losses import METRIC_SUMS, PolicyLoss, metrics_from_sums
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.collectives import (
    DEFAULT_BUCKET_MB,
    all_gather_floats,
    all_reduce_sum,
    collective_device,
    sum_gradients,
    synchronize,
)
from lightning_dta.distributed.sharding import is_sharded, local_tensor, reduce_gradients, unsharded
from lightning_dta.engine import EngineOptions, TreeBackwardOutput, tree_backward, tree_loss_normalizer
from lightning_dta.engine.diagnosis import nonfinite_rollouts

_COUNTS = ("num_rollouts", "logical_tokens", "tree_tokens")


@dataclass
class StepOutput:
    """What one DFS step did, over ALL ranks (every rank holds the same values).

    ``metrics`` has the step loss, the loss metrics (clip fraction, approx KL, entropy, ...), and the token
    counts: ``logical_tokens`` (every rollout counted in full), ``tree_tokens`` (shared tokens once per rank's
    tree) and their ratio ``compression_ratio``. ``local`` is this rank's own engine output (``None`` when the
    rank had no tree). ``rank_seconds`` is every rank's DFS time (the engine alone, without collectives), index =
    rank: the measured load balance. ``grad_norm`` is the total norm of the summed gradient before clipping (set
    by :func:`dfs_training_step`).
    """

    loss: float
    metrics: dict[str, float]
    normalizer: float
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
    if isinstance(batch, StepBatch) or hasattr(batch, "tree"):
        return batch.tree
    raise TypeError(f"expected a StepBatch, a PrefixTree or None as the step's batch, got {type(batch).__name__}")


def step_normalizer(tree: PrefixTree | None, loss_fn: PolicyLoss, device: torch.device | str = "cpu") -> float:
    """The loss normaliser of the whole step: this rank's share summed over ranks (one collective).

    ``agg="sum"`` has no normaliser (1 on every rank, and not a count), so there is nothing to sum.
    """
    if loss_fn.agg == "sum":
        return 1.0
    local = 0.0 if tree is None else tree_loss_normalizer(tree, loss_fn)
    return all_reduce_sum([local], device)[0]


def tree_step_backward(model: nn.Module, tree: PrefixTree | None, loss_fn: PolicyLoss | None = None, *,
                       engine: EngineOptions | None = None, bucket_mb: float = DEFAULT_BUCKET_MB) -> StepOutput:
    """Add the gradient of the WHOLE step's loss to ``.grad`` on every rank (steps 1-3 above).

    Call it on every rank, also on one with ``tree=None``: it still joins each collective. The gradients
    already in ``.grad`` are summed over ranks too, so zero them first. ``engine``: the
    :class:`~lightning_dta.EngineOptions` of :func:`~lightning_dta.tree_backward`.
    """
    loss_fn = loss_fn or PolicyLoss()
    device = collective_device(model)
    normalizer = step_normalizer(tree, loss_fn, device)
    local = None
    seconds = 0.0
    with unsharded(model):  # sharded: one all-gather per unit now, no collective during this rank's own walk
        if tree is not None and tree.stats.num_rollouts > 0:
            synchronize(device)
            start = time.perf_counter()
            local = tree_backward(model, tree, loss_fn, engine=engine, normalizer=normalizer)
            synchronize(device)
            seconds = time.perf_counter() - start
    values = [0.0] * (1 + len(METRIC_SUMS) + len(_COUNTS))
    if local is not None:
        values = [local.loss] + [local.sums.get(k, 0.0) for k in METRIC_SUMS] + \
            [float(getattr(local.stats, k)) for k in _COUNTS]
    ranks = all_gather_floats([*values, seconds], device)  # one collective: the sums and every rank's time
    if is_sharded(model):
        reduce_gradients(model)  # one reduce-scatter per unit: each rank keeps the SUM of its shard
    else:
        sum_gradients(model.parameters(), bucket_mb=bucket_mb)
    values = [sum(rank[i] for rank in ranks) for i in range(len(values))]  # the same order on every rank
    loss, sums, counts = values[0], dict(zip(METRIC_SUMS, values[1:])), dict(zip(_COUNTS, values[-len(_COUNTS):]))
    metrics = {"loss": loss, **metrics_from_sums(sums), **counts,
               "compression_ratio": counts["logical_tokens"] / max(counts["tree_tokens"], 1.0)}
    return StepOutput(loss=loss, metrics=metrics, normalizer=normalizer, local=local,
                      rank_seconds=[rank[-1] for rank in ranks])


def gradient_norm(parameters: Iterable[nn.Parameter]) -> float:
    """Total 2-norm of the gradients (in float32), the figure clipping compares with ``gradient_clip_val``.

    Sharded gradients (FSDP2 DTensors) hold one shard per rank: their squares are summed over ranks (one
    all-reduce, every rank calls it); replicated gradients are the same on every rank and need none."""
    grads = [p.grad for p in parameters if p.grad is not None]

    def squares(tensors: list[torch.Tensor]) -> float:  # one host sync for the whole list
        norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]
        return float(torch.stack(norms).square().sum()) if norms else 0.0

    sharded = [local_tensor(g) for g in grads if local_tensor(g) is not g]
    replicated = [g for g in grads if local_tensor(g) is g]
    total = all_reduce_sum([squares(sharded)], collective_device(grads[0]))[0] if sharded else 0.0
    return (total + squares(replicated)) ** 0.5


def _lightning_optimizer(module: pl.LightningModule, optimizer: Optimizer | None) -> LightningOptimizer:
    """The ``LightningOptimizer`` to step: its ``step()`` counts ``global_step`` and fires the optimizer hooks."""
    optimizers = module.optimizers()
    candidates = optimizers if isinstance(optimizers, list) else [optimizers]
    if optimizer is None:
        if len(candidates) != 1:
            raise ValueError(f"the module has {len(candidates)} optimizers; pass the one to step as `optimizer=`")
        return candidates[0]
    if isinstance(optimizer, LightningOptimizer):
        return optimizer
    for candidate in candidates:
        if candidate.optimizer is optimizer:
            return candidate
    raise ValueError("`optimizer` is not one of the module's optimizers (configure_optimizers)")


def _check_trainer(trainer: pl.Trainer) -> None:
    """Refuse set-ups whose gradient handling assumes ``manual_backward`` of one loss tensor."""
    strategy = trainer.strategy
    if strategy.model is not None and strategy.model is not strategy.lightning_module:  # a DDP/FSDP1 wrapper
        raise RuntimeError(
            f"{type(strategy).__name__} wrapped the module in {type(strategy.model).__name__}; its gradient hooks "
            "fire on every backward of a DFS step (or, under no_sync, leave some parameters unsynced). Fix: "
            "Trainer(strategy='dta'), which keeps the module unwrapped and sums the gradients once per step.")
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise RuntimeError(
            "precision='16-mixed' scales the loss in manual_backward, which a DFS step does not call, and would "
            "then unscale unscaled gradients. Fix: precision='bf16-mixed' or 'bf16-true' (or '32-true').")


def dfs_training_step(module: pl.LightningModule, batch: StepBatch | PrefixTree | None,
                      loss_fn: PolicyLoss | None = None, optimizer: Optimizer | None = None, *,
                      model: nn.Module | None = None, engine: EngineOptions | None = None,
                      gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm",
                      skip_nonfinite: bool = True) -> StepOutput:
    """One complete optimizer step from a manual-optimization ``LightningModule``'s ``training_step``.

    Zeroes the gradients, runs :func:`tree_step_backward` (normaliser all-reduce, DFS, one gradient sum over
    ranks), clips with ``module.clip_gradients`` (Lightning's own clipping, through the precision plugin) and
    steps the ``LightningOptimizer`` (so ``trainer.global_step`` counts it). Learning-rate schedulers are left
    to the caller, as always in manual optimization. Nothing is logged: the returned :class:`StepOutput`
    holds step-wide metrics, identical on every rank, for the caller to log.

    Args:
        module: the calling ``LightningModule`` (``automatic_optimization = False``), attached to a Trainer.
        batch: this rank's :class:`StepBatch` (or bare ``PrefixTree``; ``None`` = nothing for this rank).
        loss_fn: the policy loss (default ``PolicyLoss()``).
        optimizer: the optimizer to step (default: the module's only optimizer).
        model: the causal LM to train (default ``module.model``).
        engine: the :class:`~lightning_dta.EngineOptions` (default ``EngineOptions()``).
        gradient_clip_val: clip the summed gradient to this norm (or value); ``None``/0 = no clipping.
        gradient_clip_algorithm: ``"norm"`` or ``"value"``, as in Lightning.
        skip_nonfinite: a step whose loss or gradient norm is not finite is not applied (gradients dropped, no
            optimizer step, ``StepOutput.skipped``), on every rank alike; ``nonfinite_rollouts`` names this rank's
            rollouts whose loss terms were not finite.
    """
    model = model if model is not None else getattr(module, "model", None)
    if not isinstance(model, nn.Module):
        raise TypeError("dfs_training_step needs the causal LM: pass `model=` or set `module.model`")
    if module.automatic_optimization:
        raise RuntimeError("dfs_training_step steps the optimizer itself: set `self.automatic_optimization = False`")
    trainer = module.trainer
    _check_trainer(trainer)
    opt = _lightning_optimizer(module, optimizer)
    opt.zero_grad(set_to_none=True)
    bucket_mb = getattr(trainer.strategy, "bucket_mb", DEFAULT_BUCKET_MB)
    tree = batch_tree(batch)
    out = tree_step_backward(model, tree, loss_fn, engine=engine, bucket_mb=bucket_mb)
    out.grad_norm = gradient_norm(model.parameters())
    if skip_nonfinite and not out.finite:
        # Both figures are step-wide (the loss sums every rank's share, the norm is that of the summed gradient),
        # so every rank reaches the same decision without another collective.
        opt.zero_grad(set_to_none=True)
        out.skipped = True
        with unsharded(model, training=False):  # sharded weights: gathered on every rank, then no collective
            if tree is not None:
                out.nonfinite_rollouts = nonfinite_rollouts(model, tree, loss_fn or PolicyLoss(), engine)
        return out
    if gradient_clip_val:
        module.clip_gradients(opt, gradient_clip_val=gradient_clip_val,
                              gradient_clip_algorithm=gradient_clip_algorithm)
    opt.step()
    return out


class DFSStepMixin:
    """Mix into an existing ``LightningModule`` (``class M(DFSStepMixin, LightningModule)``) that trains on trees:
    ``self.dfs_training_step(batch, loss_fn, model=...)`` is :func:`dfs_training_step` for this module.

    Tree batches need no device hook: Lightning's default transfer leaves the tree's host tensors alone, and the
    engine moves each chunk's tokens to the model's device itself.
    """

    def dfs_training_step(self, batch: StepBatch | PrefixTree | None, loss_fn: PolicyLoss | None = None,
                          **kwargs: Any) -> StepOutput:
        """:func:`dfs_training_step` for this module (same keyword arguments)."""
        return dfs_training_step(self, batch, loss_fn, **kwargs)
