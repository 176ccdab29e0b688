"""Training and scoring entry points: ``tree_backward`` and ``tree_logprobs``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_dta.engine.dfs import DFSExecutor, DFSOptions
from lightning_dta.engine.forward import ModelNotSupportedError, inspect_model, loss_dtype
from lightning_dta.engine.logprobs import tree_logprobs_walk
from lightning_dta.engine.mask import mask_backward
from lightning_dta.engine.step_data import StepData, check_tree_fits_model, tree_loss_normalizer
from lightning_dta.engine.vanilla import vanilla_backward
from lightning_dta.losses import PolicyLoss, empty_sums, metrics_from_sums
from lightning_dta.tree import PrefixTree, TreeStats

MODES = ("dfs", "vanilla", "mask")

__all__ = ["MODES", "ModelNotSupportedError", "TreeBackwardOutput", "tree_backward", "tree_logprobs",
           "tree_loss_normalizer"]


@dataclass
class TreeBackwardOutput:
    """What one ``tree_backward`` call did. ``loss`` is this tree's share of the step loss (with a global
    ``normalizer`` the shares of all trees and ranks add up to the step loss)."""

    loss: float
    metrics: dict[str, float]
    sums: dict[str, float] = field(repr=False)  # raw sums behind the metrics, to add across trees/ranks
    stats: TreeStats
    normalizer: float


def tree_backward(model: nn.Module, tree: PrefixTree, loss_fn: PolicyLoss | None = None, mode: str = "dfs", *,
                  activation: str = "keep", chunk_size: int | None = None, sibling_batch_tokens: int | None = 4096,
                  order: str = "leaves-first", normalizer: float | None = None, mask_max_tokens: int | None = None,
                  vanilla_batch_tokens: int | None = None, prefix_attention: bool | None = None
                  ) -> TreeBackwardOutput:
    """Add the gradient of the policy loss over every rollout of ``tree`` to the parameters' ``.grad``.

    Args:
        model: a Hugging Face causal LM that accepts a KV cache.
        tree: the rollouts, as a :class:`PrefixTree`.
        loss_fn: the loss (default ``PolicyLoss()``).
        mode: ``"dfs"`` (the method), ``"vanilla"`` (each rollout alone) or ``"mask"`` (tree attention mask).
        activation: dfs only. ``"keep"`` keeps each segment's graph until it is popped; ``"recompute"`` pushes
            without a graph and re-forwards each segment with grad when it is popped.
        chunk_size: dfs only. Split segments into chunks of at most this many tokens (``None``: no split).
        sibling_batch_tokens: dfs only. Sibling segments are forwarded together, at most this many tokens per
            forward (packed into one row under prefix attention; padded rows, counted as rows x longest row,
            otherwise); ``None`` forwards each child alone.
        order: dfs only. ``"leaves-first"`` (leaf children, then subtrees from the smallest) or ``"tree"``.
        normalizer: the step's loss normaliser (see ``PolicyLoss.normalizer``); ``None`` uses this tree's own.
            A distributed step passes the sum over all ranks so that every rank's gradient shares one scale.
        mask_max_tokens: mask only. Pack at most this many tree tokens per forward (``None``: the whole tree).
        vanilla_batch_tokens: vanilla only. Padded micro-batches of at most this many tokens.
        prefix_attention: dfs only. Attend to the shared prefix without copying or masking it
            (:mod:`lightning_dta.engine.prefix_attention`; CPU, full causal attention). ``None`` uses it where the
            model supports it, ``True`` requires it, ``False`` keeps the model's attention with a KV cache.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")
    loss_fn = loss_fn or PolicyLoss()
    options = DFSOptions(activation=activation, chunk_size=chunk_size, sibling_batch_tokens=sibling_batch_tokens,
                         order=order)
    info = inspect_model(model, uses_cache=mode != "vanilla",
                         prefix_attention=prefix_attention if mode == "dfs" else False)
    if mode == "dfs" and activation == "recompute" and info.has_active_dropout:
        raise ModelNotSupportedError("activation='recompute' re-runs each segment, and active dropout would draw a "
                                     "different mask the second time. Fix: set dropout to 0 or call model.eval().")
    if mode == "mask" and info.attn_implementation not in (None, "sdpa", "eager"):
        raise ModelNotSupportedError(
            f"mode='mask' needs an arbitrary 4-D attention mask, which attn_implementation="
            f"{info.attn_implementation!r} does not take (it would silently attend causally across branches). "
            "Fix: load the model with attn_implementation='sdpa' (or 'eager') for the mask baseline.")
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    if mode == "mask" and window is not None and tree.stats.max_depth_tokens > window:
        raise ModelNotSupportedError(
            f"mode='mask' builds one tree mask for every layer and does not apply the model's sliding window "
            f"({window} tokens), which the longest rollout ({tree.stats.max_depth_tokens} tokens) exceeds. "
            "Fix: use mode='dfs' (exact with sliding windows: the model masks the cache itself) or 'vanilla'.")
    check_tree_fits_model(tree, info.vocab_size, info.max_positions)
    step = StepData(tree, loss_fn, normalizer, device=info.device, dtype=loss_dtype(info.dtype))
    sums = empty_sums()
    if mode == "dfs":
        total = DFSExecutor(model, info, tree, step, loss_fn, options, sums).run()
    elif mode == "vanilla":
        total = vanilla_backward(model, info, tree, step, loss_fn, sums, vanilla_batch_tokens)
    else:
        total = mask_backward(model, info, tree, step, loss_fn, sums, mask_max_tokens)
    sums = {key: float(value) for key, value in sums.items()}
    return TreeBackwardOutput(loss=float(total), metrics=metrics_from_sums(sums), sums=sums, stats=tree.stats,
                              normalizer=step.normalizer)


def tree_logprobs(model: nn.Module, tree: PrefixTree, *, chunk_size: int | None = None,
                  sibling_batch_tokens: int | None = 4096, prefix_attention: bool | None = None) -> list[torch.Tensor]:
    """Forward only: one 1-D tensor per rollout (input order); entry ``t-1`` is ``log p(x_t | x_<t)``.
    Options as in :func:`tree_backward`."""
    info = inspect_model(model, prefix_attention=prefix_attention)
    check_tree_fits_model(tree, info.vocab_size, info.max_positions)
    return tree_logprobs_walk(model, info, tree, chunk_size, sibling_batch_tokens)
