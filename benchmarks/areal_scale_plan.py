"""The planner's table at AReaL-DTA's scale (BENCHMARKS.md, "predicted at AReaL-DTA's scale").

Qwen3-1.7B and Qwen3-8B shapes, a tau^2-bench-like step (``tau2-like``: 4.8K-token system prompt, 8 calls per
episode, thinking dropped, 32 episodes over 8 ranks, ~9.4x compression per rank; ``tau2-long``: the same with
contexts reaching ~16K tokens), bf16, AdamW, FSDP2 over 8 ranks, 80 GB per GPU. Every number is a prediction of
``lightning-dta plan`` (activation rates probed on the CPU, FLOPs from the shape), not a GPU measurement.

    python benchmarks/areal_scale_plan.py            # prints the markdown table (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import contextlib
import io
import json

from lightning_dta.plan.cli import main as plan

MODES = ("vanilla", "vanilla-ckpt", "dfs", "dfs-recompute")


def predict(model: str, workload: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan(["--model", model, "--workload", workload, "--devices", "8", "--strategy", "dta_fsdp",
              "--memory", "80GB", "--json"])
    return json.loads(out.getvalue())


def main() -> None:
    print("| model | step (per rank) | mode | activations | peak | fits 80 GB | TFLOPs per rank | vs vanilla-ckpt |")
    print("|---|---|---|---:|---:|:---:|---:|---:|")
    for model in ("qwen3-1.7b", "qwen3-8b"):
        for workload in ("tau2-like", "tau2-long"):
            record = predict(model, workload)
            usable = 0.9 * 80e9
            step = (f"{workload}: {record['logical_tokens'] // record['ranks']:,} / "
                    f"{record['tree_tokens'] // record['ranks']:,} tokens")
            ckpt = record["modes"]["vanilla-ckpt"]["tflops"]
            rows = [(m, record["modes"][m]) for m in MODES]
            auto = next((f for f in record["fits"] if f["name"] == "dfs auto"), None)
            if auto:
                rows.append(("dfs auto (80 GB)", {"activation_bytes": None, "peak_bytes": auto["peak_bytes"],
                                                  "tflops": auto["tflops"]}))
            if record["fits"] and record["fits"][0]["name"] not in ("dfs keep", "dfs auto"):
                best = record["fits"][0]
                rows.append((f"cheapest fit: {best['name']}", {"activation_bytes": None,
                                                               "peak_bytes": best["peak_bytes"],
                                                               "tflops": best["tflops"]}))
            for name, row in rows:
                activations = "" if row["activation_bytes"] is None else f"{row['activation_bytes'] / 2**30:.1f} GiB"
                fits = "yes" if row["peak_bytes"] <= usable else "no"
                print(f"| {model} | {step} | {name} | {activations} | {row['peak_bytes'] / 2**30:.1f} GiB | {fits} | "
                      f"{row['tflops']:,.0f} | {ckpt / row['tflops']:.2f}x |")


if __name__ == "__main__":
    main()
