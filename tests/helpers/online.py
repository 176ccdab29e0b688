"""Running the online RL loop as ``lightning-dta fit`` subprocesses on 1 or 2 gloo ranks, and reading what it did."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests import helpers
from tests.helpers.lightning import clean_env

CONFIG = helpers.REPO / "configs" / "toy_rl_cpu.yaml"
STEPS, WINDOW, MARGIN, RECORDED = 100, 10, 0.1, 3

# The mechanism tests (faults, resume, sharding, multi-turn) use a smaller run: no warm start, 4 prompts x 2.
SMALL = """
seed_everything: 0
trainer:
  accelerator: cpu
  strategy: dta
  log_every_n_steps: 1
  enable_checkpointing: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {save_dir: runs, name: small}
  callbacks:
    - class_path: lightning_dta.rl.OnlineRLCallback
      init_args: {print_every_n_steps: 0, reward_plot: null}
model:
  model: {model_type: llama, vocab_size: VOCAB, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
          num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 256}
data:
  source:
    class_path: lightning_dta.rl.OnlineRolloutSource
    init_args:
      env: {class_path: ENV}
      generator: {class_path: lightning_dta.rl.HFGenerator, init_args: {max_new_tokens: 6}}
      prompts_per_step: 4
      samples_per_prompt: 2
      generation_blocks: 2
"""


def small_config(tmp_path: Path, env: str = "lightning_dta.rl.ReverseDigits", vocab: int = 16) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL.replace("ENV", env).replace("VOCAB", str(vocab)))
    return path


def fit(tmp_path: Path, devices: int, *overrides: str, module: str = "lightning_dta.cli", timeout: float = 600,
        steps: int = STEPS, config: Path = CONFIG) -> tuple[subprocess.CompletedProcess, float]:
    """``lightning-dta fit`` on the toy config with a RolloutRecorder; returns the process and its wall time."""
    env = clean_env()
    env["PYTHONPATH"] = str(helpers.REPO)  # the recorder callback lives in tests/
    cmd = [sys.executable, "-m", module, "fit", "--config", str(config), f"--trainer.devices={devices}",
           f"--trainer.max_steps={steps}", f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
           "--trainer.enable_progress_bar=false", "--trainer.callbacks+=tests.helpers.rl.RolloutRecorder",
           f"--trainer.callbacks.out_dir={tmp_path / 'records'}", f"--trainer.callbacks.steps={RECORDED}",
           *overrides]
    start = time.perf_counter()
    with open(tmp_path / "out.txt", "w") as out:  # a file, not a pipe: an orphaned rank must not hold the test
        proc = subprocess.Popen(cmd, cwd=helpers.REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # ranks left behind (the hang test's sleeping rank)
            except ProcessLookupError:
                pass
    seconds = time.perf_counter() - start
    result = subprocess.CompletedProcess(cmd, proc.returncode, (tmp_path / "out.txt").read_text(), "")
    return result, seconds


def records(tmp_path: Path, devices: int) -> list[dict]:
    return [torch.load(tmp_path / "records" / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def rewards(tmp_path: Path) -> list[float]:
    (metrics,) = (tmp_path / "logs").glob("*/version_*/metrics.csv")
    rows = [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(open(metrics))]
    return [r["rollout/reward_mean"] for r in sorted(rows, key=lambda r: r["step"]) if "rollout/reward_mean" in r]


def merged_rollouts(ranks: list[dict]) -> list[list[tuple]]:
    """The step's rollouts over all ranks (each rank saved its own share)."""
    return [sorted(r for rank in ranks for r in rank["rollouts"][step]) for step in range(RECORDED)]
