"""The one-shot GPU run behind ``benchmarks/gpu.sh``: phases with budgets, results kept as each part finishes.

A GPU machine is lent for one short window (about 15 minutes, start-up included, no network), so the run must
succeed the first time and lose nothing to a kill. The phases, in order, each a subprocess with its own timeout
under one deadline for the whole run (``--total``, 480 s: a rerun still fits the window):

1. readiness (``gpu_readiness.py``, at most 90 s): versions, the flash kernels' schemas, the device and its
   capability, every figure of prefix attention's self-check, and the measured matrix-product rate;
2. the GPU tests (``pytest -m gpu``, at most 120 s, 60 s per test);
3. the bench runs (``lightning-dta bench``), one process per model shape; each workload's rows are appended to
   ``<run>.jsonl`` as soon as it is measured. Each run's budget is sized from its FLOP estimate
   (:func:`lightning_dta.bench.cli.estimate`, the planner's FLOP model) at ``EFFICIENCY`` of the measured rate
   (the assumed ``ASSUMED_TFLOPS`` before it is measured), printed beside it; a run that no longer fits before
   the deadline is skipped with the reason;
4. the targets (``gpu_targets.py``) from what was written.

Each phase's outcome is appended to ``phases.jsonl``. ``SMOKE=1`` runs the same at toy sizes on the CPU;
``DRY_RUN=1`` prints the plan (estimates and budgets) without running anything.

    python3 benchmarks/gpu_run.py --out bench_out/gpu
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASSUMED_TFLOPS = 790.0  # H200 bf16 dense matrix products (the device notes); replaced by the measured rate
EFFICIENCY = 0.25  # the share of the matrix-product rate a bench step is assumed to reach when sizing budgets
SAFETY = 1.5  # budget = startup + SAFETY x estimated seconds
STARTUP_S = 30.0  # per bench process: imports, CUDA context, the model's random weights, probes and self-checks
SMOKE_STARTUP_S = 240.0  # toy sizes on a loaded CPU: Python overhead, not FLOPs, sets the time
TARGETS_S = 15.0  # kept for the last phase
READINESS_S, TESTS_S = 90.0, 120.0

GPU_MODES = "vanilla,vanilla-ckpt,vanilla-batched,dfs,dfs-recompute,dfs-model-attention,prefix-grouper"
GPU_COMMON = ("--dtype bfloat16 --device cuda --attn sdpa --repeats 2 --warmup 1 --no-progress --no-plots "
              "--recompute-chunk 2048 --engine.sibling_batch_tokens 32768 --engine.vanilla_batch_tokens 32768")
SMOKE_COMMON = ("--dtype float32 --device cpu --repeats 1 --warmup 1 --no-progress --no-plots --recompute-chunk 32 "
                "--engine.sibling_batch_tokens 512 --engine.vanilla_batch_tokens 512")


@dataclass(frozen=True)
class BenchRun:
    """One ``lightning-dta bench`` process: its name (results in ``<name>.jsonl``) and arguments."""

    name: str
    args: str


GPU_RUNS = (
    BenchRun("qwen3-0.6b", f"--preset qwen3-0.6b {GPU_COMMON} --modes {GPU_MODES} --workloads grpo,agent,tree-search "
             "--grpo-prompts 2 --grpo-group 16 --grpo-prompt-len 1500,2500 --grpo-response-len 256,1536 "
             "--agent-episodes 1 --agent-turns 8 --agent-system-len 8000 --agent-thinking-len 200,800 "
             "--tree-prompt-len 1024 --tree-branching 4,3,2 --memory-leaves 8,16,32 --long-len 16384"),
    BenchRun("qwen3-1.7b", f"--preset qwen3-1.7b {GPU_COMMON} --modes vanilla,vanilla-ckpt,dfs,dfs-recompute "
             "--workloads grpo,agent --no-logprobs --memory-leaves '' --long-len 0 "
             "--grpo-prompts 2 --grpo-group 8 --grpo-prompt-len 1500,2500 --grpo-response-len 256,1536 "
             "--agent-episodes 1 --agent-turns 8 --agent-system-len 4800 --agent-thinking-len 200,800"),
)
SMOKE_RUNS = (
    BenchRun("smoke-1-layer", f"--arch qwen3 --layers 1 --hidden 64 --heads 4 --kv-heads 2 --vocab 256 {SMOKE_COMMON} "
             f"--modes {GPU_MODES} --workloads grpo,agent,tree-search --grpo-prompts 1 --grpo-group 3 "
             "--grpo-prompt-len 40,60 --grpo-response-len 8,16 --agent-episodes 1 --agent-turns 3 "
             "--agent-system-len 96 --agent-thinking-len 8,16 --tree-prompt-len 32 --tree-branching 2,2 "
             "--memory-leaves 2,4 --long-len 128"),
    BenchRun("smoke-2-layers", f"--arch qwen3 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --vocab 256 "
             f"{SMOKE_COMMON} --modes vanilla,vanilla-ckpt,dfs,dfs-recompute --workloads grpo,agent --no-logprobs "
             "--memory-leaves '' --long-len 0 --grpo-prompts 1 --grpo-group 3 --grpo-prompt-len 40,60 "
             "--grpo-response-len 8,16 --agent-episodes 1 --agent-turns 3 --agent-system-len 96 "
             "--agent-thinking-len 8,16"),
)
# tests/gpu: the kernels (test_cuda.py) and dta_fsdp's CPU offload on an NCCL rank (test_cpu_offload.py)
GPU_TESTS = "-m gpu tests/gpu tests/lightning/test_accelerate.py"
SMOKE_TESTS = "tests/gpu"  # skipped without CUDA: the plumbing only


class Clock:
    """Seconds left before the run's deadline."""

    def __init__(self, total: float) -> None:
        self.deadline = time.monotonic() + total

    def left(self) -> float:
        return self.deadline - time.monotonic()


def record(out: Path, entry: dict) -> None:
    with (out / "phases.jsonl").open("a") as f:
        f.write(json.dumps(entry) + "\n")


def run_phase(name: str, command: list[str], budget: float, out: Path, clock: Clock, log: str,
              reserve: float = TARGETS_S) -> None:
    """Run ``command`` for at most ``budget`` seconds, and never past the deadline less ``reserve``; stream its
    output (and copy it to ``out/log``); record the outcome in ``phases.jsonl``."""
    limit = min(budget, clock.left() - reserve)
    if limit < 10:
        print(f"== {name}: skipped, {clock.left():.0f} s left before the deadline", flush=True)
        record(out, {"phase": name, "status": "skipped", "budget_s": round(budget, 1)})
        return
    print(f"== {name} (budget {limit:.0f} s): {shlex.join(command)}", flush=True)
    start = time.monotonic()
    with (out / log).open("w") as sink, subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                                                         stderr=subprocess.STDOUT, text=True, bufsize=1,
                                                         start_new_session=True) as process:
        # the whole process group: a phase's own subprocesses would otherwise keep its output open
        watchdog = threading.Timer(limit, os.killpg, (process.pid, signal.SIGKILL))  # also cuts a silent hang
        watchdog.start()
        for line in process.stdout:
            print(line, end="", flush=True)
            sink.write(line)
            sink.flush()
        status = process.wait()
        watchdog.cancel()
    seconds = time.monotonic() - start
    cut = seconds >= limit
    print(f"== {name}: {'CUT at its budget' if cut else f'exit status {status}'} after {seconds:.0f} s "
          f"(budget {limit:.0f} s)", flush=True)
    record(out, {"phase": name, "status": "cut" if cut else status, "seconds": round(seconds, 1),
                 "budget_s": round(limit, 1)})


def readiness_rate(out: Path) -> tuple[float, str]:
    """The matrix-product rate readiness measured (TFLOP/s), or the assumed one, and where it came from."""
    path = out / "readiness.json"
    if path.exists():
        return float(json.loads(path.read_text())["matmul_tflops"]), "measured by readiness"
    return ASSUMED_TFLOPS, "assumed (H200 bf16), not measured"


def plan(runs: tuple[BenchRun, ...], rate_tflops: float, startup: float) -> list[tuple[BenchRun, float]]:
    """Each run with its budget, from its FLOP estimate; prints the table (per part, and the total)."""
    from lightning_dta.bench.cli import estimate

    effective = EFFICIENCY * rate_tflops * 1e12
    planned = []
    print(f"{'bench run':<16} {'part':<16} {'PFLOP':>8} {'est. s':>8}   (at {EFFICIENCY:.0%} of {rate_tflops:.3g} "
          f"TFLOP/s; budget {startup:.0f} s + {SAFETY} x est.)", flush=True)
    for run in runs:
        work, _ = estimate(shlex.split(run.args))
        parts = {**work.workloads, "memory sweep": work.memory_sweep, "long rollout": work.long_rollout}
        for part, flops in parts.items():
            if flops:
                print(f"{run.name:<16} {part:<16} {flops / 1e15:8.3f} {flops / effective:8.1f}")
        seconds = work.total / effective
        budget = startup + SAFETY * seconds
        print(f"{run.name:<16} {'total':<16} {work.total / 1e15:8.3f} {seconds:8.1f}   budget {budget:.0f} s",
              flush=True)
        planned.append((run, budget))
    return planned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_out/gpu")
    parser.add_argument("--total", type=float, default=480.0, help="seconds for the whole run")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)
    smoke, dry = os.environ.get("SMOKE") == "1", os.environ.get("DRY_RUN") == "1"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.total)
    runs, tests = (SMOKE_RUNS, SMOKE_TESTS) if smoke else (GPU_RUNS, GPU_TESTS)
    startup = SMOKE_STARTUP_S if smoke else STARTUP_S
    if dry:
        print(f"DRY_RUN: the plan of {'SMOKE=1 ' if smoke else ''}benchmarks/gpu.sh, nothing is run. Phases: readiness "
              f"({READINESS_S:.0f} s), GPU tests `pytest {tests}` ({TESTS_S:.0f} s), the bench runs below, the "
              f"targets ({TARGETS_S:.0f} s). The rate is assumed here; the real run uses the one readiness measures.")
        bench = sum(budget for _, budget in plan(runs, ASSUMED_TFLOPS, startup))
        planned = READINESS_S + TESTS_S + bench + TARGETS_S
        print(f"planned: {READINESS_S:.0f} + {TESTS_S:.0f} + {bench:.0f} + {TARGETS_S:.0f} = {planned:.0f} s; every "
              f"phase is cut at the deadline, {args.total:.0f} s after the start")
        return 0
    shapes = ["4,2,16"] if smoke else ["16,8,128"]  # the attention shapes of the runs' models
    readiness = [args.python, "benchmarks/gpu_readiness.py", "--out", str(out),
                 *[a for shape in shapes for a in ("--shape", shape)], *(["--matmul-size", "512"] if smoke else [])]
    run_phase("readiness", readiness, READINESS_S, out, clock, "readiness.txt")
    per_test = ["--timeout", "60"] if importlib.util.find_spec("pytest_timeout") else []
    run_phase("GPU tests", [args.python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *per_test,
                            *shlex.split(tests)], TESTS_S, out, clock, "gpu_tests.txt")
    rate, source = readiness_rate(out)
    print(f"== bench plan (matrix products at {rate:.3g} TFLOP/s, {source})", flush=True)
    try:
        planned = plan(runs, rate, startup)
    except ImportError as error:  # jsonargparse not carried: the bench CLI cannot parse
        print(f"== bench: skipped, the bench CLI cannot be imported ({error}); see benchmarks/gpu.sh's header")
        record(out, {"phase": "bench", "status": f"skipped: {error}"})
        planned = []
    for run, budget in planned:
        command = [args.python, "-m", "lightning_dta.bench.cli", *shlex.split(run.args),
                   "--results-jsonl", str(out / f"{run.name}.jsonl"), "--out", str(out / run.name)]
        run_phase(f"bench {run.name}", command, budget, out, clock, f"{run.name}.txt")
    run_phase("targets", [args.python, "benchmarks/gpu_targets.py", str(out)], TARGETS_S, out, clock,
              "targets.txt", reserve=0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
