"""Shared pieces of the Lightning-side tests: a tiny float32 Llama, GRPO-like rollouts, per-rank step batches.

Imported by the tests and by ``dist_worker.py`` (which the tests run as a multi-process script).
"""

from __future__ import annotations

import copy
import csv
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer
from torch.utils.data import DataLoader, IterableDataset

import lightning_dta as dta
from lightning_dta.core.batch import StepBatch
from tests.helpers import REPO

VOCAB = 128
TINY_LLAMA = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


EXECUTABLE = Path(sys.executable).parent / "lightning-dta"  # the console script of [project.scripts]

LAUNCH_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
                    "MASTER_PORT")


def clean_env() -> dict[str, str]:
    """The environment for a test's subprocess that launches its own ranks: without launch variables that an
    earlier in-process run (Lightning's launcher, Accelerate) may have exported, whose port may be in use."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"  # two processes on two cores
    return env


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A float32 tiny Llama with weights scaled up, so logits are far from uniform and clipping is exercised."""
    torch.manual_seed(seed)
    model = dta.models.build_causal_lm(TINY_LLAMA)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    return model


def grpo_rollouts(seed: int = 0, groups: int = 3, per_group: int = 4) -> list[dta.Rollout]:
    """Groups of responses sharing a prompt (a shared system prefix across groups), with behaviour and reference
    log-probs far from the model's so that ratios are clipped and the KL term is active."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(6)]
    rollouts = []
    for g in range(groups):
        prompt = system + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        for _ in range(per_group):
            response = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 8))]
            ids = prompt + response
            mask = [0] * len(prompt) + [1] * len(response)
            rollouts.append(dta.Rollout(
                input_ids=ids, loss_mask=mask, advantages=rng.gauss(0, 1),
                old_logprobs=[-rng.uniform(2.0, 7.0) for _ in ids],
                ref_logprobs=[-rng.uniform(2.0, 7.0) for _ in ids], group_id=g))
    return rollouts


def reference_step(model: torch.nn.Module, rollouts: Sequence[dta.Rollout], loss_kwargs: dict, lr: float,
                   clip: float | None = None) -> dict:
    """The single-process step by hand, on a copy: ``tree_backward`` over all rollouts, clipping, SGD."""
    model = copy.deepcopy(model)
    out = dta.tree_backward(model, dta.PrefixTree.from_rollouts(rollouts), dta.PolicyLoss(**loss_kwargs))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=lr).step()
    return {"grads": grads, "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
            "loss": out.loss, "grad_norm": float(norm)}


def rank_batch(rollouts: Sequence[dta.Rollout], rank: int, world_size: int, empty_rank: int | None = None
               ) -> StepBatch:
    """This rank's share of one step: round-robin, or everything on the other ranks when ``rank == empty_rank``."""
    full = dta.PrefixTree.from_rollouts(rollouts)
    owners = [r for r in range(world_size) if r != empty_rank]
    mine = [i for i in range(len(rollouts)) if owners[i % len(owners)] == rank]
    tree = dta.PrefixTree.from_rollouts([rollouts[i] for i in mine]) if mine else None
    return StepBatch(tree=tree, rank=rank, world_size=world_size, step_stats=full.stats)


class _Batches(IterableDataset):
    def __init__(self, batches: list[StepBatch]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class StepBatchData(LightningDataModule):
    """Yields ``make(trainer)`` (a list of step batches) on each rank, built once the rank (and epoch) is known."""

    def __init__(self, make: Callable[[Trainer], list[StepBatch]]) -> None:
        super().__init__()
        self.make = make

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Batches(self.make(self.trainer)), batch_size=None)


class SignalAtStep(Callback):
    """Send SIGTERM to this process once ``step`` optimizer steps are done (a scheduler stopping the job)."""

    def __init__(self, step: int = 2) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def run_cli(tmp_path: Path, *overrides: str, timeout: float = 300, config: str = "tiny_cpu"
            ) -> list[dict[str, float]]:
    """Run ``lightning-dta fit --config configs/{config}.yaml`` (whose CSV logger is named ``config``) and return the
    metric rows of its CSV log."""
    cmd = [str(EXECUTABLE), "fit", "--config", f"configs/{config}.yaml",
           f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.enable_progress_bar=false", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (metrics,) = tmp_path.glob(f"{config}/version_*/metrics.csv")
    return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(open(metrics))]


def step_rows(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Lightning writes one CSV row per step (all metrics logged at that step merged)."""
    return sorted((r for r in rows if "train/loss" in r), key=lambda r: r["step"])


def run_name(strategy: str, devices: int, tensor_parallel: int = 1) -> str:
    """The name of an ``fsdp_worker`` run's output files: ``{run_name}-rank{r}.pt``."""
    return f"{strategy}-tp{tensor_parallel}-{devices}" if tensor_parallel > 1 else f"{strategy}-{devices}"


def train_with_fsdp_worker(out: Path, strategy: str, devices: int, activation: str = "keep", steps: int = 3,
                           *extra: str, tensor_parallel: int = 1, timeout: float = 300) -> list[dict]:
    """Run ``tests/lightning/fsdp_worker.py`` (its options in ``extra``) and load what each rank saved."""
    tp = ("--tensor-parallel", str(tensor_parallel)) if tensor_parallel > 1 else ()
    cmd = [sys.executable, "-m", "tests.lightning.fsdp_worker", str(out), strategy, str(devices), activation,
           str(steps), *tp, *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    name = run_name(strategy, devices, tensor_parallel)
    return [torch.load(out / f"{name}-rank{r}.pt", weights_only=False) for r in range(devices)]


def close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-5) -> float:
    """Every tensor of ``a`` within ``rtol`` of ``b``'s (relative, per tensor); returns the worst error."""
    worst = 0.0
    for name, weight in b.items():
        error = float((a[name] - weight).norm() / weight.norm().clamp(min=1e-30))
        assert error <= rtol, (name, error)
        worst = max(worst, error)
    return worst
