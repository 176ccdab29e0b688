"""Lightning callbacks that measure DFS training: throughput (logical and tree tokens/s), peak memory, and a
progress bar in optimizer steps.

Both count on every rank and reduce over ranks from ``on_train_batch_*`` hooks, which every rank runs; a
collective from a rank-0-only hook would hang the other ranks.
"""

from lightning_dta.lightning.callbacks.memory import PeakMemoryMonitor
from lightning_dta.lightning.callbacks.progress import StepProgressBar
from lightning_dta.lightning.callbacks.throughput import TreeThroughputMonitor

__all__ = ["PeakMemoryMonitor", "StepProgressBar", "TreeThroughputMonitor"]
