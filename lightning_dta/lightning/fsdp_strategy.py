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
from typing import Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_dta.contracts import DATA_PARALLEL, ParallelLayout, Sharding, TensorParallelism
from lightning_dta.core.errors import ConfigError
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
            ``CPUOffloadPolicy``; GPU only: ``tests/gpu/test_cpu_offload.py``).
        save_distributed_checkpoint: checkpoints as a folder of per-rank shards (default) or one gathered file.
        tensor_parallel_size: split every weight over this many ranks (1: none); the world is then a 2-D mesh
            (``data_parallel`` x ``tensor_parallel``, Lightning's ``ModelParallelStrategy`` names; tensor-parallel
            peers are neighbouring ranks, i.e. within a node) and the peers of a group walk the same tree. The plan is
            the model's own transformers plan (``lightning_dta.distributed.tensor_parallel``).
        vocab_parallel: with tensor parallelism, split the input embedding and the LM head by vocabulary too.
        tensor_parallel_plan: entries ``{module pattern: transformers style}`` that replace or add to the model's
            plan (e.g. ``{"model.layers.*.self_attn.q_norm": "replicate"}``).
        walk_gradient_dtype: the dtype the walk accumulates the unsharded gradient in under half-precision weights:
            ``float32`` (4 bytes per parameter during the walk) or ``bfloat16`` (2 bytes; the reduce-scatter then runs
            in bfloat16 too). FSDP2 keeps the unsharded gradient in its ``reduce_dtype``.
        process_group_backend, timeout: as for Lightning's strategies.
        signal_grace_sec: as for ``DTAStrategy``: after SIGTERM, a rank that has not stopped within this many
            seconds exits with status 143.
    """

    strategy_name = "dta_fsdp"

    def __init__(self, wrap_modules: list[str] | None = None, reshard_after_forward: bool = True,
                 cpu_offload: bool = False, save_distributed_checkpoint: bool = True, tensor_parallel_size: int = 1,
                 vocab_parallel: bool = True, tensor_parallel_plan: dict[str, str] | None = None,
                 walk_gradient_dtype: Literal["float32", "bfloat16"] = "float32",
                 process_group_backend: str | None = None, timeout: timedelta | None = default_pg_timeout,
                 signal_grace_sec: float = DEFAULT_SIGNAL_GRACE_SEC) -> None:
        if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) \
                or tensor_parallel_size < 1:
            raise ConfigError(f"DTAFSDPStrategy(tensor_parallel_size={tensor_parallel_size!r}): the ranks of one "
                              "tensor-parallel group. Fix: a positive int (1: no tensor parallelism)")
        if walk_gradient_dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"DTAFSDPStrategy(walk_gradient_dtype={walk_gradient_dtype!r}) is unknown. Fix: "
                              "'float32' or 'bfloat16'")
        super().__init__(data_parallel_size="auto", tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.wrap_modules = list(wrap_modules) if wrap_modules else None
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.tensor_parallel_size = tensor_parallel_size
        self.vocab_parallel = vocab_parallel
        self.tensor_parallel_plan = dict(tensor_parallel_plan or {})
        self.walk_gradient_dtype = walk_gradient_dtype
        self.signal_grace_sec = check_signal_grace(signal_grace_sec)

    @override
    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        if world % self.tensor_parallel_size:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} does not divide the {world} ranks "
                             f"(devices x nodes). Fix: a tensor-parallel size that divides {world}, or more devices")
        precision = self.precision_plugin.precision
        if self.walk_gradient_dtype == "bfloat16" and precision not in ("bf16-true", "bf16-mixed"):
            raise ConfigError(f"walk_gradient_dtype='bfloat16' halves the gradient the walk holds under bfloat16 "
                             f"weights; the precision is {precision!r}. Fix: precision='bf16-true' (or 'bf16-mixed'), "
                             "or walk_gradient_dtype='float32'")
        self._data_parallel_size = world // self.tensor_parallel_size  # every rank shards over its dp group
        self._tensor_parallel_size = self.tensor_parallel_size
        super().setup_environment()
        self._start_watchdog()

    @property
    def parallel_layout(self) -> ParallelLayout:
        """Every data-parallel rank walks its own tree on FSDP2-sharded weights (the tensor-parallel peers of a rank
        walk the same one): the module parallelizes its model in ``configure_model``
        (:func:`~lightning_dta.distributed.parallelize.parallelize_model`) with this strategy's options and the
        Trainer's precision; the step's sums run over the ``data_parallel`` dimension."""
        mesh = self.device_mesh
        tensor = None
        if self.tensor_parallel_size > 1:
            tensor = TensorParallelism(self.tensor_parallel_size, self.vocab_parallel,
                                       tuple(sorted(self.tensor_parallel_plan.items())))
        group = mesh[DATA_PARALLEL].get_group() if tensor is not None else None  # None: every rank (the same)
        return ParallelLayout(data_parallel_group=group, device_mesh=mesh, sharding=self._sharding(),
                              tensor_parallelism=tensor)

    def _sharding(self) -> Sharding:
        """``bf16-mixed`` keeps float32 shards and computes in bfloat16; ``bf16-true``/``16-true`` shard half-precision
        weights and sum gradients in float32 (``walk_gradient_dtype="bfloat16"``: in bfloat16); ``32-true`` is plain
        float32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        precision = self.precision_plugin.precision
        reduce_dtype = None if self.walk_gradient_dtype == "bfloat16" else torch.float32
        mp_policy, param_dtype = None, None
        if precision == "bf16-mixed":
            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        elif precision in ("bf16-true", "16-true"):
            mp_policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
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
