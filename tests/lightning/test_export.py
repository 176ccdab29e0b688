"""``lightning-dta export``: it refuses to write over what exists (unless ``--force``) and reads back what it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from lightning_dta.distributed.export import ExportError, export_checkpoint, main
from tests.helpers.lightning import tiny_llama


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, dict]:
    """A ``.ckpt`` as DTAModule writes it: the model's config and its weights under ``model.``."""
    model = tiny_llama(seed=4)
    path = tmp_path / "one.ckpt"
    torch.save({"hf_config": model.config.to_dict(),
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, path)
    return path, model.state_dict()


def test_an_existing_file_or_a_non_empty_directory_is_refused_unless_forced(tmp_path, checkpoint, capsys) -> None:
    path, weights = checkpoint
    afile, full = tmp_path / "afile", tmp_path / "full"
    afile.write_text("keep me")
    full.mkdir()
    (full / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="afile is a file.*--force"):
        export_checkpoint(path, afile)
    with pytest.raises(ExportError, match="full is a directory that is not empty.*--force"):
        export_checkpoint(path, full)
    assert afile.read_text() == "keep me" and sorted(p.name for p in full.iterdir()) == ["notes.txt"]
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty"):
        assert main([str(path), str(out)]) == 0 and "and read it back" in capsys.readouterr().out
    assert main([str(path), str(afile), "--force"]) == 0 and main([str(path), str(full), "--force"]) == 0
    for out in (tmp_path / "new", afile, full):
        reloaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
        for name, tensor in weights.items():
            assert torch.equal(reloaded[name], tensor), name


def test_what_was_not_written_is_an_error(tmp_path, checkpoint, monkeypatch) -> None:
    path, _ = checkpoint

    def config_only(self, out, **kwargs):  # a save that "succeeds" and writes no weights
        self.config.save_pretrained(out)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", config_only)
    with pytest.raises(ExportError, match="holds no safetensors after the export"):
        export_checkpoint(path, tmp_path / "out")
