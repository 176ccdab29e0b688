"""``lightning-dta export``: it refuses to write over what exists (unless ``--force``), reads back what it wrote, and
leaves what exists untouched when the checkpoint or the write is bad."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from lightning_dta.cli import main as lightning_dta
from lightning_dta.distributed.export import ExportError, export_checkpoint, main
from tests.helpers.lightning import tiny_llama
from tests.helpers.models import HYBRID_FAMILIES


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


def existing_outputs(tmp_path: Path) -> dict[Path, str | dict[str, str]]:
    """What ``--force`` may replace, a file and a directory, with their contents (:func:`contents`)."""
    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me too")
    return {out: contents(out) for out in (tmp_path / "afile", tmp_path / "full")}


def contents(out: Path) -> str | dict[str, str]:
    return out.read_text() if out.is_file() else {p.name: p.read_text() for p in out.iterdir()}


def test_what_was_not_written_is_an_error(tmp_path, checkpoint, monkeypatch) -> None:
    """A write that fails its read-back leaves what was there, and no temporary directory."""
    path, _ = checkpoint
    before = existing_outputs(tmp_path)

    def config_only(self, out, **kwargs):  # a save that "succeeds" and writes no weights
        self.config.save_pretrained(out)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", config_only)
    for out in (tmp_path / "new", *before):
        with pytest.raises(ExportError, match=f"the export to {out} wrote no safetensors; {out} was left as it was"):
            export_checkpoint(path, out, force=True)
    assert {out: contents(out) for out in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "full", "one.ckpt"]


def not_a_checkpoint(path: Path, what: str) -> None:
    """Write ``what`` to ``path``: files a user may name by mistake, and checkpoints that do not fit their config."""
    if what == "junk bytes":
        path.write_bytes(bytes(range(256)) * 3)
    elif what == "an empty file":
        path.write_bytes(b"")
    elif what == "a pickled list":
        torch.save([1, 2, 3], path)
    elif what == "a dict without a state_dict":
        torch.save({"epoch": 3}, path)
    else:  # "weights missing": the config of one model, a layer of its weights gone
        model = tiny_llama(seed=4)
        torch.save({"hf_config": model.config.to_dict(),
                    "state_dict": {f"model.{k}": v for k, v in model.state_dict().items() if "layers.1." not in k}},
                   path)


@pytest.mark.parametrize("what", ["junk bytes", "an empty file", "a pickled list", "a dict without a state_dict",
                                  "weights missing"])
def test_a_bad_checkpoint_is_one_message_and_leaves_the_output(tmp_path, capsys, what) -> None:
    """The checkpoint is read and checked before anything is written: with ``--force`` over a file or a directory,
    a file that is not a fitting Lightning checkpoint is one line naming it, exit status 2, and what was there stays."""
    bad = tmp_path / "bad.ckpt"
    not_a_checkpoint(bad, what)
    before = existing_outputs(tmp_path)
    for out in before:
        assert lightning_dta(["export", str(bad), str(out), "--force"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured.err
        assert captured.err.startswith(f"lightning-dta export: error: {bad} ") and "Fix: " in captured.err
    assert {out: contents(out) for out in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "bad.ckpt", "full"]


def test_forced_into_an_earlier_export_its_stale_weights_go(tmp_path, checkpoint) -> None:
    """``--force`` into the directory of an earlier, sharded export: the files of the same names are replaced, the
    earlier shards and their index (which ``from_pretrained`` would read) are removed, other files stay."""
    path, weights = checkpoint
    out = tmp_path / "hf"
    tiny_llama(seed=5).save_pretrained(out, max_shard_size="20KB")
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    (out / "tokenizer.json").write_text("{}")
    export_checkpoint(path, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json"]
    reloaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, tensor in weights.items():
        assert torch.equal(reloaded[name], tensor), name


def test_a_sharded_checkpoint_and_one_whose_shards_do_not_fit(tmp_path, checkpoint) -> None:
    """The folder layout of ``dta_fsdp`` (``meta.pt`` + torch.distributed.checkpoint shards, written here in one
    process): exported like a file; shards of another model are one message naming the folder."""
    import torch.distributed.checkpoint as dcp

    path, weights = checkpoint
    stored = torch.load(path, weights_only=True)
    for name, config in (("sharded", stored["hf_config"]), ("other", {**stored["hf_config"], "hidden_size": 64})):
        (tmp_path / name).mkdir()
        torch.save({"hf_config": config}, tmp_path / name / "meta.pt")
        dcp.save({"state_dict": stored["state_dict"]}, checkpoint_id=str(tmp_path / name), no_dist=True)
    export_checkpoint(tmp_path / "sharded", tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for name, tensor in weights.items():
        assert torch.equal(reloaded[name], tensor), name
    with pytest.raises(ExportError, match=f"{tmp_path / 'other'}: the shards cannot be read into the llama model.*Fix"):
        export_checkpoint(tmp_path / "other", tmp_path / "other-hf")
    assert not (tmp_path / "other-hf").exists()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_a_hybrid_round_trips(tmp_path, family) -> None:
    """A hybrid's checkpoint (Gated DeltaNet, short convolution, Mamba2 layers beside attention or alone) exports
    to a directory that transformers loads as the same model: every weight bitwise, the same logits. transformers
    saves some families in their original checkpoints' layout (Nemotron-H's ``backbone.``, the MoE hybrids' experts
    one per expert), which the read-back must expect rather than refuse."""
    from tests.helpers.float64 import without_float32_islands
    from tests.helpers.models import make_model

    model = make_model(family).eval()
    path = tmp_path / "hybrid.ckpt"
    torch.save({"hf_config": model.config.to_dict(),
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, path)
    assert main([str(path), str(tmp_path / "out")]) == 0
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    without_float32_islands(reloaded)  # as make_model computes its float32 steps: the same code on both sides
    if family in ("qwen3_next", "lfm2_moe", "granitemoehybrid", "kimi_linear"):  # MoE: as make_model, eager experts
        reloaded.set_experts_implementation("eager")
    assert type(reloaded) is type(model)
    assert reloaded.config.layer_types == model.config.layer_types
    state = reloaded.state_dict()
    assert set(state) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name
    tokens = torch.tensor([[3, 17, 5, 9, 30, 2, 11]])
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
