"""``lightning-dta fit``: training through LightningCLI.

``lightning-dta fit --config configs/tiny_cpu.yaml`` trains a :class:`~lightning_dta.DTAModule` on a
:class:`~lightning_dta.RolloutDataModule`; every ``--model.*``, ``--data.*`` and ``--trainer.*`` option can be
overridden on the command line, as with any LightningCLI.

The default strategy is ``"dta"``: Lightning's ``"auto"`` would pick DDP for ``devices>1``, whose wrapper does not
fit a step with one backward per tree node (see :mod:`lightning_dta.lightning.strategy`). The multi-process launcher
re-runs this same command once per rank, so it works from the shell as ``"ddp"`` does.

Every setting is checked before anything runs: the classes of the config check their own arguments when they are
built, and a setting refused there (by this package, Lightning, torch or transformers) is reported as a
:class:`~lightning_dta.core.errors.ConfigError` (``lightning-dta`` prints it without a traceback and exits with
status 2). The Trainer settings Lightning refuses with a message that names no fix (``devices=0``, an unknown
strategy name) are checked first (:func:`check_trainer_settings`).
"""

from __future__ import annotations

import sys
from argparse import ArgumentError, Namespace
from collections.abc import Mapping, Sequence
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

import lightning_dta  # noqa: F401  (registers the "dta" strategies before the Trainer is built)
from lightning_dta.arguments import option_keys, refusal
from lightning_dta.core.errors import ConfigError, UsageError
from lightning_dta.lightning.callbacks import StepProgressBar
from lightning_dta.lightning.data import RolloutDataModule
from lightning_dta.lightning.help import fix_lightning_defaults, short_help
from lightning_dta.lightning.module import DTAModule


class SaveConfigToLogDir(SaveConfigCallback):
    """Lightning's config saver, where a run keeps its files: in the logger's directory. A run without a logger has
    none (``trainer.log_dir`` falls back to the working directory, where a ``config.yaml`` would be littered or
    overwritten), so nothing is saved then."""

    @override
    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if trainer.logger is None:
            return
        super().setup(trainer, pl_module, stage)


def check_trainer_settings(trainer: Mapping[str, Any]) -> None:
    """Refuse ``trainer.devices`` and ``trainer.strategy`` values that Lightning refuses only with its own
    message (or a ``TypeError``), with the setting and the fix."""
    devices = trainer.get("devices")
    try:
        count = int(devices) if isinstance(devices, (int, str)) and not isinstance(devices, bool) else None
    except ValueError:  # "auto", "0,1": Lightning's own forms
        count = None
    if count is not None and (count == 0 or count < -1):
        raise ConfigError(f"trainer.devices={devices}: the number of devices (one process each) to train on. Fix: "
                          "a positive number such as 1 or 2, a list of device indices such as [0, 1], -1 (every "
                          "device) or 'auto'")
    strategy = trainer.get("strategy")
    if isinstance(strategy, str) and strategy != "auto" and strategy not in StrategyRegistry:
        raise ConfigError(f"trainer.strategy={strategy!r} is not a strategy Lightning knows. Fix: 'dta' (weights "
                          "replicated on every rank) or 'dta_fsdp' (weights sharded with FSDP2); the registered "
                          f"names are {sorted(StrategyRegistry.available_strategies())}")


def _usage_cause(error: BaseException) -> UsageError | None:
    """The :class:`UsageError` ``error`` was raised from, if any (jsonargparse wraps the errors of the classes it
    builds in its own)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UsageError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _refusal(text: str) -> str:
    """The refusal in a jsonargparse error, on one line. A value of a ``Union`` type (``trainer.strategy``: a name or
    a class) that no member accepts lists each member's error (``- Expected a <class 'str'>``, then the class's own
    refusal) and the value; only the refusals are kept."""
    if "\nErrors:\n" not in text:
        return " ".join(text.split())
    listed = text.split("\nErrors:\n", 1)[1].split("\nGiven value type:", 1)[0]
    errors = [" ".join(item.split()) for item in listed.split("\n  - ") if item.strip()]
    errors = [error.removeprefix("- ") for error in errors if not error.lstrip("- ").startswith("Expected a ")]
    return "; ".join(errors) or " ".join(text.split())


class DTACLI(LightningCLI):
    """LightningCLI with the subcommand that trains (``fit``; DTAModule has no validation or prediction step) and
    the step progress bar (:class:`~lightning_dta.lightning.callbacks.StepProgressBar`) unless the run disables
    the bar or brings its own."""

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        return {"fit": LightningCLI.subcommands()["fit"]}

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse; a refused key, value or file is one line with the fix (:mod:`lightning_dta.arguments`), not the
        usage (the parsers are built with ``exit_on_error=False``)."""
        subcommands = parser._subcommands_action  # jsonargparse keeps no public map of subcommand parsers
        fit = subcommands._name_parser_map["fit"] if subcommands is not None else parser
        given = list(sys.argv[1:] if args is None else args) if not isinstance(args, (dict, Namespace)) else []
        if "--help-all" in given:
            fix_lightning_defaults(fit)
            given = [("--help" if arg == "--help-all" else arg) for arg in given]
            if args is None:  # LightningCLI warns when given both arguments and sys.argv
                sys.argv[1:] = given
            else:
                args = given
        elif {"-h", "--help"} & set(given):
            print(short_help(fit), end="")
            raise SystemExit(0)
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as error:
            raise refusal(str(error), option_keys(fit), "fit") from None

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_trainer_settings(config["trainer"])

    @override
    def instantiate_classes(self) -> None:
        """Build the config's classes; a setting refused while they are built is a :class:`ConfigError`."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, MisconfigurationException) as error:
            cause = _usage_cause(error)
            if cause is not None:
                raise cause from None
            raise ConfigError(f"a setting of the config was refused while its classes were built: "
                              f"{_refusal(str(error))}") from error

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        own = [*callbacks, *(config.get("callbacks") or [])]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in own):
            callbacks = [*callbacks, StepProgressBar()]
        return super()._instantiate_trainer(config, callbacks)


def cli_main(args: Sequence[str] | None = None, run: bool = True) -> LightningCLI:
    """Build (and by default run) the LightningCLI of :class:`DTAModule` and ``RolloutDataModule``.

    ``run=False`` only parses and instantiates (no subcommand in ``args`` then), which is how tests check a config.
    """
    from jsonargparse import set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # dataclass field docstrings become --help
    return DTACLI(
        DTAModule,
        RolloutDataModule,
        # The model summary's FLOPs column is 0 without an example input; DTAModule prints a one-line summary.
        trainer_defaults={"strategy": "dta", "enable_model_summary": False},
        save_config_callback=SaveConfigToLogDir,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"exit_on_error": False, "fit": {"exit_on_error": False}},  # one line, not the usage
        args=list(args) if args is not None else None,
        run=run,
    )
