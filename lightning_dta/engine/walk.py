"""The depth-first traversal shared by the training walk (:mod:`.dfs`) and the forward-only walk (:mod:`.logprobs`).

The vocabulary of the engine:

- a **node** (:class:`~lightning_dta.core.tree.TreeNode`) holds the positions ``start .. end-1`` that its rollouts
  share;
- a **chunk** (:class:`Chunk`) is the engine's unit of work: positions ``start .. end-1`` of one node, forwarded
  in one call. A node is one chunk, or with ``chunk_size`` a chain of chunks walked front to back and popped
  back to front;
- a **sibling batch** is a list of chunks that start at the same position (children of one node), forwarded
  together over their shared prefix (:class:`~lightning_dta.engine.sibling_batch.SiblingBatch` is its layout).

:class:`TreeWalk` cuts the children of a node into chunks, orders them, groups them into sibling batches of at
most ``sibling_batch_tokens`` computed tokens, and hands each batch to :meth:`TreeWalk.visit_batch`, which a
walker implements: it forwards the batch, writes each chunk's keys/values into the path buffers (and, for a model
with recurrent layers, its end state into :class:`~lightning_dta.engine.recurrent_state.PathStates`) and calls
:meth:`TreeWalk.descend` for the chunks with something below them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from lightning_dta.core.tree import PrefixTree, TreeNode
from lightning_dta.engine.kv import PathKV
from lightning_dta.engine.options import EngineOptions
from lightning_dta.engine.recurrent_state import PathStates

MAX_PADDING = 0.15  # a padded batch stops growing once padding would exceed this fraction of its computed tokens


@dataclass(frozen=True, slots=True)
class Chunk:
    """Positions ``start .. end-1`` of ``node``: one forward of the engine."""

    node: TreeNode
    start: int
    end: int

    @classmethod
    def first(cls, node: TreeNode, chunk_size: int | None) -> Chunk:
        """The node's first chunk (the whole node without ``chunk_size``)."""
        return cls.at(node, node.start, chunk_size)

    @classmethod
    def at(cls, node: TreeNode, start: int, chunk_size: int | None) -> Chunk:
        return cls(node, start, node.end if chunk_size is None else min(start + chunk_size, node.end))

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def has_children(self) -> bool:
        """Something lies below: the node's next chunk, or its children."""
        return self.end < self.node.end or not self.node.is_leaf


def order_children(node: TreeNode, order: str) -> list[TreeNode]:
    """``"leaves-first"``: leaf children first (they are freed at once), then subtrees from the smallest up;
    ``"tree"``: the tree's own order."""
    if order == "tree":
        return list(node.children)
    return sorted(node.children, key=lambda c: (not c.is_leaf, c.length if c.is_leaf else len(c.rollouts)))


FRAMES_PER_CHUNK = 4  # visit_batch -> descend -> visit_batch (visit_children at a node's end), with room to spare


@contextmanager
def recursion_room(chunks: int) -> Iterator[None]:
    """Let the depth-first walk recurse through ``chunks`` chunks on one path: a long rollout in small chunks
    (``chunk_size=16`` over 16K tokens, or ``activation="auto"`` cutting chunks to fit a tight budget) goes deeper
    than Python's default limit of 1000 frames. The walk's frames are Python-to-Python calls, which CPython 3.11+
    keeps off the C stack, and their number is bounded by the path; the limit is restored afterwards."""
    before = sys.getrecursionlimit()
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    needed = depth + FRAMES_PER_CHUNK * chunks + 100
    if needed > before:
        sys.setrecursionlimit(needed)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def batch_by_budget(chunks: list[Chunk], budget: int | None, packed: bool) -> list[list[Chunk]]:
    """Group consecutive chunks so that a batch computes at most ``budget`` tokens (``None``: one per batch).

    Packed batches have no padding. Padded batches count rows x longest row and also keep padding under
    ``MAX_PADDING``: a padded token costs as much as a real one, an extra forward only its fixed overhead. A
    chunk longer than the budget forms a batch of its own.
    """
    if budget is None:
        return [[chunk] for chunk in chunks]
    batches: list[list[Chunk]] = []
    longest = real = 0
    for chunk in chunks:
        size = chunk.length
        if batches:
            width = max(longest, size)
            computed = real + size if packed else (len(batches[-1]) + 1) * width
            if computed <= budget and computed - (real + size) <= MAX_PADDING * computed:
                batches[-1].append(chunk)
                longest, real = width, real + size
                continue
        batches.append([chunk])
        longest = real = size
    return batches


class TreeWalk:
    """Depth-first over ``tree`` in sibling batches; subclasses implement :meth:`visit_batch`."""

    with_grads = True  # whether the path buffers collect gradients

    def __init__(self, tree: PrefixTree, engine: EngineOptions, packed: bool, recurrent: bool = False) -> None:
        self.tree = tree
        self.engine = engine
        self.packed = packed  # sibling batches are packed rows (prefix attention), else padded rows
        self.recurrent = recurrent  # the model has recurrent layers: chunks hand on a state at their end
        self.kv = PathKV(tree.stats.max_depth_tokens, with_grads=self.with_grads)
        self.states = PathStates(with_grads=self.with_grads, required=recurrent)

    def run(self) -> None:
        with recursion_room(self.deepest_chain()):
            self.visit_children(self.tree.root)

    def deepest_chain(self) -> int:
        """The most chunks on one root-to-leaf path: the walk's recursion depth (a node of ``n`` tokens is
        ``ceil(n / chunk)`` chunks, each one level deeper than the last)."""
        chunk = self.chunk_tokens()
        depth = {self.tree.root.index: 0}
        deepest = 0
        for node in self.tree.iter_nodes():  # parents before children
            chunks = 1 if chunk is None else -(-node.length // chunk)
            depth[node.index] = depth[node.parent.index] + chunks
            deepest = max(deepest, depth[node.index])
        return deepest

    def groups(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        """The chunks of sibling nodes, in the groups batches may not cross (one group here)."""
        return [chunks]

    def chunk_tokens(self) -> int | None:
        """Nodes are cut into chunks of at most this many tokens (``chunk_size`` here)."""
        return self.engine.chunk_size

    def batch_tokens(self, group: list[Chunk]) -> int | None:
        """At most this many computed tokens per sibling batch of ``group`` (``sibling_batch_tokens`` here)."""
        return self.engine.sibling_batch_tokens

    def visit_children(self, node: TreeNode) -> None:
        chunks = [Chunk.first(child, self.chunk_tokens()) for child in order_children(node, self.engine.order)]
        for group in (part for whole in self.groups(chunks) for part in self.state_groups(whole)):
            if self.engine.order == "leaves-first":
                group = sorted(group, key=lambda chunk: chunk.length)  # similar lengths: little padding
            for batch in batch_by_budget(group, self.batch_tokens(group), self.packed):
                self.visit_batch(batch)

    def state_groups(self, group: list[Chunk]) -> list[list[Chunk]]:
        """With recurrent layers, the chunks that hand a state on (something lies below them) go into batches of
        one length: a padded row's state at the batch's end is its own end state only if it has no padding (the
        scan would run on through the padding). Leaves hand nothing on and keep their batches."""
        if not self.recurrent:
            return [group]
        parts: dict[int | None, list[Chunk]] = {}
        for chunk in group:
            parts.setdefault(chunk.length if chunk.has_children else None, []).append(chunk)
        return list(parts.values())

    def descend(self, chunk: Chunk) -> None:
        """Walk what lies below ``chunk``: the node's next chunk, or the node's children."""
        if chunk.end < chunk.node.end:
            self.visit_batch([Chunk.at(chunk.node, chunk.end, self.chunk_tokens())])
        else:
            self.visit_children(chunk.node)

    def visit_batch(self, chunks: list[Chunk]) -> None:
        raise NotImplementedError
