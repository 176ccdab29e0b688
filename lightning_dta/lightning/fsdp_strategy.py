"""``DTAFSDPStrategy`` (``Trainer(strategy="dta_fsdp")``): DFS training with weights, gradients and optimizer state
sharded over the ranks by FSDP2.

Built on Lightning's ``ModelParallelStrategy`` (the FSDP2 / DTensor support of Lightning), not on ``DTAStrategy``
plus ``fully_shard``, because that strategy already brings what a sharded run needs around the step and what a
DDP-based one would have to rewrite: a device mesh, sharded checkpoints through ``torch.distributed.checkpoint``
(each rank writes its shards; ``save_distributed_checkpoint=False`` gathers one file), resuming into the shards,
and meta-device initialisation. What this strategy adds:

- sharding: each decoder layer (found from the model's ``_no_split_modules``, or ``wrap_modules``) and the root,
  applied by the module in ``configure_model`` from this strategy's :class:`~lightning_dta.contracts.ParallelLayout`
  (Lightning's ``ModelParallelStrategy`` convention), with the Trainer's precision: ``bf16-mixed`` keeps float32
  shards and computes in bfloat16 (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``);
  ``bf16-true`` shards bfloat16 weights and sums gradients in float32; ``32-true`` is plain float32.
  ``reshard_after_forward`` and ``cpu_offload`` are FSDP2's own options (the DFS step itself always runs unsharded, see
  :mod:`lightning_dta.distributed.sharding`);
- a model given as a local Hugging Face checkpoint (or a hub name, downloaded once) is built on the meta device
  and loaded into the shards (every rank reads only its slices): no rank ever holds the whole model;
- the DFS step: one all-gather per unit before the walk, no collective during it (every rank walks its own tree),
  one reduce-scatter per unit after it, summed over ranks (:func:`lightning_dta.distributed.step.tree_step_backward`);
- the watchdog of ``DTAStrategy`` (:mod:`lightning_dta.lightning.watchdog`: a failure stops every rank within
  seconds, SIGTERM every rank at the end of the same step, with status 143), and the same refusals (automatic
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
from typing_extensions import override

from lightning_dta.contracts import ParallelLayout, Sharding
from lightning_dta.distributed.faults import DEFAULT_SIGNAL_GRACE_SEC
from lightning_dta.distributed.sharding import ShardingError, is_sharded
from lightning_dta.lightning.step import check_dfs_setup
from lightning_dta.lightning.watchdog import RankWatchdogMixin, check_signal_grace


class DTAFSDPStrategy(RankWatchdogMixin, ModelParallelStrategy):
    """DFS training on FSDP2-sharded weights (module docstring).

    Args:
        wrap_modules: class names of the blocks to shard one by one (default: the model's ``_no_split_modules``).
        reshard_after_forward: FSDP2's option for forwards outside the DFS step (the step keeps every unit
            unsharded from its first forward to its last backward, whatever this says).
        cpu_offload: keep the shards (and their optimizer state) in CPU memory between their uses on the GPU (FSDP2
            ``CPUOffloadPolicy``; GPU only, not run here).
        save_distributed_checkpoint: checkpoints as a folder of per-rank shards (default) or one gathered file.
        process_group_backend, timeout: as for Lightning's strategies.
        signal_grace_sec: as for ``DTAStrategy``: after SIGTERM, a rank that has not stopped within this many
            seconds exits with status 143.
    """

    strategy_name = "dta_fsdp"

    def __init__(self, wrap_modules: list[str] | None = None, reshard_after_forward: bool = True,
                 cpu_offload: bool = False, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 signal_grace_sec: float = DEFAULT_SIGNAL_GRACE_SEC) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.wrap_modules = list(wrap_modules) if wrap_modules else None
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.signal_grace_sec = check_signal_grace(signal_grace_sec)

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank shards: a 1-D mesh
        self._tensor_parallel_size = 1
        super().setup_environment()
        self._start_watchdog()

    @property
    def parallel_layout(self) -> ParallelLayout:
        """Every rank walks its own tree on FSDP2-sharded weights: the module shards its model over the mesh's
        ``data_parallel`` dimension in ``configure_model``
        (:func:`~lightning_dta.distributed.parallelize.parallelize_model`), with this strategy's options and the
        Trainer's precision."""
        return ParallelLayout(device_mesh=self.device_mesh, sharding=self._sharding())

    def _sharding(self) -> Sharding:
        """``bf16-mixed`` keeps float32 shards and computes in bfloat16; ``bf16-true``/``16-true`` shard half-precision
        weights and sum gradients in float32; ``32-true`` is plain float32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        precision = self.precision_plugin.precision
        mp_policy, param_dtype = None, None
        if precision == "bf16-mixed":
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        elif precision in ("bf16-true", "16-true"):
            mp_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
            param_dtype = torch.bfloat16 if precision == "bf16-true" else torch.float16
        return Sharding(wrap_modules=tuple(self.wrap_modules) if self.wrap_modules else None,
                        reshard_after_forward=self.reshard_after_forward, offload=self.cpu_offload,
                        param_dtype=param_dtype, mp_policy=mp_policy)

    @override
    def setup(self, trainer: Trainer) -> None:
        """Check the set-up and that the module sharded its model in ``configure_model``, then Lightning's setup:
        device, precision, optimizers over the shards."""
        check_dfs_setup(self)
        if self.cpu_offload and self.root_device.type == "cpu":
            raise ShardingError("cpu_offload keeps the shards in CPU memory between their uses on a GPU; the model "
                                "already runs on the CPU. Fix: cpu_offload=False (or train on GPUs)")
        module = self.lightning_module
        if not any(is_sharded(child) for child in module.children()):
            raise ShardingError(
                f"strategy='dta_fsdp' found no FSDP2-sharded model in {type(module).__name__}: under this strategy the "
                "module shards its causal LM in configure_model, as DTAModule does. Fix: in configure_model call "
                "lightning_dta.parallelize_model(self.model, self.trainer.strategy.parallel_layout, "
                "self.trainer.strategy.root_device)")
        super().setup(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="DFS prefix-tree training on FSDP2-sharded weights")
