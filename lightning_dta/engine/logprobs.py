"""Forward-only tree walk: the log-prob of every token of every rollout, each shared token computed once.

Used for reference-model and proximal/old log-probs, which RL recomputes every step. No graph is kept; the
path's keys/values live in the same preallocated buffers as in training, and siblings are batched.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dta.engine.dfs import batch_by_budget, chunk_end
from lightning_dta.engine.forward import ModelInfo, SegmentBatch, forward_segment, loss_dtype
from lightning_dta.engine.path_kv import PathKV
from lightning_dta.engine.step_data import StepData
from lightning_dta.engine.token_scores import token_scores
from lightning_dta.tree import PrefixTree, TreeNode


class LogprobWalk:
    def __init__(self, model: nn.Module, info: ModelInfo, tree: PrefixTree, chunk_size: int | None,
                 sibling_batch_tokens: int | None) -> None:
        self.model, self.info, self.tree = model, info, tree
        self.chunk_size, self.sibling_batch_tokens = chunk_size, sibling_batch_tokens
        self.step = StepData(tree)
        self.kv = PathKV(tree.stats.max_depth_tokens, with_grads=False)
        lengths = self.step.lengths
        self.out_offsets = torch.cumsum(lengths - 1, 0) - (lengths - 1)
        self.out = torch.full((int((lengths - 1).sum()),), float("nan"), dtype=loss_dtype(info.dtype),
                              device=info.device)

    def run(self) -> list[torch.Tensor]:
        self._visit_children(self.tree.root)
        if bool(torch.isnan(self.out).any()):  # every position is written exactly once by construction
            raise RuntimeError("tree_logprobs left positions unset; this is a bug in lightning_dta")
        return list(torch.split(self.out, (self.step.lengths - 1).tolist()))

    def _record(self, logits: torch.Tensor, rollouts: list[int], start: int, length: int) -> None:
        seg = self.step.segment(rollouts, start, length, all_positions=True)
        if seg.empty:
            return
        count = seg.columns.numel()
        # columns are sorted and unique: ending at count-1 means 0..count-1, a view instead of a gathered copy
        rows = logits[:count] if int(seg.columns[-1]) == count - 1 else logits[seg.columns.to(logits.device)]
        logp, _ = token_scores(rows, seg.targets, self.out.dtype, with_entropy=False)
        target_pos = start + seg.columns  # position p predicts token p+1, stored at entry p
        index = self.out_offsets[seg.rollouts][:, None] + target_pos[None, :]
        valid = (target_pos[None, :] + 1) < self.step.lengths[seg.rollouts][:, None]
        self.out[index[valid].to(self.out.device)] = logp[valid.to(logp.device)]

    def _visit_children(self, node: TreeNode) -> None:
        items = sorted(((c, c.start, chunk_end(c, c.start, self.chunk_size)) for c in node.children),
                       key=lambda item: item[2] - item[1])
        for batch in batch_by_budget(items, lambda item: item[2] - item[1], self.sibling_batch_tokens,
                                     packed=self.info.packs_siblings):
            self._visit_batch(batch)

    def _visit_batch(self, items: list[tuple[TreeNode, int, int]]) -> None:
        batch = SegmentBatch.of(self.tree, items, self.info.packs_siblings)
        past, _ = self.kv.past(batch.start, requires_grad=False)
        logits, new_kv = forward_segment(self.model, self.info, batch, past, None)
        for row_logits, (node, a, b) in zip(logits, items):
            self._record(row_logits, node.rollouts, a, b - a)
        for row, (node, a, b) in enumerate(items):
            if b < node.end or not node.is_leaf:
                self.kv.write(a, [(batch.row(k, row), batch.row(v, row)) for k, v in new_kv])
                if b < node.end:
                    self._visit_batch([(node, b, chunk_end(node, b, self.chunk_size))])
                else:
                    self._visit_children(node)


def tree_logprobs_walk(model: nn.Module, info: ModelInfo, tree: PrefixTree, chunk_size: int | None,
                       sibling_batch_tokens: int | None) -> list[torch.Tensor]:
    with torch.no_grad():
        return LogprobWalk(model, info, tree, chunk_size, sibling_batch_tokens).run()
