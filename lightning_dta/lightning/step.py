"""One optimizer step of DFS training from a manual-optimization ``LightningModule``.

:func:`dfs_training_step` is the framework-free gradient of the step
(:func:`lightning_dta.distributed.step.tree_step_backward`: the loss-normaliser all-reduce, the DFS, one gradient sum
over the data-parallel ranks) plus what Lightning adds: clipping (by norm: by the step's one gradient norm, the
logged one; by value: through the precision plugin) and the ``LightningOptimizer`` step that counts
``global_step``. It is what :class:`~lightning_dta.lightning.module.DTAModule` calls; :class:`DFSStepMixin` gives
an existing ``LightningModule`` the step as a method. The ranks' layout (the data-parallel group, the bucket size)
comes from the strategy's :class:`~lightning_dta.contracts.ParallelLayout`.

Why ``tree_backward`` and not ``manual_backward`` per node: Lightning's ``manual_backward`` fires the
``on_before_backward``/``on_after_backward`` hooks of the module and of every callback on each call, and a DFS
runs one backward per tree node. The consequence: those two hooks are NOT fired by a DFS step. Use
``on_before_optimizer_step`` (fired once per step by ``optimizer.step()``, after the cross-rank sum and the
clipping) to inspect gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import Strategy
from torch import nn
from torch.optim import Optimizer

from lightning_dta.contracts import Objective, parallel_layout
from lightning_dta.core.batch import StepBatch
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.losses import PolicyLoss
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.sharding import unsharded
from lightning_dta.distributed.step import StepOutput, batch_tree, clip_by_norm, gradient_norm, tree_step_backward
from lightning_dta.engine.diagnosis import nonfinite_rollouts
from lightning_dta.engine.options import EngineOptions


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


def check_clipping(gradient_clip_val: float | None, gradient_clip_algorithm: str, where: str = "model") -> None:
    """Clipping settings: a norm or value >= 0 (0 and ``None``: no clipping) and ``"norm"`` or ``"value"``. A negative
    value would be skipped by Lightning's clipping and would flip the sign of gradients in torch's
    ``clip_grad_norm_``."""
    if gradient_clip_val is not None and not (isinstance(gradient_clip_val, (int, float))
                                              and math.isfinite(gradient_clip_val) and gradient_clip_val >= 0):
        raise ConfigError(f"{where}.gradient_clip_val={gradient_clip_val!r}: the largest gradient norm (or value) "
                          "after clipping. Fix: a number > 0, or 0/null for no clipping")
    if gradient_clip_algorithm not in ("norm", "value"):
        raise ConfigError(f"{where}.gradient_clip_algorithm={gradient_clip_algorithm!r} is unknown. Fix: 'norm' (the "
                          "total 2-norm, the default) or 'value' (each entry)")


def build_optimizer(factory: Callable[[Iterable[torch.nn.Parameter]], Optimizer],
                    parameters: Iterable[torch.nn.Parameter], where: str) -> Optimizer:
    """``factory(parameters)``, its settings checked: the optimizer's own refusal (a ``ValueError``: "Invalid
    learning rate: -1.0") and a learning rate that is negative or not finite (which some optimizers accept) are a
    :class:`ConfigError` naming ``where`` (the setting, e.g. ``model.optimizer``)."""
    try:
        optimizer = factory(parameters)
    except ValueError as error:
        raise ConfigError(f"{where} refuses its settings: {error}. Fix: the optimizer's init_args within their "
                          "ranges (a learning rate >= 0, betas in [0, 1), ...)") from error
    for group in optimizer.param_groups:
        lr = group.get("lr")
        lr = float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None
        if lr is not None and not (math.isfinite(lr) and lr >= 0):
            raise ConfigError(f"{where}: {type(optimizer).__name__} has a learning rate of {lr}, which would train "
                              "against the gradient (or not at all). Fix: a learning rate >= 0")
    return optimizer


def check_optimizer(factory: Callable[[Iterable[torch.nn.Parameter]], Optimizer], where: str) -> None:
    """Refuse bad optimizer settings when a config is read, before any model exists: build the optimizer once
    over a one-element parameter (:func:`build_optimizer`). A factory that needs the real parameters (it raises
    anything but a refusal of its settings) is checked when it builds the real optimizer."""
    try:
        build_optimizer(factory, [torch.nn.Parameter(torch.zeros(1))], where)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 (a factory of the user's that wants the model's parameters)
        return


def check_dfs_setup(strategy: Strategy) -> None:
    """Refuse set-ups whose gradient handling assumes ``manual_backward`` of one loss tensor: the one place every
    DFS strategy (at ``setup``) and :func:`dfs_training_step` (for any other strategy) check them."""
    module = strategy.lightning_module
    if module is not None and module.automatic_optimization:
        raise ConfigError(
            f"{type(strategy).__name__} trains manual-optimization modules that run one DFS step per batch (DTAModule, "
            "or a module calling lightning_dta.dfs_training_step): it does not synchronise gradients in backward, "
            "and a DFS runs one backward per tree node. Fix: set `self.automatic_optimization = False`.")
    if strategy.model is not None and strategy.model is not strategy.lightning_module:  # a DDP/FSDP1 wrapper
        raise ConfigError(
            f"{type(strategy).__name__} wrapped the module in {type(strategy.model).__name__}; its gradient hooks "
            "fire on every backward of a DFS step (or, under no_sync, leave some parameters unsynced). Fix: "
            "Trainer(strategy='dta'), which keeps the module unwrapped and sums the gradients once per step.")
    plugin = strategy.precision_plugin
    # Only mixed-precision plugins have a grad scaler; on a CPU Lightning turns 16-mixed into bf16-mixed.
    if plugin.precision == "16-mixed" or getattr(plugin, "scaler", None) is not None:
        raise ConfigError(
            "precision='16-mixed' scales the loss in manual_backward, which a DFS step does not call, and would "
            "then unscale unscaled gradients. Fix: precision='bf16-mixed' or 'bf16-true' (or '32-true').")


def dfs_training_step(module: pl.LightningModule, batch: StepBatch | PrefixTree | None,
                      loss_fn: Objective | None = None, optimizer: Optimizer | None = None, *,
                      model: nn.Module | None = None, engine: EngineOptions | None = None,
                      gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm",
                      skip_nonfinite: bool = True) -> StepOutput:
    """One complete optimizer step from a manual-optimization ``LightningModule``'s ``training_step``.

    Zeroes the gradients, runs :func:`~lightning_dta.distributed.step.tree_step_backward` (normaliser all-reduce,
    DFS, one gradient sum over ranks), clips (by norm: by the gradient norm it returns, in at least float32,
    :func:`~lightning_dta.distributed.step.clip_by_norm`; by value: ``module.clip_gradients``, Lightning's own
    clipping through the precision plugin) and steps the ``LightningOptimizer`` (so ``trainer.global_step`` counts
    it). Learning-rate schedulers are left to the caller, as always in manual optimization. Nothing is logged: the
    returned :class:`StepOutput` holds step-wide metrics, identical on every rank, for the caller to log.

    Args:
        module: the calling ``LightningModule`` (``automatic_optimization = False``), attached to a Trainer.
        batch: this rank's :class:`StepBatch` (or bare ``PrefixTree``; ``None`` = nothing for this rank).
        loss_fn: the objective (default ``PolicyLoss()``).
        optimizer: the optimizer to step (default: the module's only optimizer).
        model: the causal LM to train (default ``module.model``).
        engine: the :class:`~lightning_dta.EngineOptions` (default ``EngineOptions()``).
        gradient_clip_val: clip the summed gradient to this norm (or value); ``None``/0 = no clipping.
        gradient_clip_algorithm: ``"norm"`` or ``"value"``, as in Lightning.
        skip_nonfinite: a step whose loss or gradient norm is not finite is not applied (gradients dropped, no
            optimizer step, ``StepOutput.skipped``), on every rank alike; ``nonfinite_rollouts`` names this rank's
            rollouts whose loss terms were not finite.
    """
    model = model if model is not None else getattr(module, "model", None)  # a user module: the documented default
    if not isinstance(model, nn.Module):
        raise TypeError("dfs_training_step needs the causal LM: pass `model=` or set `module.model`")
    check_clipping(gradient_clip_val, gradient_clip_algorithm, "dfs_training_step")
    strategy = module.trainer.strategy
    check_dfs_setup(strategy)
    layout = parallel_layout(strategy)
    opt = _lightning_optimizer(module, optimizer)
    opt.zero_grad(set_to_none=True)
    tree = batch_tree(batch)
    out = tree_step_backward(model, tree, loss_fn, engine=engine, layout=layout)
    out.grad_norm = gradient_norm(model.parameters(), layout)
    if skip_nonfinite and not out.finite:
        # Both figures are step-wide (the loss sums every rank's share, the norm is that of the summed gradient),
        # so every rank reaches the same decision without another collective.
        opt.zero_grad(set_to_none=True)
        out.skipped = True
        with unsharded(model, training=False):  # sharded weights: gathered on every rank, then no collective
            if tree is not None:
                out.nonfinite_rollouts = nonfinite_rollouts(model, tree, loss_fn or PolicyLoss(), engine)
        return out
    if gradient_clip_val and gradient_clip_algorithm == "norm":  # by the norm just logged: one figure for both
        clip_by_norm(model.parameters(), gradient_clip_val, out.grad_norm)
    elif gradient_clip_val:
        module.clip_gradients(opt, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm)
    opt.step()
    return out


class DFSStepMixin:
    """Mix into an existing ``LightningModule`` (``class M(DFSStepMixin, LightningModule)``) that trains on trees:
    ``self.dfs_training_step(batch, loss_fn, model=...)`` is :func:`dfs_training_step` for this module.

    Tree batches need no device hook: Lightning's default transfer leaves the tree's host tensors alone, and the
    engine moves each chunk's tokens to the model's device itself.
    """

    def dfs_training_step(self, batch: StepBatch | PrefixTree | None, loss_fn: Objective | None = None,
                          **kwargs: Any) -> StepOutput:
        """:func:`dfs_training_step` for this module (same keyword arguments)."""
        return dfs_training_step(self, batch, loss_fn, **kwargs)
