"""The ``lightning-dta`` command: ``fit`` (and the other Lightning subcommands) through LightningCLI.

``lightning-dta fit --config configs/tiny_cpu.yaml`` trains a :class:`~lightning_dta.DTAModule` on a
:class:`~lightning_dta.lightning.data.RolloutDataModule`; every ``--model.*``, ``--data.*`` and ``--trainer.*`` option can be
overridden on the command line, as with any LightningCLI. ``lightning-dta bench ...`` is handed to
``lightning_dta.bench.cli.main(argv)`` when that module is installed, so the benchmark harness can add its own
subcommand without this file knowing its options.

The default strategy is ``"dta"``: Lightning's ``"auto"`` would pick DDP for ``devices>1``, whose wrapper does
not fit a step with one backward per tree node (see :mod:`lightning_dta.lightning.strategy`). The multi-process launcher
re-runs this same command once per rank, so it works from the shell as ``"ddp"`` does.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI
from typing_extensions import override

import lightning_dta  # noqa: F401  (registers the "dta" strategy before the Trainer is built)
from lightning_dta.core.rollout import RolloutError
from lightning_dta.lightning.callbacks import StepProgressBar
from lightning_dta.lightning.module import DTAModule

BENCH_MODULE = "lightning_dta.bench.cli"


class DTACLI(LightningCLI):
    """LightningCLI with the subcommand that trains (``fit``; DTAModule has no validation or prediction step) and
    the step progress bar (:class:`~lightning_dta.lightning.callbacks.StepProgressBar`) unless the run disables the bar or
    brings its own."""

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        return {"fit": LightningCLI.subcommands()["fit"]}

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        own = [*callbacks, *(config.get("callbacks") or [])]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in own):
            callbacks = [*callbacks, StepProgressBar()]
        return super()._instantiate_trainer(config, callbacks)


USAGE = """usage: lightning-dta {fit,plan,bench,export} ...

  fit      train a DTAModule on a RolloutDataModule (LightningCLI: --config FILE, --model.*, --data.*,
           --trainer.*); lightning-dta fit --help
  plan     predict a step's memory and FLOPs per mode, and the engine options that fit --memory;
           lightning-dta plan --help
  bench    every training mode side by side on the same model and rollouts; lightning-dta bench --help
  export   a training checkpoint as a Hugging Face model directory; lightning-dta export --help
"""


def cli_main(args: Sequence[str] | None = None, run: bool = True) -> LightningCLI:
    """Build (and by default run) the LightningCLI of :class:`DTAModule` and ``RolloutDataModule``.

    ``run=False`` only parses and instantiates (no subcommand in ``args`` then), which is how tests check a config.
    """
    from jsonargparse import set_parsing_settings

    from lightning_dta.lightning.data import RolloutDataModule

    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # dataclass field docstrings become --help
    return DTACLI(
        DTAModule,
        RolloutDataModule,
        # The model summary's FLOPs column is 0 without an example input; DTAModule prints a one-line summary.
        trainer_defaults={"strategy": "dta", "enable_model_summary": False},
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
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        sys.exit(0 if args else 2)
    if args and args[0] == "export":
        from lightning_dta.distributed.export import ExportError
        from lightning_dta.distributed.export import main as export_main

        try:
            sys.exit(export_main(args[1:]))
        except ExportError as error:
            sys.exit(f"lightning-dta export: {error}")
    if args and args[0] == "plan":
        from lightning_dta.plan.cli import main as plan_main

        sys.exit(plan_main(args[1:]))
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
