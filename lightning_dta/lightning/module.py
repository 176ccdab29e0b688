"""``DTAModule``: a manual-optimization ``LightningModule`` that trains a Hugging Face causal LM with DFS steps.

Each ``training_step`` receives this rank's :class:`~lightning_dta.core.batch.StepBatch` and runs exactly one
optimizer step (:func:`~lightning_dta.lightning.step.dfs_training_step`): normaliser all-reduce, DFS, one gradient sum
over ranks, clipping, step. Manual optimization is not a choice of style: Lightning's automatic loop wants
one loss tensor per step to call ``backward`` on, and a DFS runs one backward per tree node.

The causal LM is built and parallelized in ``configure_model`` (Lightning's ``ModelParallelStrategy`` convention),
not in ``__init__``: LightningCLI instantiates the module to parse and check a config, and a hub name must not
trigger a download (or a 16 GB allocation) at that point. What the module leaves to others: building models
(:mod:`lightning_dta.models`), sharding them (:func:`~lightning_dta.distributed.parallelize.parallelize_model`, from
the strategy's :class:`~lightning_dta.contracts.ParallelLayout`), a PPO critic and its GAE
(:class:`~lightning_dta.lightning.critic.PPOCritic`), counting non-finite steps (:class:`NonFiniteGuard`).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_dta.contracts import EstimatesAdvantages, ParallelLayout, TreeDataModule, parallel_layout
from lightning_dta.core.batch import StepBatch
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.losses import PolicyLoss
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.parallelize import parallelize_model
from lightning_dta.distributed.step import StepOutput, batch_tree
from lightning_dta.engine import EngineOptions
from lightning_dta.engine.model_info import check_model
from lightning_dta.lightning.critic import PPOCritic
from lightning_dta.lightning.step import DFSStepMixin, build_optimizer, check_clipping, check_optimizer
from lightning_dta.models import ModelSpec, build_causal_lm, build_on_meta, config_from_dict


def _is_plain(value: Any) -> bool:
    """Data that ``torch.load(weights_only=True)`` accepts: primitives, strings and containers of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


class NonFiniteGuard:
    """Counts the steps skipped for a non-finite loss or gradient, names the rollouts behind each in a warning,
    and stops the run after ``max_in_a_row`` of them in a row."""

    def __init__(self, max_in_a_row: int) -> None:
        if not (isinstance(max_in_a_row, int) and max_in_a_row >= 1):
            raise ConfigError(f"model.max_nonfinite_skips={max_in_a_row!r}: the run stops after this many skipped "
                              "steps in a row. Fix: an int >= 1 (default 3)")
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0

    def observe(self, out: StepOutput, tree: PrefixTree | None, batch_idx: int, rank: int) -> None:
        if not out.skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        named = [f"{i} ({len(tree.rollouts[i])} tokens, group {tree.rollouts[i].group_id})"
                 for i in out.nonfinite_rollouts] if tree is not None else []
        warnings.warn(f"batch {batch_idx} skipped on every rank (loss {out.loss}, gradient norm {out.grad_norm}); "
                      f"rank {rank}: non-finite loss terms in rollouts {named or 'none of this rank'} "
                      "(indices in this rank's tree)", RuntimeWarning, stacklevel=2)
        if self.in_a_row >= self.max_in_a_row:
            raise RuntimeError(f"{self.in_a_row} steps in a row had a non-finite loss or gradient "
                               f"(max_nonfinite_skips={self.max_in_a_row}): the run stops. Check the "
                               "rollouts named above (log-probs, advantages) and the learning rate")


class DTAModule(DFSStepMixin, LightningModule):
    """Train a causal LM on prefix trees of RL rollouts, one DFS per optimizer step.

    Args:
        model: a local path or hub name (``AutoModelForCausalLM.from_pretrained``), a config dict such as
            ``{"model_type": "llama", "vocab_size": 256, ...}`` (random init), or an ``nn.Module``.
        model_kwargs: extra arguments for ``from_pretrained``/``from_config`` (``dtype``, ``attn_implementation``).
        loss: the :class:`~lightning_dta.PolicyLoss` (in YAML a nested block: ``loss: {clip_eps: 0.2, ...}``).
        engine: the :class:`~lightning_dta.EngineOptions` of every engine call of a step, the forward-only walks
            of an online rollout source and of the critic included (in YAML: ``engine: {activation: recompute}``).
        optimizer: called with the parameters (LightningCLI fills it from ``class_path``/``init_args``). A
            Python callable is not stored in the checkpoint's hyper-parameters (see ``_save_plain_hyperparameters``):
            pass it again to the module you resume or load.
        lr_scheduler: called with the optimizer; stepped once per optimizer step.
        gradient_clip_val, gradient_clip_algorithm: clipping of the gradient summed over ranks, for the policy and
            the critic (``Trainer(gradient_clip_val=...)`` is refused by Lightning in manual optimization).
        max_nonfinite_skips: a step whose loss or gradient norm is not finite is skipped on every rank (a warning
            names the rollouts with non-finite terms); this many skipped steps in a row stop the run.
        critic: PPO with a learned baseline (:class:`~lightning_dta.PPOCritic`: its model, optimizer, value loss and
            GAE's gamma and lambda; in YAML ``critic: {model: ..., gamma: ...}``). Each step the values (recorded in
            the rollouts, else the critic's) and GAE set the advantages (once per generation batch, at its first
            step, when one feeds several), the policy trains, then the critic trains on the same tree. Needs
            ``advantage_estimator: gae`` on the step source (it leaves the advantages to the critic).
    """

    def __init__(self, model: ModelSpec, *, model_kwargs: dict[str, Any] | None = None,
                 loss: PolicyLoss = PolicyLoss(), engine: EngineOptions = EngineOptions(),  # noqa: B008 (frozen)
                 optimizer: OptimizerCallable = torch.optim.AdamW, lr_scheduler: LRSchedulerCallable | None = None,
                 gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm",
                 max_nonfinite_skips: int = 3, critic: PPOCritic | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        check_clipping(gradient_clip_val, gradient_clip_algorithm)
        check_optimizer(optimizer, "model.optimizer")
        if isinstance(model, Mapping):
            config_from_dict(model, "model.model")  # its type and shape, checked now (no weights are built)
        self.guard = NonFiniteGuard(max_nonfinite_skips)
        self.loss_fn = loss if isinstance(loss, PolicyLoss) else PolicyLoss(**loss)  # a mapping: from a checkpoint
        self.engine = EngineOptions.resolve(engine)
        critic = critic if critic is None or isinstance(critic, PPOCritic) else PPOCritic(**critic)  # a checkpoint's
        self._save_plain_hyperparameters(["model"] if isinstance(model, nn.Module) else [], critic)
        self.model_spec = None if isinstance(model, nn.Module) else model  # a module is registered once, below
        self.model_kwargs = dict(model_kwargs or {})
        self.model: nn.Module | None = model if isinstance(model, nn.Module) else None
        self.hf_checkpoint: Path | None = None  # set when the model is built on the meta device (sharded runs)
        self.critic = critic
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm

    def _save_plain_hyperparameters(self, ignore: list[str], critic: PPOCritic | None) -> None:
        """``save_hyperparameters`` minus Python objects (an optimizer class, a ``functools.partial``), with the loss,
        the engine options and the critic's settings stored as plain dicts.

        Lightning resumes with ``torch.load(weights_only=True)``, which refuses arbitrary globals in the
        checkpoint, so a stored ``torch.optim.AdamW`` would make every Python-side checkpoint unloadable. From
        LightningCLI the hyper-parameters are the parsed config (plain data) and are all kept.
        """
        frame = inspect.currentframe().f_back
        structured = ["loss", "engine", "critic"]
        self.save_hyperparameters(ignore=[*ignore, *structured], frame=frame)
        opaque = [key for key, value in self.hparams.items() if not _is_plain(value)]
        if opaque:
            self.save_hyperparameters(ignore=[*ignore, *structured, *opaque], frame=frame)
        self.hparams.update(loss=dataclasses.asdict(self.loss_fn), engine=self.engine.to_dict())
        if critic is not None and _is_plain(critic.hyperparameters()):
            self.hparams.update(critic=critic.hyperparameters())

    @property
    def layout(self) -> ParallelLayout:
        """The ranks' layout the strategy offers (default: one process, replicated weights)."""
        return parallel_layout(self._trainer.strategy) if self._trainer is not None else ParallelLayout()

    @override
    def configure_model(self) -> None:
        """Build the causal LM and parallelize it as the strategy's layout asks, once (Lightning may call this hook
        again, e.g. for ``validate`` after ``fit``).

        Under a sharding strategy (``dta_fsdp``) a checkpoint path or hub name is built on the meta device and
        loaded into the shards, so no rank holds the whole model."""
        layout = self.layout
        if self.model is None:
            if layout.shards_weights and isinstance(self.model_spec, (str, PathLike)):
                self.model, self.hf_checkpoint = build_on_meta(self.model_spec, self.model_kwargs)
            else:
                self.model = build_causal_lm(self.model_spec, self.model_kwargs)
        if layout.shards_weights:
            parallelize_model(self.model, layout, self.trainer.strategy.root_device, self.hf_checkpoint)
        if self.critic is not None:  # after the policy: its random init is unchanged
            self.critic.configure(self.model_kwargs, layout)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the model's config in the checkpoint: ``lightning-dta export`` builds the Hugging Face model from it
        without downloading anything. The critic's optimizer is not one of Lightning's: saved here."""
        if self.model is not None and hasattr(self.model, "config"):  # a user's nn.Module may have no HF config
            checkpoint["hf_config"] = self.model.config.to_dict()
        if self.critic is not None and self.critic.optimizer_state() is not None:
            checkpoint["critic_optimizer"] = self.critic.optimizer_state()
        if self.critic is not None:  # a run resumed in the middle of a generation batch trains on its estimates
            checkpoint["critic_generation_batch"] = self.critic.batch_state()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.critic is not None:
            self.critic.load_optimizer_state(checkpoint.get("critic_optimizer"))
            self.critic.load_batch_state(checkpoint.get("critic_generation_batch"))

    @override
    def configure_optimizers(self) -> Any:
        if self.model is None:
            raise RuntimeError("configure_model() must run before configure_optimizers()")
        optimizer = build_optimizer(self.optimizer_factory, self.model.parameters(), "model.optimizer")
        if self.lr_scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": self.lr_scheduler_factory(optimizer), "interval": "step"}}

    @property
    def _tree_data(self) -> TreeDataModule | None:
        datamodule = self.trainer.datamodule
        return datamodule if isinstance(datamodule, TreeDataModule) else None

    @override
    def on_fit_start(self) -> None:
        """Hand the model's limits (vocabulary, positions) to the tree data module, so a config states them once: in
        the model; check that a critic and the data side agree on who estimates the advantages."""
        data = self._tree_data
        if data is not None and self.model is not None:
            data.connect_model(self.model)
        datamodule = self.trainer.datamodule
        self._check_gae_setup(datamodule.advantage_estimator if isinstance(datamodule, EstimatesAdvantages) else None)
        for model in (self.model, self.critic.model if self.critic is not None else None):
            if model is not None:
                check_model(model, self.engine)  # a refused model: before the first step, not after its bar
        if self.model is not None:
            total = sum(p.numel() for p in self.model.parameters())
            trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            rank_zero_info(f"model: {type(self.model).__name__}, {total:,} parameters ({trained:,} trained), "
                           f"{next(self.model.parameters()).dtype}")

    def _check_gae_setup(self, estimator: str | None) -> None:
        """A critic and advantage_estimator='gae' come together: one without the other trains on something else."""
        if estimator == "gae" and self.critic is None:
            raise ConfigError("advantage_estimator='gae' needs a critic to estimate the advantages. Fix: "
                             "DTAModule(critic=...) with a lightning_dta.PPOCritic (in YAML model.critic.model: a "
                             "model spec like model.model)")
        if self.critic is not None and estimator != "gae":
            raise ConfigError(f"DTAModule(critic=...) estimates advantages with GAE, but the step source uses "
                             f"{estimator or 'the rollouts own advantages'}. Fix: advantage_estimator: gae (on the "
                             "data module, or on the online source)")

    @override
    def training_step(self, batch: StepBatch | PrefixTree | None, batch_idx: int) -> dict[str, Any]:
        """One optimizer step; returns the loss and, under ``"step"``, the :class:`StepOutput` (callbacks read it
        in ``on_train_batch_end``: the online RL callback checks the log-prob gap)."""
        tree = batch_tree(batch)
        layout = self.layout
        if self.critic is not None:
            self.critic.estimate(tree, self.engine, layout,
                                 batch.generation if isinstance(batch, StepBatch) else None)
        out = self.dfs_training_step(batch, self.loss_fn, model=self.model, engine=self.engine,
                                     gradient_clip_val=self.gradient_clip_val,
                                     gradient_clip_algorithm=self.gradient_clip_algorithm)
        self.guard.observe(out, tree, batch_idx, self.global_rank)
        if self.critic is not None:
            critic = self.critic.step(tree, self.engine, layout, self.gradient_clip_val, self.gradient_clip_algorithm)
            self.log_dict({f"critic/{key}": value for key, value in critic.metrics.items()
                           if key.startswith("value_") or key == "loss"} | {
                              "critic/loss": critic.loss, "critic/grad_norm": critic.grad_norm or 0.0,
                              "critic/skipped": float(critic.skipped)}, on_step=True, on_epoch=False, batch_size=1)
        lr = self.optimizers().optimizer.param_groups[0]["lr"]  # the rate this step used
        scheduler = self.lr_schedulers()
        if scheduler is not None and not out.skipped:  # a skipped step is no optimizer step: the schedule waits
            scheduler.step()
        self.log_step(out, batch, lr)
        data = self._tree_data
        if data is not None and isinstance(batch, StepBatch):  # the partition's cost model learns from the times
            data.observe_step(batch, out.rank_seconds)
        return {"loss": torch.tensor(out.loss), "step": out}

    def log_step(self, out: StepOutput, batch: StepBatch | PrefixTree | None, lr: float) -> None:
        """Log the step's metrics. They are step-wide and identical on every rank, so no ``sync_dist``."""
        metrics = {f"train/{key}": value for key, value in out.metrics.items()}
        if self.loss_fn.kl_coef == 0.0:
            metrics.pop("train/ref_kl", None)
        metrics["train/grad_norm"] = out.grad_norm or 0.0
        metrics["train/lr"] = lr
        if isinstance(batch, StepBatch):
            metrics["train/rank_cost_imbalance"] = batch.imbalance  # predicted by the partition's cost model
        if out.rank_seconds:
            slowest, mean = max(out.rank_seconds), sum(out.rank_seconds) / len(out.rank_seconds)
            metrics["train/dfs_sec_max"] = slowest
            metrics["train/rank_time_imbalance"] = slowest / mean if mean > 0 else 1.0  # measured
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        self.log("loss", out.loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=1, logger=False)
