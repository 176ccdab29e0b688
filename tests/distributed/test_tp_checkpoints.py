"""Checkpoints of a tensor-parallel x FSDP2 run: loading a Hugging Face checkpoint into 2-D shards, resume on the
2-D mesh, and export to a plain Hugging Face directory (``tests/lightning/fsdp_worker.py --tensor-parallel 2``).

The worker trains AdamW steps with clipping active (0.2, below every step's norm) from a local Hugging Face
checkpoint: ``DTAModule(model="<dir>")`` under ``DTAFSDPStrategy`` builds the model on the meta device, applies
TP then FSDP2 and reads each rank's slices through DCP's ``HuggingFaceStorageReader``. Each rank saves the full
trained weights (gathered), its logged loss and gradient norm per step, and the logits on a fixed input.

- loaded and trained, the weights equal those of ``dta`` on one process that loaded the same directory whole
  (float32, relative 1e-5 per tensor, the dta_fsdp tests' tolerance);
- a run stopped after 2 steps (a sharded checkpoint: one file per rank) and resumed for the third ends with the
  uninterrupted run's weights, bitwise;
- ``export_hf_checkpoint`` inside the job and ``lightning-dta export`` of the sharded checkpoint write directories
  that ``AutoModelForCausalLM.from_pretrained`` loads with exactly the trained weights (bitwise) and the job's
  logits (to float32 rounding: the job's forward sums the row-parallel halves in another order, measured 4e-7).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import helpers
from tests.helpers.lightning import clean_env, close_weights, run_name, tiny_llama, train_with_fsdp_worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
IDS = torch.tensor([[5, 17, 33, 2, 90, 64, 1]])
LOGITS = dict(rtol=1e-5, atol=1e-6)  # a plain forward vs the job's tensor-parallel one (the same weights)


def exported(directory: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The weights and the logits on ``IDS`` of a Hugging Face directory, loaded by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return dict(model.state_dict()), model(input_ids=IDS).logits


def assert_equal_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Bitwise, every tensor (RoPE's frequencies are non-persistent buffers: not in a loaded state dict)."""
    assert set(got) == {name for name in expected if not name.endswith("inv_freq")}, set(got) ^ set(expected)
    for name, weight in got.items():
        torch.testing.assert_close(weight, expected[name], rtol=0, atol=0, msg=name)


def resume_and_export(tmp_path: Path, devices: int) -> None:
    checkpoint = tmp_path / "hf"
    tiny_llama(seed=3).save_pretrained(checkpoint)
    whole, first, resumed, one = (tmp_path / name for name in ("whole", "first", "resumed", "one"))
    for path in (whole, first, resumed, one):
        path.mkdir()
    run = dict(tensor_parallel=2, timeout=600)
    model = ("--model", str(checkpoint))
    (reference,) = train_with_fsdp_worker(one, "dta", 1, "keep", 3, *model)
    uninterrupted = train_with_fsdp_worker(whole, "dta_fsdp", devices, "keep", 3, *model, **run)
    for rank in uninterrupted:  # meta-device loading into 2-D shards, then three steps: the one-process steps
        assert rank["world_size"] == devices
        assert all(row["grad_norm"] > 0.2 for row in rank["rows"])  # clipping acted on every step
        for row, ref in zip(rank["rows"], reference["rows"], strict=True):
            assert row["loss"] == pytest.approx(ref["loss"], rel=1e-5)
            assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        close_weights(rank["weights"], reference["weights"])
    ckpt = tmp_path / "step2.ckpt"
    train_with_fsdp_worker(first, "dta_fsdp", devices, "keep", 2, *model, "--save", str(ckpt), **run)
    assert ckpt.is_dir() and len(list(ckpt.glob("*.distcp"))) == devices  # each rank wrote its shards
    export = tmp_path / "export"
    again = train_with_fsdp_worker(resumed, "dta_fsdp", devices, "keep", 3, *model, "--resume", str(ckpt),
                                   "--export", str(export), **run)
    assert len(again[0]["rows"]) == 1  # only step 3 ran after the resume
    for rank in again:
        for name, weight in uninterrupted[0]["weights"].items():
            torch.testing.assert_close(rank["weights"][name], weight, rtol=0, atol=0, msg=name)
    weights, logits = exported(export)  # written from the running job's 2-D shards
    assert_equal_weights(weights, again[0]["weights"])
    torch.testing.assert_close(logits, again[0]["logits"], **LOGITS)
    offline = tmp_path / "offline"  # the sharded checkpoint after step 2, through the command
    command = [sys.executable, "-m", "lightning_dta.cli", "export", str(ckpt), str(offline)]
    proc = subprocess.run(command, cwd=helpers.REPO, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = torch.load(first / f"{run_name('dta_fsdp', devices, 2)}-rank0.pt", weights_only=False)  # step 2
    weights, logits = exported(offline)
    assert_equal_weights(weights, before["weights"])
    torch.testing.assert_close(logits, before["logits"], **LOGITS)


@pytest.mark.long  # about 70 s; the default suite resumes and exports dta_fsdp (tests/lightning/test_fsdp.py)
def test_tp2_load_resume_and_export(tmp_path: Path) -> None:
    """TP 2 on 2 processes (data-parallel size 1: FSDP2 over a 1-rank dimension, the TP shards as they are)."""
    resume_and_export(tmp_path, 2)


@pytest.mark.long
def test_tp2_dp2_load_resume_and_export(tmp_path: Path) -> None:
    """TP 2 x DP 2 on 4 processes: every weight sharded over both dimensions (in the last step one data-parallel
    rank has no rollout and still joins every collective)."""
    resume_and_export(tmp_path, 4)
