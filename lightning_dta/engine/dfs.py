"""The depth-first training walk: push, visit, pop over the prefix tree.

*push* forwards only a chunk's own tokens with the path's keys/values as its prefix (and, in recurrent layers, the
state at its start); *visit* of a leaf computes its loss and backpropagates at once; *pop* runs the chunk's
backward once, with its own loss plus the gradients that all its descendants sent to its keys/values and to its
recurrent layers' end state. Long nodes are split into chains of at most
``chunk_size`` tokens, which is exactly "pop back to front in chunks". Under ``activation="recompute"`` the push
runs without a graph and the pop re-forwards the chunk with grad, so memory holds the path's keys/values and
their gradients plus one chunk's activations.

Siblings are pushed together (:mod:`~lightning_dta.engine.walk`): up to ``sibling_batch_tokens`` tokens of a
node's children go through one forward over the shared prefix, then each child's subtree is walked in turn
with that child's keys/values on the path, and the batch is popped with one backward. Fewer, larger calls keep
the hardware busy (each call reads every weight, forward and backward); memory grows by at most one batch per
tree level.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_dta.contracts import Objective
from lightning_dta.core.tree import PrefixTree, TreeNode
from lightning_dta.engine.activation_budget import ActivationBudget, measure_rates, path_kv_bytes
from lightning_dta.engine.forward import forward_batch, loss_inputs
from lightning_dta.engine.model_info import ModelInfo, tensor_parallel_mesh
from lightning_dta.engine.options import EngineOptions
from lightning_dta.engine.recurrent_state import flatten, row_states
from lightning_dta.engine.sibling_batch import SiblingBatch
from lightning_dta.engine.step_data import ChunkTargets, StepData
from lightning_dta.engine.walk import Chunk, TreeWalk


@dataclass
class BatchPlan:
    """What the schedule decided for one sibling batch: its chunks (leaves with nothing to train dropped), their
    targets, which have something below them, the layout, and whether its graph is kept until its pop
    (``granted``: the bytes the budget granted, 0 without a budget; ``None``: recompute at the pop)."""

    chunks: list[Chunk]
    targets: list[ChunkTargets]
    inner: list[bool]
    batch: SiblingBatch
    granted: int | None

    @property
    def keep(self) -> bool:
        return self.granted is not None


class DFSSchedule(TreeWalk):
    """The training walk's decisions, without a model: how chunks are cut and batched and which batches keep their
    graph. :class:`DFSWalk` runs them; ``lightning-dta plan`` (:mod:`lightning_dta.plan`) walks them dry to predict
    memory, so the prediction follows the very schedule that runs."""

    def __init__(self, tree: PrefixTree, engine: EngineOptions, packed: bool, step: StepData,
                 budget: ActivationBudget | None, recurrent: bool = False) -> None:
        super().__init__(tree, engine, packed, recurrent)
        self.step = step
        self.budget = budget
        self.room_below = self._room_below() if budget is not None else {}

    def _room_below(self) -> dict[TreeNode, int]:
        """Per node, the predicted bytes of the largest batch that can run while a chunk of it is kept: its later
        chunks, its children's sibling batches (leaves and inner chunks apart, each at most the batch cap) and,
        recursively, theirs. A kept batch needs room for that much only, not for the tree's largest batch.
        Padded batches (the model's own attention) keep the tree-wide reserve: each of their rows holds a copy of
        the prefix's keys/values, which the prediction does not count and the reserve's slack covers."""
        budget, cap = self.budget, self.budget.reserve_tokens
        if not self.packed:
            return {node: budget.reserve for node in self.tree.nodes[1:]}
        room: dict[TreeNode, int] = {}
        for node in reversed(self.tree.nodes[1:]):  # children before parents (pre-order reversed)
            sizes = [min(node.length - cap, cap)] if node.length > cap else []
            for inner in (False, True):
                tokens = sum(min(c.length, cap) for c in node.children if (not c.is_leaf) == inner)
                if tokens:
                    sizes.append(min(tokens, cap))
            largest = max(sizes, default=0)
            below = max((room[c] for c in node.children), default=0)
            room[node] = max(budget.predict(largest, largest, largest), below)
        return room

    def groups(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        """Under recompute (and auto), leaves need grad at once and inner chunks perhaps only at their pop: never
        one batch."""
        if self.engine.activation != "keep":
            return [[c for c in chunks if not c.has_children], [c for c in chunks if c.has_children]]
        return [chunks]

    def chunk_tokens(self) -> int | None:
        """Under auto, a chunk is also cut so that its forward fits the room the budget keeps free."""
        if self.budget is None:
            return self.engine.chunk_size
        return self.budget.reserve_tokens

    def batch_tokens(self, group: list[Chunk]) -> int | None:
        """Under recompute and auto with chunk_size, inner chunks (re-forwarded with grad at their pop) are batched
        within one chunk's tokens: a batch of many would hold many chunks' activations at the pop. Leaves keep the
        sibling batches (forward and backward at once). Under auto every batch fits the room the budget keeps."""
        limit = self.engine.sibling_batch_tokens
        cap = None
        if self.budget is not None:
            cap = self.budget.reserve_tokens
        elif self.engine.activation == "recompute" and group and group[0].has_children:
            cap = self.engine.chunk_size
        if cap is not None:
            limit = cap if limit is None else min(limit, cap)
        return limit

    def plan_batch(self, chunks: list[Chunk]) -> BatchPlan | None:
        """The plan of a sibling batch (``None``: leaves with no trained token, which send no gradient)."""
        targets = [self.step.targets(c.node.rollouts, c.start, c.length) for c in chunks]
        if not any(c.has_children for c in chunks):
            kept = [(c, t) for c, t in zip(chunks, targets) if not t.empty]
            if not kept:
                return None
            chunks, targets = [k[0] for k in kept], [k[1] for k in kept]
        inner = [c.has_children for c in chunks]
        batch = SiblingBatch.of(self.tree, chunks, self.packed)
        return BatchPlan(chunks, targets, inner, batch, self._keeps(chunks, batch, targets, inner))

    def _keeps(self, batch_chunks: list[Chunk], batch: SiblingBatch, targets: list[ChunkTargets], inner: list[bool]
               ) -> int | None:
        if self.engine.activation == "keep" or not any(inner):
            return 0
        if self.budget is None:
            return None
        tokens = sum(batch.lengths) if batch.packed else len(batch.lengths) * max(batch.lengths)
        predicted = self.budget.predict(tokens, sum(t.columns.numel() for t in targets),
                                        sum(t.token_ids.numel() for t in targets))
        room = max(self.room_below[c.node] for c, is_inner in zip(batch_chunks, inner) if is_inner)
        return predicted if self.budget.try_keep(predicted, room) else None

    def release(self, plan: BatchPlan) -> None:
        """The batch was popped: what it was granted is free again."""
        if plan.granted:
            self.budget.release(plan.granted)


def activation_budget(model: nn.Module, info: ModelInfo, tree: PrefixTree, engine: EngineOptions,
                      dtype: torch.dtype, loss_fn: Objective) -> ActivationBudget | None:
    """The budget of ``activation="auto"`` (``None`` otherwise), with the rates probed on ``model``."""
    if engine.activation != "auto":
        return None
    mesh = tensor_parallel_mesh(model)
    return ActivationBudget.for_tree(tree, engine, measure_rates(model, info, dtype, loss_fn),
                                     path_kv_bytes(model.config, tree.stats.max_depth_tokens, info.dtype,
                                                   1 if mesh is None else mesh.size()))


class DFSWalk(DFSSchedule):
    """One training step over a tree: adds the gradient of its loss to ``.grad``; :meth:`run` returns the loss."""

    def __init__(self, model: nn.Module, info: ModelInfo, tree: PrefixTree, step: StepData, loss_fn: Objective,
                 engine: EngineOptions, sums: dict) -> None:
        super().__init__(tree, engine, info.packs_siblings, step,
                         activation_budget(model, info, tree, engine, step.dtype, loss_fn), info.recurrent)
        self.model = model
        self.info = info
        self.loss_fn = loss_fn
        self.sums = sums
        self.total_loss = torch.zeros((), dtype=step.dtype, device=info.device)

    def run(self) -> torch.Tensor:
        super().run()
        return self.total_loss

    def _loss(self, logits: torch.Tensor, targets: ChunkTargets) -> torch.Tensor:
        scores, entropy = loss_inputs(self.loss_fn, logits, targets.token_ids, self.step.dtype,
                                     self.engine.policy_temperature)
        loss = self.loss_fn(scores, entropy, targets.data, self.sums)
        self.total_loss += loss.detach()
        return loss

    def _forward(self, batch: SiblingBatch, targets: list[ChunkTargets], with_grad: bool):
        """One forward of a sibling batch over its shared prefix; the loss only when ``with_grad``."""
        columns = [t.columns if with_grad else t.columns[:0] for t in targets]
        with torch.set_grad_enabled(with_grad):
            past, leaves_kv = self.kv.past(batch.start, requires_grad=with_grad)
            states, leaves_states = self.states.past(batch.start, requires_grad=with_grad)
            per_chunk, new_kv, new_states = forward_batch(self.model, self.info, batch, past, columns, states)
            loss = None
            if with_grad:
                losses = [self._loss(logits, t) for logits, t in zip(per_chunk, targets) if not t.empty]
                loss = sum(losses) if losses else None
        return loss, new_kv, new_states, (leaves_kv, leaves_states)

    def visit_batch(self, chunks: list[Chunk]) -> None:
        """Push sibling chunks together, walk each one's subtree, then pop them with one backward."""
        plan = self.plan_batch(chunks)
        if plan is None:
            return
        chunks, targets, batch = plan.chunks, plan.targets, plan.batch
        loss, new_kv, new_states, leaves = self._forward(batch, targets, with_grad=plan.keep)
        kv_grads = state_grads = None
        if any(plan.inner):
            kv_grads = [torch.zeros_like(t) for pair in new_kv for t in pair]
            state_grads = [torch.zeros_like(t) for t in flatten(new_states)]
            for row, chunk in enumerate(chunks):
                if not chunk.has_children:
                    continue
                self.kv.write(chunk.start, [(batch.row(k, row), batch.row(v, row)) for k, v in new_kv])
                self.states.write(chunk.end, row_states(new_states, row))
                self.descend(chunk)
                for grad, path_grad in zip(kv_grads, self.kv.grads(chunk.start, chunk.end)):
                    batch.row(grad, row).copy_(path_grad)
                for grad, path_grad in zip(state_grads, self.states.grads(chunk.end)):
                    grad[row:row + 1].copy_(path_grad)
                self.states.drop(chunk.end)
            if not plan.keep:  # pop: re-forward the batch with grad, behind the subtrees
                loss, new_kv, new_states, leaves = self._forward(batch, targets, with_grad=True)
        outputs, grads = [], []
        if kv_grads is not None:
            outputs += [t for pair in new_kv for t in pair] + flatten(new_states)
            grads += kv_grads + state_grads
        if loss is not None:
            outputs.append(loss)
            grads.append(None)
        # Keys/values of frozen early layers (LoRA, frozen embeddings) carry no graph: nothing to send back.
        pairs = [(t, g) for t, g in zip(outputs, grads) if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self.kv.collect(batch.start, leaves[0])
        self.states.collect(batch.start, leaves[1])
        self.release(plan)
