"""``lightning-dta fit``: training through LightningCLI.

``lightning-dta fit --config configs/tiny_cpu.yaml`` trains a :class:`~lightning_dta.DTAModule` on a
:class:`~lightning_dta.RolloutDataModule`; every ``--model.*``, ``--data.*`` and ``--trainer.*`` option can be
overridden on the command line, as with any LightningCLI.

The default strategy is ``"dta"``: Lightning's ``"auto"`` would pick DDP for ``devices>1``, whose wrapper does not
fit a step with one backward per tree node (see :mod:`lightning_dta.lightning.strategy`). The multi-process launcher
re-runs this same command once per rank, so it works from the shell as ``"ddp"`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from typing_extensions import override

import lightning_dta  # noqa: F401  (registers the "dta" strategies before the Trainer is built)
from lightning_dta.lightning.callbacks import StepProgressBar
from lightning_dta.lightning.data import RolloutDataModule
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


class DTACLI(LightningCLI):
    """LightningCLI with the subcommand that trains (``fit``; DTAModule has no validation or prediction step) and
    the step progress bar (:class:`~lightning_dta.lightning.callbacks.StepProgressBar`) unless the run disables
    the bar or brings its own."""

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
        args=list(args) if args is not None else None,
        run=run,
    )
