"""``lightning-dta export CKPT OUT_DIR``: a training checkpoint as a plain Hugging Face model directory.

For serving (vLLM, SGLang) and the hub: ``config.json`` + safetensors, loadable with
``AutoModelForCausalLM.from_pretrained(OUT_DIR)``. It reads both kinds of checkpoint ``DTAModule`` writes: a
``.ckpt`` file (``strategy="dta"``) and the folder of per-rank shards of ``strategy="dta_fsdp"`` (read here in one
process with ``torch.distributed.checkpoint``; no process group is needed). The model is rebuilt from the config
``DTAModule`` stores in every checkpoint, so nothing is downloaded. Inside a running sharded job,
:func:`lightning_dta.distributed.sharding.export_hf_checkpoint` writes the same layout without gathering the model
anywhere.
Tokenizer files are not part of a training checkpoint: copy them from the base model.

The output must be a new or an empty directory (``--force`` writes into an existing one, or replaces a file), and
what was written is read back and checked: ``config.json`` names the model's type, and the safetensors hold every
tensor of the model, bitwise (one tensor at a time, so the check needs no second copy of the model).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from lightning_dta.core.errors import UsageError

METADATA = "meta.pt"  # the non-tensor part of a sharded Lightning checkpoint (ModelParallelStrategy's name)
PREFIX = "model."  # DTAModule keeps the causal LM in `self.model`


class ExportError(UsageError, ValueError):
    """The checkpoint cannot be exported; the message says why and what to do."""


def _model_from(config: dict | None, where: Path) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not config or "model_type" not in config:
        raise ExportError(f"{where} holds no model config (it was not written by DTAModule, or by a version before "
                          "the config was stored). Fix: load the checkpoint into your model and call "
                          "model.save_pretrained(OUT_DIR)")
    config = dict(config)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))


def _load_sharded(path: Path) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    metadata = path / METADATA
    if not metadata.is_file():
        raise ExportError(f"{path} is a folder without {METADATA}: not a sharded Lightning checkpoint")
    model = _model_from(torch.load(metadata, map_location="cpu", weights_only=True).get("hf_config"), path)
    state = {"state_dict": {PREFIX + k: v for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return model, state["state_dict"]


def _load_file(path: Path) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    return _model_from(checkpoint.get("hf_config"), path), checkpoint["state_dict"]


def check_output(out: Path, force: bool) -> None:
    """Refuse to write over a file or into a directory that holds anything, unless ``force``."""
    if force:
        if out.is_file():
            out.unlink()
        return
    if out.is_file():
        raise ExportError(f"{out} is a file; the export is a directory (config.json + safetensors). Fix: a new or "
                          "empty directory, or --force to replace the file")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(f"{out} is a directory that is not empty. Fix: a new or empty directory, or --force to write "
                          "into it (files of the same names are replaced)")


def verify_export(out: Path, model: nn.Module) -> None:
    """Read back what ``save_pretrained`` wrote: ``config.json`` with the model's type, and safetensors holding every
    tensor of ``model`` bitwise (a tensor tied to another one is stored once)."""
    from safetensors import safe_open

    config = out / "config.json"
    if not config.is_file() or json.loads(config.read_text()).get("model_type") != model.config.model_type:
        raise ExportError(f"{out} holds no config.json of a {model.config.model_type} model after the export")
    index = out / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        (["model.safetensors"] if (out / "model.safetensors").is_file() else [])
    if not files:
        raise ExportError(f"{out} holds no safetensors after the export")
    expected = model.state_dict()
    stored: dict[int, str] = {}
    for name in files:
        with safe_open(str(out / name), framework="pt") as weights:
            for key in weights.keys():
                if key not in expected or not torch.equal(weights.get_tensor(key), expected[key]):
                    raise ExportError(f"{out / name}: tensor {key!r} is not the model's")
                stored[expected[key].data_ptr()] = key
    missing = [key for key, tensor in expected.items() if tensor.data_ptr() not in stored]  # tied: stored once
    if missing:
        raise ExportError(f"{out} lacks the tensors {missing[:5]} after the export")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Write the causal LM of a ``DTAModule`` checkpoint to ``out_dir`` in the ``save_pretrained`` layout, and check
    what was written (module docstring). ``force``: write over an existing file or into a non-empty directory."""
    path = Path(checkpoint)
    if not path.exists():
        raise ExportError(f"{path} does not exist. Fix: the path of a .ckpt file (strategy dta) or of a sharded "
                          "checkpoint folder (dta_fsdp)")
    out = Path(out_dir)
    check_output(out, force)
    model, state = _load_sharded(path) if path.is_dir() else _load_file(path)
    weights = {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # optional Hugging Face attribute: the keys that alias another parameter, where any
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ExportError(f"{path} does not match the stored model config: missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(unexpected)[:5]}")
    model.save_pretrained(out)
    verify_export(out, model)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-dta export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a .ckpt file (strategy dta) or a sharded checkpoint folder (dta_fsdp)")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write (new or empty)")
    parser.add_argument("--force", action="store_true", help="write into an existing directory, or over a file")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out_dir, force=args.force)
    print(f"wrote {out} and read it back (load it with AutoModelForCausalLM.from_pretrained; copy the tokenizer from "
          "the base model)")
    return 0
