"""Write the model of a ``lightning-dta fit`` config, with its environment's tokenizer, as a Hugging Face directory
that an inference server can start from.

    python scripts/server_model.py configs/toy_rl_vllm.yaml runs/toy_rl_vllm/server_model

A server needs a checkpoint of the policy's architecture to start; the weights it starts with do not matter, because
the client pushes the policy's own weights at attach (``weight_sync``) and after every optimizer step. For a config
whose ``model.model`` is a config dict (random init, nothing to download) this builds that model (float32) and saves
it beside the tokenizer the run uses (``data.source.init_args.env``'s ``default_tokenizer()``), so the server's
token ids are the trainer's.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import yaml
from transformers import AutoModelForCausalLM

from lightning_dta.core.errors import ConfigError
from lightning_dta.models import config_from_dict


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path, help="a lightning-dta fit config whose model.model is a config dict")
    parser.add_argument("out", type=Path, help="the directory to write (config.json, weights, tokenizer)")
    args = parser.parse_args(argv)
    run = yaml.safe_load(args.config.read_text())
    spec = run.get("model", {}).get("model")
    if not isinstance(spec, dict):
        raise ConfigError(f"{args.config}: model.model is {spec!r}, not a config dict. Fix: a checkpoint path needs no "
                          "conversion: start the server from that path")
    model = AutoModelForCausalLM.from_config(config_from_dict(spec, where=f"{args.config}: model.model"))
    model.save_pretrained(args.out)
    env = run["data"]["source"]["init_args"]["env"]
    module, _, name = env["class_path"].rpartition(".")
    init_args = {k: v for k, v in env.get("init_args", {}).items() if k != "reward_fn"}  # the tokenizer needs no reward
    getattr(importlib.import_module(module), name)(**init_args).default_tokenizer().save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
