"""TreeThroughputMonitor and PeakMemoryMonitor: what they log is what the steps did."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

import lightning_dta as dta
from tests.helpers.lightning import StepBatchData, grpo_rollouts, rank_batch, tiny_llama


def test_throughput_and_memory_are_logged_per_step(tmp_path: Path) -> None:
    batches = [rank_batch(grpo_rollouts(seed=s, groups=2 + s), 0, 1) for s in range(3)]  # different sizes
    trainer = L.Trainer(strategy="dta", accelerator="cpu", devices=1, max_steps=3, log_every_n_steps=1,
                        logger=CSVLogger(tmp_path), enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[dta.TreeThroughputMonitor(window_size=2), dta.PeakMemoryMonitor()])
    trainer.fit(dta.DTAModule(tiny_llama()), StepBatchData(lambda t: batches))
    assert "tok/s" in trainer.progress_bar_metrics
    rows = [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(
        open(Path(trainer.logger.log_dir) / "metrics.csv"))]
    rows = sorted((r for r in rows if "throughput/step_time_sec" in r), key=lambda r: r["step"])
    assert len(rows) == 3
    for row, batch in zip(rows, batches):
        stats, seconds = batch.tree.stats, row["throughput/step_time_sec"]
        assert seconds > 0
        assert row["throughput/logical_tokens_per_sec"] * seconds == pytest.approx(stats.logical_tokens, rel=1e-5)
        assert row["throughput/tree_tokens_per_sec"] * seconds == pytest.approx(stats.tree_tokens, rel=1e-5)
        assert row["throughput/rollouts_per_sec"] * seconds == pytest.approx(stats.num_rollouts, rel=1e-5)
        assert row["throughput/compression_ratio"] == pytest.approx(stats.compression_ratio, rel=1e-5)
        assert row["throughput/rank_time_ratio"] == 1.0
        assert 0.05 < row["memory/cpu_peak_rss_gib"] < 20
        assert "memory/cuda_max_allocated_gib" not in row  # CPU run
    last, previous = rows[2], rows[1]
    window_time = last["throughput/step_time_sec"] + previous["throughput/step_time_sec"]
    window_tokens = batches[1].tree.stats.logical_tokens + batches[2].tree.stats.logical_tokens
    assert last["throughput/logical_tokens_per_sec_window"] == pytest.approx(window_tokens / window_time, rel=1e-4)


def test_window_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_size"):
        dta.TreeThroughputMonitor(window_size=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/clear_refs is Linux-only")
def test_peak_rss_is_reset_per_step() -> None:
    """In a fresh process: in a test worker that ran other tests first, a freed 64 MiB block may come back from
    the heap's free space instead of new pages, and then neither raises nor lowers the resident set."""
    code = ("import torch\n"
            "from lightning_dta.engine.memory import peak_rss_bytes, reset_peak_rss\n"
            "block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched\n"
            "high = peak_rss_bytes()\n"
            "del block\n"
            "assert reset_peak_rss()\n"
            "assert peak_rss_bytes() < high - 32 * 2**20, (peak_rss_bytes(), high)  # the peak is forgotten\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
