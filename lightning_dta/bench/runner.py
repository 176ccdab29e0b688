"""Side-by-side measurement of the training modes on one model and one step of rollouts.

Modes run round-robin within each repeat (vanilla, dfs, ... then again), so that drifts of a noisy machine
hit every mode alike; medians and spreads are reported. Beside every timing stands the mode's gradient
agreement with the per-rollout baseline, so that a fast wrong mode is visible.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_dta.callbacks.throughput import synchronize
from lightning_dta.engine import tree_backward, tree_logprobs
from lightning_dta.losses import PolicyLoss
from lightning_dta.memory import SavedTensorMeter, current_rss_bytes, peak_rss_bytes, reset_peak_rss
from lightning_dta.tree import PrefixTree

BASELINE = "vanilla"


CHECKPOINTING = "activation_checkpointing"  # a mode key the runner handles: transformers checkpointing on


def training_modes(chunk_size: int, sibling_batch_tokens: int | None, vanilla_batch_tokens: int) -> dict[str, dict]:
    """The modes compared, as ``tree_backward`` keyword arguments.

    ``vanilla-ckpt`` is per-rollout training with transformers activation checkpointing: the baseline the
    reference system (AReaL-DTA) reports its speed-ups against.
    """
    return {
        "vanilla": dict(mode="vanilla"),
        "vanilla-ckpt": dict(mode="vanilla", **{CHECKPOINTING: True}),
        "vanilla-batched": dict(mode="vanilla", vanilla_batch_tokens=vanilla_batch_tokens),
        "mask": dict(mode="mask"),
        "dfs": dict(mode="dfs", sibling_batch_tokens=sibling_batch_tokens),
        "dfs-recompute": dict(mode="dfs", activation="recompute", chunk_size=chunk_size,
                              sibling_batch_tokens=sibling_batch_tokens),
        # dfs with the model's own attention over a KV cache and a causal mask (what runs where prefix
        # attention does not: GPUs, sliding windows), to measure what prefix attention brings
        "dfs-model-attention": dict(mode="dfs", sibling_batch_tokens=sibling_batch_tokens, prefix_attention=False),
    }


@dataclass
class ModeResult:
    name: str
    times: list[float] = field(default_factory=list)
    grad_rel_error: float | None = None  # ||g - g_vanilla|| / ||g_vanilla|| over all parameters
    peak_saved_bytes: int | None = None
    peak_rss_growth_bytes: int | None = None
    cuda_peak_bytes: int | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.times), max(self.times)


def _flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().double()
                      for p in model.parameters()])


def run_mode(model: nn.Module, tree: PrefixTree, loss_fn: PolicyLoss, kwargs: dict) -> None:
    """One ``tree_backward`` with a mode's keyword arguments (handling the runner's own keys)."""
    kwargs = dict(kwargs)
    if kwargs.pop(CHECKPOINTING, False):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 renamed the methods
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            tree_backward(model, tree, loss_fn, **kwargs)
        finally:
            (model.activation_checkpointing_disable if hasattr(model, "activation_checkpointing_disable")
             else model.gradient_checkpointing_disable)()
    else:
        tree_backward(model, tree, loss_fn, **kwargs)


def saved_peak_bytes(model: nn.Module, tree: PrefixTree, kwargs: dict) -> int:
    """Peak bytes saved for backward by one ``tree_backward`` of a mode (gradients cleared before and after)."""
    model.zero_grad(set_to_none=True)
    with SavedTensorMeter(model) as meter:
        run_mode(model, tree, PolicyLoss(), kwargs)
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes


def run_training_modes(model: nn.Module, tree: PrefixTree, loss_fn: PolicyLoss, modes: dict[str, dict],
                       repeats: int, warmup: int = 1, progress: Callable[[str], None] | None = None
                       ) -> dict[str, ModeResult]:
    """Time every mode ``repeats`` times (round-robin) and measure its memory and gradient agreement."""
    device = next(model.parameters()).device
    if BASELINE not in modes:
        raise ValueError(f"the modes must include the baseline {BASELINE!r}")
    modes = {BASELINE: modes[BASELINE], **{n: k for n, k in modes.items() if n != BASELINE}}
    results = {name: ModeResult(name) for name in modes}
    reference = None
    for name, kwargs in modes.items():  # one untimed pass each (baseline first): gradients, memory, warm-up
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rss_ok = reset_peak_rss()
        rss_before = current_rss_bytes()
        with SavedTensorMeter(model) as meter:  # the hooks only alias saved tensors: memory is unchanged
            run_mode(model, tree, loss_fn, kwargs)
        synchronize(device)
        results[name].peak_saved_bytes = meter.peak_bytes
        if device.type == "cuda":
            results[name].cuda_peak_bytes = torch.cuda.max_memory_allocated(device)
        peak = peak_rss_bytes()
        if rss_ok and peak is not None and rss_before is not None:
            results[name].peak_rss_growth_bytes = max(peak - rss_before, 0)
        grads = _flat_grads(model)
        reference = grads if reference is None else reference
        results[name].grad_rel_error = float((grads - reference).norm() / reference.norm().clamp(min=1e-30))
        model.zero_grad(set_to_none=True)
        if progress:
            progress(f"checked {name}")
    for _ in range(max(warmup - 1, 0)):
        for kwargs in modes.values():
            run_mode(model, tree, loss_fn, kwargs)
    for rep in range(repeats):
        for name, kwargs in modes.items():
            model.zero_grad(set_to_none=True)
            synchronize(device)
            start = time.perf_counter()
            run_mode(model, tree, loss_fn, kwargs)
            synchronize(device)
            results[name].times.append(time.perf_counter() - start)
            if progress:
                progress(f"repeat {rep + 1}/{repeats} {name}")
    model.zero_grad(set_to_none=True)
    return results


def _per_rollout_logprobs(model: nn.Module, tree: PrefixTree) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for tokens in tree.token_tensors:
            ids = tokens[None].to(device)
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def run_logprob_modes(model: nn.Module, tree: PrefixTree, repeats: int,
                      progress: Callable[[str], None] | None = None) -> dict[str, ModeResult]:
    """Forward-only scoring: ``tree_logprobs`` against one plain forward per rollout."""
    device = next(model.parameters()).device
    modes = {"logprobs-vanilla": _per_rollout_logprobs, "logprobs-tree": tree_logprobs}
    results = {name: ModeResult(name) for name in modes}
    reference = torch.cat(_per_rollout_logprobs(model, tree)).double()
    for name, fn in modes.items():
        values = torch.cat(fn(model, tree)).double()
        results[name].grad_rel_error = float((values - reference).abs().max())  # max abs log-prob difference
    for rep in range(repeats):
        for name, fn in modes.items():
            synchronize(device)
            start = time.perf_counter()
            fn(model, tree)
            synchronize(device)
            results[name].times.append(time.perf_counter() - start)
            if progress:
                progress(f"repeat {rep + 1}/{repeats} {name}")
    return results
