"""The training modes that ``lightning-dta bench`` times and ``lightning-dta plan`` predicts, defined once.

Every row is the run's :class:`~lightning_dta.EngineOptions` (``--engine.*`` in both commands) turned into one mode:
``dfs`` is that engine in dfs mode, ``dfs-recompute`` the same with ``activation="recompute"`` and chunks of
``recompute_chunk`` tokens, ``dfs-model-attention`` without prefix attention; the per-rollout baselines
(``vanilla``, with transformers activation checkpointing ``vanilla-ckpt``, and ``vanilla-batched``: padded
micro-batches of the engine's ``vanilla_batch_tokens``, or of :data:`VANILLA_BATCH_TOKENS` when it is null), the
tree-mask baseline ``mask`` and the published one-level peer ``prefix-grouper`` stand beside them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from lightning_dta.engine.options import EngineOptions

RECOMPUTE_CHUNK = 256
"""tokens per chunk of the dfs-recompute row (bench and plan)."""
VANILLA_BATCH_TOKENS = 4096
"""token budget of the vanilla-batched row (bench) when the engine's vanilla_batch_tokens is null."""
PLANNED_MODES = ("vanilla", "vanilla-ckpt", "dfs", "dfs-recompute")
"""the rows the planner predicts (it does not model padded micro-batches, the mask or the model's own attention)."""


@dataclass(frozen=True)
class ModeSpec:
    """A mode: the engine options, whether transformers activation checkpointing is on (a baseline), or a peer
    method run instead of the engine."""

    engine: EngineOptions
    activation_checkpointing: bool = False
    peer: Literal["prefix-grouper"] | None = None


def compared_modes(engine: EngineOptions | None = None, recompute_chunk: int = RECOMPUTE_CHUNK) -> dict[str, ModeSpec]:
    """Every mode, from the run's ``engine`` (module docstring).

    ``vanilla-ckpt`` is per-rollout training with transformers activation checkpointing: the baseline the
    reference system (AReaL-DTA) reports its speed-ups against.
    """
    engine = engine or EngineOptions()
    dfs = dataclasses.replace(engine, mode="dfs")
    batched = engine.vanilla_batch_tokens or VANILLA_BATCH_TOKENS
    vanilla = EngineOptions(mode="vanilla")
    recompute = dataclasses.replace(dfs, activation="recompute", activation_memory_budget=None,
                                    chunk_size=recompute_chunk)
    return {
        "vanilla": ModeSpec(vanilla),
        "vanilla-ckpt": ModeSpec(vanilla, activation_checkpointing=True),
        "vanilla-batched": ModeSpec(EngineOptions(mode="vanilla", vanilla_batch_tokens=batched)),
        "mask": ModeSpec(EngineOptions(mode="mask")),
        "dfs": ModeSpec(dfs),
        "dfs-recompute": ModeSpec(recompute),
        # dfs with the model's own attention over a KV cache and a causal mask (what runs where prefix
        # attention does not: sliding windows, models whose attention brings a bias), to measure what prefix
        # attention brings
        "dfs-model-attention": ModeSpec(dataclasses.replace(dfs, prefix_attention=False)),
        "prefix-grouper": ModeSpec(EngineOptions(), peer="prefix-grouper"),
    }


def planned_modes(engine: EngineOptions | None = None, recompute_chunk: int = RECOMPUTE_CHUNK) -> dict[str, ModeSpec]:
    """The rows the planner predicts (:data:`PLANNED_MODES`), from the same definitions as the bench's."""
    modes = compared_modes(engine, recompute_chunk)
    return {name: modes[name] for name in PLANNED_MODES}
