"""Lightning: ``Trainer(strategy="dta")`` with ``DTAModule`` and ``RolloutDataModule``.

    python examples/lightning_trainer.py --max-steps 4
    python examples/lightning_trainer.py --max-steps 4 --devices 2     # two CPU processes (gloo)

The same run as ``lightning-dta fit --config configs/tiny_cpu.yaml``, written in Python. ``import lightning_dta``
registers the strategy name ``"dta"``; the "dta" launcher re-runs this script once per extra process, like "ddp".
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

import lightning_dta as dta
from lightning_dta.lightning.data import RolloutDataModule

DATA = Path(__file__).resolve().parent.parent / "data" / "tiny_rollouts.jsonl"


def main(max_steps: int = 4, devices: int = 1, log_dir: str = "runs") -> L.Trainer:
    L.seed_everything(0)
    module = dta.DTAModule(
        {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512},
        loss=dta.PolicyLoss(clip_eps=0.2, agg="token-mean"), engine=dta.EngineOptions(activation="keep"),
        gradient_clip_val=1.0, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    data = RolloutDataModule(path=DATA, rollouts_per_step=16, advantage_estimator="grpo")  # limits: from the model
    trainer = L.Trainer(strategy="dta", accelerator="cpu", devices=devices, max_steps=max_steps,
                        log_every_n_steps=1, enable_checkpointing=False, logger=CSVLogger(log_dir, name="example"),
                        callbacks=[dta.TreeThroughputMonitor(window_size=4), dta.PeakMemoryMonitor()])
    trainer.fit(module, data)
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    main(args.max_steps, args.devices)
