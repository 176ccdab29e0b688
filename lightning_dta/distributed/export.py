"""``lightning-dta export CKPT OUT_DIR``: a training checkpoint as a plain Hugging Face model directory.

For serving (vLLM, SGLang) and the hub: ``config.json`` + safetensors, loadable with
``AutoModelForCausalLM.from_pretrained(OUT_DIR)``. It reads both kinds of checkpoint ``DTAModule`` writes: a
``.ckpt`` file (``strategy="dta"``) and the folder of per-rank shards of ``strategy="dta_fsdp"`` (read here in one
process with ``torch.distributed.checkpoint``; no process group is needed). The model is rebuilt from the config
``DTAModule`` stores in every checkpoint, so nothing is downloaded. Inside a running sharded job,
:func:`lightning_dta.distributed.sharding.export_hf_checkpoint` writes the same layout without gathering the model
anywhere.
Tokenizer files are not part of a training checkpoint: copy them from the base model.

The output must be a new or an empty directory (``--force`` writes into an existing one, or replaces a file). Nothing
there is touched until the export is known good: the checkpoint is read and checked first (a file that is not a
Lightning checkpoint is one message, exit status 2), the model is written into a temporary sibling directory and
read back (``config.json`` names the model's type, and the safetensors hold every tensor of the model, bitwise, one
tensor at a time so the check needs no second copy of the model), and only then moved into place by renames on the
same file system. Moving into a non-empty directory replaces the files of the same names and removes the weight
files of an earlier export that this one did not write (``from_pretrained`` would load a stale
``model.safetensors`` before a new index); other files, such as a copied tokenizer, stay.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from lightning_dta.core.errors import UsageError

METADATA = "meta.pt"  # the non-tensor part of a sharded Lightning checkpoint (ModelParallelStrategy's name)
PREFIX = "model."  # DTAModule keeps the causal LM in `self.model`
CHECKPOINT_FIX = ("Fix: the path of a .ckpt file written by Lightning from a DTAModule (strategy dta) or of a sharded "
                  "checkpoint folder (dta_fsdp); --traceback shows what torch found")
WEIGHT_FILES = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                "pytorch_model.bin.index.json")  # what save_pretrained writes as weights, sharded or not


class ExportError(UsageError, ValueError):
    """The checkpoint cannot be exported; the message says why and what to do."""


def _model_from(config: dict | None, where: Path) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not isinstance(config, dict) or "model_type" not in config:
        raise ExportError(f"{where} holds no model config (it was not written by DTAModule, or by a version before "
                          "the config was stored). Fix: load the checkpoint into your model and call "
                          "model.save_pretrained(OUT_DIR)")
    config = dict(config)
    model_type = config.pop("model_type")
    try:
        hf_config = AutoConfig.for_model(model_type, **config)
    except (ValueError, KeyError, TypeError) as error:
        raise ExportError(f"{where} stores a config of model type {model_type!r} that transformers cannot build "
                          f"({type(error).__name__}). Fix: the transformers version the checkpoint was trained "
                          "with") from error
    return AutoModelForCausalLM.from_config(hf_config)


def _torch_load(path: Path, where: Path) -> object:
    """``torch.load`` of a file the user named: anything it raises is about the file (junk bytes, a truncated
    archive, a pickle of something else), so it is bad input, not a bug."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ExportError(f"{where} cannot be read as a Lightning checkpoint (torch.load raised "
                          f"{type(error).__name__}). {CHECKPOINT_FIX}") from error


def _load_sharded(path: Path) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    metadata = path / METADATA
    if not metadata.is_file():
        raise ExportError(f"{path} is a folder without {METADATA}: not a sharded Lightning checkpoint. "
                          f"{CHECKPOINT_FIX}")
    meta = _torch_load(metadata, metadata)
    model = _model_from(meta.get("hf_config") if isinstance(meta, dict) else None, path)
    state = {"state_dict": {PREFIX + k: v for k, v in model.state_dict().items()}}
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    # the shards of another model, or missing or damaged files (CheckpointException is a BaseException)
    except (Exception, dcp.CheckpointException) as error:
        raise ExportError(f"{path}: the shards cannot be read into the {model.config.model_type} model its "
                          f"{METADATA} describes ({type(error).__name__}). {CHECKPOINT_FIX}") from error
    return model, state["state_dict"]


def _load_file(path: Path) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    checkpoint = _torch_load(path, path)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ExportError(f"{path} holds a {type(checkpoint).__name__} without a state_dict: not a Lightning "
                          f"checkpoint. {CHECKPOINT_FIX}")
    return _model_from(checkpoint.get("hf_config"), path), checkpoint["state_dict"]


def load_checkpoint(path: Path) -> nn.Module:
    """The causal LM of the checkpoint at ``path`` with its weights, checked against the stored config."""
    model, state = _load_sharded(path) if path.is_dir() else _load_file(path)
    weights = {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # optional Hugging Face attribute: the keys that alias another parameter, where any
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ExportError(f"{path} does not match the stored model config: missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(unexpected)[:5]}. Fix: a checkpoint as DTAModule wrote it, whose "
                          "state_dict holds every weight of the model its hf_config describes")
    return model


def check_output(out: Path, force: bool) -> None:
    """Refuse to write over a file or into a directory that holds anything, unless ``force`` (which changes
    nothing yet: :func:`move_into_place` replaces what is there once the export is known good)."""
    if force:
        return
    if out.is_file():
        raise ExportError(f"{out} is a file; the export is a directory (config.json + safetensors). Fix: a new or "
                          "empty directory, or --force to replace the file")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(f"{out} is a directory that is not empty. Fix: a new or empty directory, or --force to write "
                          "into it (files of the same names are replaced)")


def saved_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` writes, under the names it writes them: transformers 5 saves in the layout of
    the family's original checkpoints, reverting the renames and merges it applies at load (Nemotron-H's
    ``model.`` is ``backbone.`` on disk; MoE experts fused in the model are stored one per expert). Renamed tensors
    are the model's own; only merged or split ones are new."""
    try:  # transformers >= 5.0 (the project's floor); a release without it saves the module names as they are
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return model.state_dict()
    return revert_weight_conversion(model, model.state_dict())


def verify_export(written: Path, model: nn.Module, out: Path) -> None:
    """Read back what ``save_pretrained`` wrote into ``written`` (the export bound for ``out``, named in the
    errors): ``config.json`` with the model's type, and safetensors holding every tensor of ``model`` bitwise (a
    tensor tied to another one is stored once)."""
    from safetensors import safe_open

    kept = f"{out} was left as it was"
    config = written / "config.json"
    if not config.is_file() or json.loads(config.read_text()).get("model_type") != model.config.model_type:
        raise ExportError(f"the export to {out} wrote no config.json of a {model.config.model_type} model; {kept}")
    index = written / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        (["model.safetensors"] if (written / "model.safetensors").is_file() else [])
    if not files:
        raise ExportError(f"the export to {out} wrote no safetensors; {kept}")
    expected = saved_state(model)
    stored: dict[int, str] = {}
    for name in files:
        with safe_open(str(written / name), framework="pt") as weights:
            for key in weights.keys():
                if key not in expected or not torch.equal(weights.get_tensor(key), expected[key]):
                    raise ExportError(f"the export to {out} wrote a tensor {key!r} into {name} that is not the "
                                      f"model's; {kept}")
                stored[expected[key].data_ptr()] = key
    missing = [key for key, tensor in expected.items() if tensor.data_ptr() not in stored]  # tied: stored once
    if missing:
        raise ExportError(f"the export to {out} lacks the tensors {missing[:5]}; {kept}")


def sibling(out: Path, what: str) -> Path:
    """A new hidden directory next to ``out`` (so that renames to ``out`` stay on one file system), created with
    the process's default permissions: it may become ``out``."""
    folder = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}.{what}"
    folder.mkdir()
    return folder


def move_into_place(written: Path, out: Path) -> None:
    """Move the checked export ``written`` (a directory on ``out``'s file system) to ``out`` by renames: over a
    file (set aside until the rename succeeded), as ``out`` itself when that is new or empty, or file by file into
    a non-empty directory, then removing the weight files of an earlier export that this one did not write."""
    if out.is_file():
        aside = sibling(out, "replaced") / out.name
        os.replace(out, aside)
        try:
            os.replace(written, out)
        except BaseException:
            os.replace(aside, out)
            raise
        finally:
            shutil.rmtree(aside.parent, ignore_errors=True)
        return
    if not out.is_dir() or not any(out.iterdir()):
        os.replace(written, out)  # an empty directory is replaced by the rename (POSIX)
        return
    new = {entry.name for entry in written.iterdir()}
    for name in sorted(new):
        os.replace(written / name, out / name)
    for stale in sorted({f for pattern in WEIGHT_FILES for f in out.glob(pattern)}):
        if stale.name not in new:
            stale.unlink()


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Write the causal LM of a ``DTAModule`` checkpoint to ``out_dir`` in the ``save_pretrained`` layout, and check
    what was written (module docstring). ``force``: write over an existing file or into a non-empty directory;
    what is there stays untouched unless the export succeeds."""
    path = Path(checkpoint)
    if not path.exists():
        raise ExportError(f"{path} does not exist. Fix: the path of a .ckpt file (strategy dta) or of a sharded "
                          "checkpoint folder (dta_fsdp)")
    out = Path(out_dir)
    check_output(out, force)
    model = load_checkpoint(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = sibling(out, "export")
    try:
        model.save_pretrained(written)
        verify_export(written, model, out)
        move_into_place(written, out)
    finally:
        shutil.rmtree(written, ignore_errors=True)  # gone already when it became `out`
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from jsonargparse import ArgumentParser

    from lightning_dta.arguments import parse_args

    parser = ArgumentParser(prog="lightning-dta export", description=__doc__.splitlines()[0], exit_on_error=False)
    parser.add_argument("checkpoint", help="a .ckpt file (strategy dta) or a sharded checkpoint folder (dta_fsdp)")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write (new or empty)")
    parser.add_argument("--force", action="store_true", help="write into an existing directory, or over a file")
    args = parse_args(parser, argv, "export")
    out = export_checkpoint(args.checkpoint, args.out_dir, force=args.force)
    print(f"wrote {out} and read it back (load it with AutoModelForCausalLM.from_pretrained; copy the tokenizer from "
          "the base model)")
    return 0
