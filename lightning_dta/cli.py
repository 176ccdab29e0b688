"""The ``lightning-dta`` command: ``fit`` (and the other Lightning subcommands) through LightningCLI.

``lightning-dta fit --config configs/tiny_cpu.yaml`` trains a :class:`~lightning_dta.DTAModule` on a
:class:`~lightning_dta.data.RolloutDataModule`; every ``--model.*``, ``--data.*`` and ``--trainer.*`` option can be
overridden on the command line, as with any LightningCLI. ``lightning-dta bench ...`` is handed to
``lightning_dta.bench.cli.main(argv)`` when that module is installed, so the benchmark harness can add its own
subcommand without this file knowing its options.

The default strategy is ``"dta"``: Lightning's ``"auto"`` would pick DDP for ``devices>1``, whose wrapper does
not fit a step with one backward per tree node (see :mod:`lightning_dta.strategy`). The multi-process launcher
re-runs this same command once per rank, so it works from the shell as ``"ddp"`` does.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from lightning.pytorch.cli import LightningCLI

import lightning_dta  # noqa: F401  (registers the "dta" strategy before the Trainer is built)
from lightning_dta.module import DTAModule
from lightning_dta.rollout import RolloutError

BENCH_MODULE = "lightning_dta.bench.cli"


def cli_main(args: Sequence[str] | None = None, run: bool = True) -> LightningCLI:
    """Build (and by default run) the LightningCLI of :class:`DTAModule` and ``RolloutDataModule``.

    ``run=False`` only parses and instantiates (no subcommand in ``args`` then), which is how tests check a config.
    """
    from jsonargparse import set_parsing_settings

    from lightning_dta.data import RolloutDataModule

    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # dataclass field docstrings become --help
    return LightningCLI(
        DTAModule,
        RolloutDataModule,
        trainer_defaults={"strategy": "dta"},
        save_config_kwargs={"overwrite": True},
        args=list(args) if args is not None else None,
        run=run,
    )


def _bench_main():
    """The ``bench`` subcommand's entry point, or ``None`` while the benchmark package is not installed."""
    try:
        return importlib.import_module(BENCH_MODULE).main
    except ModuleNotFoundError as error:
        if error.name is not None and BENCH_MODULE.startswith(error.name):
            return None  # the bench package itself is missing, not one of its dependencies
        raise


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point (``[project.scripts] lightning-dta``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "export":
        from lightning_dta.export import ExportError
        from lightning_dta.export import main as export_main

        try:
            sys.exit(export_main(args[1:]))
        except ExportError as error:
            sys.exit(f"lightning-dta export: {error}")
    if args and args[0] == "bench":
        bench = _bench_main()
        if bench is None:
            sys.exit(f"lightning-dta bench: {BENCH_MODULE} is not installed in this version")
        bench(args[1:])
        return
    try:
        cli_main(argv)  # None: LightningCLI reads sys.argv itself (it warns when given both)
    except RolloutError as error:  # bad input, not a bug: the message says where and how to fix it
        print(f"lightning-dta: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
