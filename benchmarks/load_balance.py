"""Load balance of DFS steps across ranks: predicted (the cost model) against measured (each rank's DFS time).

Part 1, measured on 2 gloo processes: ``Trainer(strategy="dta", devices=2)`` trains the same skewed step again and
again (many tiny GRPO groups beside a few long rollouts, a tiny Llama on the CPU, where every forward call has a
fixed cost the token-only default cost model ignores). Every step logs the partition's predicted max/mean cost and
the measured max/mean DFS time; the data module fits its cost model to the measured times as the run goes
(``calibrate_cost_model``), so the measured imbalance should fall after the first steps.

Part 2, predicted: the max/mean cost of the partition of the bench's GRPO, agent and tree-search steps (and the
skewed one) on 2, 4 and 8 ranks, and the sharing the cut keeps.

    python benchmarks/load_balance.py --steps 20 --out bench_out/balance.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from pathlib import Path

import lightning as L
import torch

import lightning_dta as dta
from lightning_dta.core.balance import CostModel, partition_contiguous, partition_report
from lightning_dta.lightning.data import RolloutDataModule
from lightning_dta.shapes.workloads import AgentWorkload, GRPOWorkload, TreeSearchWorkload

VOCAB = 256
MODEL = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024)


def skewed_step(seed: int = 0) -> list[dta.Rollout]:
    """60 GRPO groups of 4 tiny answers (8-token prompts) and 6 long rollouts (700 tokens): ~5K tokens each half."""
    rng = random.Random(seed)
    rollouts = []
    for group in range(60):
        prompt = [1] + [rng.randrange(2, VOCAB) for _ in range(7)]
        for _ in range(4):
            rollouts.append(dta.Rollout(input_ids=prompt + [rng.randrange(2, VOCAB) for _ in range(rng.randint(4, 8))],
                                        advantages=rng.gauss(0, 1), group_id=group))
    for _ in range(6):
        rollouts.append(dta.Rollout(input_ids=[VOCAB - 1] + [rng.randrange(2, VOCAB) for _ in range(700)],
                                    advantages=rng.gauss(0, 1)))
    return rollouts


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        self.rows.append({"step": trainer.global_step, "predicted": float(metrics["train/rank_cost_imbalance"]),
                          "measured": float(metrics["train/rank_time_imbalance"]),
                          "dfs_sec_max": float(metrics["train/dfs_sec_max"]),
                          "cost_model": dict(vars(trainer.datamodule.cost_model))})


def measure(steps: int) -> list[dict]:
    torch.manual_seed(0)
    step = skewed_step()
    data = RolloutDataModule(source=[step] * steps, calibrate_cost_model=True)
    recorder = Recorder()
    trainer = L.Trainer(strategy="dta", accelerator="cpu", devices=2, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[recorder])
    trainer.fit(dta.DTAModule(MODEL), data)
    return recorder.rows if trainer.is_global_zero else []


def predicted() -> list[dict]:
    workloads = {"grpo": GRPOWorkload().generate(2048, 0), "agent": AgentWorkload().generate(2048, 0),
                 "tree-search": TreeSearchWorkload().generate(2048, 0), "skewed": skewed_step()}
    rows = []
    for name, rollouts in workloads.items():
        for world_size in (2, 4, 8):
            report = partition_report(rollouts, partition_contiguous(rollouts, world_size, CostModel()), CostModel())
            rows.append({"workload": name, "ranks": world_size, "max_over_mean": report.imbalance,
                         "max_over_bound": report.max_over_bound, "compression_before": report.compression_before,
                         "compression_after": report.compression_after})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args()
    rows = measure(args.steps)
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    print("step  predicted max/mean  measured max/mean  slowest rank DFS s   cost model (token, attention, branch)")
    for row in rows:
        model = row["cost_model"]
        print(f"{row['step']:4d}  {row['predicted']:18.3f}  {row['measured']:17.3f}  {row['dfs_sec_max']:18.3f}   "
              f"{model['token']:.3g}, {model['attention']:.3g}, {model['branch']:.3g}")
    first = statistics.fmean(r["measured"] for r in rows[:3])
    last = statistics.fmean(r["measured"] for r in rows[-5:])
    print(f"measured max/mean: first 3 steps {first:.3f} -> last 5 steps {last:.3f}")
    prediction = predicted()
    print("\npredicted partition (default cost model): max/mean cost, max/lower bound, compression before -> after")
    for row in prediction:
        print(f"  {row['workload']:<12} {row['ranks']} ranks  {row['max_over_mean']:.3f}  {row['max_over_bound']:.3f}  "
              f"{row['compression_before']:.2f} -> {row['compression_after']:.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"measured": rows, "predicted": prediction}, indent=2))


if __name__ == "__main__":
    main()
