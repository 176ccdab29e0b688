"""The ``lightning-dta`` command: one entry point, a verb per job, one way to configure.

``fit`` trains through LightningCLI (:mod:`lightning_dta.lightning.cli`); ``plan``, ``bench`` and ``export`` are
their modules' ``main(argv)``. Every verb parses with jsonargparse, and the engine options are one nested group
everywhere, read from :class:`~lightning_dta.EngineOptions` (its field docstrings are the help): ``--model.engine.*``
in ``fit`` (the engine belongs to the module), ``--engine.*`` in ``plan`` and ``bench``
(:func:`add_engine_options`). The command installs the filters for warnings Lightning prints although nothing is
wrong (:func:`lightning_dta.quiet_known_warnings`); importing the package does not.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from jsonargparse import ArgumentParser

from lightning_dta.core.rollout import RolloutError
from lightning_dta.engine.options import EngineOptions
from lightning_dta.lightning.cli import cli_main

COMMANDS = {"plan": "lightning_dta.plan.cli", "bench": "lightning_dta.bench.cli",
            "export": "lightning_dta.distributed.export", "convert": "lightning_dta.integrations.convert"}
"""the verbs besides ``fit``, each a module with ``main(argv) -> int``."""

USAGE = """usage: lightning-dta {fit,plan,bench,export,convert} ...

  fit      train a DTAModule on a RolloutDataModule (LightningCLI: --config FILE, --model.*, --data.*,
           --trainer.*; the engine: --model.engine.*); lightning-dta fit --help
  plan     predict a step's memory and FLOPs per mode, and the engine options that fit --memory
           (the engine: --engine.*); lightning-dta plan --help
  bench    every training mode side by side on the same model and rollouts (the engine: --engine.*);
           lightning-dta bench --help
  export   a training checkpoint as a Hugging Face model directory; lightning-dta export --help
  convert  TRL, verl or AReaL settings as a fit config fragment (model.loss, model.engine, data.advantage_*);
           lightning-dta convert {trl,verl,areal} CONFIG

engine options, the same in every verb (fit: --model.engine.NAME, plan and bench: --engine.NAME), with defaults:
"""


def usage() -> str:
    """The command's usage, with every engine option and its default read from :class:`EngineOptions`."""
    fields = [f"{name}={'null' if value is None else value}" for name, value in EngineOptions().to_dict().items()]
    lines, line = [], " "
    for field in fields:
        if len(line) + len(field) > 110:
            lines.append(line)
            line = " "
        line += f" {field}"
    return USAGE + "\n".join([*lines, line]) + "\n"


def add_engine_options(parser: ArgumentParser) -> None:
    """The run's :class:`~lightning_dta.EngineOptions` as the nested group ``--engine.*``: the names, defaults and
    help of ``fit``'s ``--model.engine.*`` (one definition: the dataclass and its field docstrings)."""
    from jsonargparse import set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser.add_class_arguments(EngineOptions, "engine", help="the engine options (lightning_dta.EngineOptions; in "
                               "fit: --model.engine.*)")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``[project.scripts] lightning-dta``): the verb's exit status."""
    from lightning_dta.lightning.quiet import install

    install()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if args else 2
    if args[0] in COMMANDS:
        return importlib.import_module(COMMANDS[args[0]]).main(args[1:]) or 0
    try:
        cli_main(argv)  # None: LightningCLI reads sys.argv itself (it warns when given both)
    except RolloutError as error:  # bad input, not a bug: the message says where and how to fix it
        print(f"lightning-dta: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
