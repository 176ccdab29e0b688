"""The ``lightning-dta`` command: the shipped configs parse, tiny_cpu trains on 1 and 2 CPU processes."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

import lightning_dta as dta
from lightning_dta import cli
from lightning_dta.core.advantages import grpo_advantages
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.rollout import read_rollouts
from lightning_dta.lightning.data import make_step_batch
from tests import helpers
from tests.helpers.lightning import EXECUTABLE, clean_env, run_cli, step_rows

REPO = helpers.REPO
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
GPU_CONFIGS = [c for c in CONFIGS if "gpu" in c.name]
THROUGHPUT = ("throughput/logical_tokens_per_sec", "throughput/tree_tokens_per_sec", "throughput/compression_ratio",
              "throughput/step_time_sec", "throughput/logical_tokens_per_sec_window")


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when pytest's own arguments sit in ``sys.argv`` next to ``args=``."""
    monkeypatch.setattr(sys, "argv", ["lightning-dta"])


def test_fit_tiny_cpu(tmp_path: Path) -> None:
    rows = step_rows(run_cli(tmp_path, "--trainer.max_steps=3"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        for key in (*THROUGHPUT, "memory/cpu_peak_rss_gib", "train/clip_fraction", "train/approx_kl",
                    "train/entropy", "train/logical_tokens", "train/tree_tokens", "train/compression_ratio"):
            assert key in row, key
        assert row["throughput/logical_tokens_per_sec"] > 0 and row["memory/cpu_peak_rss_gib"] > 0


def test_fit_prints_no_warning_the_project_causes_or_can_silence(tmp_path: Path) -> None:
    proc = subprocess.run([str(EXECUTABLE), "fit", "--config", "configs/tiny_cpu.yaml", "--trainer.max_steps=2",
                           f"--trainer.logger.init_args.save_dir={tmp_path}"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    for unwanted in ("litlogger", "FLOPs", "LeafSpec", "IterableDataset", "Warning", "v_num", "/-2"):
        assert unwanted not in output, (unwanted, output[-3000:])
    assert "step: 2/2" in output and "loss:" in output  # the step progress bar
    assert "model: LlamaForCausalLM" in output


@pytest.mark.distributed
def test_a_step_with_a_non_finite_loss_is_skipped_on_both_ranks_and_named(tmp_path: Path) -> None:
    """Rollout 20 (step 1; its group's lowest reward, so its GRPO advantage is negative) has behaviour and proximal
    log-probs of -1e4: its ratio exp(logp + 1e4) overflows and its PPO term is +inf. Step 1 is skipped on both ranks,
    the warning names the rollout, and training goes on with the other steps."""
    lines = (REPO / "data" / "tiny_rollouts.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    bad = records[20]
    group = [r for r in records if r["group_id"] == bad["group_id"]]
    bad["reward"] = min(r["reward"] for r in group) - 1.0
    bad["old_logprobs"] = [-1e4] * len(bad["input_ids"])
    path = tmp_path / "nonfinite.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = subprocess.run([str(EXECUTABLE), "fit", "--config", "configs/tiny_cpu.yaml", f"--data.path={path}",
                           "--trainer.devices=2", "--trainer.max_steps=3", "--trainer.enable_progress_bar=false",
                           f"--trainer.logger.init_args.save_dir={tmp_path}"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert output.count("batch 1 skipped on every rank") == 2, output[-4000:]  # one warning per rank
    assert "non-finite loss terms in rollouts [" in output and "none of this rank" in output, output[-4000:]
    (metrics,) = tmp_path.glob("tiny_cpu/version_*/metrics.csv")
    losses = [float(row["train/loss"]) for row in csv.DictReader(open(metrics)) if row.get("train/loss")]
    assert len(losses) == 4 and not math.isfinite(losses[1]), losses  # 3 optimizer steps took 4 batches
    assert all(math.isfinite(v) for i, v in enumerate(losses) if i != 1), losses


def test_help_lists_the_subcommands_that_work() -> None:
    proc = subprocess.run([str(EXECUTABLE), "--help"], capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0 and "{fit,plan,bench,export,convert}" in proc.stdout, proc.stdout
    with pytest.raises(ConfigError, match="subcommand 'validate'.*Fix: one of fit"):
        cli.cli_main(["validate", "--config", str(REPO / "configs" / "tiny_cpu.yaml")])  # no validation_step


def test_fit_help_starts_with_the_projects_options_one_line_each(capsys: pytest.CaptureFixture) -> None:
    """Issue 32: a screenful per section, not LightningCLI's 1,300 lines; every option of the loss and the engine
    (their fields), each on one line with its meaning; the rest behind --help-all."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--help"])
    assert exit_info.value.code in (0, None)
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("usage: lightning-dta fit") and len(lines) < 100 and max(map(len, lines)) <= 120, text
    first_trainer = next(i for i, line in enumerate(lines) if "--trainer." in line)
    for name in [f.name for f in dataclasses.fields(dta.PolicyLoss) if not f.name.startswith("_")]:
        (line,) = [i for i, line in enumerate(lines) if line.startswith(f"  --model.loss.{name} ")]
        assert line < first_trainer and len(lines[line].split(None, 1)) == 2, lines[line]
    for name in dta.EngineOptions().to_dict():
        assert any(line.startswith(f"  --model.engine.{name} ") for line in lines[:first_trainer]), name
    assert "torch.nn.Linear" not in text and 'Default: ``"auto"``' not in text and "--help-all" in text
    assert "--trainer.strategy" in text and "(default: dta)" in text
    with pytest.raises(SystemExit):
        cli.main(["fit", "--help-all"])
    every = capsys.readouterr().out
    assert "--trainer.gradient_clip_val" in every and "default: dta" in every
    assert 'Default: ``"auto"``' not in every.split("--trainer.strategy STRATEGY")[1][:300]


def test_a_bad_rollout_file_is_one_clear_error_without_a_traceback(tmp_path: Path) -> None:
    lines = (REPO / "data" / "tiny_rollouts.jsonl").read_text().splitlines()
    first, second = json.loads(lines[1]), json.loads(lines[4])
    first["loss_mask"] = first["loss_mask"][:-1]
    second["input_ids"][3] = -3
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], json.dumps(first), "", *lines[2:4], json.dumps(second), *lines[5:]]) + "\n")
    proc = subprocess.run([str(EXECUTABLE), "fit", "--config", "configs/tiny_cpu.yaml", f"--data.path={bad}",
                           f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_steps=1"],
                          cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    n = len(first["input_ids"])
    assert f"{bad}:2: rollout index 1, field 'loss_mask': has {n - 1} entries but input_ids has {n}" in proc.stderr
    assert (f"{bad}:6: rollout index 4, field 'input_ids': token 3 is -3, outside the vocabulary [0, vocab_size)"
            in proc.stderr)


@pytest.mark.distributed
def test_fit_tiny_cpu_on_two_processes(tmp_path: Path) -> None:
    rows = step_rows(run_cli(tmp_path, "--trainer.devices=2", "--trainer.max_steps=2"))
    assert len(rows) == 2
    steps = read_rollouts(REPO / "data" / "tiny_rollouts.jsonl")
    for number, row in enumerate(rows):  # the file's steps in order (no shuffle), 16 rollouts each
        whole = make_step_batch(grpo_advantages(steps[16 * number:16 * (number + 1)]), 0, 1).step_stats
        # both ranks' tokens are counted: the step's logical tokens over the slowest rank's time
        tokens = row["throughput/logical_tokens_per_sec"] * row["throughput/step_time_sec"]
        assert tokens == pytest.approx(whole.logical_tokens, rel=1e-5)
        assert row["train/logical_tokens"] == whole.logical_tokens
        assert row["train/num_rollouts"] == 16


@pytest.mark.slow
def test_fit_tiny_hybrid_cpu(tmp_path: Path) -> None:
    """``lightning-dta fit`` with a hybrid (Qwen3.5: Gated DeltaNet and attention) config trains on its trees."""
    rows = step_rows(run_cli(tmp_path, "--trainer.max_steps=2", config="tiny_hybrid_cpu"))
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["train/compression_ratio"] > 1 and r["train/grad_norm"] > 0 for r in rows)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_config_parses(config: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.cli_main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert ("strategy: dta" in printed or "lightning_dta.DTAFSDPStrategy" in printed) \
        and "lightning_dta.TreeThroughputMonitor" in printed


@pytest.mark.parametrize("config", GPU_CONFIGS, ids=[c.stem for c in GPU_CONFIGS])
def test_gpu_config_instantiates_without_downloading(config: Path, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    def no_download(*args, **kwargs):
        raise AssertionError("the model must be loaded in configure_model, not when the config is parsed")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    written = yaml.safe_load(config.read_text())
    # a GPU config names the data set of the GPU machine; the data module checks that the file exists
    data = [f"--data.path={REPO / 'data' / 'tiny_rollouts.jsonl'}"] if written["data"].get("path") else []
    parsed = cli.cli_main(["--config", str(config), "--trainer.accelerator=cpu", "--trainer.devices=1",
                           "--trainer.precision=32-true", f"--trainer.default_root_dir={tmp_path}",
                           f"--trainer.logger.init_args.save_dir={tmp_path}", *data], run=False)
    module = parsed.model
    assert isinstance(module, dta.DTAModule) and module.model is None
    assert module.hparams["model"].startswith("Qwen/Qwen3-")
    assert module.model_kwargs == written["model"]["model_kwargs"]
    assert module.model_kwargs["attn_implementation"] == "flash_attention_2"
    assert module.engine.activation == "recompute"
    assert parsed.config["trainer"]["precision"] == "32-true"  # the override
    assert written["trainer"]["precision"] in ("bf16-true", "bf16-mixed")  # what the file says


def test_bench_subcommand_is_dispatched(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    fake = types.ModuleType("fake_bench_cli")
    fake.main = calls.append
    monkeypatch.setitem(sys.modules, "fake_bench_cli", fake)
    monkeypatch.setitem(cli.COMMANDS, "bench", "fake_bench_cli")
    cli.main(["bench", "--steps", "3"])
    assert calls == [["--steps", "3"]]


@pytest.mark.distributed
def test_fit_tiny_cpu_sharded_logs_the_one_process_step(tmp_path: Path) -> None:
    """``--trainer.strategy=dta_fsdp --trainer.devices=2`` trains the same steps as ``dta`` on one process: the
    logged loss and gradient norm per step agree (float32, relative 1e-5)."""
    sharded = step_rows(run_cli(tmp_path / "fsdp", "--trainer.strategy=dta_fsdp", "--trainer.devices=2",
                                "--trainer.max_steps=3"))
    single = step_rows(run_cli(tmp_path / "dta", "--trainer.max_steps=3"))
    assert len(sharded) == len(single) == 3
    for a, b in zip(sharded, single):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
        assert a["train/logical_tokens"] == b["train/logical_tokens"]
