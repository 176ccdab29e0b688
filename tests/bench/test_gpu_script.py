"""``benchmarks/gpu.sh``, the one-shot GPU run, end to end on the CPU: ``SMOKE=1`` (toy sizes, every phase) and
``DRY_RUN=1`` (the plan of the real run: each bench run's FLOP estimate and budget, nothing run)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests import helpers

SCRIPT = helpers.REPO / "benchmarks" / "gpu.sh"


def run_script(tmp_path, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(SCRIPT)], env=environment, capture_output=True, text=True, timeout=600)


def test_the_dry_run_plans_within_the_window(tmp_path):
    proc = run_script(tmp_path, DRY_RUN="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    totals = re.findall(r"^(qwen3-\S+)\s+total\s+([\d.]+)\s+([\d.]+)\s+budget (\d+) s$", proc.stdout, re.M)
    assert [name for name, *_ in totals] == ["qwen3-0.6b", "qwen3-1.7b"], proc.stdout
    for _, pflop, seconds, budget in totals:
        assert float(pflop) > 1 and int(budget) > float(seconds) > 0
    planned = int(re.search(r"^planned: .* = (\d+) s", proc.stdout, re.M).group(1))
    assert planned <= 480, proc.stdout  # the whole run fits 8 minutes, leaving the window room for a rerun
    assert not list(tmp_path.glob("gpu/*.jsonl"))  # nothing ran


@pytest.mark.slow
def test_smoke_runs_every_phase_and_keeps_each_part(tmp_path):
    archive = tmp_path / "gpu.tgz"
    proc = run_script(tmp_path, SMOKE="1", ARCHIVE=str(archive))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    phases = [json.loads(line) for line in (tmp_path / "gpu" / "phases.jsonl").read_text().splitlines()]
    assert [p["phase"] for p in phases] == ["readiness", "GPU tests", "bench smoke-1-layer", "bench smoke-2-layers",
                                            "targets"]
    assert all(p["status"] == 0 for p in phases), phases
    readiness = json.loads((tmp_path / "gpu" / "readiness.json").read_text())
    assert "_flash_attention_forward" in readiness["schemas"] and readiness["matmul_tflops"] > 0
    checked = [r for r in readiness["self_check"] if "figures" in r]
    assert {r["backend"] for r in checked} == {"cpu-flash", "reference"} and not any(r["verdict"] for r in checked)
    assert "1 token over a 29-token prefix (T = 1)" in proc.stdout  # every self-check figure is printed
    parts = [json.loads(line) for line in (tmp_path / "gpu" / "smoke-1-layer.jsonl").read_text().splitlines()]
    assert [p.get("workload", p["part"]) for p in parts] == ["grpo", "agent", "tree-search", "memory_scaling",
                                                              "long_sequence"]
    assert "grpo: dfs speed-up over vanilla-ckpt" in proc.stdout  # the targets, read from the parts
    assert archive.stat().st_size > 1000


def test_a_phase_that_hangs_is_cut_at_its_budget_with_its_subprocesses(tmp_path, monkeypatch):
    """A phase that prints, then hangs silently while a subprocess of its own holds its output open, is killed with
    that subprocess at its budget, and the cut is recorded: the run goes on to its next phase."""
    spec = importlib.util.spec_from_file_location("gpu_run", helpers.REPO / "benchmarks" / "gpu_run.py")
    gpu_run = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_run", gpu_run)  # (its dataclasses look their module up)
    spec.loader.exec_module(gpu_run)
    start = time.monotonic()
    gpu_run.run_phase("hangs", ["bash", "-c", "echo started; (sleep 300) & sleep 300"], 10, tmp_path,
                      gpu_run.Clock(60), "hangs.txt", reserve=0)
    assert time.monotonic() - start < 30
    (entry,) = [json.loads(line) for line in (tmp_path / "phases.jsonl").read_text().splitlines()]
    assert entry["phase"] == "hangs" and entry["status"] == "cut"
    assert (tmp_path / "hangs.txt").read_text() == "started\n"
