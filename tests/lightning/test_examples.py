"""The examples run, and the four ways of training (plain PyTorch, Trainer + DTAModule, an existing module
calling the DFS step, Accelerate) compute the same losses from the same seed and data."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from tests import helpers

EXAMPLES = helpers.REPO / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plain_losses() -> list[float]:
    losses = load("plain_pytorch").main(steps=2)
    assert len(losses) == 2 and losses[0] != losses[1]
    return losses


def test_lightning_trainer_example(plain_losses: list[float], tmp_path: Path) -> None:
    trainer = load("lightning_trainer").main(max_steps=2, log_dir=str(tmp_path))
    rows = csv.DictReader(open(Path(trainer.logger.log_dir) / "metrics.csv"))
    losses = [float(r["train/loss"]) for r in sorted(rows, key=lambda r: int(r["step"])) if r.get("train/loss")]
    assert losses == pytest.approx(plain_losses, rel=1e-6)


def test_existing_module_example(plain_losses: list[float]) -> None:
    module = load("existing_lightning_module").main(max_steps=1)
    assert float(module.trainer.callback_metrics["policy/loss"]) == pytest.approx(plain_losses[0], rel=1e-6)
    assert len(module.grad_norms) == 1  # on_before_optimizer_step fired once for the whole DFS step


def test_accelerate_example(plain_losses: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    # A fresh one-process Accelerate state: the shared state of an earlier test in this process (or a launcher's
    # variables) would make Accelerate prepare DDP without a process group.
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    losses = load("accelerate_loop").main(steps=2, accelerator=Accelerator(cpu=True))
    assert losses == pytest.approx(plain_losses, rel=1e-6)
