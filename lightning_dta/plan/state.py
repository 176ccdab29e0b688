"""The memory of the training state per rank: weights, gradients and optimizer state, replicated (``dta``) or
sharded over the ranks (``dta_fsdp``: FSDP2 over the data-parallel ranks, times tensor parallelism within a group),
in Lightning's precision names.

Under ``dta_fsdp`` the DFS walk runs with every unit unsharded (a pop's backward starts from keys/values, which
FSDP2 supports only unsharded) and defers the reduce-scatter to the end of the step (``docs/lightning.md``): during
the walk a rank also holds the full weights in the compute dtype and the full gradient in float32 (the strategy's
``reduce_dtype``; 2 bytes with ``walk_gradient_dtype="bfloat16"``). That, not the shards, is what a step's peak
carries. With tensor parallelism of size ``t`` the walk gathers over the data-parallel ranks only: a rank holds
``1/t`` of the weights and of that gradient during the walk. Mixed precision under ``dta`` runs the model
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
WALK_GRADIENT_BYTES = {"float32": 4, "bfloat16": 2}  # dta_fsdp's walk_gradient_dtype (FSDP2's reduce_dtype)
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}  # tensors per parameter


def parameter_count(config) -> int:
    """The parameters of a model built from ``config``, on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class TrainingState:
    """Weights, gradients and optimizer state of one rank. Under ``dta_fsdp`` each is 1/``ranks`` of the whole (all
    ranks: data- times tensor-parallel), plus the weights and the gradient of the walk, unsharded over the
    data-parallel ranks (module docstring)."""

    parameters: int
    precision: str = "bf16-true"
    optimizer: str = "adamw"
    strategy: str = "dta"
    ranks: int = 1
    tensor_parallel: int = 1
    walk_gradient_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}; choose from {sorted(PRECISIONS)}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer {self.optimizer!r}; choose from {sorted(OPTIMIZER_STATES)}")
        if self.strategy not in ("dta", "dta_fsdp"):
            raise ValueError(f"strategy {self.strategy!r}; choose 'dta' or 'dta_fsdp'")
        if self.tensor_parallel < 1 or self.ranks % self.tensor_parallel:
            raise ValueError(f"tensor parallelism of {self.tensor_parallel} does not divide the {self.ranks} ranks")
        if self.tensor_parallel > 1 and self.strategy != "dta_fsdp":
            raise ValueError("tensor parallelism runs under strategy 'dta_fsdp' "
                             "(DTAFSDPStrategy(tensor_parallel_size))")
        if self.walk_gradient_dtype not in WALK_GRADIENT_BYTES:
            raise ValueError(f"walk_gradient_dtype {self.walk_gradient_dtype!r}; choose from "
                             f"{sorted(WALK_GRADIENT_BYTES)}")
        if self.walk_gradient_dtype == "bfloat16" and not self.precision.startswith("bf16"):
            raise ValueError(f"walk_gradient_dtype 'bfloat16' needs bfloat16 weights, not precision {self.precision!r}")
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
        """dta_fsdp: the weights (compute dtype) and the gradient (``walk_gradient_dtype``) held during the walk, whole
        over the data-parallel ranks and 1/``tensor_parallel`` of the model (0 when replicated: the weights and
        gradients above are already whole)."""
        if self.strategy != "dta_fsdp":
            return 0.0
        per_parameter = self.activation_dtype.itemsize + WALK_GRADIENT_BYTES[self.walk_gradient_dtype]
        return self.parameters / self.tensor_parallel * per_parameter

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_state + self.gathered
