"""Forward-only tree walk: the log-prob of every token of every rollout, each shared token computed once.

Used for reference-model and proximal/old log-probs, which RL recomputes every step. No graph is kept; the
path's keys/values live in the same preallocated buffers as in training, and sibling leaves are batched.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dta.engine.dfs import batch_leaves, chunk_bounds
from lightning_dta.engine.forward import ModelInfo, forward_segment, loss_dtype
from lightning_dta.engine.path_kv import PathKV
from lightning_dta.engine.step_data import StepData
from lightning_dta.tree import PrefixTree, TreeNode


class LogprobWalk:
    def __init__(self, model: nn.Module, info: ModelInfo, tree: PrefixTree, chunk_size: int | None,
                 leaf_batch_tokens: int | None) -> None:
        self.model, self.info, self.tree = model, info, tree
        self.chunk_size, self.leaf_batch_tokens = chunk_size, leaf_batch_tokens
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
        log_probs = torch.log_softmax(logits[seg.columns.to(logits.device)].to(self.out.dtype), dim=-1)
        logp = log_probs[torch.arange(log_probs.shape[0], device=log_probs.device)[None, :], seg.targets]
        target_pos = start + seg.columns  # position p predicts token p+1, stored at entry p
        index = self.out_offsets[seg.rollouts][:, None] + target_pos[None, :]
        valid = (target_pos[None, :] + 1) < self.step.lengths[seg.rollouts][:, None]
        self.out[index[valid].to(self.out.device)] = logp[valid.to(logp.device)]

    def _visit_children(self, node: TreeNode) -> None:
        leaves = [c for c in node.children if c.is_leaf and len(chunk_bounds(c, self.chunk_size)) == 1]
        for batch in batch_leaves(leaves, self.leaf_batch_tokens):
            start = batch[0].start
            width = max(leaf.length for leaf in batch)
            input_ids = torch.zeros(len(batch), width, dtype=torch.long)
            for i, leaf in enumerate(batch):
                input_ids[i, :leaf.length] = self.tree.tokens(leaf)
            past, _ = self.kv.past(start, requires_grad=False, batch=len(batch))
            logits, _ = forward_segment(self.model, self.info, input_ids.to(self.info.device), start, past, None)
            for i, leaf in enumerate(batch):
                self._record(logits[i, :leaf.length], leaf.rollouts, start, leaf.length)
        batched = {id(c) for c in leaves}
        for child in node.children:
            if id(child) in batched:
                continue
            for a, b in chunk_bounds(child, self.chunk_size):
                tokens = self.tree.tokens(child)[a - child.start:b - child.start][None].to(self.info.device)
                past, _ = self.kv.past(a, requires_grad=False)
                logits, new_kv = forward_segment(self.model, self.info, tokens, a, past, None)
                self._record(logits[0], child.rollouts, a, b - a)
                self.kv.write(a, new_kv)
            self._visit_children(child)


def tree_logprobs_walk(model: nn.Module, info: ModelInfo, tree: PrefixTree, chunk_size: int | None,
                       leaf_batch_tokens: int | None) -> list[torch.Tensor]:
    with torch.no_grad():
        return LogprobWalk(model, info, tree, chunk_size, leaf_batch_tokens).run()
