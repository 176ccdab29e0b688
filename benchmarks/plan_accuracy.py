"""The planner's predicted peak of saved bytes against the engine's, on the bench's default workloads and model.

For each workload and mode, ``lightning-dta plan``'s prediction (:func:`lightning_dta.plan.plan_step`) beside the
peak that :class:`~lightning_dta.engine.memory.SavedTensorMeter` measures around the real ``tree_backward``. ``--qwen3``
uses a Qwen3 shape with grouped-query attention in bfloat16 instead of the bench's Llama in float32.

    python benchmarks/plan_accuracy.py [--qwen3]
"""

from __future__ import annotations

import argparse

import torch

from lightning_dta.bench.runner import saved_peak_bytes
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine import EngineOptions
from lightning_dta.plan import TrainingState, plan_step, probe_rates
from lightning_dta.shapes.models import build_model
from lightning_dta.shapes.modes import ModeSpec, planned_modes
from lightning_dta.shapes.workloads import WORKLOADS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qwen3", action="store_true")
    args = parser.parse_args()
    if args.qwen3:
        model, precision = build_model(arch="qwen3", kv_heads=2, head_dim=64, dtype=torch.bfloat16), "bf16-true"
    else:
        model, precision = build_model(), "32-true"
    rates = probe_rates(model.config, next(model.parameters()).dtype)
    print("| workload | mode | measured | predicted | error |\n|---|---|---:|---:|---:|")
    for name in ("grpo", "agent", "tree-search"):
        tree = PrefixTree.from_rollouts(WORKLOADS[name].generate(model.config.vocab_size, 0))
        modes = planned_modes(EngineOptions(), recompute_chunk=256)
        keep = saved_peak_bytes(model, tree, modes["dfs"])
        modes["dfs-auto (half keep)"] = ModeSpec(EngineOptions(activation="auto",
                                                               activation_memory_budget=int(0.5 * keep)))
        plan = plan_step(tree, model.config, rates, TrainingState(1, precision=precision), modes)
        for mode, spec in modes.items():
            measured = saved_peak_bytes(model, tree, spec)
            predicted = plan.modes[mode].saved
            print(f"| {name} | {mode} | {measured / 2**20:.2f} MiB | {predicted / 2**20:.2f} MiB | "
                  f"{predicted / measured - 1:+.3%} |")


if __name__ == "__main__":
    main()
