"""A published one-level peer in the bench: PrefixGrouper (the ``prefix_grouper`` package, used in verl).

PrefixGrouper trains a GRPO group as one packed row ``[prompt, response 1, response 2, ...]``: attention runs
as the prompt's causal self-attention plus each response over ``[prompt, response]`` (its keys/values copied
per response), through flash-attention's padded varlen path. It shares one level (the prompt), where the tree
shares every level. This mode runs it on the bench's rollouts with the same loss as every other mode (the
loss inputs of the same ``StepData`` grid), so its gradient error against the per-rollout baseline is shown
like every mode's.

Groups are the root's children of the tree (for a GRPO step: one per prompt); the group's prefix is that
node (the tokens all its rollouts share). The package's own transformers hook reads the attention
implementation from the model's config, which the switch below renames, so the bench registers a thin
attention function of its own around ``prefix_grouper``'s ``AttentionForward`` with flash-attention 2 called
directly; ``attention`` replaces the kernel in CPU tests (a reference with flash-attention 2's padding and
bottom-right causal conventions).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from lightning_dta.core.losses import PolicyLoss, empty_sums
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine.device import host_values, to_device
from lightning_dta.engine.forward import score
from lightning_dta.engine.hf_attention import AttentionSwitch, attention_configs
from lightning_dta.engine.model_info import inspect_model, loss_dtype
from lightning_dta.engine.step_data import StepData

ATTENTION_NAME = "lightning_dta_bench_prefix_grouper"
# attention(q, k, v [b, heads, len, dim], padding_mask [b, keys] (True: a token), scale) -> [b, len, heads, dim]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

_ACTIVE: ContextVar[tuple | None] = ContextVar("lightning_dta_bench_prefix_grouper", default=None)


def unavailable_reason(device: torch.device) -> str | None:
    """Why the PrefixGrouper mode cannot run here (``None``: it can)."""
    if importlib.util.find_spec("prefix_grouper") is None:
        return "pip install prefix_grouper"
    if device.type != "cuda":
        return "it runs through flash-attention 2's varlen kernels, which need CUDA"
    if importlib.util.find_spec("flash_attn") is None:
        return "it needs flash-attn (pip install 'lightning-dta[gpu]')"
    return None


def flash_attention_2(query, key, value, padding_mask, scale):
    """transformers' flash-attention 2 path with a padding mask (unpadded varlen, bottom-right causal)."""
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return _flash_attention_forward(q, k, v, padding_mask, query_length=q.shape[1], is_causal=True,
                                    softmax_scale=scale, attn_implementation="flash_attention_2")


def _grouped_attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from prefix_grouper.forward import AttentionForward

    grouper, attention = _ACTIVE.get()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = AttentionForward(lambda q, k, v, mask: attention(q, k, v, mask, scale))(grouper, query, key, value)
    return out, None


_SWITCH = AttentionSwitch(ATTENTION_NAME, _grouped_attention)


@contextmanager
def _grouped(model: nn.Module, grouper, attention: Attention) -> Iterator[None]:
    token = _ACTIVE.set((grouper, attention))
    try:
        with _SWITCH.on(attention_configs(model)):
            yield
    finally:
        _ACTIVE.reset(token)


def prefix_grouper_backward(model: nn.Module, tree: PrefixTree, loss_fn: PolicyLoss,
                            attention: Attention = flash_attention_2) -> float:
    """One training step with PrefixGrouper, a packed row per group; adds the gradient to ``.grad``."""
    from prefix_grouper import PrefixGrouper

    info = inspect_model(model, uses_cache=False, prefix_attention=False, prefix_attention_backend=None)
    step = StepData(tree, loss_fn, device=info.device, dtype=loss_dtype(info.dtype))
    sums, total = empty_sums(), []
    for group in tree.root.children:
        members = list(group.rollouts)
        lengths = [int(step.lengths[r]) for r in members]
        prefix = min(group.end, min(lengths) - 1)  # every member keeps at least one token of its own
        tokens = [step.tokens[int(step.offsets[r]):int(step.offsets[r]) + n] for r, n in zip(members, lengths)]
        row = torch.cat([tokens[0][:prefix], *[t[prefix:] for t in tokens]])
        positions = torch.cat([torch.arange(prefix), *[torch.arange(prefix, n) for n in lengths]])
        # where each member's positions lie in the packed row: shared ones in the prefix, then its response
        starts, placed = [], prefix
        for n in lengths:
            starts.append(placed)
            placed += n - prefix
        targets = [step.targets([r], 0, n - 1) for r, n in zip(members, lengths)]
        packed = [torch.where(t.columns < prefix, t.columns, t.columns - prefix + s) for t, s in zip(targets, starts)]
        kept = torch.unique(torch.cat(packed))
        if kept.numel() == 0:
            continue
        grouper = PrefixGrouper([[prefix, *[n - prefix for n in lengths]]], device=info.device, padding_mode="right")
        with _grouped(model, grouper, attention):
            logits = model(input_ids=to_device(row[None], info.device),
                           position_ids=to_device(positions[None], info.device),
                           logits_to_keep=to_device(kept, info.device), use_cache=False).logits[0]
        losses = []
        for t, where in zip(targets, packed):
            if t.empty:
                continue
            rows = logits.index_select(0, to_device(torch.searchsorted(kept, where), logits.device))
            logp, entropy = score(rows, t.token_ids, step.dtype, with_entropy=True,
                                  entropy_grad=loss_fn.needs_entropy_grad, temperature=1.0)
            losses.append(loss_fn(logp, entropy, t.data, sums))
        loss = sum(losses)
        loss.backward()
        total.append(loss.detach())
    return host_values([sum(total, 0.0)], info.device)[0]  # one host read per step, as the engine's
