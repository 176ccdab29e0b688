"""GSPO's extra cost over PPO on the bench workloads: one forward-only walk per step for the sequence ratios.

GSPO's ratio exp(mean over a rollout's trained tokens of (logp - prox)) needs every token of the rollout under the
current weights before any of its terms can be formed, so ``tree_backward`` runs ``tree_logprobs`` first
(docs/losses.md says why not in one pass). This times ``tree_backward`` with ``PolicyLoss()`` and with
``PolicyLoss(loss_mode="gspo")`` side by side on the bench's default model and workloads (median of --repeats,
interleaved), and counts the model's forward calls per step.

    python benchmarks/gspo_cost.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import lightning_dta as dta
from lightning_dta.shapes.models import build_model
from lightning_dta.shapes.workloads import AgentWorkload, GRPOWorkload, TreeSearchWorkload

WORKLOADS = {"grpo": GRPOWorkload(), "agent": AgentWorkload(), "tree-search": TreeSearchWorkload()}
LOSSES = {"ppo": dta.PolicyLoss(), "gspo": dta.PolicyLoss(loss_mode="gspo", clip_eps=3e-4, clip_eps_high=4e-4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model()
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    print(f"bench model (4 layers, hidden 256, vocab 2048, float32), {args.threads} threads, median of {args.repeats}")
    print(f"{'workload':12s} {'ppo s':>8s} {'gspo s':>8s} {'gspo/ppo':>9s} {'calls ppo':>10s} {'calls gspo':>11s}")
    for name, workload in WORKLOADS.items():
        tree = dta.PrefixTree.from_rollouts(workload.generate(2048, seed=0))
        times: dict[str, list[float]] = {loss: [] for loss in LOSSES}
        counts = {}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for loss_name, loss_fn in LOSSES.items():
                model.zero_grad(set_to_none=True)
                calls[0] = 0
                start = time.perf_counter()
                dta.tree_backward(model, tree, loss_fn)
                if repeat:
                    times[loss_name].append(time.perf_counter() - start)
                counts[loss_name] = calls[0]
        ppo, gspo = statistics.median(times["ppo"]), statistics.median(times["gspo"])
        print(f"{name:12s} {ppo:8.3f} {gspo:8.3f} {gspo / ppo:9.2f} {counts['ppo']:10d} {counts['gspo']:11d}")


if __name__ == "__main__":
    main()
