"""The GPU targets of the benchmark, read from the results ``benchmarks/gpu.sh`` wrote (``<run>.jsonl``).

Targets (issue 12): dfs at >= 0.9 of the FLOP limit on the GRPO and agent workloads; dfs CUDA peak memory
<= 0.5 of per-rollout training without checkpointing on the agent workload; dfs speed-up over checkpointed
per-rollout training >= 0.88 x the compression C (AReaL-DTA's 8.31x at C = 9.43).

    python benchmarks/gpu_targets.py bench_out/gpu
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows_by(record: dict) -> dict[tuple[str, str], dict]:
    return {(r["workload"], r["mode"]): r for r in record["results"]}


def targets(record: dict) -> list[tuple[str, float | None, float, bool | None]]:
    """(what, measured, target, met) for every target this record can answer."""
    rows = rows_by(record)
    out = []
    for workload in ("grpo", "agent"):
        dfs = rows.get((workload, "dfs"))
        if dfs is None:
            continue
        fraction = dfs["fraction_of_flop_limit"]
        out.append((f"{workload}: dfs fraction of the FLOP limit", fraction, 0.9, fraction >= 0.9))
        if dfs["speedup_vs_ckpt"] is not None:
            want = 0.88 * dfs["compression"]
            out.append((f"{workload}: dfs speed-up over vanilla-ckpt (target 0.88 x C = {want:.2f})",
                        dfs["speedup_vs_ckpt"], want, dfs["speedup_vs_ckpt"] >= want))
    dfs, vanilla = rows.get(("agent", "dfs")), rows.get(("agent", "vanilla"))
    if dfs and vanilla and dfs["cuda_peak_mib"] and vanilla["cuda_peak_mib"]:
        ratio = dfs["cuda_peak_mib"] / vanilla["cuda_peak_mib"]
        out.append(("agent: dfs CUDA peak / vanilla CUDA peak", ratio, 0.5, ratio <= 0.5))
    return out


def records(out_dir: Path) -> dict[str, dict]:
    """Per bench run, its measured workloads so far: the ``<run>.jsonl`` files that ``--results-jsonl`` appends to
    as each workload finishes (a run cut at its budget keeps what it finished)."""
    found = {}
    for path in sorted(out_dir.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        parts = [line for line in lines if line.get("part") == "workload"]
        if parts:
            found[path.stem] = {"meta": parts[0]["meta"], "results": [r for p in parts for r in p["results"]],
                                "skipped": [s for p in parts for s in p["skipped"]],
                                "workloads": [p["workload"] for p in parts]}
    return found


def main(out_dir: str) -> int:
    for name, record in records(Path(out_dir)).items():
        meta = record["meta"]
        print(f"\n{name} on {meta.get('gpu') or meta.get('device')} ({meta.get('date')}; measured: "
              f"{', '.join(record['workloads'])}):")
        for what, measured, target, met in targets(record):
            verdict = "met" if met else "NOT met"
            print(f"  {what:<66} {measured:7.2f}  (target {target:.2f}: {verdict})")
        for note in record["skipped"]:
            print(f"  skipped {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else "bench_out/gpu"))
