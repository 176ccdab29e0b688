"""``TreeThroughputMonitor``: tokens per second of a DFS step, counted the way the paper reports them.

Throughput is logical tokens (every rollout counted in full, shared prefixes once per rollout) over the wall
time of the slowest rank; tree tokens/s (each shared token once per rank's tree) shows the work actually done,
and their ratio is the compression. Lightning's own ``ThroughputMonitor`` counts on rank 0 only, which is
wrong as soon as the load balancer gives ranks different trees, so here every rank counts its own batch and
one all-gather yields the token sums and the slowest rank's time.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_dta.contracts import parallel_layout
from lightning_dta.core.errors import ConfigError
from lightning_dta.distributed.collectives import all_gather_floats, synchronize
from lightning_dta.distributed.step import batch_tree


class TreeThroughputMonitor(Callback):
    """Log logical and tree tokens/s per step and over a sliding window of steps.

    Logged (``on_step``, identical on every rank): ``throughput/step_time_sec`` (slowest rank),
    ``throughput/logical_tokens_per_sec``, ``throughput/tree_tokens_per_sec``, ``throughput/rollouts_per_sec``,
    ``throughput/compression_ratio``, ``throughput/rank_time_ratio`` (slowest / fastest rank) and the
    ``..._window`` variants of the token rates over the last ``window_size`` steps (steady state, without the
    first step's warm-up dominating). The progress bar shows ``tok/s`` (logical tokens/s, windowed).

    Args:
        window_size: steps in the sliding window.
        prog_bar: show ``tok/s`` in the progress bar.
    """

    def __init__(self, window_size: int = 20, prog_bar: bool = True) -> None:
        if window_size < 1:
            raise ConfigError(f"window_size must be >= 1, got {window_size}")
        self.window_size = window_size
        self.prog_bar = prog_bar
        self._start: float | None = None
        self._window: deque[tuple[float, float, float]] = deque(maxlen=window_size)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._window.clear()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        synchronize(trainer.strategy.root_device)
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._start is None:
            return
        device = trainer.strategy.root_device
        synchronize(device)
        elapsed = time.perf_counter() - self._start
        self._start = None
        tree = batch_tree(batch)
        stats = (0, 0, 0) if tree is None else (tree.stats.num_rollouts, tree.stats.logical_tokens,
                                                 tree.stats.tree_tokens)
        # every rank calls this hook: no hang; over the ranks that walk different trees (tensor-parallel peers walk
        # one tree: counting every peer would count its tokens once per peer)
        group = parallel_layout(trainer.strategy).data_parallel_group
        ranks = all_gather_floats([elapsed, *stats], device, group=group)
        slowest = max(r[0] for r in ranks)
        fastest = min(r[0] for r in ranks)
        rollouts, logical, tree_tokens = (sum(r[i] for r in ranks) for i in (1, 2, 3))
        self._window.append((slowest, logical, tree_tokens))
        window_time = sum(w[0] for w in self._window)
        metrics = {
            "throughput/step_time_sec": slowest,
            "throughput/logical_tokens_per_sec": logical / slowest,
            "throughput/tree_tokens_per_sec": tree_tokens / slowest,
            "throughput/rollouts_per_sec": rollouts / slowest,
            "throughput/compression_ratio": logical / max(tree_tokens, 1.0),
            "throughput/rank_time_ratio": slowest / max(fastest, 1e-9),
            "throughput/logical_tokens_per_sec_window": sum(w[1] for w in self._window) / window_time,
            "throughput/tree_tokens_per_sec_window": sum(w[2] for w in self._window) / window_time,
        }
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        if self.prog_bar:
            pl_module.log("tok/s", metrics["throughput/logical_tokens_per_sec_window"], prog_bar=True,
                          logger=False, on_step=True, on_epoch=False, batch_size=1)
