"""Forward-only tree walk: the log-prob of every token of every rollout, each shared token computed once.

Used for reference-model and proximal/old log-probs, which RL recomputes every step. No graph is kept. Under
prefix attention the walk packs cousins (:class:`CousinLogprobWalk`, :mod:`~lightning_dta.engine.cousins`): any
pending chunks, whatever their parents, share one forward of up to ``sibling_batch_tokens`` tokens. Otherwise
(the model's own attention, ``sibling_batch_tokens=None``, or a hybrid: cousins in one row would share one
recurrent scan, :attr:`~lightning_dta.engine.model_info.ModelInfo.packs_cousins`) it batches siblings exactly as
the training walk does (the same :class:`~lightning_dta.engine.walk.TreeWalk`, the path's keys/values and
recurrent states in the same buffers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine.cousins import CousinBatch, PendingChunks, successors
from lightning_dta.engine.device import expected_sync, to_device
from lightning_dta.engine.forward import forward_batch, forward_cousins, forward_plain
from lightning_dta.engine.model_info import ModelInfo, inspect_model, loss_dtype
from lightning_dta.engine.options import EngineOptions
from lightning_dta.engine.recurrent_state import row_states
from lightning_dta.engine.sibling_batch import SiblingBatch
from lightning_dta.engine.step_data import StepData, check_tree_fits_model
from lightning_dta.engine.token_scores import token_scores
from lightning_dta.engine.walk import Chunk, TreeWalk, order_children


class LogprobWalk(TreeWalk):
    """Records the log-prob of every token (``values=False``) or the value head's output at the position before it
    (``values=True``: a critic built by :func:`~lightning_dta.models.value_model`)."""

    with_grads = False

    def __init__(self, model: nn.Module, info: ModelInfo, tree: PrefixTree, engine: EngineOptions,
                 values: bool = False) -> None:
        super().__init__(tree, engine, info.packs_siblings, info.recurrent)
        self.model = model
        self.info = info
        self.values = values
        self.step = StepData(tree)
        lengths = self.step.lengths
        self.out_offsets = torch.cumsum(lengths - 1, 0) - (lengths - 1)
        self.out = torch.full((int((lengths - 1).sum()),), float("nan"), dtype=loss_dtype(info.dtype),
                              device=info.device)

    def logprobs(self) -> list[torch.Tensor]:
        self.run()
        with expected_sync(self.out.device):  # after the walk: its one host read
            unset = bool(torch.isnan(self.out).any())
        if unset:  # every position is written exactly once by construction
            raise RuntimeError("the forward-only walk left positions unset; this is a bug in lightning_dta")
        return list(torch.split(self.out, (self.step.lengths - 1).tolist()))

    def _record(self, logits: torch.Tensor, chunk: Chunk) -> None:
        targets = self.step.targets(chunk.node.rollouts, chunk.start, chunk.length, all_positions=True)
        if targets.empty:
            return
        count = targets.columns.numel()
        # columns are sorted and unique: ending at count-1 means 0..count-1, a view instead of a gathered copy
        device = self.out.device
        rows = logits[:count] if int(targets.columns[-1]) == count - 1 else logits[to_device(targets.columns, device)]
        if self.values:
            logp = rows[:, 0].to(self.out.dtype)[None, :].expand(targets.token_ids.shape)
        else:
            logp, _ = token_scores(rows, targets.token_ids, self.out.dtype, with_entropy=False,
                                   temperature=self.engine.policy_temperature)
        target_pos = chunk.start + targets.columns  # position p predicts token p+1, stored at entry p
        index = self.out_offsets[targets.rollouts][:, None] + target_pos[None, :]
        valid = ((target_pos[None, :] + 1) < self.step.lengths[targets.rollouts][:, None]).flatten()
        # which entries to write is decided on the host: boolean indexing on the device would wait for it
        picked = torch.nonzero(valid).flatten()
        self.out.index_copy_(0, to_device(index.flatten()[picked], device),
                             logp.flatten().index_select(0, to_device(picked, device)))

    def visit_batch(self, chunks: list[Chunk]) -> None:
        batch = SiblingBatch.of(self.tree, chunks, self.info.packs_siblings)
        past, _ = self.kv.past(batch.start, requires_grad=False)
        states, _ = self.states.past(batch.start, requires_grad=False)
        logits, new_kv, new_states = forward_batch(self.model, self.info, batch, past, None, states)
        for chunk_logits, chunk in zip(logits, chunks):
            self._record(chunk_logits, chunk)
        for row, chunk in enumerate(chunks):
            if chunk.has_children:
                self.kv.write(chunk.start, [(batch.row(k, row), batch.row(v, row)) for k, v in new_kv])
                self.states.write(chunk.end, row_states(new_states, row))
                self.descend(chunk)
                self.states.drop(chunk.end)


class CousinLogprobWalk(LogprobWalk):
    """The forward-only walk with cousins packed (prefix attention only; :mod:`~lightning_dta.engine.cousins`):
    pending chunks of any parent go through one forward, up to ``sibling_batch_tokens`` tokens."""

    def run(self) -> None:
        chunk_size, order = self.engine.chunk_size, self.engine.order
        roots = [Chunk.first(child, chunk_size) for child in order_children(self.tree.root, order)]
        pending = PendingChunks(roots)
        while pending:
            self._forward_batch(pending, pending.take(self.engine.sibling_batch_tokens))

    def _forward_batch(self, pending: PendingChunks, chunks: list[Chunk]) -> None:
        """One cousin batch: forward, record, and keep (copies of) the keys/values of the chunks with something
        below them. A method, so that the batch's logits and full keys/values are freed before the next forward;
        copies, so that a kept row does not hold its whole batch's keys/values alive."""
        chunk_size, order = self.engine.chunk_size, self.engine.order
        ancestry = [pending.ancestry(c) for c in chunks]
        batch = CousinBatch([self.tree.tokens(c.node)[c.start - c.node.start:c.end - c.node.start] for c in chunks],
                            chunks)
        levels = batch.levels(ancestry, pending.kv, self.info.device) if any(ancestry) else []
        logits, new_kv = forward_cousins(self.model, self.info, batch, levels)
        for chunk_logits, chunk in zip(logits, chunks):
            self._record(chunk_logits, chunk)

        def kv_of(row: int):
            a, n = batch.offsets[row], batch.lengths[row]
            return [(k[:, :, a:a + n].clone(), v[:, :, a:a + n].clone()) for k, v in new_kv]

        pending.finish(chunks, kv_of, lambda c: successors(c, chunk_size, order))


def _per_rollout(model: nn.Module, info: ModelInfo, tree: PrefixTree, engine: EngineOptions,
                 values: bool) -> list[torch.Tensor]:
    """``mode='vanilla'``: every rollout through the model's own forward, without a cache, as
    :mod:`~lightning_dta.engine.vanilla` trains it. It is what a model the tree walk refuses (layers without
    keys/values, a forward that takes no cache) still runs, so the refusals' fix holds for the forward-only passes
    of a step too."""
    out = []
    for tokens in tree.token_tensors:
        ids = to_device(tokens, info.device)
        logits = forward_plain(model, info, ids[None], None)[0, :-1]
        if values:
            out.append(logits[:, 0].to(loss_dtype(info.dtype)))
        else:
            logp, _ = token_scores(logits, ids[None, 1:], loss_dtype(info.dtype), with_entropy=False,
                                   temperature=engine.policy_temperature)
            out.append(logp[0])
    return out


def _forward_only(model: nn.Module, tree: PrefixTree, engine: EngineOptions, values: bool) -> list[torch.Tensor]:
    """Check the model and the tree, then walk: cousins packed where prefix attention runs (and sibling batching is
    on), siblings only otherwise; every rollout on its own under ``mode='vanilla'``."""
    if engine.mode == "vanilla":
        info = inspect_model(model, uses_cache=False, prefix_attention=False, prefix_attention_backend=None)
        check_tree_fits_model(tree, info.vocab_size, info.max_positions)
        with torch.no_grad():
            return _per_rollout(model, info, tree, engine, values)
    info = inspect_model(model, uses_cache=True, prefix_attention=engine.prefix_attention,
                         prefix_attention_backend=engine.prefix_attention_backend)
    check_tree_fits_model(tree, info.vocab_size, info.max_positions)
    packs_cousins = info.packs_cousins and engine.sibling_batch_tokens is not None  # never for hybrids
    with torch.no_grad():
        return (CousinLogprobWalk if packs_cousins else LogprobWalk)(model, info, tree, engine, values).logprobs()


def tree_logprobs(model: nn.Module, tree: PrefixTree, *, engine: EngineOptions | Mapping[str, Any] | None = None,
                  **overrides: Any) -> list[torch.Tensor]:
    """Forward only: one 1-D tensor per rollout (input order); entry ``t-1`` is ``log p(x_t | x_<t)``.

    ``engine`` (:class:`EngineOptions`, keyword ``overrides`` on top) walks the tree as training does: its
    ``chunk_size``, ``sibling_batch_tokens``, ``order`` and ``prefix_attention`` apply; ``mode='vanilla'`` forwards
    every rollout on its own instead (the model's own forward without a cache: what runs a model the tree walk
    refuses); the training-only options (``activation``, ...) are ignored.
    """
    return _forward_only(model, tree, EngineOptions.resolve(engine, **overrides), values=False)


def tree_values(critic: nn.Module, tree: PrefixTree, *, engine: EngineOptions | Mapping[str, Any] | None = None,
                **overrides: Any) -> list[torch.Tensor]:
    """Forward only, for a critic (:func:`~lightning_dta.models.value_model`): one 1-D tensor per rollout (input
    order); entry ``t-1`` is the value of token ``t``'s state (the head's output at position ``t - 1``), as
    ``tree_logprobs`` indexes log-probs and ``Rollout.old_values`` is read (entry ``t``, index 0 unused)."""
    return _forward_only(critic, tree, EngineOptions.resolve(engine, **overrides), values=True)
