"""Per-phase time of an online RL step: generation, weight sync and training, per step, from a short fit.

Runs ``lightning-dta fit`` on a config (default: the toy task, ``configs/toy_rl_cpu.yaml``, HF generation in this
process) for ``--steps`` RL steps and prints one markdown table row from its ``metrics.csv``: the median over the
steps after the first ``--skip`` of ``time/generation_sec``, ``time/weight_sync_sec``, ``time/train_sec`` and
``time/step_sec`` (the OnlineRLCallback's metrics, docs/rl.md), and the largest ``train/logprob_gap_max`` of the
run. Any further argument goes to ``lightning-dta fit`` as is, so the same script measures another generator, e.g.
a real server:

    python benchmarks/rl_phase_times.py --label "HF generate (in process)"
    python benchmarks/rl_phase_times.py --label "vLLM server" -- \\
        --data.source.init_args.generator.class_path=lightning_dta.rl.OpenAICompatibleGenerator ...

The config's SFT warm start runs first and is not timed.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
from pathlib import Path

from lightning_dta import cli

REPO = Path(__file__).resolve().parent.parent
PHASES = ("time/generation_sec", "time/weight_sync_sec", "time/train_sec", "time/step_sec")
HEADER = ("| generator | steps | generation s/step | weight sync s/step | training s/step | step s (end to end) | "
          "largest log-prob gap |\n|---|---|---|---|---|---|---|")


def phase_row(metrics_csv: Path, label: str, skip: int) -> str:
    """The table row of one run: medians over its steps after the first ``skip``."""
    rows = [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(metrics_csv.open())]
    steps = sorted((r for r in rows if "time/generation_sec" in r), key=lambda r: r["step"])[skip:]
    if not steps:
        raise SystemExit(f"{metrics_csv}: no RL step after the first {skip}; run more --steps")
    medians = [statistics.median(r[name] for r in steps) for name in PHASES]
    gaps = [r["train/logprob_gap_max"] for r in rows if "train/logprob_gap_max" in r]
    gap = f"{max(gaps):.1e}" if gaps else "-"
    return f"| {label} | {len(steps)} | " + " | ".join(f"{m:.3f}" for m in medians) + f" | {gap} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "toy_rl_cpu.yaml"))
    parser.add_argument("--steps", type=int, default=40, help="RL steps to run")
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the medians (warm-up)")
    parser.add_argument("--label", default="HF generate (in process)")
    args, fit_args = parser.parse_known_args()
    fit_args = [a for a in fit_args if a != "--"]
    with tempfile.TemporaryDirectory() as out:
        status = cli.main(["fit", "--config", args.config, f"--trainer.max_steps={args.steps}",
                           f"--trainer.logger.init_args.save_dir={out}", "--trainer.enable_progress_bar=false",
                           *fit_args])
        if status:
            raise SystemExit(status)
        (metrics_csv,) = Path(out).glob("*/version_*/metrics.csv")
        print(HEADER)
        print(phase_row(metrics_csv, args.label, args.skip))


if __name__ == "__main__":
    main()
