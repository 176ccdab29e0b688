"""Turning measurements into the terminal table, the JSON record and the PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_dta.bench.runner import BenchResults


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(all_rows: list[dict]) -> str:
    header = (f"{'workload':<12} {'mode':<19} {'C':>5} {'median s':>9} {'min-max s':>13} {'tok/s':>8} "
              f"{'speedup':>7} {'eff':>5} {'vs ckpt':>7} {'flop lim':>8} {'of lim':>6} {'grad err':>9} "
              f"{'saved MiB':>9} {'cuda MiB':>8}")
    lines = [header, "-" * len(header)]
    for r in all_rows:
        lines.append(
            f"{r['workload']:<12} {r['mode']:<19} {r['compression']:>5.2f} {r['median_s']:>9.3f} "
            f"{r['min_s']:>6.2f}-{r['max_s']:<6.2f} {r['logical_tokens_per_s']:>8.0f} {_fmt(r['speedup'], '.2f'):>7} "
            f"{_fmt(r['efficiency'], '.2f'):>5} {_fmt(r['speedup_vs_ckpt'], '.2f'):>7} "
            f"{_fmt(r['flop_speedup_limit'], '.2f'):>8} {_fmt(r['fraction_of_flop_limit'], '.2f'):>6} "
            f"{_fmt(r['grad_rel_error'], '.1e'):>9} {_fmt(r['peak_saved_mib'], '.1f'):>9} "
            f"{_fmt(r['cuda_peak_mib'], '.0f'):>8}")
    return "\n".join(lines)


def side_by_side(all_rows: list[dict]) -> str:
    """Per workload, each model's tree walk against its own per-rollout training: the speed-ups of dfs, dfs with
    recompute and forward-only ``tree_logprobs``, and dfs's fraction of its FLOP-model limit."""
    header = (f"{'workload':<12} {'model':<10} {'C':>5} {'flop lim':>8} {'dfs':>6} {'of lim':>6} {'recomp':>6} "
              f"{'logprobs':>8} {'vanilla s':>9} {'dfs s':>7} {'dfs err':>8}")
    lines = ["side by side (speed-ups over each model's own per-rollout training):", header, "-" * len(header)]
    by_key = {(r["workload"], r["model"], r["mode"]): r for r in all_rows}
    for workload, model in dict.fromkeys((r["workload"], r["model"]) for r in all_rows):
        def get(mode: str, key: str, spec: str, workload: str = workload, model: str = model) -> str:
            row = by_key.get((workload, model, mode))
            return _fmt(row[key] if row else None, spec)

        dfs = by_key.get((workload, model, "dfs"), {})
        lines.append(f"{workload:<12} {model:<10} {_fmt(dfs.get('compression'), '.2f'):>5} "
                     f"{get('dfs', 'flop_speedup_limit', '.2f'):>8} {get('dfs', 'speedup', '.2f'):>6} "
                     f"{get('dfs', 'fraction_of_flop_limit', '.2f'):>6} {get('dfs-recompute', 'speedup', '.2f'):>6} "
                     f"{get('logprobs-tree', 'speedup', '.2f'):>8} {get('vanilla', 'median_s', '.3f'):>9} "
                     f"{get('dfs', 'median_s', '.3f'):>7} {get('dfs', 'grad_rel_error', '.1e'):>8}")
    return "\n".join(lines)


def render(results: BenchResults, header: str, profiled_mode: str | None = None) -> str:
    """The whole terminal report: the model line, the table, profiles and the memory sweeps."""
    lines = [header, table(results.rows)]
    lines += [f"skipped {note}" for note in results.skipped]
    for name, text in results.profiles.items():
        lines.append(f"\ntorch.profiler, one {profiled_mode} step of {name}:\n{text}")
    if results.memory_scaling:
        lines.append("\npeak bytes saved for backward (MiB) vs leaves per prompt (400-token prompt, 128-token "
                     "responses):")
        for mode in ("dfs", "dfs-unbatched", "mask", "vanilla"):
            values = [f"{m['leaves']}: {m['peak_saved_mib']:.1f}" for m in results.memory_scaling if m["mode"] == mode]
            lines.append(f"  {mode:<8} " + "  ".join(values))
    if results.long_rows:
        base = results.long_rows[0]["total_mib"]
        tokens = results.long_rows[0]["tokens"]
        lines.append(f"\none {tokens}-token rollout, peak bytes saved for backward + dfs path key/value buffers:")
        for row in results.long_rows:
            lines.append(f"  {row['mode']:<14} {row['peak_saved_mib']:8.1f} + {row['path_buffers_mib']:5.1f} = "
                         f"{row['total_mib']:8.1f} MiB  ({row['total_mib'] / base:.2f} of per-rollout)")
    return "\n".join(lines)


def write_json(path: Path, meta: dict, all_rows: list[dict], memory_scaling: list[dict]) -> None:
    path.write_text(json.dumps({"meta": meta, "results": all_rows, "memory_scaling": memory_scaling}, indent=2))


def append_jsonl(path: Path, record: dict) -> None:
    """One JSON line appended (and the file closed, so that a killed process keeps it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def save(out_dir: Path, meta: dict, results: BenchResults, plots: bool = True) -> list[Path]:
    """``bench.json`` (and the PNG plots) in ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "bench.json", {**meta, "long_sequence": results.long_rows, "skipped": results.skipped},
               results.rows, results.memory_scaling)
    written = [out_dir / "bench.json"]
    if plots:
        written += plot(out_dir, results.rows, results.memory_scaling)
    return written


def _save(fig, ax, xlabel: str, ylabel: str, path: Path) -> Path:
    """Label, legend and grid a plot, write it as PNG and close it."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot(out_dir: Path, all_rows: list[dict], memory_scaling: list[dict]) -> list[Path]:
    """speed-up vs C across workloads, and peak saved memory vs number of leaves (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4.5))
    several = len({r.get("model") for r in all_rows}) > 1  # --also-arch: a series per model and mode
    series = sorted({(r.get("model") or "", r["mode"]) for r in all_rows
                     if r["speedup"] is not None and not r["mode"].startswith("logprobs")})
    for model, mode in series:
        pts = [(r["compression"], r["speedup"]) for r in all_rows if r["mode"] == mode and r.get("model", "") == model]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=f"{model} {mode}" if several else mode)
    limits = {(r["workload"], r["compression"], r["flop_speedup_limit"]) for r in all_rows
              if r["flop_speedup_limit"] is not None and not r["mode"].startswith("logprobs")}
    ax.scatter([c for _, c, _ in limits], [f for *_, f in limits], marker="x", color="black",
               label="FLOP-model limit (training)")
    limit = max((r["compression"] for r in all_rows), default=1.0) * 1.1
    ax.plot([1, limit], [1, limit], "k--", linewidth=1, label="speed-up = C")
    for r in all_rows:
        if r["mode"] == "dfs":
            ax.annotate(r["workload"], (r["compression"], r["speedup"]), fontsize=8)
    paths.append(_save(fig, ax, "compression ratio C (logical / tree tokens)", "speed-up over per-rollout training",
                       out_dir / "speedup_vs_compression.png"))
    if memory_scaling:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for model, mode in sorted({(m.get("model") or "", m["mode"]) for m in memory_scaling}):
            pts = sorted((m["leaves"], m["peak_saved_mib"]) for m in memory_scaling
                         if m["mode"] == mode and m.get("model", "") == model)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{model} {mode}" if several else mode)
        paths.append(_save(fig, ax, "leaves (responses per prompt)", "peak bytes saved for backward (MiB)",
                           out_dir / "memory_vs_leaves.png"))
    return paths
