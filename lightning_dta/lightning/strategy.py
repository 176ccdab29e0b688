"""``DTAStrategy``: multi-process data parallelism for DFS training, without a DDP wrapper.

A DFS step runs one backward per tree node. ``DistributedDataParallel`` reduces gradients from autograd hooks
during backward, so it would all-reduce once per node, or, under ``no_sync``, leave a parameter touched only in
``no_sync`` backwards silently unsynced (``docs/traps.md``). This strategy therefore keeps every rank's module
unwrapped and only guarantees what the DFS step (:mod:`lightning_dta.distributed.step`) relies on, offered to it as a
:class:`~lightning_dta.contracts.ParallelLayout` (``parallel_layout``):

- identical weights on every rank: rank 0's parameters and buffers are broadcast at setup (also after a
  checkpoint restore, which Lightning does before ``Strategy.setup``);
- a process group (gloo on CPU, NCCL on GPU) for the step's collectives: the loss-normaliser all-reduce
  before the DFS and one flattened SUM of the gradients after it (``bucket_mb`` per bucket);
- the usual DDP launchers, ranks, ``barrier``/``broadcast``/``reduce`` for logging and checkpointing, which it
  inherits from Lightning's ``DDPStrategy``;
- a failure on one rank stops every rank within seconds, with that rank's error printed on all of them, instead
  of the others waiting for the collective timeout; SIGTERM to any rank stops every rank at the end of the same
  step, with exit status 143 (:mod:`lightning_dta.lightning.watchdog`).

On a single device no process group is created at all and every collective is a no-op, so ``devices=1`` runs
the same code. Lightning finds no third-party strategy by itself, so ``import lightning_dta`` registers the
names ``"dta"`` (subprocess launcher, as ``"ddp"``; for scripts and the CLI), ``"dta_spawn"`` (spawned
processes, as ``"ddp_spawn"``; for code that cannot be re-run once per rank) and ``"dta_fork"`` (forked
processes, as ``"ddp_notebook"``; for notebooks, CPU or before CUDA is initialised).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_dta.contracts import DEFAULT_BUCKET_MB, ParallelLayout
from lightning_dta.core.errors import ConfigError
from lightning_dta.distributed.collectives import broadcast_module
from lightning_dta.distributed.faults import DEFAULT_SIGNAL_GRACE_SEC
from lightning_dta.lightning.step import check_dfs_setup
from lightning_dta.lightning.watchdog import RankWatchdogMixin, check_signal_grace


class DTAStrategy(RankWatchdogMixin, DDPStrategy):
    """Data parallelism for DFS steps: unwrapped module, weights broadcast at setup, gradients summed once per step.

    Args:
        bucket_mb: size of each flattened gradient bucket summed across ranks (one all-reduce per bucket).
        process_group_backend: ``"gloo"``/``"nccl"``; default: NCCL on CUDA, gloo on CPU.
        timeout: collective timeout.
        start_method: ``"popen"`` (re-run the script per rank, like ``"ddp"``) or ``"spawn"``/``"fork"``.
        signal_grace_sec: after SIGTERM, a rank that has not stopped with the others within this many seconds (a
            step or a checkpoint that takes longer, a collective that does not end) exits with status 143.
        The other arguments are filled in by the Trainer, as for every Lightning strategy.
    """

    strategy_name = "dta"

    def __init__(self, accelerator: Accelerator | None = None, parallel_devices: list[torch.device] | None = None,
                 cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
                 precision_plugin: Precision | None = None, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
                 bucket_mb: float = DEFAULT_BUCKET_MB, signal_grace_sec: float = DEFAULT_SIGNAL_GRACE_SEC) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        if not bucket_mb > 0:
            raise ConfigError(f"DTAStrategy bucket_mb={bucket_mb!r}: the size in MB of each gradient bucket summed "
                              f"over ranks. Fix: a positive size (default {DEFAULT_BUCKET_MB})")
        self.bucket_mb = float(bucket_mb)
        self.signal_grace_sec = check_signal_grace(signal_grace_sec)

    @property
    def parallel_layout(self) -> ParallelLayout:
        """Every rank walks its own tree with replicated weights; the step's sums run over every rank."""
        return ParallelLayout(bucket_mb=self.bucket_mb)

    @property
    def _single_process(self) -> bool:
        return self.num_nodes * self.num_processes <= 1

    @override
    def _configure_launcher(self) -> None:
        """No launcher for a single process. Lightning's subprocess launcher would otherwise export
        ``LOCAL_RANK``/``MASTER_PORT`` into this process's environment even for one device, and a later
        multi-process Trainer (or Accelerate) in the same interpreter would read them as "launched externally"."""
        if self._single_process:
            self._launcher = None
            return
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        """Create the process group, except on a single process where every collective is a no-op anyway
        (no port to bind, nothing to tear down)."""
        if self._single_process and not dist.is_initialized():
            self.set_world_ranks()
            return
        super().setup_distributed()
        self._start_watchdog()

    @override
    def setup(self, trainer: Trainer) -> None:
        """``DDPStrategy.setup`` without the wrapper: convert precision, move to the device, broadcast the weights
        of rank 0 (they may differ: random init, or a restore on rank 0 only), then build the optimizers.

        Copied rather than inherited because ``DDPStrategy.setup`` wraps the module (``configure_ddp``) when
        fitting and otherwise syncs module states through the default process group, which a single-process
        ``DTAStrategy`` never creates; ``broadcast_module`` serves both cases and is a no-op on one process."""
        assert self.accelerator is not None and self.model is not None
        check_dfs_setup(self)
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        broadcast_module(self.model, bucket_mb=self.bucket_mb)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def configure_ddp(self) -> None:
        """Nothing to wrap (kept so code that calls ``DDPStrategy.configure_ddp`` still works)."""

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("dta", "popen"), ("dta_spawn", "spawn"), ("dta_fork", "fork")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"DFS prefix-tree training, start_method '{start_method}'",
                    start_method=start_method)
