"""The depth-first executor: push, visit, pop over the prefix tree.

*push* forwards only a segment's own tokens with the path's keys/values as the cache; *visit* of a leaf
computes its loss and backpropagates at once; *pop* runs the segment's backward once, with its own loss plus
the gradients that all its descendants sent to its keys/values. Long segments are split into chains of at
most ``chunk_size`` tokens, which is exactly "pop back to front in chunks". Under ``activation="recompute"``
the push runs without a graph and the pop re-forwards the segment with grad, so memory holds the path's
keys/values and their gradients plus one segment's activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_dta.engine.forward import ModelInfo, forward_segment, row_logits, score
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
    leaf_batch_tokens: int | None = 4096
    order: str = "leaves-first"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}; choose one of {ACTIVATIONS}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size={self.chunk_size}; use None (no chunking) or a positive int")
        if self.leaf_batch_tokens is not None and self.leaf_batch_tokens < 1:
            raise ValueError(f"leaf_batch_tokens={self.leaf_batch_tokens}; use None (no batching) or a positive int")
        if self.order not in ORDERS:
            raise ValueError(f"order={self.order!r}; choose one of {ORDERS}")


def chunk_bounds(node: TreeNode, chunk_size: int | None) -> list[tuple[int, int]]:
    """Split a node's positions into consecutive chunks of at most ``chunk_size`` tokens."""
    if chunk_size is None or node.length <= chunk_size:
        return [(node.start, node.end)]
    return [(a, min(a + chunk_size, node.end)) for a in range(node.start, node.end, chunk_size)]


def order_children(node: TreeNode, order: str) -> list[TreeNode]:
    """Leaf children first (they are batched and freed at once), then subtrees from the smallest up."""
    if order == "tree":
        return list(node.children)
    return sorted(node.children, key=lambda c: (not c.is_leaf, c.length if c.is_leaf else len(c.rollouts)))


def batch_leaves(leaves: list[TreeNode], budget: int | None) -> list[list[TreeNode]]:
    """Group sibling leaves (sorted by length) so that rows x longest row stays within ``budget`` tokens."""
    if budget is None:
        return [[leaf] for leaf in leaves]
    batches: list[list[TreeNode]] = []
    for leaf in sorted(leaves, key=lambda n: n.length):
        if batches and (len(batches[-1]) + 1) * leaf.length <= budget:
            batches[-1].append(leaf)
        else:
            batches.append([leaf])
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

    def _visit_children(self, node: TreeNode) -> None:
        children = order_children(node, self.options.order)
        batchable = [c for c in children if c.is_leaf and len(chunk_bounds(c, self.options.chunk_size)) == 1]
        for batch in batch_leaves(batchable, self.options.leaf_batch_tokens):
            self._visit_leaves([(leaf, leaf.start, leaf.end) for leaf in batch])
        batched = {id(c) for c in batchable}
        for child in children:
            if id(child) not in batched:
                self._visit(child, chunk_bounds(child, self.options.chunk_size), 0)

    def _visit_leaves(self, items: list[tuple[TreeNode, int, int]]) -> None:
        """Visit leaf segments ``(node, a, b)`` that share a prefix of length ``a``: one padded forward over
        the prefix's keys/values, loss, and backward at once."""
        rows = [(node, a, b, self.step.segment(node.rollouts, a, b - a)) for node, a, b in items]
        rows = [row for row in rows if not row[3].empty]
        if not rows:
            return  # nothing in these leaves is trained: they send no gradient
        start = rows[0][1]
        width = max(b - a for _, a, b, _ in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (node, a, b, _) in enumerate(rows):  # right padding never reaches real tokens (causal)
            input_ids[i, :b - a] = self.tree.tokens(node)[a - node.start:b - node.start]
        columns = torch.unique(torch.cat([seg.columns for *_, seg in rows]))
        past, leaves_kv = self.kv.past(start, requires_grad=True, batch=len(rows))
        logits, _ = forward_segment(self.model, self.info, input_ids.to(self.info.device), start, past, columns)
        segments = [seg for *_, seg in rows]
        per_row = row_logits(logits, columns, [seg.columns for seg in segments])
        loss = sum(self._loss(row, seg) for row, seg in zip(per_row, segments))
        loss.backward()
        self.kv.collect(start, leaves_kv)

    def _visit(self, node: TreeNode, chunks: list[tuple[int, int]], index: int) -> None:
        a, b = chunks[index]
        has_children = index + 1 < len(chunks) or not node.is_leaf
        if not has_children:
            self._visit_leaves([(node, a, b)])
            return
        segment = self.step.segment(node.rollouts, a, b - a)
        tokens = self.tree.tokens(node)[a - node.start:b - node.start][None].to(self.info.device)
        keep = self.options.activation == "keep"
        loss, new_kv, leaves_kv = self._push(tokens, a, segment, with_grad=keep)
        if index + 1 < len(chunks):
            self._visit(node, chunks, index + 1)
        else:
            self._visit_children(node)
        if not keep:  # pop: re-forward the segment with grad, behind the children
            loss, new_kv, leaves_kv = self._push(tokens, a, segment, with_grad=True, write=False)
        outputs = [t for pair in new_kv for t in pair]
        grads = self.kv.grads(a, b)
        if loss is not None:
            outputs.append(loss)
            grads.append(None)
        torch.autograd.backward(outputs, grads)
        self.kv.collect(a, leaves_kv)

    def _push(self, tokens: torch.Tensor, start: int, segment: Segment, with_grad: bool, write: bool = True):
        with torch.set_grad_enabled(with_grad):
            past, leaves_kv = self.kv.past(start, requires_grad=with_grad)
            columns = segment.columns if with_grad else segment.columns[:0]
            logits, new_kv = forward_segment(self.model, self.info, tokens, start, past, columns)
            loss = self._loss(logits[0], segment) if with_grad and not segment.empty else None
        if write:
            self.kv.write(start, new_kv)
        return loss, new_kv, leaves_kv
