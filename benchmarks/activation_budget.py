"""``activation="auto"`` against keep and recompute, and chunked recompute's peak RSS (issue 13's targets).

Part 1, the bench model and its agent workload, side by side in one process (median of --repeats, round-robin):
keep, recompute, auto with a budget that holds the whole path (keep's measured peak x 1.5) and auto with half of
keep's peak. Peaks are bytes saved for backward (:class:`~lightning_dta.engine.memory.SavedTensorMeter`, one extra run
per mode), which is what the budget bounds.

Part 2, each measurement in its own process: peak RSS of per-rollout training of one 3,072-token rollout against
dfs with ``activation="recompute", chunk_size=256`` on 4 rollouts of 3,072 tokens sharing 2,048.

    python benchmarks/activation_budget.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import lightning_dta as dta
from lightning_dta.engine.memory import SavedTensorMeter, peak_rss_bytes
from lightning_dta.shapes.models import build_model
from lightning_dta.shapes.workloads import AgentWorkload


def timed(model, tree, options: dict) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    dta.tree_backward(model, tree, dta.PolicyLoss(), **options)
    return time.perf_counter() - start


def peak_saved(model, tree, options: dict) -> int:
    model.zero_grad(set_to_none=True)
    with SavedTensorMeter(model) as meter:
        dta.tree_backward(model, tree, dta.PolicyLoss(), **options)
    return meter.peak_bytes


def budget_table(repeats: int) -> None:
    model = build_model()
    tree = dta.PrefixTree.from_rollouts(AgentWorkload().generate(2048, seed=0))
    keep_peak = peak_saved(model, tree, {})
    modes = {"keep": {}, "recompute": {"activation": "recompute"},
             "auto (1.5 x keep's peak)": {"activation": "auto", "activation_memory_budget": int(1.5 * keep_peak)},
             "auto (0.5 x keep's peak)": {"activation": "auto", "activation_memory_budget": keep_peak // 2}}
    times = {name: [] for name in modes}
    for repeat in range(repeats + 1):  # round 0 warms up
        for name, options in modes.items():
            seconds = timed(model, tree, options)
            if repeat:
                times[name].append(seconds)
    keep_time = statistics.median(times["keep"])
    print(f"agent workload, bench model, {torch.get_num_threads()} threads, median of {repeats}")
    print(f"{'mode':28s} {'median s':>9s} {'vs keep':>8s} {'peak saved MiB':>15s} {'budget MiB':>11s}")
    for name, options in modes.items():
        peak = peak_saved(model, tree, options)
        budget = options.get("activation_memory_budget")
        print(f"{name:28s} {statistics.median(times[name]):9.3f} {statistics.median(times[name]) / keep_time:8.2f} "
              f"{peak / 2**20:15.1f} {'-' if budget is None else f'{budget / 2**20:.1f}':>11s}")


def rss_child(kind: str) -> None:
    """One measurement in this process: print the peak RSS growth of one step, in bytes."""
    import random

    model = build_model()
    rng = random.Random(0)
    shared = [rng.randrange(2048) for _ in range(2048)]
    if kind == "vanilla-one":
        rollouts = [dta.Rollout(input_ids=shared + [rng.randrange(2048) for _ in range(1024)], advantages=1.0)]
        options = {"mode": "vanilla"}
    else:
        rollouts = [dta.Rollout(input_ids=shared + [rng.randrange(2048) for _ in range(1024)], advantages=1.0)
                    for _ in range(4)]
        options = {"activation": "recompute", "chunk_size": 256}
    tree = dta.PrefixTree.from_rollouts(rollouts)
    before = peak_rss_bytes()
    dta.tree_backward(model, tree, dta.PolicyLoss(), **options)
    print(json.dumps({"kind": kind, "peak_rss_growth": peak_rss_bytes() - before}))


def rss_table() -> None:
    results = {}
    for kind in ("vanilla-one", "recompute-chunked"):
        out = subprocess.run([sys.executable, __file__, "--rss-child", kind], capture_output=True, text=True,
                             check=True)
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_growth"]
    ratio = results["recompute-chunked"] / results["vanilla-one"]
    print(f"peak RSS growth: per-rollout training of one 3,072-token rollout {results['vanilla-one'] / 2**20:.1f} "
          f"MiB; dfs recompute chunk_size=256 on 4 such rollouts sharing 2,048 "
          f"{results['recompute-chunked'] / 2**20:.1f} MiB ({ratio:.2f} of it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rss_child:
        rss_child(args.rss_child)
        return
    budget_table(args.repeats)
    rss_table()


if __name__ == "__main__":
    main()
