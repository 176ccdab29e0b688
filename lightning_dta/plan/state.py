"""The memory of the training state per rank: weights, gradients and optimizer state, replicated (``dta``) or
sharded over the data-parallel ranks (``dta_fsdp``, FSDP2), in Lightning's precision names.

Under ``dta_fsdp`` the DFS walk runs with every unit unsharded (a pop's backward starts from keys/values, which
FSDP2 supports only unsharded) and defers the reduce-scatter to the end of the step (``docs/lightning.md``): during
the walk a rank also holds the full weights in the compute dtype and the full gradient in float32 (the strategy's
``reduce_dtype``). That, not the shards, is what a step's peak carries. Mixed precision under ``dta`` runs the model
under autocast, which saves other tensors than the probe measures; the planner refuses it there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

PRECISIONS = {  # precision -> (parameter/gradient/optimizer dtype, activation dtype)
    "32-true": (torch.float32, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
    "16-true": (torch.float16, torch.float16),
    "bf16-mixed": (torch.float32, torch.bfloat16),  # dta_fsdp only: FSDP2's MixedPrecisionPolicy, no autocast
}
UNSHARDED_GRADIENT_BYTES = 4  # dta_fsdp's reduce_dtype is float32
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}  # tensors per parameter


def parameter_count(config) -> int:
    """The parameters of a model built from ``config``, on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class TrainingState:
    """Weights, gradients and optimizer state of one rank. Under ``dta_fsdp`` each is 1/``ranks`` of the whole, plus
    the unsharded weights and float32 gradient of the walk (module docstring)."""

    parameters: int
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
        if self.precision.endswith("-mixed") and self.strategy == "dta":
            raise ValueError(f"precision {self.precision!r} with strategy 'dta' runs the model under autocast, whose "
                             "saved tensors the planner does not model; plan with bf16-true, or dta_fsdp")

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype the model computes (and saves activations) in."""
        return PRECISIONS[self.precision][1]

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
        """dta_fsdp: the full weights (compute dtype) and the full float32 gradient held during the walk (0 when
        replicated: the weights and gradients above are already full)."""
        if self.strategy != "dta_fsdp":
            return 0.0
        return self.parameters * (self.activation_dtype.itemsize + UNSHARDED_GRADIENT_BYTES)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_state + self.gathered
