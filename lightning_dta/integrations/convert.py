"""``lightning-dta convert {trl,verl,areal} CONFIG``: their settings as a ``lightning-dta fit`` config fragment.

Why a verb and not ``--model.loss from_trl:grpo_config.json``: LightningCLI builds ``model.loss`` from a typed
dataclass, and a string that turns into a loss at parse time would hide the converted values from the saved
config and from ``--print_config``. Converting once and printing the fragment keeps the run's config explicit
(paste it, review it, change it) and puts the converter's notes in front of the user; a refusal exits with status 2
and says what to change.

CONFIG is a JSON or YAML file: TRL, a ``GRPOConfig``'s arguments (``GRPOConfig.to_dict()``, or the ones you set);
verl, a trainer config (``actor_rollout_ref.actor``, ``algorithm``, ``actor_rollout_ref.rollout``, ``data``,
``trainer``) with its interpolations resolved (``OmegaConf.to_container(cfg, resolve=True)``); AReaL, a config with
an ``actor:`` section (or that section itself).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_dta.core.conversions import ConversionError, Converted


def _unresolved(config: Any, where: str = "") -> str | None:
    """The first value left as an OmegaConf interpolation (``${...}``), if any."""
    if isinstance(config, dict):
        for key, value in config.items():
            found = _unresolved(value, f"{where}{key}.")
            if found:
                return found
    elif isinstance(config, str) and "${" in config:
        return f"{where[:-1]}={config!r}"
    return None


def convert(framework: str, config: dict[str, Any]) -> Converted:
    """Convert a loaded config of ``framework`` (``trl``, ``verl`` or ``areal``)."""
    from lightning_dta.core.losses import PolicyLoss

    if framework == "trl":
        return PolicyLoss.from_trl(config)
    if framework == "verl":
        parts = config.get("actor_rollout_ref", {})
        return PolicyLoss.from_verl(parts.get("actor", config.get("actor", {})), config.get("algorithm", {}),
                                    parts.get("rollout", config.get("rollout")), config.get("data"),
                                    config.get("trainer"))
    return PolicyLoss.from_areal(config.get("actor", config))


def render(converted: Converted) -> str:
    """The fragment as YAML, the notes and the rollout fields as comments above it."""
    lines = ["# converted by lightning-dta convert; merge into a fit config (lightning-dta fit --config ...)"]
    lines += [f"# note: {note}" for note in converted.notes]
    lines += [f"# rollout field: their {theirs} -> Rollout.{ours}" for theirs, ours in
              converted.rollout_fields.items()]
    return "\n".join(lines) + "\n" + yaml.safe_dump(converted.to_config(), sort_keys=False)


def main(argv: Sequence[str] | None = None) -> int:
    from jsonargparse import ArgumentParser

    from lightning_dta.arguments import parse_args

    parser = ArgumentParser(prog="lightning-dta convert", description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("framework", choices=("trl", "verl", "areal"))
    parser.add_argument("config", help="their config, JSON or YAML")
    args = parse_args(parser, argv, "convert")
    args.config = Path(args.config)
    try:
        text = args.config.read_text()
        config = json.loads(text) if args.config.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as error:
        print(f"lightning-dta convert: error: cannot read {args.config}: {error}. Fix: give a JSON or YAML file",
              file=sys.stderr)
        return 2
    if not isinstance(config, dict):
        print(f"lightning-dta convert: error: {args.config} holds no mapping of settings. Fix: give a JSON or YAML "
              "mapping", file=sys.stderr)
        return 2
    left = _unresolved(config)
    if left:
        print(f"lightning-dta convert: error: {args.config}: {left} is an unresolved interpolation. Fix: resolve "
              "it first (OmegaConf.to_container(cfg, resolve=True)) or write the value", file=sys.stderr)
        return 2
    try:
        print(render(convert(args.framework, config)), end="")
    except (ConversionError, ValueError, TypeError) as error:
        print(f"lightning-dta convert: error: {args.config}: {error}", file=sys.stderr)
        return 2
    return 0
