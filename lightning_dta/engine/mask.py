"""The tree-attention baseline: a whole tree packed into one sequence under a 4-D tree attention mask.

Every token attends to its ancestors' tokens and to the earlier tokens of its own segment, at its true
position. One forward and one backward per pack; activation memory grows with the packed tokens. With
``max_tokens`` the rollouts are cut, in lexicographic order, into packs of at most that many tree tokens:
sharing across packs is lost, as in systems that cap packed sequences.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from lightning_dta.contracts import Objective
from lightning_dta.core.tree import PrefixTree, common_prefix_length
from lightning_dta.engine.device import to_device
from lightning_dta.engine.forward import forward_plain, loss_inputs
from lightning_dta.engine.model_info import ModelInfo
from lightning_dta.engine.step_data import StepData


def rollout_packs(tree: PrefixTree, max_tokens: int | None) -> list[list[int]]:
    """Rollouts grouped in lexicographic order so that each group's tree has at most ``max_tokens`` tokens
    (a single rollout longer than the cap forms a pack of its own)."""
    order = tree.lexicographic_order()
    if max_tokens is None:
        return [order]
    arrays = [t.numpy() for t in tree.token_tensors]
    packs: list[list[int]] = []
    tokens = 0
    for r in order:
        shared = common_prefix_length(arrays[packs[-1][-1]], arrays[r]) if packs and packs[-1] else 0
        extra = len(arrays[r]) - shared
        if packs and tokens + extra <= max_tokens:
            packs[-1].append(r)
            tokens += extra
        else:
            packs.append([r])
            tokens = len(arrays[r])
    return packs


def tree_attention_mask(pack: PrefixTree, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Packed positions ``[T]``, the additive mask ``[1, 1, T, T]`` and each node's offset in the pack."""
    nodes = pack.nodes[1:]
    offsets = np.cumsum([0] + [n.length for n in nodes])[:-1].tolist()
    node_of_token = torch.repeat_interleave(torch.arange(len(nodes)), torch.tensor([n.length for n in nodes]))
    ancestor = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)  # ancestor[i, j]: j is i or above i
    for i, node in enumerate(nodes):  # pre-order: a parent's row is complete before its children's
        if node.parent is not pack.root:
            ancestor[i] = ancestor[node.parent.index - 1]
        ancestor[i, i] = True
    allowed = ancestor[node_of_token][:, node_of_token]
    allowed &= torch.ones_like(allowed).tril()  # ancestors precede in pre-order; own segment is causal
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    positions = torch.cat([torch.arange(n.start, n.end) for n in nodes])
    return positions, mask[None, None], offsets


def mask_backward(model: nn.Module, info: ModelInfo, tree: PrefixTree, step: StepData, loss_fn: Objective,
                  sums: dict, max_tokens: int | None, temperature: float) -> torch.Tensor:
    total = torch.zeros((), dtype=step.dtype, device=info.device)
    for group in rollout_packs(tree, max_tokens):
        pack = tree.subset(group)
        to_global = torch.tensor(group, dtype=torch.long)
        positions, mask, offsets = tree_attention_mask(pack, info.dtype)
        rows = []
        for node, offset in zip(pack.nodes[1:], offsets):
            targets = step.targets(to_global[torch.tensor(node.rollouts)], node.start, node.length)
            if not targets.empty:
                rows.append((offset, targets))
        if not rows:
            continue
        columns = torch.cat([offset + targets.columns for offset, targets in rows])
        input_ids = to_device(torch.cat([pack.tokens(n) for n in pack.nodes[1:]])[None], info.device)
        logits = forward_plain(model, info, input_ids, columns, position_ids=to_device(positions[None], info.device),
                               attention_mask=to_device(mask, info.device))[0]
        loss = 0.0
        # split, not slices: backward assembles one gradient buffer instead of a full-size one per node
        per_node = torch.split(logits, [targets.columns.numel() for _, targets in rows])
        for node_logits, (_, targets) in zip(per_node, rows):
            scores, entropy = loss_inputs(loss_fn, node_logits, targets.token_ids, step.dtype, temperature)
            loss = loss + loss_fn(scores, entropy, targets.data, sums)
        loss.backward()
        total += loss.detach()
    return total
