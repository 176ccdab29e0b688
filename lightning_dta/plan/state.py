"""The memory of the training state per rank: weights, gradients and optimizer state, replicated (``dta``) or
sharded over the data-parallel ranks (``dta_fsdp``, FSDP2), in Lightning's precision names."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

PRECISIONS = {  # precision -> (parameter/gradient/optimizer dtype, activation dtype)
    "32-true": (torch.float32, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "16-true": (torch.float16, torch.float16),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "16-mixed": (torch.float32, torch.float16),
}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}  # tensors per parameter


def parameter_counts(config) -> tuple[int, int]:
    """(all parameters, the largest decoder layer's) of a model built from ``config``, on the meta device (no
    memory, no weights)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    largest = max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)
    return total, largest


@dataclass(frozen=True)
class TrainingState:
    """Weights, gradients and optimizer state of one rank. Under ``dta_fsdp`` each is 1/``ranks`` of the whole,
    plus two decoder layers gathered unsharded at a time (the one running and the one prefetched)."""

    parameters: int
    largest_layer: int
    precision: str = "bf16-true"
    optimizer: str = "adamw"
    strategy: str = "dta"
    ranks: int = 1

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}; choose from {sorted(PRECISIONS)}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer {self.optimizer!r}; choose from {sorted(OPTIMIZER_STATES)}")
        if self.strategy not in ("dta", "dta_fsdp"):
            raise ValueError(f"strategy {self.strategy!r}; choose 'dta' or 'dta_fsdp'")

    @property
    def _element(self) -> int:
        return torch.empty((), dtype=PRECISIONS[self.precision][0]).element_size()

    @property
    def _share(self) -> float:
        return 1 / self.ranks if self.strategy == "dta_fsdp" else 1.0

    @property
    def weights(self) -> float:
        return self.parameters * self._element * self._share

    @property
    def gradients(self) -> float:
        return self.weights

    @property
    def optimizer_state(self) -> float:
        return OPTIMIZER_STATES[self.optimizer] * self.weights

    @property
    def gathered(self) -> float:
        """FSDP2's unsharded layers during forward and backward (0 when replicated)."""
        return 2 * self.largest_layer * self._element if self.strategy == "dta_fsdp" else 0.0

    @property
    def autocast_copies(self) -> float:
        """Mixed precision: autocast's half-precision copies of the weights (all of them replicated, where autocast
        caches them for the step; the gathered layers under FSDP2, whose unsharded weights it does not cache)."""
        if not self.precision.endswith("-mixed"):
            return 0.0
        return 2.0 * (2 * self.largest_layer if self.strategy == "dta_fsdp" else self.parameters)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_state + self.gathered + self.autocast_copies
