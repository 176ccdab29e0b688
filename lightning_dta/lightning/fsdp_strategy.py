"""``DTAFSDPStrategy`` (``Trainer(strategy="dta_fsdp")``): DFS training with weights, gradients and optimizer state
sharded over the ranks by FSDP2.

Built on Lightning's ``ModelParallelStrategy`` (the FSDP2 / DTensor support of Lightning), not on ``DTAStrategy``
plus ``fully_shard``, because that strategy already brings what a sharded run needs around the step and what a
DDP-based one would have to rewrite: a device mesh, sharded checkpoints through ``torch.distributed.checkpoint``
(each rank writes its shards; ``save_distributed_checkpoint=False`` gathers one file), resuming into the shards,
and meta-device initialisation. What this strategy adds:

- sharding: each decoder layer (found from the model's ``_no_split_modules``, or ``wrap_modules``) and the root,
  in ``setup``, with the Trainer's precision: ``bf16-mixed`` keeps float32 shards and computes in bfloat16
  (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``); ``bf16-true`` shards bfloat16 weights
  and sums gradients in float32; ``32-true`` is plain float32. ``reshard_after_forward`` and ``cpu_offload`` are
  FSDP2's own options (the DFS step itself always runs unsharded, see :mod:`lightning_dta.distributed.sharding`);
- a model given as a local Hugging Face checkpoint (or a hub name, downloaded once) is built on the meta device
  and loaded into the shards (every rank reads only its slices): no rank ever holds the whole model;
- the DFS step: one all-gather per unit before the walk, no collective during it (every rank walks its own tree),
  one reduce-scatter per unit after it, summed over ranks (:func:`lightning_dta.lightning.step.tree_step_backward`);
- the failure watchdog of ``DTAStrategy`` (:mod:`lightning_dta.distributed.faults`), and the same refusals (automatic
  optimization, ``16-mixed``).

Registered as ``"dta_fsdp"`` on ``import lightning_dta``. There are no ``_spawn``/``_fork`` variants: the parent
strategy launches by re-running the script (``torchrun``/SLURM environments are picked up as usual).
"""

from __future__ import annotations

from datetime import timedelta

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from typing_extensions import override

from lightning_dta.distributed.faults import FailureWatchdogMixin
from lightning_dta.distributed.sharding import ShardingError, load_hf_checkpoint, materialize, shard


class DTAFSDPStrategy(FailureWatchdogMixin, ModelParallelStrategy):
    """DFS training on FSDP2-sharded weights (module docstring).

    Args:
        wrap_modules: class names of the blocks to shard one by one (default: the model's ``_no_split_modules``).
        reshard_after_forward: FSDP2's option for forwards outside the DFS step (the step keeps every unit
            unsharded from its first forward to its last backward, whatever this says).
        cpu_offload: keep the shards (and their optimizer state) in CPU memory between their uses on the GPU (FSDP2
            ``CPUOffloadPolicy``; GPU only, not run here).
        save_distributed_checkpoint: checkpoints as a folder of per-rank shards (default) or one gathered file.
        process_group_backend, timeout: as for Lightning's strategies.
    """

    strategy_name = "dta_fsdp"
    shards_model = True  # DTAModule builds a checkpoint-path model on the meta device for it

    def __init__(self, wrap_modules: list[str] | None = None, reshard_after_forward: bool = True,
                 cpu_offload: bool = False, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.wrap_modules = list(wrap_modules) if wrap_modules else None
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank shards: a 1-D mesh
        self._tensor_parallel_size = 1
        super().setup_environment()
        self._start_failure_watchdog()

    def _mixed_precision(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        precision = getattr(self.precision_plugin, "precision", "32-true")
        if precision == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision in ("bf16-true", "16-true"):
            return MixedPrecisionPolicy(reduce_dtype=torch.float32)
        return None

    @override
    def setup(self, trainer: Trainer) -> None:
        """Shard the causal LM (and load it into the shards when it was built on the meta device), then
        Lightning's setup: device, precision, optimizers over the shards."""
        module = self.lightning_module
        if module is not None and module.automatic_optimization:
            raise RuntimeError(
                "strategy='dta_fsdp' trains manual-optimization modules that run one DFS step per batch (DTAModule, or "
                "a module calling lightning_dta.dfs_training_step). Fix: set `self.automatic_optimization = False`.")
        if getattr(self.precision_plugin, "precision", None) == "16-mixed":
            raise RuntimeError("precision='16-mixed' scales the loss in manual_backward, which a DFS step does not "
                               "call. Fix: precision='bf16-mixed', 'bf16-true' or '32-true'.")
        if self.cpu_offload and self.root_device.type == "cpu":
            raise ShardingError("cpu_offload keeps the shards in CPU memory between their uses on a GPU; the model "
                                "already runs on the CPU. Fix: cpu_offload=False (or train on GPUs)")
        model = getattr(module, "model", None)
        if not isinstance(model, nn.Module):
            raise ShardingError(f"strategy='dta_fsdp' shards `{type(module).__name__}.model`, the causal LM; it is "
                                f"{type(model).__name__}. Fix: keep the model in `self.model` (as DTAModule does)")
        on_meta = any(p.is_meta for p in model.parameters())
        buffers = {name: b for name, b in model.named_buffers() if not b.is_meta}
        if getattr(self.precision_plugin, "precision", None) in ("bf16-true", "16-true"):
            model.to(dtype=torch.bfloat16 if self.precision_plugin.precision == "bf16-true" else torch.float16)
        shard(model, self.device_mesh["data_parallel"], mp_policy=self._mixed_precision(),
              reshard_after_forward=self.reshard_after_forward, offload=self.cpu_offload,
              wrap_modules=self.wrap_modules)
        if on_meta:
            checkpoint = getattr(module, "hf_checkpoint", None)
            if checkpoint is None:
                raise ShardingError("the model was built on the meta device but there is no checkpoint to load "
                                    "into its shards. Fix: give DTAModule a local checkpoint path or a hub name")
            materialize(model, self.root_device, buffers)
            load_hf_checkpoint(model, checkpoint)
        super().setup(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="DFS prefix-tree training on FSDP2-sharded weights")
