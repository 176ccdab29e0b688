"""Forward-only walks with cousins packed: chunks of different parents (and depths) in one forward.

A training walk must pop every chunk after its subtree, so it batches only siblings, which share one prefix (the
path buffers). A forward-only walk (proximal and reference log-probs, every step) has no pop: a chunk needs its
ancestors' keys/values and nothing else. So :class:`CousinLogprobWalk` keeps the keys/values of every chunk whose
subtree is still pending, and forwards the pending chunks in batches of up to ``sibling_batch_tokens`` tokens,
whatever their parents: a tree-search step of 3 x 3 x 2 branches takes 4 forwards instead of 14.

In a batch, each chunk attends to its own ancestors and causally to itself. Ancestors are taken level by level:
at level ``d`` every chunk has at most one ancestor chunk, so one varlen call per level computes all of them
(queries grouped by that ancestor, the level's distinct ancestors' keys concatenated once), and the levels and
the own causal block are merged by log-sum-exp, as prefix attention merges its two blocks
(:mod:`~lightning_dta.engine.prefix_attention`). Pending chunks are a stack, taken from the top and pushed
children first-to-top, so the walk stays depth-first in its memory: the keys/values held are those of the
ancestors of pending chunks (at most one batch's tokens per level of the tree, and never more than the tree).
"""

from __future__ import annotations

import torch

from lightning_dta.engine.attention_backends import Varlen
from lightning_dta.engine.device import to_device
from lightning_dta.engine.kv import KV
from lightning_dta.engine.prefix_attention import AncestorLevel
from lightning_dta.engine.walk import Chunk, order_children


class CousinBatch:
    """Chunks packed one after another into one row, each at its own positions, with its ancestors' levels."""

    def __init__(self, tokens: list[torch.Tensor], chunks: list[Chunk]) -> None:
        self.tokens, self.chunks = tokens, chunks
        self.lengths = [len(t) for t in tokens]
        self.offsets = [0]
        for n in self.lengths[:-1]:
            self.offsets.append(self.offsets[-1] + n)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.offsets, self.lengths))

    def input_ids(self) -> torch.Tensor:
        return torch.cat(self.tokens)[None]

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(c.start, c.end) for c in self.chunks])[None]

    def levels(self, ancestry: list[list[Chunk]], stored: dict[Chunk, KV], device: torch.device
               ) -> list[AncestorLevel]:
        """The ancestor levels of the batch; ``ancestry[i]`` lists chunk ``i``'s ancestor chunks from the root
        down, ``stored`` holds their keys/values. Chunks are in an order where those sharing an ancestor are
        adjacent (the stack order of the walk)."""
        levels = []
        for depth in range(max(len(a) for a in ancestry)):
            rows = [i for i, a in enumerate(ancestry) if len(a) > depth]
            groups: list[tuple[Chunk, int]] = []  # (ancestor, query tokens), in order
            for i in rows:
                ancestor = ancestry[i][depth]
                if groups and groups[-1][0] == ancestor:
                    groups[-1] = (ancestor, groups[-1][1] + self.lengths[i])
                else:
                    groups.append((ancestor, self.lengths[i]))
            distinct = list(dict.fromkeys(a for a, _ in groups))
            if len(distinct) != len(groups):
                raise RuntimeError("cousin batch rows are not grouped by ancestor; this is a bug in lightning_dta")
            index = None
            if len(rows) < len(ancestry):
                index = to_device(torch.cat([torch.arange(self.offsets[i], self.offsets[i] + self.lengths[i])
                                             for i in rows]), device)
            if len(distinct) == 1:
                kv = stored[distinct[0]]
            else:  # each ancestor once, whatever the number of chunks below it
                kv = [(torch.cat([stored[a][layer][0] for a in distinct], 2),
                       torch.cat([stored[a][layer][1] for a in distinct], 2))
                      for layer in range(len(stored[distinct[0]]))]
            levels.append(AncestorLevel(index, Varlen.of(tuple(n for _, n in groups), device),
                                        Varlen.of(tuple(a.length for a in distinct), device), kv))
        return levels


class PendingChunks:
    """The stack of chunks whose ancestors are all computed, and the keys/values those ancestors hold (freed when
    nothing below them is pending)."""

    def __init__(self, roots: list[Chunk]) -> None:
        self.stack: list[Chunk] = list(reversed(roots))
        self.parent: dict[Chunk, Chunk | None] = {c: None for c in roots}
        self.kv: dict[Chunk, KV] = {}
        self.pending_below: dict[Chunk, int] = {}

    def __bool__(self) -> bool:
        return bool(self.stack)

    def take(self, budget: int | None) -> list[Chunk]:
        """Chunks from the top of the stack, at most ``budget`` tokens (at least one chunk)."""
        batch = [self.stack.pop()]
        total = batch[0].length
        while self.stack and budget is not None and total + self.stack[-1].length <= budget:
            total += self.stack[-1].length
            batch.append(self.stack.pop())
        return batch

    def ancestry(self, chunk: Chunk) -> list[Chunk]:
        out = []
        parent = self.parent[chunk]
        while parent is not None:
            out.append(parent)
            parent = self.parent[parent]
        return out[::-1]

    def finish(self, batch: list[Chunk], kv_of, successors_of) -> None:
        """A batch is computed: :meth:`done` for each chunk, the last first, so that the first chunk's successors
        end on top and the stack stays in depth-first order (chunks below one node stay adjacent)."""
        for row in reversed(range(len(batch))):
            following = successors_of(batch[row])
            self.done(batch[row], kv_of(row) if following else None, following)

    def done(self, chunk: Chunk, kv: KV | None, successors: list[Chunk]) -> None:
        """``chunk`` is computed: keep its keys/values for its ``successors`` (pushed, the first on top); release
        ancestors with nothing pending below them."""
        if successors:
            self.kv[chunk] = kv
            self.pending_below[chunk] = len(successors)
            for s in successors:
                self.parent[s] = chunk
            self.stack.extend(reversed(successors))
            return
        node = self.parent.pop(chunk)
        while node is not None:
            self.pending_below[node] -= 1
            if self.pending_below[node]:
                break
            del self.pending_below[node], self.kv[node]
            node = self.parent.pop(node)


def successors(chunk: Chunk, chunk_size: int | None, order: str) -> list[Chunk]:
    """What lies directly below ``chunk``: the node's next chunk, or the first chunks of its children."""
    if chunk.end < chunk.node.end:
        return [Chunk.at(chunk.node, chunk.end, chunk_size)]
    return [Chunk.first(child, chunk_size) for child in order_children(chunk.node, order)]
