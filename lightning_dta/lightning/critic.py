"""``PPOCritic``: PPO's learned baseline, its own model, objective, optimizer and advantage estimator (GAE).

Advantages have one owner per run: the step source (file, iterable or online generation) estimates group-relative
advantages before the step is partitioned, and a critic estimates GAE inside the training step, when its values
of the step's own rollouts are known. That second job is this class's, not the policy module's: each step it
fills the ``old_values`` of the rollouts that carry none with one forward-only walk
(:func:`~lightning_dta.tree_values`), gives the step's tree copies of the rollouts with GAE's advantages and returns
(:func:`~lightning_dta.core.advantages.gae_advantages`), and after the policy's step trains itself on the same tree
with :class:`~lightning_dta.ValueLoss`, summed over ranks like the policy.

When one generation batch feeds several steps (:class:`~lightning_dta.core.generation.GenerationBatches`), PPO takes
the values once, with the critic's weights before the batch's first update, and estimates GAE (and whitens it) over
the whole batch (verl's trainer does so before it splits the batch into mini-batches). So at the batch's first step
(the step's :class:`~lightning_dta.core.generation.GenerationContext`) the critic walks the whole batch, its ranks
sharing the walk (:func:`~lightning_dta.distributed.batch_walk.walk_batch`), estimates and whitens over all of it,
and keeps each rollout's values, advantages and returns; the batch's later steps (and later passes) take them from
there, whatever the critic's updates in between. They travel in the module's checkpoint (:meth:`batch_state`), so
a run resumed in the middle of a batch trains its remaining steps on the same estimates.

``old_values`` given in the data win: they are the critic's values when the rollout was generated (a rollout
file's or an iterable source's; the online source records none), so they are GAE's baseline and the value clip's
anchor, as in PPO, where both are the values of the generation batch however many steps it feeds. The critic
fills only the rollouts without them. The
source's own rollouts are never written to: a file's are read again next epoch, and values written into them
would then pass for recorded ones.

Its optimizer is a plain torch optimizer, not one of Lightning's: a second ``LightningOptimizer.step()`` would
count twice in ``global_step`` (``max_steps``, the online loop's policy version). Its state travels in the module's
checkpoint (:meth:`optimizer_state` / :meth:`load_optimizer_state`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import nn

from lightning_dta.contracts import ParallelLayout
from lightning_dta.core.advantages import advantage_sums, gae_advantages, whiten_advantages
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.generation import GenerationContext
from lightning_dta.core.losses import ValueLoss
from lightning_dta.core.rollout import Rollout
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.batch_walk import walk_batch
from lightning_dta.distributed.collectives import all_reduce_sum, collective_device
from lightning_dta.distributed.step import StepOutput, clip_by_norm, gradient_norm, tree_step_backward
from lightning_dta.engine import EngineOptions, tree_values
from lightning_dta.lightning.step import build_optimizer, check_optimizer
from lightning_dta.models import ModelSpec, build_causal_lm, config_from_dict, value_model


class PPOCritic(nn.Module):
    """A critic for PPO with GAE (module docstring); ``DTAModule(critic=PPOCritic(...))``, in YAML ``model.critic``.

    Args:
        model: a model spec like ``DTAModule``'s (a path or hub name, a config dict, or an ``nn.Module``), turned into
            a critic by :func:`~lightning_dta.value_model` (a zero-initialised scalar head).
        model_kwargs: extra arguments for ``from_pretrained``/``from_config`` (default: the policy's).
        optimizer: called with the critic's parameters.
        value_loss: the critic's :class:`~lightning_dta.ValueLoss`.
        gamma, lam: GAE's discount and trace decay, each in [0, 1].
        whiten: whiten GAE's advantages over the whole step, every rank's rollouts together (over the whole
            generation batch when one feeds several steps): ``(A - mean) / sqrt(var + 1e-8)`` over every trained
            (token, rollout) pair, var the unbiased one (verl's ``masked_whiten``); the returns stay ``A + V`` from
            before. Two small all-reduces per step (none for a generation batch: every rank holds all of it).
    """

    def __init__(self, model: ModelSpec, *, model_kwargs: dict[str, Any] | None = None,
                 optimizer: OptimizerCallable = torch.optim.AdamW,
                 value_loss: ValueLoss = ValueLoss(), gamma: float = 1.0,  # noqa: B008 (frozen)
                 lam: float = 1.0, whiten: bool = False) -> None:
        super().__init__()
        if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
            raise ConfigError(f"model.critic.gamma={gamma} and lam={lam}: GAE's discount and trace decay. Fix: "
                              "numbers in [0, 1]")
        check_optimizer(optimizer, "model.critic.optimizer")
        if isinstance(model, Mapping):
            config_from_dict(model, "model.critic.model")
        self.spec = None if isinstance(model, nn.Module) else model
        self.model_kwargs = None if model_kwargs is None else dict(model_kwargs)
        self.model: nn.Module | None = value_model(model) if isinstance(model, nn.Module) else None
        self.optimizer_factory = optimizer
        self.value_loss = value_loss if isinstance(value_loss, ValueLoss) else ValueLoss(**value_loss)
        self.gamma, self.lam, self.whiten = gamma, lam, whiten
        self._optimizer: torch.optim.Optimizer | None = None
        self._optimizer_state: dict | None = None  # from a checkpoint, applied when the optimizer exists
        # the current generation batch's estimates, by rollout content (_content): (old_values, advantages, returns)
        self._batch: dict[tuple, tuple[list[float], list[float], list[float]]] = {}

    def hyperparameters(self) -> dict[str, Any]:
        """The settings as plain data, for the module's checkpoint (a module given as an ``nn.Module`` is not)."""
        return {"model": self.spec, "model_kwargs": self.model_kwargs,
                "value_loss": dataclasses.asdict(self.value_loss), "gamma": self.gamma, "lam": self.lam,
                "whiten": self.whiten}

    def configure(self, model_kwargs: dict[str, Any], layout: ParallelLayout) -> None:
        """Build the value model (once; after the policy, so that the policy's random init is unchanged)."""
        if layout.shards_weights:
            raise ConfigError("PPOCritic is not supported with strategy='dta_fsdp' yet (the critic would be a second "
                             "sharded model). Fix: strategy='dta', or GRPO-style advantages")
        if self.model is None:
            kwargs = model_kwargs if self.model_kwargs is None else self.model_kwargs
            self.model = value_model(build_causal_lm(self.spec, kwargs))

    def estimate(self, tree: PrefixTree | None, engine: EngineOptions, layout: ParallelLayout | None = None,
                 generation: GenerationContext | None = None) -> None:
        """GAE on the step's tree: the tree's rollouts become copies with ``old_values`` (the recorded ones where
        given, else the critic's, module docstring), GAE's advantages and returns; with ``whiten``, the advantages
        whitened with the mean and variance of the whole step (every rank calls this, also one without a tree: it
        joins the all-reduces). A step of a generation batch (``generation``) takes them from the batch's
        estimate, made at its first step (module docstring)."""
        layout = layout or ParallelLayout()
        if generation is not None:
            if generation.position == 0:
                self._estimate_batch(generation, engine, layout)
            if tree is not None:
                tree.rollouts[:] = [self._from_batch(rollout, generation) for rollout in tree.rollouts]
            return
        estimated = []
        if tree is not None:
            estimated = gae_advantages(self._with_values(tree, engine), self.gamma, self.lam)
        if self.whiten:
            estimated = self._whitened(estimated, self._summed_over(layout))
        if tree is not None:
            tree.rollouts[:] = estimated  # the tree's own list: the source's rollouts stay as they were

    def _estimate_batch(self, generation: GenerationContext, engine: EngineOptions, layout: ParallelLayout) -> None:
        """Values (one walk shared by the ranks), GAE and its whitening over the whole generation batch, kept by
        rollout content for the batch's steps. Every rank holds the whole batch: no all-reduce."""
        if generation.batch is None:
            raise RuntimeError(f"the first step of {generation.label} came without its generation batch: the step "
                               "source must hand the whole batch with its first step")
        rollouts = list(generation.batch)
        missing = [index for index, rollout in enumerate(rollouts) if rollout.old_values is None]
        values = walk_batch([rollouts[i] for i in missing],
                            lambda tree: tree_values(self.model, tree, engine=engine), layout.data_parallel_group)
        for index, walked in zip(missing, values):
            rollouts[index] = dataclasses.replace(rollouts[index], old_values=[0.0, *walked])
        estimated = gae_advantages(rollouts, self.gamma, self.lam)
        if self.whiten:
            estimated = self._whitened(estimated, lambda sums: sums)
        self._batch = {_content(source): (list(rollout.old_values), list(rollout.advantages), list(rollout.returns))
                       for source, rollout in zip(generation.batch, estimated)}

    def _from_batch(self, rollout: Rollout, generation: GenerationContext) -> Rollout:
        """A copy of ``rollout`` with its generation batch's estimate."""
        found = self._batch.get(_content(rollout))
        if found is None:
            raise RuntimeError(f"a rollout of step {generation.position} of {generation.label} is not in the critic's "
                               "estimate of that batch (made at its first step, or restored from the checkpoint): "
                               "the step source handed the critic another batch than the one it trains")
        old_values, advantages, returns = found
        return dataclasses.replace(rollout, old_values=old_values, advantages=advantages, returns=returns)

    def batch_state(self) -> list:
        """The current generation batch's estimates, for the module's checkpoint (plain data)."""
        return [[list(key), *estimate] for key, estimate in self._batch.items()]

    def load_batch_state(self, state: Sequence | None) -> None:
        self._batch = {tuple(key): tuple(estimate) for key, *estimate in state or []}

    def _with_values(self, tree: PrefixTree, engine: EngineOptions) -> list[Rollout]:
        """The tree's rollouts, those without ``old_values`` copied with the critic's (one forward-only walk over
        them alone; entry 0, which no state precedes, is 0)."""
        rollouts = list(tree.rollouts)
        missing = [index for index, rollout in enumerate(rollouts) if rollout.old_values is None]
        if missing:
            for index, values in zip(missing, tree_values(self.model, tree.subset(missing), engine=engine)):
                values = [0.0] + values.double().cpu().tolist()
                rollouts[index] = dataclasses.replace(rollouts[index], old_values=values)
        return rollouts

    def _summed_over(self, layout: ParallelLayout) -> Callable[[tuple[float, float]], tuple[float, float]]:
        """Sums over the data-parallel ranks: N ranks whiten a step exactly as 1 rank over the same rollouts."""
        device, group = collective_device(self.model), layout.data_parallel_group
        return lambda sums: all_reduce_sum(sums, device, group=group)

    def _whitened(self, estimated: list, summed: Callable[[tuple[float, float]], tuple[float, float]]) -> list:
        """GAE's advantages whitened with the mean and unbiased variance of every rollout ``summed`` adds up (a
        step's: over the ranks; a generation batch's: held whole on each rank)."""
        total, count = summed(advantage_sums(estimated))
        if count < 2:
            raise ConfigError(f"PPOCritic(whiten=True) needs at least 2 trained tokens in the step, got {int(count)} "
                             "(the unbiased variance of fewer is undefined). Fix: whiten=False, or larger steps")
        mean = total / count
        squares, _ = summed(advantage_sums(estimated, center=mean))
        return whiten_advantages(estimated, mean, squares / count * (count / (count - 1)))

    def step(self, tree: PrefixTree | None, engine: EngineOptions, layout: ParallelLayout,
             clip_val: float | None, clip_algorithm: str) -> StepOutput:
        """One optimizer step of the critic on the step's tree, clipped like the policy (by the logged norm)."""
        optimizer = self._ensure_optimizer()
        optimizer.zero_grad(set_to_none=True)
        out = tree_step_backward(self.model, tree, self.value_loss, engine=engine, layout=layout)
        out.grad_norm = gradient_norm(self.model.parameters(), layout)
        if not out.finite:
            optimizer.zero_grad(set_to_none=True)
            out.skipped = True
            return out
        if clip_val and clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(self.model.parameters(), clip_val)
        elif clip_val:
            clip_by_norm(self.model.parameters(), clip_val, out.grad_norm)
        optimizer.step()
        return out

    def _ensure_optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            self._optimizer = build_optimizer(self.optimizer_factory, self.model.parameters(),
                                              "model.critic.optimizer")
            if self._optimizer_state is not None:
                self._optimizer.load_state_dict(self._optimizer_state)
        return self._optimizer

    def optimizer_state(self) -> dict | None:
        """The optimizer's state for a checkpoint: its own, or the one loaded and not yet used by a step."""
        return self._optimizer.state_dict() if self._optimizer is not None else self._optimizer_state

    def load_optimizer_state(self, state: dict | None) -> None:
        self._optimizer_state = state


def _content(rollout: Rollout) -> tuple:
    """What a rollout's estimate depends on (its tokens, trained positions, reward and recorded values): the key of a
    generation batch's estimates. Rollouts alike in all of these have the same estimate."""
    optional = (rollout.loss_mask, rollout.old_values)
    return (tuple(rollout.input_ids), float(rollout.reward), *(None if v is None else tuple(v) for v in optional))
