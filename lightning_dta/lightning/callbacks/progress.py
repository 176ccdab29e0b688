"""``StepProgressBar``: the progress of an RL run as its users count it, in optimizer steps.

Lightning's bar counts epochs (an online run has one endless epoch: ``Epoch 0/-2``), shows the logger's
``v_num`` and prints every metric with three decimals (``loss: 0.000``). This one shows the step out of
``max_steps`` (the number metrics.csv and the console use), the loss and reward to four significant digits,
and the logical tokens per second.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

TOKENS_PER_SEC = "throughput/logical_tokens_per_sec"


def readable(value: Any) -> Any:
    """Four significant digits for floats (``-0.02734``, ``1.2e-05``); other values as they are."""
    return f"{value:.4g}" if isinstance(value, float) else value


class StepProgressBar(RichProgressBar):
    """A Rich progress bar with the step of ``max_steps``, loss, reward and tokens/s (no ``v_num``)."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is None or self.trainer.max_epochs < 0:  # an endless epoch: no "/-2"
            return f"Epoch {current_epoch}"
        return super()._get_train_description(current_epoch)

    @override
    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        # trainer.global_step counts finished steps; the one being shown is the CSV's step (0-based), so this is
        # "steps done / max_steps".
        steps = f"{trainer.global_step}/{trainer.max_steps}" if trainer.max_steps > 0 else str(trainer.global_step)
        tokens = trainer.callback_metrics.get(TOKENS_PER_SEC)
        shown = {"step": steps, **{name: readable(value) for name, value in items.items()}}
        if tokens is not None:
            shown["tok/s"] = f"{float(tokens):.0f}"
        return shown
