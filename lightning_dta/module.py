"""``DTAModule``: a manual-optimization ``LightningModule`` that trains a Hugging Face causal LM with DFS steps.

Each ``training_step`` receives this rank's :class:`~lightning_dta.batch.StepBatch` and runs exactly one
optimizer step (:func:`~lightning_dta.step.dfs_training_step`): normaliser all-reduce, DFS, one gradient sum
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

from lightning_dta.batch import StepBatch
from lightning_dta.engine import EngineOptions
from lightning_dta.losses import PolicyLoss
from lightning_dta.step import DFSStepMixin, StepOutput
from lightning_dta.tree import PrefixTree

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
    """

    def __init__(self, model: ModelSpec, *, model_kwargs: dict[str, Any] | None = None,
                 loss: PolicyLoss = PolicyLoss(), engine: EngineOptions = EngineOptions(),  # noqa: B008 (frozen)
                 optimizer: OptimizerCallable = torch.optim.AdamW, lr_scheduler: LRSchedulerCallable | None = None,
                 gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm",
                 max_nonfinite_skips: int = 3) -> None:
        super().__init__()
        self.automatic_optimization = False
        if max_nonfinite_skips < 1:
            raise ValueError(f"max_nonfinite_skips={max_nonfinite_skips} must be >= 1")
        self.max_nonfinite_skips = max_nonfinite_skips
        self.loss_fn = loss if isinstance(loss, PolicyLoss) else PolicyLoss(**loss)  # a mapping: from a checkpoint
        self.engine = EngineOptions.resolve(engine)
        self._save_plain_hyperparameters(ignore=["model"] if isinstance(model, nn.Module) else [])
        self.model_spec = None if isinstance(model, nn.Module) else model  # a module is registered once, below
        self.model_kwargs = dict(model_kwargs or {})
        self.model: nn.Module | None = model if isinstance(model, nn.Module) else None
        self.hf_checkpoint: Path | None = None  # set when the model is built on the meta device (sharded runs)
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm

    def _save_plain_hyperparameters(self, ignore: list[str]) -> None:
        """``save_hyperparameters`` minus Python objects (an optimizer class, a ``functools.partial``), with the loss
        and the engine options stored as plain dicts.

        Lightning resumes with ``torch.load(weights_only=True)``, which refuses arbitrary globals in the
        checkpoint, so a stored ``torch.optim.AdamW`` would make every Python-side checkpoint unloadable. From
        LightningCLI the hyper-parameters are the parsed config (plain data) and are all kept.
        """
        frame = inspect.currentframe().f_back
        self.save_hyperparameters(ignore=[*ignore, "loss", "engine"], frame=frame)
        opaque = [key for key, value in self.hparams.items() if not _is_plain(value)]
        if opaque:
            self.save_hyperparameters(ignore=[*ignore, "loss", "engine", *opaque], frame=frame)
        self.hparams.update(loss=dataclasses.asdict(self.loss_fn), engine=self.engine.to_dict())

    @override
    def configure_model(self) -> None:
        """Build the causal LM once (Lightning may call this hook again, e.g. for ``validate`` after ``fit``).

        Under a sharding strategy (``dta_fsdp``) a checkpoint path or hub name is built on the meta device and
        the strategy loads it into the shards (``hf_checkpoint``), so no rank holds the whole model."""
        if self.model is not None:
            return
        strategy = self._trainer.strategy if self._trainer is not None else None
        if getattr(strategy, "shards_model", False) and isinstance(self.model_spec, (str, PathLike)):
            self.model, self.hf_checkpoint = build_on_meta(self.model_spec, self.model_kwargs)
        else:
            self.model = build_causal_lm(self.model_spec, self.model_kwargs)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the model's config in the checkpoint: ``lightning-dta export`` builds the Hugging Face model from it
        without downloading anything."""
        if self.model is not None and hasattr(self.model, "config"):
            checkpoint["hf_config"] = self.model.config.to_dict()

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
        if self.model is not None:
            total = sum(p.numel() for p in self.model.parameters())
            trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            rank_zero_info(f"model: {type(self.model).__name__}, {total:,} parameters ({trained:,} trained), "
                           f"{next(self.model.parameters()).dtype}")

    @override
    def training_step(self, batch: StepBatch | PrefixTree | None, batch_idx: int) -> torch.Tensor:
        out = self.dfs_training_step(batch, self.loss_fn, model=self.model, engine=self.engine,
                                     gradient_clip_val=self.gradient_clip_val,
                                     gradient_clip_algorithm=self.gradient_clip_algorithm)
        self._guard_nonfinite(out, batch, batch_idx)
        lr = self.optimizers().optimizer.param_groups[0]["lr"]  # the rate this step used
        scheduler = self.lr_schedulers()
        if scheduler is not None:
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
