"""The per-rollout baseline: every rollout forwarded and backpropagated on its own, prefixes recomputed.

It is both the correctness reference of the tree engines and the speed baseline. With ``batch_tokens``
rollouts are sorted by length and packed into right-padded micro-batches of at most that many tokens
(rows x longest row), the way ordinary trainers batch.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dta.contracts import Objective
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine.device import to_device
from lightning_dta.engine.forward import forward_plain, loss_inputs
from lightning_dta.engine.model_info import ModelInfo
from lightning_dta.engine.sibling_batch import row_logits
from lightning_dta.engine.step_data import StepData


def micro_batches(lengths: list[int], batch_tokens: int | None) -> list[list[int]]:
    """Rollout indices grouped (sorted by length) so that rows x longest row <= ``batch_tokens``."""
    if batch_tokens is None:
        return [[i] for i in range(len(lengths))]
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[i] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def vanilla_backward(model: nn.Module, info: ModelInfo, tree: PrefixTree, step: StepData, loss_fn: Objective,
                     sums: dict, batch_tokens: int | None, temperature: float) -> torch.Tensor:
    total = torch.zeros((), dtype=step.dtype, device=info.device)
    lengths = [len(t) for t in tree.token_tensors]
    for batch in micro_batches(lengths, batch_tokens):
        grids = [step.targets([r], 0, lengths[r]) for r in batch]
        rows = [(r, targets) for r, targets in zip(batch, grids) if not targets.empty]
        if not rows:
            continue
        width = max(lengths[r] for r, _ in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (r, _) in enumerate(rows):
            input_ids[i, :lengths[r]] = tree.token_tensors[r]
            attention_mask[i, :lengths[r]] = 1
        columns = torch.unique(torch.cat([targets.columns for _, targets in rows]))
        logits = forward_plain(model, info, to_device(input_ids, info.device), columns,
                               attention_mask=to_device(attention_mask, info.device))
        loss = 0.0
        grids = [targets for _, targets in rows]
        for row, targets in zip(row_logits(logits, columns, [targets.columns for targets in grids]), grids):
            scores, entropy = loss_inputs(loss_fn, row, targets.token_ids, step.dtype, temperature)
            loss = loss + loss_fn(scores, entropy, targets.data, sums)
        loss.backward()
        total += loss.detach()
    return total
