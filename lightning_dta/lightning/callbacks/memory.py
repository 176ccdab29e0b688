"""``PeakMemoryMonitor``: the peak memory of each training step, per step (not since the process started).

On CUDA it reads ``torch.cuda.max_memory_allocated``/``max_memory_reserved`` and resets them at the start of
each step. On the CPU it reads the process's peak resident set size (``VmHWM`` in ``/proc/self/status``) and
resets it by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0); where that is not possible the value
falls back to ``resource.getrusage`` and is the peak since the process started. The per-rank values are
all-gathered and the maximum over ranks is logged, since the rank that runs out of memory is the one that matters.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from lightning_dta.distributed.collectives import all_gather_floats
from lightning_dta.engine.memory import peak_rss_bytes, reset_peak_rss

GIB = 2.0**30


class PeakMemoryMonitor(Callback):
    """Log each step's peak memory, maximum over ranks, in GiB.

    Logged: ``memory/cpu_peak_rss_gib`` always; ``memory/cuda_max_allocated_gib`` and
    ``memory/cuda_max_reserved_gib`` when training on a CUDA device.
    """

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        reset_peak_rss()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        device = trainer.strategy.root_device
        values = [peak_rss_bytes() / GIB]
        if device.type == "cuda":
            values += [torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB]
        ranks = all_gather_floats(values, device)  # every rank calls this hook: no hang
        peak = [max(r[i] for r in ranks) for i in range(len(values))]
        names = ["memory/cpu_peak_rss_gib", "memory/cuda_max_allocated_gib", "memory/cuda_max_reserved_gib"]
        pl_module.log_dict(dict(zip(names, peak)), on_step=True, on_epoch=False, batch_size=1)
