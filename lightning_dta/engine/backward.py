"""``tree_backward``: the gradient of the policy loss over every rollout of a tree, by the chosen engine mode."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_dta.contracts import Objective
from lightning_dta.core.tree import PrefixTree, TreeStats
from lightning_dta.engine.device import host_values
from lightning_dta.engine.dfs import DFSWalk
from lightning_dta.engine.errors import ModelNotSupportedError
from lightning_dta.engine.logprobs import tree_logprobs
from lightning_dta.engine.mask import mask_backward
from lightning_dta.engine.model_info import ModelInfo, inspect_model, loss_dtype
from lightning_dta.engine.options import EngineOptions
from lightning_dta.engine.step_data import StepData, check_tree_fits_model, warn_if_nothing_to_learn
from lightning_dta.engine.vanilla import vanilla_backward


@dataclass
class TreeBackwardOutput:
    """What one ``tree_backward`` call did. ``loss`` is this tree's share of the step loss (with a global
    ``normalizer`` the shares of all trees and ranks add up to the step loss)."""

    loss: float
    metrics: dict[str, float]
    sums: dict[str, float] = field(repr=False)  # raw sums behind the metrics, to add across trees/ranks
    stats: TreeStats
    normalizer: tuple[float, ...]


def _check_supported(model: nn.Module, info: ModelInfo, tree: PrefixTree, engine: EngineOptions,
                     loss_fn: Objective) -> None:
    """Refuse combinations that would train on something other than what was asked."""
    if loss_fn.needs_sequence_ratio and info.has_active_dropout:
        raise ModelNotSupportedError("loss_mode='gspo' computes each rollout's ratio in a forward-only pass before "
                                     "the training walk, and active dropout would draw different masks in the two. "
                                     "Fix: set dropout to 0 or call model.eval().")
    if engine.mode == "dfs" and engine.activation in ("recompute", "auto") and info.has_active_dropout:
        raise ModelNotSupportedError(f"activation={engine.activation!r} re-runs chunks, and active dropout would draw "
                                     "a different mask the second time. Fix: set dropout to 0 or call model.eval().")
    if engine.mode == "mask" and info.recurrent:
        raise ModelNotSupportedError(
            f"mode='mask' packs the whole tree into one sequence under a tree attention mask, and "
            f"{type(model).__name__} has recurrent layers (layer types {sorted(set(info.layer_kinds))}): a mask "
            "cannot reach a recurrent layer, whose scan would run across branches. Fix: use mode='dfs' (exact: "
            "each node continues from its parent's state) or 'vanilla'.")
    if engine.mode == "mask" and info.attn_implementation not in (None, "sdpa", "eager"):
        raise ModelNotSupportedError(
            f"mode='mask' needs an arbitrary 4-D attention mask, which attn_implementation="
            f"{info.attn_implementation!r} does not take (it would silently attend causally across branches). "
            "Fix: load the model with attn_implementation='sdpa' (or 'eager') for the mask baseline.")
    # a user's model: not every nn.Module carries a Hugging Face config
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if engine.mode == "mask" and window is not None and tree.stats.max_depth_tokens > window:
        raise ModelNotSupportedError(
            f"mode='mask' builds one tree mask for every layer and does not apply the model's sliding window "
            f"({window} tokens), which the longest rollout ({tree.stats.max_depth_tokens} tokens) exceeds. "
            "Fix: use mode='dfs' (exact with sliding windows: the model masks the cache itself) or mode='vanilla'.")


def tree_backward(model: nn.Module, tree: PrefixTree, loss_fn: Objective, mode: str | None = None,
                  *, engine: EngineOptions | Mapping[str, Any] | None = None,
                  normalizer: Sequence[float] | None = None,
                  **overrides: Any) -> TreeBackwardOutput:
    """Add the gradient of the loss over every rollout of ``tree`` to the parameters' ``.grad``.

    Args:
        model: a Hugging Face causal LM that accepts a KV cache.
        tree: the rollouts, as a :class:`PrefixTree`.
        loss_fn: the objective: a :class:`~lightning_dta.PolicyLoss` (``PolicyLoss()`` is the plain policy gradient)
            or a critic's :class:`~lightning_dta.ValueLoss`.
        mode: shorthand for ``EngineOptions.mode`` (``"dfs"``, ``"vanilla"`` or ``"mask"``).
        engine: the :class:`EngineOptions` (default ``EngineOptions()``); every combination is exact.
        normalizer: the step's loss normalisers (the counts of ``tree_loss_normalizer``, summed elementwise over
            the step's trees and ranks); ``None`` uses this tree's own. A distributed step passes the sums over all
            ranks so that every rank's gradient shares one scale.
        overrides: any :class:`EngineOptions` field as a keyword (``activation="recompute"``, ``chunk_size=256``,
            ...), applied on top of ``engine``.
    """
    if mode is not None:
        overrides["mode"] = mode
    engine = EngineOptions.resolve(engine, **overrides)
    if not isinstance(loss_fn, Objective):
        raise TypeError(f"loss_fn must be an objective such as lightning_dta.PolicyLoss(), got "
                        f"{type(loss_fn).__name__}")
    info = inspect_model(model, uses_cache=engine.mode != "vanilla",
                         prefix_attention=engine.prefix_attention if engine.mode == "dfs" else False,
                         prefix_attention_backend=engine.prefix_attention_backend)
    _check_supported(model, info, tree, engine, loss_fn)
    check_tree_fits_model(tree, info.vocab_size, info.max_positions)
    step = StepData(tree, loss_fn, normalizer, device=info.device, dtype=loss_dtype(info.dtype))
    if normalizer is None:  # the tree is the whole step (a distributed step passes the ranks' normaliser)
        warn_if_nothing_to_learn(step, loss_fn)
    if loss_fn.needs_sequence_ratio:  # GSPO: each rollout's ratio under these weights, from a forward-only walk
        step.set_current_logprobs(tree_logprobs(model, tree, engine=engine))
    sums = dict.fromkeys(loss_fn.metric_sums, 0.0)
    if engine.mode == "dfs":
        total = DFSWalk(model, info, tree, step, loss_fn, engine, sums).run()
    elif engine.mode == "vanilla":
        total = vanilla_backward(model, info, tree, step, loss_fn, sums, engine.vanilla_batch_tokens,
                                 engine.policy_temperature)
    else:
        total = mask_backward(model, info, tree, step, loss_fn, sums, engine.mask_max_tokens,
                              engine.policy_temperature)
    total, *values = host_values([total, *sums.values()], info.device)  # the step's one host read
    sums = dict(zip(sums, values))
    return TreeBackwardOutput(loss=total, metrics=loss_fn.metrics(sums), sums=sums, stats=tree.stats,
                              normalizer=step.normalizer)
