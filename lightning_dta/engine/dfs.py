"""The depth-first executor: push, visit, pop over the prefix tree.

*push* forwards only a segment's own tokens with the path's keys/values as the cache; *visit* of a leaf
computes its loss and backpropagates at once; *pop* runs the segment's backward once, with its own loss plus
the gradients that all its descendants sent to its keys/values. Long segments are split into chains of at
most ``chunk_size`` tokens, which is exactly "pop back to front in chunks". Under ``activation="recompute"``
the push runs without a graph and the pop re-forwards the segment with grad, so memory holds the path's
keys/values and their gradients plus one segment's activations.

Siblings are pushed together: up to ``sibling_batch_tokens`` tokens of a node's children go through one
forward over the shared prefix (packed into one row under prefix attention, padded rows otherwise; see
:class:`~lightning_dta.engine.forward.SegmentBatch`), then each child's subtree is walked in turn with that
child's keys/values on the path, and the batch is popped with one backward. Fewer, larger calls keep the
hardware busy (each call reads every weight, forward and backward); memory grows by at most one batch per
tree level.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_dta.engine.forward import ModelInfo, SegmentBatch, forward_segment, score
from lightning_dta.engine.path_kv import PathKV
from lightning_dta.engine.step_data import Segment, StepData
from lightning_dta.losses import PolicyLoss
from lightning_dta.tree import PrefixTree, TreeNode

ACTIVATIONS = ("keep", "recompute")
ORDERS = ("leaves-first", "tree")


@dataclass(frozen=True)
class DFSOptions:
    """Engine options; every combination computes exactly the same gradients."""

    activation: str = "keep"
    chunk_size: int | None = None
    sibling_batch_tokens: int | None = 4096
    order: str = "leaves-first"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}; choose one of {ACTIVATIONS}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size}; use None (no chunking) or a positive int")
        if self.sibling_batch_tokens is not None and self.sibling_batch_tokens < 1:
            raise ValueError(f"sibling_batch_tokens={self.sibling_batch_tokens}; use None (no batching) or a "
                             "positive int")
        if self.order not in ORDERS:
            raise ValueError(f"order={self.order!r}; choose one of {ORDERS}")


def chunk_end(node: TreeNode, start: int, chunk_size: int | None) -> int:
    """End of the chunk of ``node`` that begins at ``start`` (chunks hold at most ``chunk_size`` tokens)."""
    return node.end if chunk_size is None else min(start + chunk_size, node.end)


def order_children(node: TreeNode, order: str) -> list[TreeNode]:
    """Leaf children first (they are freed at once), then subtrees from the smallest up."""
    if order == "tree":
        return list(node.children)
    return sorted(node.children, key=lambda c: (not c.is_leaf, c.length if c.is_leaf else len(c.rollouts)))


MAX_PADDING = 0.15  # a padded batch stops growing once padding would exceed this fraction of its computed tokens


def batch_by_budget(items: list, length, budget: int | None, packed: bool) -> list[list]:
    """Group items (sorted by length) so that a batch computes at most ``budget`` tokens.

    Packed batches have no padding. Padded batches count rows x longest row and also keep padding under
    ``MAX_PADDING``: a padded token costs as much as a real one, an extra forward only its fixed overhead.
    """
    if budget is None:
        return [[item] for item in items]
    batches: list[list] = []
    longest = real = 0
    for item in items:
        size = length(item)
        if batches:
            rows = len(batches[-1]) + 1
            width = max(longest, size)
            computed = real + size if packed else rows * width
            if computed <= budget and computed - (real + size) <= MAX_PADDING * computed:
                batches[-1].append(item)
                longest, real = width, real + size
                continue
        batches.append([item])
        longest = real = size
    return batches


class DFSExecutor:
    def __init__(self, model: nn.Module, info: ModelInfo, tree: PrefixTree, step: StepData,
                 loss_fn: PolicyLoss, options: DFSOptions, sums: dict) -> None:
        self.model = model
        self.info = info
        self.tree = tree
        self.step = step
        self.loss_fn = loss_fn
        self.options = options
        self.sums = sums
        self.kv = PathKV(tree.stats.max_depth_tokens)
        self.total_loss = torch.zeros((), dtype=step.dtype, device=info.device)

    def run(self) -> torch.Tensor:
        self._visit_children(self.tree.root)
        return self.total_loss

    def _loss(self, logits: torch.Tensor, segment: Segment) -> torch.Tensor:
        logp, entropy = score(logits, segment.targets, self.step.dtype, with_entropy=True,
                              entropy_grad=self.loss_fn.needs_entropy_grad)
        loss = self.loss_fn(logp, entropy, segment.data, self.sums)
        self.total_loss += loss.detach()
        return loss

    def _has_children(self, node: TreeNode, end: int) -> bool:
        return end < node.end or not node.is_leaf

    def _descend(self, node: TreeNode, end: int) -> None:
        """Walk what lies below the chunk of ``node`` that ends at ``end``: its next chunk, or its children."""
        if end < node.end:
            self._visit_batch([(node, end, chunk_end(node, end, self.options.chunk_size))])
        else:
            self._visit_children(node)

    def _visit_children(self, node: TreeNode) -> None:
        chunk = self.options.chunk_size
        items = [(c, c.start, chunk_end(c, c.start, chunk)) for c in order_children(node, self.options.order)]
        if self.options.activation == "recompute":  # leaves need grad at once, inner nodes only at their pop
            groups = [[i for i in items if not self._has_children(i[0], i[2])],
                      [i for i in items if self._has_children(i[0], i[2])]]
        else:
            groups = [items]
        for group in groups:
            if self.options.order == "leaves-first":
                group = sorted(group, key=lambda item: item[2] - item[1])  # similar lengths: little padding
            for batch in batch_by_budget(group, lambda item: item[2] - item[1], self.options.sibling_batch_tokens,
                                         packed=self.info.packs_siblings):
                self._visit_batch(batch)

    def _forward(self, batch: SegmentBatch, segments: list[Segment], with_grad: bool):
        """One forward of sibling segments over their shared prefix; loss only when ``with_grad``."""
        columns = [seg.columns if with_grad else seg.columns[:0] for seg in segments]
        with torch.set_grad_enabled(with_grad):
            past, leaves_kv = self.kv.past(batch.start, requires_grad=with_grad)
            per_row, new_kv = forward_segment(self.model, self.info, batch, past, columns)
            loss = None
            if with_grad:
                losses = [self._loss(row, seg) for row, seg in zip(per_row, segments) if not seg.empty]
                loss = sum(losses) if losses else None
        return loss, new_kv, leaves_kv

    def _visit_batch(self, items: list[tuple[TreeNode, int, int]]) -> None:
        """Push sibling segments together, walk each one's subtree, then pop them with one backward."""
        segments = [self.step.segment(node.rollouts, a, b - a) for node, a, b in items]
        inner = [self._has_children(node, b) for node, _, b in items]
        if not any(inner):  # leaves whose tokens are all untrained send no gradient anywhere: skip them
            kept = [(item, seg) for item, seg in zip(items, segments) if not seg.empty]
            if not kept:
                return
            items, segments = [k[0] for k in kept], [k[1] for k in kept]
            inner = [False] * len(items)
        batch = SegmentBatch.of(self.tree, items, self.info.packs_siblings)
        keep = self.options.activation == "keep" or not any(inner)
        loss, new_kv, leaves_kv = self._forward(batch, segments, with_grad=keep)
        kv_grads = None
        if any(inner):
            kv_grads = [torch.zeros_like(t) for pair in new_kv for t in pair]
            for row, ((node, a, b), has_children) in enumerate(zip(items, inner)):
                if not has_children:
                    continue
                self.kv.write(a, [(batch.row(k, row), batch.row(v, row)) for k, v in new_kv])
                self._descend(node, b)
                for grad, path_grad in zip(kv_grads, self.kv.grads(a, b)):
                    batch.row(grad, row).copy_(path_grad)
            if not keep:  # pop: re-forward the batch with grad, behind the subtrees
                loss, new_kv, leaves_kv = self._forward(batch, segments, with_grad=True)
        outputs, grads = [], []
        if kv_grads is not None:
            outputs += [t for pair in new_kv for t in pair]
            grads += kv_grads
        if loss is not None:
            outputs.append(loss)
            grads.append(None)
        # Keys/values of frozen early layers (LoRA, frozen embeddings) carry no graph: nothing to send back.
        pairs = [(t, g) for t, g in zip(outputs, grads) if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self.kv.collect(batch.start, leaves_kv)
