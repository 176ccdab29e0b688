"""``lightning-dta fit --config configs/tiny_cpu.yaml`` with tensor parallelism logs the one-process steps.

The config runs unchanged but for ``--trainer.devices=N --trainer.strategy=lightning_dta.DTAFSDPStrategy
--trainer.strategy.tensor_parallel_size=2`` (LightningCLI's class-path form). Per optimizer step the logged
``train/loss`` and ``train/grad_norm`` equal those of ``strategy=dta`` on one process (float32, relative 1e-5: the
tolerance of the dta_fsdp-vs-dta test in tests/lightning/test_cli.py). AdamW, and clipping at 0.3, below every
step's norm (~0.5), so the later steps' losses also check the clipped update. A normaliser or a gradient norm summed
over the tensor-parallel peers would be off by a factor (the prototype's norm read 7.82 for 6.77), a per-peer data
partition would train other rollouts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.lightning import run_cli, step_rows

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
RTOL = 1e-5
TP2 = ("--trainer.strategy=lightning_dta.DTAFSDPStrategy", "--trainer.strategy.tensor_parallel_size=2")
QWEN3 = ("--model.model.model_type=qwen3", "--model.model.head_dim=16")  # per-head q/k norms; head_dim 64 / 4 heads
STEPS = 3
CLIP = 0.3


def assert_same_steps(parallel: list[dict], single: list[dict], steps: int) -> None:
    assert len(parallel) == len(single) == steps
    for a, b in zip(parallel, single):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=RTOL)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=RTOL)
        assert a["train/logical_tokens"] == b["train/logical_tokens"]  # the same rollouts, each counted once
        assert a["train/num_rollouts"] == b["train/num_rollouts"] == 16
        assert b["train/grad_norm"] > CLIP  # clipping acted


@pytest.mark.parametrize("shape", [pytest.param((), marks=pytest.mark.long, id="llama"),
                                   pytest.param(QWEN3, id="qwen3")])
def test_tp2_on_two_processes_logs_the_one_process_steps(tmp_path: Path, shape: tuple[str, ...]) -> None:
    """TP 2 x DP 1: both ranks walk the same trees (the whole step), each with half of every weight. The config's
    Llama runs under ``long`` (the default suite's Llama under TP: test_tp_resume), Qwen3 in the default suite."""
    steps = (f"--trainer.max_steps={STEPS}", f"--model.gradient_clip_val={CLIP}")
    parallel = step_rows(run_cli(tmp_path / "tp", "--trainer.devices=2", *TP2, *steps, *shape))
    single = step_rows(run_cli(tmp_path / "one", *steps, *shape))
    assert_same_steps(parallel, single, STEPS)


@pytest.mark.long
def test_tp2_dp2_on_four_processes_logs_the_one_process_steps(tmp_path: Path) -> None:
    """TP 2 x DP 2 on 4 processes (measured 41 s on 2 cores): ranks {0, 1} and {2, 3} each walk half of every
    step (the data-parallel partition), FSDP2 shards the tensor-parallel shards over the data-parallel pair."""
    steps = ("--trainer.max_steps=4", f"--model.gradient_clip_val={CLIP}")
    parallel = step_rows(run_cli(tmp_path / "tp", "--trainer.devices=4", *TP2, *steps, timeout=600))
    single = step_rows(run_cli(tmp_path / "one", *steps))
    assert_same_steps(parallel, single, 4)
