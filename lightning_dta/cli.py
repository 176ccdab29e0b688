"""The ``lightning-dta`` command: one entry point, a verb per job, one way to configure.

``fit`` trains through LightningCLI (:mod:`lightning_dta.lightning.cli`); ``plan``, ``bench`` and ``export`` are
their modules' ``main(argv)``. Every verb parses with jsonargparse, and the engine options are one nested group
everywhere, read from :class:`~lightning_dta.EngineOptions` (its field docstrings are the help): ``--model.engine.*``
in ``fit`` (the engine belongs to the module), ``--engine.*`` in ``plan`` and ``bench``
(:func:`add_engine_options`). The command installs the filters for warnings Lightning prints although nothing is
wrong (:func:`lightning_dta.quiet_known_warnings`); importing the package does not.

Exit status: 0 when the verb did its job; 2 for bad input of any kind, a setting, a file, a model, a server's answer
(:class:`~lightning_dta.core.errors.UsageError`), printed as one message (what, where, the fix) without a
traceback; ``128 + signal`` (143) when a signal stopped a training run; a bug keeps its traceback (status 1).
``--traceback`` (anywhere on the command line) or ``LIGHTNING_DTA_TRACEBACK=1`` prints the traceback of bad input
too, for debugging.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from jsonargparse import ArgumentParser

from lightning_dta.arguments import engine_flags
from lightning_dta.core.errors import UsageError
from lightning_dta.distributed.faults import stopping
from lightning_dta.engine.options import EngineOptions
from lightning_dta.lightning.cli import cli_main

COMMANDS = {"plan": "lightning_dta.plan.cli", "bench": "lightning_dta.bench.cli",
            "export": "lightning_dta.distributed.export", "convert": "lightning_dta.integrations.convert"}
"""the verbs besides ``fit``, each a module with ``main(argv) -> int``."""
TRACEBACK = "LIGHTNING_DTA_TRACEBACK"
"""set to 1 (or pass ``--traceback``): print the traceback of bad input too."""

USAGE = """usage: lightning-dta [--traceback] {fit,plan,bench,export,convert} ...

  fit      train a DTAModule on a RolloutDataModule (LightningCLI: --config FILE, --model.*, --data.*,
           --trainer.*; the engine: --model.engine.*); lightning-dta fit --help (--help-all: every option)
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
    """Console entry point (``[project.scripts] lightning-dta``): the verb's exit status (module docstring)."""
    from lightning_dta.lightning.quiet import install

    install()
    args = list(sys.argv[1:] if argv is None else argv)
    if "--traceback" not in args:
        return _run(args, argv)
    args = [arg for arg in args if arg != "--traceback"]
    if argv is None:
        sys.argv[1:] = args  # LightningCLI, and the launcher that re-runs this command per rank, read sys.argv
    before = os.environ.get(TRACEBACK)
    os.environ[TRACEBACK] = "1"  # the ranks a launcher starts inherit it
    try:
        return _run(args, argv)
    finally:  # called in-process (tests, notebooks): the next command prints no traceback unless asked
        if before is None:
            os.environ.pop(TRACEBACK, None)
        else:
            os.environ[TRACEBACK] = before


def _run(args: list[str], argv: Sequence[str] | None) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if args else 2
    verb = args[0] if args[0] in COMMANDS else "fit"
    if not args[0].startswith("-") and args[0] not in (*COMMANDS, "fit"):
        verbs = ["fit", *COMMANDS]
        close = difflib.get_close_matches(args[0], verbs, n=1)
        print(f"lightning-dta: error: {args[0]!r} is not a verb. Fix: "
              f"{f'did you mean {close[0]}? ' if close else ''}one of {', '.join(verbs)}", file=sys.stderr)
        return 2
    try:
        if verb in COMMANDS:
            return importlib.import_module(COMMANDS[verb]).main(args[1:]) or 0
        cli = cli_main(None if argv is None else args)  # None: LightningCLI reads sys.argv (it warns given both)
        stop = stopping()  # a signal that came after the last step: the run is complete, the status still says so
        if stop is not None:
            return stop.exit_status
        return 143 if cli.trainer.received_sigterm else 0
    except BaseException as error:
        status = exit_status(error)
        if status is None:
            raise
        if os.environ.get(TRACEBACK) == "1":
            traceback.print_exc()
        message = describe(error, status)
        if verb == "fit":  # the engine's fixes as the options of the command
            message = engine_flags(message, "--model.engine.")
        print(f"lightning-dta {verb}: {message}", file=sys.stderr, flush=True)
        return status


def describe(error: BaseException, status: int) -> str:
    """The one line printed for an error that ends the command with ``status``."""
    if status == 2:
        return f"error: {error}"
    stop = stopping()
    return f"stopped by {stop.describe() if stop is not None else 'SIGTERM'}; exit status {status}"


def exit_status(error: BaseException) -> int | None:
    """The status for ``error``: ``128 + signal`` when a signal stopped the run (whatever the error it left), 2 for
    bad input, ``None`` for anything else (a bug: its traceback is printed)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    stop = stopping()
    if stop is not None:
        return stop.exit_status
    if isinstance(error, SIGTERMException):
        return 143
    if isinstance(error, UsageError):
        return 2
    return None


if __name__ == "__main__":
    raise SystemExit(main())
