"""``DTAModule``: a manual-optimization ``LightningModule`` that trains a Hugging Face causal LM with DFS steps.

Each ``training_step`` receives this rank's :class:`~lightning_dta.core.batch.StepBatch` and runs exactly one
optimizer step (:func:`~lightning_dta.lightning.step.dfs_training_step`): normaliser all-reduce, DFS, one gradient sum
over ranks, clipping, step. Manual optimization is not a choice of style: Lightning's automatic loop wants
one loss tensor per step to call ``backward`` on, and a DFS runs one backward per tree node.

The causal LM is built in ``configure_model``, not in ``__init__``: LightningCLI instantiates the module to
parse and check a config, and a hub name must not trigger a download (or a 16 GB allocation) at that point.
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

from lightning_dta.core.advantages import gae_advantages
from lightning_dta.core.batch import StepBatch
from lightning_dta.core.losses import PolicyLoss, ValueLoss
from lightning_dta.core.tree import PrefixTree
from lightning_dta.distributed.collectives import DEFAULT_BUCKET_MB
from lightning_dta.engine import EngineOptions, tree_values
from lightning_dta.lightning.step import DFSStepMixin, StepOutput, gradient_norm, tree_step_backward
from lightning_dta.models import value_model

ModelSpec = str | dict[str, Any] | nn.Module


def _dtype_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """YAML gives dtypes as strings ("bfloat16"); transformers wants ``torch.dtype`` (or "auto")."""
    out = dict(kwargs)
    for key in ("dtype", "torch_dtype"):
        if isinstance(out.get(key), str) and out[key] != "auto":
            out[key] = getattr(torch, out[key])
    return out


def _is_plain(value: Any) -> bool:
    """Data that ``torch.load(weights_only=True)`` accepts: primitives, strings and containers of them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def build_causal_lm(model: str | PathLike | Mapping[str, Any] | nn.Module,
                    model_kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """A causal LM from a local path or hub name (``from_pretrained``), a config dict with a ``model_type``
    (``AutoConfig.for_model`` + ``from_config``: random weights, for tests and tiny runs), or a module as is."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = _dtype_kwargs(model_kwargs or {})
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, Mapping):
        spec = dict(model)
        if "model_type" not in spec:
            raise ValueError("a model config dict needs a 'model_type' (e.g. 'llama', 'qwen3'); got keys "
                             f"{sorted(spec)}")
        config = AutoConfig.for_model(spec.pop("model_type"), **spec)
        return AutoModelForCausalLM.from_config(config, **kwargs)
    if isinstance(model, (str, PathLike)):
        return AutoModelForCausalLM.from_pretrained(model, **kwargs)
    raise TypeError(f"model must be a path or hub name, a config dict or an nn.Module; got {type(model).__name__}")


def local_checkpoint(model: str | PathLike) -> Path:
    """The local directory of a Hugging Face checkpoint: the path itself, or the hub snapshot (downloaded once)."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))


def build_on_meta(model: str | PathLike, model_kwargs: Mapping[str, Any] | None = None) -> tuple[nn.Module, Path]:
    """The causal LM of a checkpoint with its parameters on the meta device (no memory) and its buffers real, and
    the checkpoint's local directory: a sharding strategy allocates the shards and loads them from it."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    path = local_checkpoint(model)
    kwargs = _dtype_kwargs(model_kwargs or {})
    with init_empty_weights(include_buffers=False):
        causal_lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), **kwargs)
    return causal_lm, path


class DTAModule(DFSStepMixin, LightningModule):
    """Train a causal LM on prefix trees of RL rollouts, one DFS per optimizer step.

    Args:
        model: a local path or hub name (``AutoModelForCausalLM.from_pretrained``), a config dict such as
            ``{"model_type": "llama", "vocab_size": 256, ...}`` (random init), or an ``nn.Module``.
        model_kwargs: extra arguments for ``from_pretrained``/``from_config`` (``dtype``, ``attn_implementation``).
        loss: the :class:`~lightning_dta.PolicyLoss` (in YAML a nested block: ``loss: {clip_eps: 0.2, ...}``).
        engine: the :class:`~lightning_dta.EngineOptions` of every engine call of a step, the forward-only walks
            of an online rollout source included (in YAML: ``engine: {activation: recompute, ...}``).
        optimizer: called with the parameters (LightningCLI fills it from ``class_path``/``init_args``). A
            Python callable is not stored in the checkpoint's hyper-parameters (see ``_save_plain_hyperparameters``):
            pass it again to the module you resume or load.
        lr_scheduler: called with the optimizer; stepped once per optimizer step.
        gradient_clip_val, gradient_clip_algorithm: clipping of the gradient summed over ranks
            (``Trainer(gradient_clip_val=...)`` is refused by Lightning in manual optimization).
        max_nonfinite_skips: a step whose loss or gradient norm is not finite is skipped on every rank (a warning
            names the rollouts with non-finite terms); this many skipped steps in a row stop the run.
        critic: PPO with a learned baseline: a model spec like ``model`` (built with ``model_kwargs``) turned into
            a critic (:func:`~lightning_dta.models.value_model`). Each step then fills the rollouts' ``old_values``
            with ``tree_values``, estimates advantages and returns with GAE, trains the policy, and trains the
            critic with ``value_loss`` on the same tree (its own optimizer, the same clipping). Needs
            ``advantage_estimator: gae`` on the data side (the data module's or the online source's).
        critic_optimizer: called with the critic's parameters.
        value_loss: the critic's :class:`~lightning_dta.ValueLoss`.
        gae_gamma, gae_lambda: GAE's discount and trace decay (:func:`~lightning_dta.core.advantages.gae_advantages`).
    """

    def __init__(self, model: ModelSpec, *, model_kwargs: dict[str, Any] | None = None,
                 loss: PolicyLoss = PolicyLoss(), engine: EngineOptions = EngineOptions(),  # noqa: B008 (frozen)
                 optimizer: OptimizerCallable = torch.optim.AdamW, lr_scheduler: LRSchedulerCallable | None = None,
                 gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm",
                 max_nonfinite_skips: int = 3, critic: ModelSpec | None = None,
                 critic_optimizer: OptimizerCallable = torch.optim.AdamW,
                 value_loss: ValueLoss = ValueLoss(), gae_gamma: float = 1.0,  # noqa: B008 (frozen)
                 gae_lambda: float = 1.0) -> None:
        super().__init__()
        self.automatic_optimization = False
        if max_nonfinite_skips < 1:
            raise ValueError(f"max_nonfinite_skips={max_nonfinite_skips} must be >= 1")
        self.max_nonfinite_skips = max_nonfinite_skips
        self.loss_fn = loss if isinstance(loss, PolicyLoss) else PolicyLoss(**loss)  # a mapping: from a checkpoint
        self.value_loss = value_loss if isinstance(value_loss, ValueLoss) else ValueLoss(**value_loss)
        self.engine = EngineOptions.resolve(engine)
        self._save_plain_hyperparameters(ignore=[name for name, value in (("model", model), ("critic", critic))
                                                 if isinstance(value, nn.Module)])
        self.model_spec = None if isinstance(model, nn.Module) else model  # a module is registered once, below
        self.model_kwargs = dict(model_kwargs or {})
        self.model: nn.Module | None = model if isinstance(model, nn.Module) else None
        self.hf_checkpoint: Path | None = None  # set when the model is built on the meta device (sharded runs)
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.critic_spec = critic
        self.critic: nn.Module | None = None  # built in configure_model
        self.critic_optimizer_factory = critic_optimizer
        if not (0.0 <= gae_gamma <= 1.0 and 0.0 <= gae_lambda <= 1.0):
            raise ValueError(f"gae_gamma={gae_gamma} and gae_lambda={gae_lambda} must lie in [0, 1]")
        self.gae_gamma, self.gae_lambda = gae_gamma, gae_lambda
        self._critic_optimizer: torch.optim.Optimizer | None = None
        self._critic_optimizer_state: dict | None = None  # from a checkpoint, applied when the optimizer exists

    def _save_plain_hyperparameters(self, ignore: list[str]) -> None:
        """``save_hyperparameters`` minus Python objects (an optimizer class, a ``functools.partial``), with the loss
        and the engine options stored as plain dicts.

        Lightning resumes with ``torch.load(weights_only=True)``, which refuses arbitrary globals in the
        checkpoint, so a stored ``torch.optim.AdamW`` would make every Python-side checkpoint unloadable. From
        LightningCLI the hyper-parameters are the parsed config (plain data) and are all kept.
        """
        frame = inspect.currentframe().f_back
        structured = ["loss", "engine", "value_loss"]
        self.save_hyperparameters(ignore=[*ignore, *structured], frame=frame)
        opaque = [key for key, value in self.hparams.items() if not _is_plain(value)]
        if opaque:
            self.save_hyperparameters(ignore=[*ignore, *structured, *opaque], frame=frame)
        self.hparams.update(loss=dataclasses.asdict(self.loss_fn), engine=self.engine.to_dict())
        self.hparams.update(value_loss=dataclasses.asdict(self.value_loss))

    @override
    def configure_model(self) -> None:
        """Build the causal LM once (Lightning may call this hook again, e.g. for ``validate`` after ``fit``).

        Under a sharding strategy (``dta_fsdp``) a checkpoint path or hub name is built on the meta device and
        the strategy loads it into the shards (``hf_checkpoint``), so no rank holds the whole model."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        if self.model is None:
            if getattr(strategy, "shards_model", False) and isinstance(self.model_spec, (str, PathLike)):
                self.model, self.hf_checkpoint = build_on_meta(self.model_spec, self.model_kwargs)
            else:
                self.model = build_causal_lm(self.model_spec, self.model_kwargs)
        if self.critic_spec is not None and self.critic is None:  # after the policy: its random init is unchanged
            if getattr(strategy, "shards_model", False):
                raise ValueError("DTAModule(critic=...) is not supported with strategy='dta_fsdp' yet (the critic "
                                 "would be a second sharded model). Fix: strategy='dta', or GRPO-style advantages")
            self.critic = value_model(build_causal_lm(self.critic_spec, self.model_kwargs))

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the model's config in the checkpoint: ``lightning-dta export`` builds the Hugging Face model from it
        without downloading anything."""
        if self.model is not None and hasattr(self.model, "config"):
            checkpoint["hf_config"] = self.model.config.to_dict()
        if self._critic_optimizer is not None:  # not a Lightning optimizer (see _critic_step): saved here
            checkpoint["critic_optimizer"] = self._critic_optimizer.state_dict()
        elif self._critic_optimizer_state is not None:  # resumed, and no critic step since: keep what was loaded
            checkpoint["critic_optimizer"] = self._critic_optimizer_state

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._critic_optimizer_state = checkpoint.get("critic_optimizer")

    @override
    def configure_optimizers(self) -> Any:
        if self.model is None:
            raise RuntimeError("configure_model() must run before configure_optimizers()")
        optimizer = self.optimizer_factory(self.model.parameters())
        if self.lr_scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": self.lr_scheduler_factory(optimizer), "interval": "step"}}

    @override
    def on_fit_start(self) -> None:
        """Hand the model's limits (vocabulary, positions) to a data module that checks rollouts against them
        (``RolloutDataModule.connect_model``), so a config states them once: in the model."""
        connect = getattr(getattr(self.trainer, "datamodule", None), "connect_model", None)
        if callable(connect) and self.model is not None:
            connect(self.model)
        self._check_gae_setup()
        if self.model is not None:
            total = sum(p.numel() for p in self.model.parameters())
            trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            rank_zero_info(f"model: {type(self.model).__name__}, {total:,} parameters ({trained:,} trained), "
                           f"{next(self.model.parameters()).dtype}")

    def _check_gae_setup(self) -> None:
        """A critic and advantage_estimator='gae' come together: one without the other trains on something else."""
        datamodule = getattr(self.trainer, "datamodule", None)
        estimators = {getattr(datamodule, "advantage_estimator", None),
                      getattr(getattr(datamodule, "source", None), "advantage_estimator", None)}
        if "gae" in estimators and self.critic is None:
            raise ValueError("advantage_estimator='gae' needs a critic to estimate the advantages. Fix: "
                             "DTAModule(critic=...) (in YAML model.critic: a model spec like model.model)")
        if self.critic is not None and "gae" not in estimators:
            raise ValueError(f"DTAModule(critic=...) estimates advantages with GAE, but the data side uses "
                             f"{sorted(e for e in estimators if e) or 'the rollouts own advantages'}. Fix: "
                             "advantage_estimator: gae (on the data module, or on the online source)")

    def _estimate_with_critic(self, tree: PrefixTree | None) -> None:
        """The critic's values on the step's tree (one forward-only walk), then GAE: each rollout's advantages
        and returns, in place (the tree's rollouts are this step's own)."""
        if tree is None:
            return
        for rollout, values in zip(tree.rollouts, tree_values(self.critic, tree, engine=self.engine)):
            rollout.old_values = [0.0] + values.double().cpu().tolist()
        for rollout, estimated in zip(tree.rollouts, gae_advantages(tree.rollouts, self.gae_gamma, self.gae_lambda)):
            rollout.advantages, rollout.returns = estimated.advantages, estimated.returns

    def _critic_step(self, tree: PrefixTree | None) -> StepOutput:
        """One optimizer step of the critic on the same tree. Its optimizer is a plain torch optimizer, not one of
        Lightning's: a second LightningOptimizer.step() would count twice in global_step (max_steps, the RL
        loop's policy version)."""
        if self._critic_optimizer is None:
            self._critic_optimizer = self.critic_optimizer_factory(self.critic.parameters())
            if self._critic_optimizer_state is not None:
                self._critic_optimizer.load_state_dict(self._critic_optimizer_state)
        self._critic_optimizer.zero_grad(set_to_none=True)
        bucket_mb = getattr(self.trainer.strategy, "bucket_mb", DEFAULT_BUCKET_MB)
        out = tree_step_backward(self.critic, tree, self.value_loss, engine=self.engine, bucket_mb=bucket_mb)
        out.grad_norm = gradient_norm(self.critic.parameters())
        if not out.finite:
            self._critic_optimizer.zero_grad(set_to_none=True)
            out.skipped = True
            return out
        if self.gradient_clip_val:
            if self.gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(self.critic.parameters(), self.gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.gradient_clip_val)
        self._critic_optimizer.step()
        return out

    @override
    def training_step(self, batch: StepBatch | PrefixTree | None, batch_idx: int) -> torch.Tensor:
        if self.critic is not None:
            self._estimate_with_critic(batch.tree if isinstance(batch, StepBatch) else batch)
        out = self.dfs_training_step(batch, self.loss_fn, model=self.model, engine=self.engine,
                                     gradient_clip_val=self.gradient_clip_val,
                                     gradient_clip_algorithm=self.gradient_clip_algorithm)
        self._guard_nonfinite(out, batch, batch_idx)
        if self.critic is not None:
            critic = self._critic_step(batch.tree if isinstance(batch, StepBatch) else batch)
            self.log_dict({f"critic/{key}": value for key, value in critic.metrics.items()
                           if key.startswith("value_") or key == "loss"} | {
                              "critic/loss": critic.loss, "critic/grad_norm": critic.grad_norm or 0.0,
                              "critic/skipped": float(critic.skipped)}, on_step=True, on_epoch=False, batch_size=1)
        lr = self.optimizers().optimizer.param_groups[0]["lr"]  # the rate this step used
        scheduler = self.lr_schedulers()
        if scheduler is not None and not out.skipped:  # a skipped step is no optimizer step: the schedule waits
            scheduler.step()
        self.log_step(out, batch, lr)
        observe = getattr(getattr(self.trainer, "datamodule", None), "observe_step", None)
        if callable(observe) and isinstance(batch, StepBatch):  # the partition's cost model learns from the times
            observe(batch, out.rank_seconds)
        return torch.tensor(out.loss)

    def _guard_nonfinite(self, out: StepOutput, batch: StepBatch | PrefixTree | None, batch_idx: int) -> None:
        """Count skipped (non-finite) steps, say which rollouts caused them, stop after too many in a row."""
        if not out.skipped:
            self._nonfinite_in_a_row = 0
            return
        self._nonfinite_in_a_row = getattr(self, "_nonfinite_in_a_row", 0) + 1
        self.skipped_steps = getattr(self, "skipped_steps", 0) + 1
        tree = batch.tree if isinstance(batch, StepBatch) else batch
        named = [f"{i} ({len(tree.rollouts[i])} tokens, group {tree.rollouts[i].group_id})"
                 for i in out.nonfinite_rollouts] if tree is not None else []
        warnings.warn(f"batch {batch_idx} skipped on every rank (loss {out.loss}, gradient norm {out.grad_norm}); "
                      f"rank {self.global_rank}: non-finite loss terms in rollouts {named or 'none of this rank'} "
                      "(indices in this rank's tree)", RuntimeWarning, stacklevel=2)
        if self._nonfinite_in_a_row >= self.max_nonfinite_skips:
            raise RuntimeError(f"{self._nonfinite_in_a_row} steps in a row had a non-finite loss or gradient "
                               f"(max_nonfinite_skips={self.max_nonfinite_skips}): the run stops. Check the "
                               "rollouts named above (log-probs, advantages) and the learning rate")

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
