"""``lightning-dta export CKPT OUT_DIR``: a training checkpoint as a plain Hugging Face model directory.

For serving (vLLM, SGLang) and the hub: ``config.json`` + safetensors, loadable with
``AutoModelForCausalLM.from_pretrained(OUT_DIR)``. It reads both kinds of checkpoint ``DTAModule`` writes: a
``.ckpt`` file (``strategy="dta"``) and the folder of per-rank shards of ``strategy="dta_fsdp"`` (read here in one
process with ``torch.distributed.checkpoint``; no process group is needed). The model is rebuilt from the config
``DTAModule`` stores in every checkpoint, so nothing is downloaded. Inside a running sharded job,
:func:`lightning_dta.distributed.sharding.export_hf_checkpoint` writes the same layout without gathering the model
anywhere.
Tokenizer files are not part of a training checkpoint: copy them from the base model.
"""

from __future__ import annotations

import argparse
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


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the causal LM of a ``DTAModule`` checkpoint to ``out_dir`` in the ``save_pretrained`` layout."""
    path = Path(checkpoint)
    if not path.exists():
        raise ExportError(f"{path} does not exist")
    model, state = _load_sharded(path) if path.is_dir() else _load_file(path)
    weights = {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # optional Hugging Face attribute: the keys that alias another parameter, where any
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if model.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ExportError(f"{path} does not match the stored model config: missing {sorted(missing)[:5]}, "
                          f"unexpected {sorted(unexpected)[:5]}")
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-dta export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a .ckpt file (strategy dta) or a sharded checkpoint folder (dta_fsdp)")
    parser.add_argument("out_dir", help="the Hugging Face model directory to write")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out_dir)
    print(f"wrote {out} (load it with AutoModelForCausalLM.from_pretrained; copy the tokenizer from the base model)")
    return 0
