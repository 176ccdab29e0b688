"""``benchmarks/gpu.sh``, the one-shot GPU run, end to end on the CPU: ``SMOKE=1`` (toy sizes, every phase) and
``DRY_RUN=1`` (the install step and the plan of the real run: each bench run's FLOP estimate and budget, nothing run
or installed); and its first step, the check that this Python can run the package (``gpu_requirements.py``)."""

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


def load(name: str, monkeypatch):
    """A script of ``benchmarks/`` as a module."""
    spec = importlib.util.spec_from_file_location(name, helpers.REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_the_requirements_check_takes_the_image_torch_and_names_what_is_missing(monkeypatch, capsys):
    """torch 2.11 (the image's, a local or pre-release build) meets the claim, 2.10 does not; a torch API the package
    calls that this torch lacks is named, and either refuses the run."""
    check = load("gpu_requirements", monkeypatch)
    (torch_requirement,) = [r for r in check.requirements() if r.name == "torch"]
    for found in ("2.11.0+cu130", "2.12.0a0+gitc0ffee", "2.13.0+cpu"):
        assert check.unmet(torch_requirement, found) is None, found
    assert check.unmet(torch_requirement, "2.10.2+cu128") == "found 2.10.2+cu128, needs >=2.11"
    assert check.unmet(torch_requirement, None) == "not installed"
    assert check.missing_torch_apis() == [] and check.main() == 0
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    monkeypatch.setattr(HuggingFaceStorageWriter, "__init__", lambda self, path, save_distributed=False: None)
    assert check.missing_torch_apis() == [
        "torch.distributed.fsdp:FSDPModule.set_force_sum_reduction_for_comms",
        "torch.distributed.checkpoint:HuggingFaceStorageWriter(enable_consolidation=...)"]
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    real_init = FSDPState.__init__

    def init_without_groups(self):  # a torch whose unit keeps its parameter groups under another name
        real_init(self)
        del self._fsdp_param_groups

    monkeypatch.setattr(FSDPState, "__init__", init_without_groups)
    monkeypatch.setattr(FSDPState, "_fsdp_param_group", None, raising=False)
    assert check.missing_fsdp_internals() == []  # torch < 2.12's single group is enough
    monkeypatch.delattr(FSDPState, "_fsdp_param_group")
    assert check.missing_fsdp_internals() == ["FSDPState._fsdp_param_groups (or _fsdp_param_group)"]
    monkeypatch.setattr(FSDPState, "__init__", real_init)
    monkeypatch.setattr(check, "installed", lambda name, real=check.installed: "2.10.0" if name == "torch" else
                        real(name))
    capsys.readouterr()
    assert check.main() == 1
    refusal = capsys.readouterr().out.splitlines()[-1]
    assert refusal == ("cannot run the package from this tree on this Python: torch: found 2.10.0, needs >=2.11; "
                       "torch 2.10.0 lacks torch.distributed.fsdp:FSDPModule.set_force_sum_reduction_for_comms; "
                       "torch 2.10.0 lacks torch.distributed.checkpoint:HuggingFaceStorageWriter"
                       "(enable_consolidation=...)")


def test_the_dry_run_shows_the_install_step_and_plans_within_the_window(tmp_path):
    """The image's torch (2.11, CUDA) must stay: the package goes on PYTHONPATH, only the two carried wheels are
    pip-installed, offline and without dependencies, and a dry run prints that step without running pip at all;
    then the plan of the real run."""
    calls, wheels = tmp_path / "calls.txt", tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "jsonargparse-4.53.0-py3-none-any.whl").write_bytes(b"")
    python = tmp_path / "python"  # logs every call; its image "lacks" jsonargparse, so the install branch is taken
    python.write_text(f'#!/usr/bin/env bash\necho "$*" >> {calls}\n'
                      '[ "$1" = -c ] && [[ "$2" == *jsonargparse* ]] && exit 1\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    proc = run_script(tmp_path, DRY_RUN="1", PYTHON=str(python), WHEELS=str(wheels))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (step,) = [line for line in proc.stdout.splitlines() if line.startswith("install: ")]
    assert "on PYTHONPATH (no pip install of it, nor of torch)" in step
    assert step.endswith(f"-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "
                         f"/tmp/lightning_dta_site {wheels}/*.whl")
    assert f"DRY_RUN: jsonargparse or docstring-parser is absent; the run would install {wheels}/*.whl" in proc.stdout
    assert re.search(r"^  torch>=2.11 +ok, ", proc.stdout, re.M) and "all present" in proc.stdout
    assert not [call for call in calls.read_text().splitlines() if "pip" in call], calls.read_text()
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
    gpu_run = load("gpu_run", monkeypatch)
    start = time.monotonic()
    gpu_run.run_phase("hangs", ["bash", "-c", "echo started; (sleep 300) & sleep 300"], 10, tmp_path,
                      gpu_run.Clock(60), "hangs.txt", reserve=0)
    assert time.monotonic() - start < 30
    (entry,) = [json.loads(line) for line in (tmp_path / "phases.jsonl").read_text().splitlines()]
    assert entry["phase"] == "hangs" and entry["status"] == "cut"
    assert (tmp_path / "hangs.txt").read_text() == "started\n"
