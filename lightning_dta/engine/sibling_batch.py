"""The layout of a sibling batch: chunks that start at the same position, in one forward over their prefix.

Packed (prefix attention): the chunks lie one after another in a single row, no padding; each chunk is a
*span* ``(offset, length)`` of the row. Padded (the model's own attention): one row per chunk, right-padded to
the longest; padding never reaches real tokens under causal attention.
"""

from __future__ import annotations

import itertools

import torch

from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine.device import to_device
from lightning_dta.engine.prefix_attention import Spans
from lightning_dta.engine.walk import Chunk


class SiblingBatch:
    """Token ids, positions and per-chunk views of one sibling batch (see the module docstring)."""

    def __init__(self, tokens: list[torch.Tensor], start: int, packed: bool) -> None:
        self.tokens, self.start, self.packed = tokens, start, packed
        self.lengths = [len(t) for t in tokens]
        self.offsets = [0, *itertools.accumulate(self.lengths[:-1])]

    @classmethod
    def of(cls, tree: PrefixTree, chunks: list[Chunk], packed: bool) -> SiblingBatch:
        """The batch of sibling ``chunks``, which all start at the same position."""
        tokens = [tree.tokens(c.node)[c.start - c.node.start:c.end - c.node.start] for c in chunks]
        return cls(tokens, chunks[0].start, packed)

    @property
    def spans(self) -> Spans:
        return tuple(zip(self.offsets, self.lengths))

    def input_ids(self) -> torch.Tensor:
        if self.packed:
            return torch.cat(self.tokens)[None]
        ids = torch.zeros(len(self.tokens), max(self.lengths), dtype=torch.long)
        for row, t in enumerate(self.tokens):
            ids[row, :len(t)] = t
        return ids

    def positions(self) -> torch.Tensor:
        if self.packed:
            return torch.cat([torch.arange(self.start, self.start + n) for n in self.lengths])[None]
        width = max(self.lengths)
        return torch.arange(self.start, self.start + width).expand(len(self.tokens), width)

    def row(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Chunk ``i``'s part of a ``[rows, heads, length, dim]`` tensor (keys, values or their gradients)."""
        if self.packed:
            return t[:, :, self.offsets[i]:self.offsets[i] + self.lengths[i]]
        return t[i:i + 1, :, :self.lengths[i]]

    def keep(self, columns: list[torch.Tensor]) -> torch.Tensor:
        """The positions to project to logits: each chunk's ``columns`` (packed), or their union (padded)."""
        if self.packed:
            return torch.cat([c + a for c, a in zip(columns, self.offsets)])
        return torch.unique(torch.cat(columns))

    def split_logits(self, logits: torch.Tensor, kept: torch.Tensor, columns: list[torch.Tensor]
                     ) -> list[torch.Tensor]:
        """Each chunk's logits ``[C_i, V]`` at its own ``columns`` from the logits of ``kept`` = :meth:`keep`."""
        if self.packed:
            return list(logits[0].split([len(c) for c in columns]))
        return row_logits(logits, kept, columns)

    def split_all(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Each chunk's logits at all its positions ``[L_i, V]``."""
        if self.packed:
            return list(logits[0].split(self.lengths))
        return [r[:n] for r, n in zip(logits, self.lengths)]


def row_logits(logits: torch.Tensor, columns: torch.Tensor, row_columns: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each row's logits ``[C_i, V]`` at its own columns (a subset of the batch's sorted ``columns``).

    Rows are separated with ``unbind`` so that backward assembles one gradient for the batch instead of a
    full-size zero buffer per row (which plain indexing would allocate, quadratic in the batch size).
    """
    out = []
    for row, cols in zip(logits.unbind(0), row_columns):
        if cols.numel() == columns.numel():
            out.append(row)
        else:
            out.append(row.index_select(0, to_device(torch.searchsorted(columns, cols), row.device)))
    return out
