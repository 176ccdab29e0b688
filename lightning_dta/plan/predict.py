"""The prediction of one step: every mode's activation memory and FLOPs, and which engine options fit a memory.

Per mode, the peak of bytes saved for backward comes from a dry run of the mode's schedule (:class:`PlannedWalk`
for dfs: the engine's own :class:`~lightning_dta.engine.dfs.DFSSchedule`), each forward priced by
:class:`~lightning_dta.plan.rates.ActivationRates`. Beside it: the dfs path buffers (keys, values and their
gradients, allocated outside autograd; for a hybrid also each recurrent layer's fixed-size state and its gradient
at every chunk end on the path, :func:`~lightning_dta.plan.mixers.recurrent_state_bytes`), what activation
checkpointing recomputes in backward (one layer, which a saved-tensor meter does not see) and the head's working
set (the largest batch's logits, their gradient and one float32 block of the log-softmax), which lives only during
a loss and its backward.

A hybrid's saved bytes are less exact than an attention model's: transformers' CPU Gated DeltaNet pads every
forward to whole 64-token chunks and saves per padded chunk, so forwards shorter than the 64-token probe save more
per token than probed (measured on a tiny Qwen3.5, GRPO shape: dfs +6%, per-rollout -10%, recompute with 32-token
chunks -48%).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from lightning_dta.core.losses import PolicyLoss
from lightning_dta.core.tree import PrefixTree, causal_pairs
from lightning_dta.engine.activation_budget import ActivationBudget, path_kv_bytes
from lightning_dta.engine.cousins import PendingChunks, successors
from lightning_dta.engine.dfs import DFSSchedule
from lightning_dta.engine.layer_kinds import is_recurrent, model_layer_kinds
from lightning_dta.engine.options import EngineOptions
from lightning_dta.engine.step_data import StepData
from lightning_dta.engine.token_scores import BLOCK_ELEMENTS
from lightning_dta.engine.vanilla import micro_batches
from lightning_dta.engine.walk import Chunk, order_children
from lightning_dta.plan.flops import ModelShape, WorkCount
from lightning_dta.plan.mixers import meta_model, recurrent_state_bytes
from lightning_dta.plan.rates import ActivationRates
from lightning_dta.plan.state import TrainingState
from lightning_dta.shapes.modes import ModeSpec, planned_modes

HEADROOM = 0.10  # of the accelerator's memory left to the allocator's fragmentation and the runtime's context
RECOMPUTE_CHUNKS = (4096, 2048, 1024, 512, 256)  # chunk sizes tried for dfs recompute, largest (fewest calls) first


@dataclass
class ModePrediction:
    """One mode's predicted activation memory (bytes) and FLOPs for the step."""

    name: str
    engine: EngineOptions
    saved: float  # peak bytes saved for backward at once (what SavedTensorMeter measures)
    path_buffers: float  # dfs: keys, values and their gradients for the longest path (and a hybrid's states)
    recomputed_layer: float  # activation checkpointing: one layer re-run in backward (not a saved tensor)
    head_working_set: float  # the largest batch's logits, their gradient and one float32 block
    flops: float
    checkpointing: bool = False

    @property
    def activations(self) -> float:
        return self.saved + self.path_buffers + self.recomputed_layer + self.head_working_set


@dataclass
class StepPlan:
    """Predictions for one step on one rank."""

    shape: ModelShape
    state: TrainingState
    modes: dict[str, ModePrediction]
    forward_only: ModePrediction  # tree_logprobs: proximal / reference log-probs
    vanilla_forward_flops: float
    stats: object  # the tree's TreeStats
    notes: list[str] = field(default_factory=list)
    state_bytes_per_node: int = 0  # a hybrid: the recurrent states one chunk end hands to what lies below

    def peak(self, mode: ModePrediction) -> float:
        return self.state.total + mode.activations


class PlannedWalk(DFSSchedule):
    """The training walk's schedule run dry: the peak of saved bytes and the work of every forward."""

    def __init__(self, tree: PrefixTree, engine: EngineOptions, step: StepData, rates: ActivationRates,
                 path_bytes: int) -> None:
        budget = None
        if engine.activation == "auto":
            budget = ActivationBudget.for_tree(tree, engine, rates.budget_rates(), path_bytes)
        super().__init__(tree, engine, rates.packed, step, budget)
        self.rates = rates
        self.live = self.peak = 0.0
        self.work = WorkCount()
        self.largest_positions = 0
        self.held_states = self.most_held_states = 0  # chunk ends on the path whose states are held

    def _hold(self, nbytes: float) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def visit_batch(self, chunks: list[Chunk]) -> None:
        plan = self.plan_batch(chunks)
        if plan is None:
            return
        batch = plan.batch
        tokens = sum(batch.lengths) if batch.packed else len(batch.lengths) * max(batch.lengths)
        pairs = sum(causal_pairs(batch.start, n) for n in batch.lengths)
        positions = sum(t.columns.numel() for t in plan.targets)
        saved = self.rates.saved(tokens, positions, sum(t.token_ids.numel() for t in plan.targets))
        self.work.tokens += tokens
        self.work.pairs += pairs
        self.work.positions += positions
        self.largest_positions = max(self.largest_positions, positions)
        retained = self.rates.retained(tokens, positions, sum(t.token_ids.numel() for t in plan.targets))
        if plan.keep:
            self._hold(saved)
            self.live -= saved - retained
        else:  # pushed without a graph, re-forwarded with grad at the pop
            self.work.recomputed_tokens += tokens
            self.work.recomputed_pairs += pairs
        for chunk in plan.chunks:
            if chunk.has_children:
                self.held_states += 1
                self.most_held_states = max(self.most_held_states, self.held_states)
                self.descend(chunk)
                self.held_states -= 1
        if not plan.keep:
            self._hold(saved)
            self.live -= saved - retained
        self.live -= retained
        self.release(plan)


def state_bytes(config, dtype: torch.dtype) -> int:
    """The recurrent states one chunk end hands on (0 for an attention-only model: nothing to build)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not is_recurrent(model_layer_kinds(text)):
        return 0
    return recurrent_state_bytes(meta_model(config), dtype)


def head_working_set(positions: int, vocab: int, dtype: torch.dtype) -> float:
    """Logits [positions, vocab] and their gradient in the model's dtype, and one float32 block."""
    return 2.0 * positions * vocab * dtype.itemsize + 4.0 * min(positions * vocab, BLOCK_ELEMENTS)


def path_state_bytes(walk: PlannedWalk, state_bytes_per_node: int) -> float:
    """A hybrid's recurrent states on the path at its deepest: one state per chunk end with something below it
    (the walk's own chunks, so ``chunk_size`` and ``auto``'s cuts count), and its summed gradient."""
    return 2.0 * state_bytes_per_node * walk.most_held_states


def _dfs(name: str, tree: PrefixTree, engine: EngineOptions, step: StepData, rates: ActivationRates,
         shape: ModelShape, dtype: torch.dtype, config) -> ModePrediction:
    kv = path_kv_bytes(config, tree.stats.max_depth_tokens, dtype)
    walk = PlannedWalk(tree, engine, step, rates, kv)
    walk.run()
    states = path_state_bytes(walk, state_bytes(config, dtype))
    return ModePrediction(name, engine, saved=walk.peak, path_buffers=2.0 * kv + states, recomputed_layer=0.0,
                          head_working_set=head_working_set(walk.largest_positions, shape.vocab, dtype),
                          flops=walk.work.training_flops(shape))


def _vanilla(name: str, tree: PrefixTree, engine: EngineOptions, step: StepData, rates: ActivationRates,
             shape: ModelShape, dtype: torch.dtype, checkpointing: bool) -> ModePrediction:
    """Per-rollout training, as :mod:`~lightning_dta.engine.vanilla` runs it: the peak is the largest rollout's
    forward. (Padded micro-batches, ``vanilla_batch_tokens``, are not modelled: the attention's saved mask and
    layout copies depend on the kernel sdpa picks.)"""
    if engine.vanilla_batch_tokens is not None:
        raise ValueError("the planner predicts per-rollout vanilla (vanilla_batch_tokens=None) only")
    lengths = [len(t) for t in tree.token_tensors]
    work = WorkCount()
    peak = largest_tokens = largest_positions = 0.0
    for batch in micro_batches(lengths, engine.vanilla_batch_tokens):
        grids = [g for g in (step.targets([r], 0, lengths[r]) for r in batch) if not g.empty]
        rows = [r for r in batch if not step.targets([r], 0, lengths[r]).empty]
        if not grids:
            continue
        width = max(lengths[r] for r in rows)
        union = torch.unique(torch.cat([g.columns for g in grids])).numel()
        # the head runs on the union of the rows' columns; a row scored on fewer keeps its own copy
        positions = len(rows) * union + sum(g.columns.numel() for g in grids if g.columns.numel() != union)
        grid = sum(g.token_ids.numel() for g in grids)
        tokens = len(rows) * width
        saved = (rates.checkpointed if checkpointing else rates.saved)(tokens, positions, grid)
        peak = max(peak, saved)
        largest_tokens = max(largest_tokens, tokens)
        largest_positions = max(largest_positions, positions)
        work.tokens += tokens
        work.pairs += sum(causal_pairs(0, width) for _ in rows)
        work.positions += len(rows) * union
        if checkpointing:
            work.recomputed_tokens += tokens
            work.recomputed_pairs += sum(causal_pairs(0, width) for _ in rows)
    return ModePrediction(name, engine, saved=peak, path_buffers=0.0,
                          recomputed_layer=largest_tokens * rates.token_per_layer if checkpointing else 0.0,
                          head_working_set=head_working_set(int(largest_positions), shape.vocab, dtype),
                          flops=work.training_flops(shape), checkpointing=checkpointing)


def _level_copies(ancestry: list[list[Chunk]]) -> int:
    """Tokens of keys/values a cousin batch concatenates: at each ancestor level with more than one distinct
    ancestor, each of them once (:meth:`~lightning_dta.engine.cousins.CousinBatch.levels`)."""
    total = 0
    for depth in range(max(map(len, ancestry))):
        distinct = dict.fromkeys(chain[depth] for chain in ancestry if len(chain) > depth)
        if len(distinct) > 1:
            total += sum(a.length for a in distinct)
    return total


def _forward_only(tree: PrefixTree, engine: EngineOptions, shape: ModelShape, dtype: torch.dtype, config
                  ) -> tuple[ModePrediction, float]:
    """``tree_logprobs`` as :class:`~lightning_dta.engine.logprobs.CousinLogprobWalk` runs it (the same stack of
    pending chunks): every tree token once, the head at every position, no graph. Its memory: the keys/values of the
    ancestors of pending chunks, the batch's own and its ancestor levels' concatenations, and the batch's logits.
    Also returns the per-rollout forward's FLOPs."""
    per_token = path_kv_bytes(config, 1, dtype)
    per_state = state_bytes(config, dtype)
    roots = [Chunk.first(child, engine.chunk_size) for child in order_children(tree.root, engine.order)]
    pending = PendingChunks(roots)
    work, peak = WorkCount(), 0.0
    while pending:
        batch = pending.take(engine.sibling_batch_tokens)
        tokens = sum(c.length for c in batch)
        work.tokens += tokens
        work.positions += tokens
        work.pairs += sum(causal_pairs(c.start, c.length) for c in batch)
        ancestry = [pending.ancestry(c) for c in batch]
        copies = _level_copies(ancestry)
        held = sum(c.length for c in pending.kv)
        logits = tokens * shape.vocab * dtype.itemsize + 4.0 * min(tokens * shape.vocab, BLOCK_ELEMENTS)
        peak = max(peak, (held + tokens + copies) * per_token + len(pending.kv) * per_state + logits)
        pending.finish(batch, lambda row: None, lambda c: successors(c, engine.chunk_size, engine.order))
    lengths = [len(t) for t in tree.token_tensors]
    vanilla = shape.forward_flops(sum(lengths), sum(causal_pairs(0, n) for n in lengths), sum(lengths))
    prediction = ModePrediction("tree_logprobs", engine, saved=0.0, path_buffers=0.0, recomputed_layer=0.0,
                                head_working_set=peak, flops=shape.forward_flops(work.tokens, work.pairs,
                                                                                 work.positions))
    return prediction, vanilla


def predict_mode(name: str, spec: ModeSpec, tree: PrefixTree, config, rates: ActivationRates,
                 state: TrainingState, step: StepData | None = None) -> ModePrediction:
    """One mode's prediction (dfs or vanilla, with or without activation checkpointing)."""
    shape = ModelShape.from_config(config, state.tensor_parallel)
    dtype = state.activation_dtype
    step = step or StepData(tree, PolicyLoss())
    if spec.engine.mode == "dfs" and not spec.activation_checkpointing:
        return _dfs(name, tree, spec.engine, step, rates, shape, dtype, config)
    if spec.engine.mode == "vanilla":
        return _vanilla(name, tree, spec.engine, step, rates, shape, dtype, spec.activation_checkpointing)
    raise ValueError(f"mode {name!r}: the planner predicts dfs (without transformers checkpointing) and vanilla "
                     f"(with or without it), not mode={spec.engine.mode!r}")


def plan_step(tree: PrefixTree, config, rates: ActivationRates, state: TrainingState,
              modes: dict[str, ModeSpec] | None = None, loss_fn: PolicyLoss | None = None) -> StepPlan:
    """Predict the step of ``tree`` under each of ``modes`` (default: ``planned_modes()``), and the forward-only
    walk with the dfs mode's options."""
    modes = modes or planned_modes()
    step = StepData(tree, loss_fn or PolicyLoss())
    predictions = {name: predict_mode(name, spec, tree, config, rates, state, step) for name, spec in modes.items()}
    walk_engine = next((s.engine for s in modes.values() if s.engine.mode == "dfs"), EngineOptions())
    shape = ModelShape.from_config(config, state.tensor_parallel)
    forward_only, vanilla_forward = _forward_only(tree, walk_engine, shape, state.activation_dtype, config)
    return StepPlan(shape, state, predictions, forward_only, vanilla_forward, tree.stats,
                    state_bytes_per_node=state_bytes(config, state.activation_dtype))


@dataclass
class Fit:
    """A set of engine options that fits the memory, with its prediction."""

    prediction: ModePrediction
    peak: float


def fitting_options(tree: PrefixTree, config, rates: ActivationRates, state: TrainingState, memory: float,
                    engine: EngineOptions | None = None, loss_fn: PolicyLoss | None = None) -> list[Fit]:
    """The dfs options whose predicted peak fits ``memory`` (less ``HEADROOM``), cheapest FLOPs first: keep; auto
    with the budget the memory leaves; recompute at each of ``RECOMPUTE_CHUNKS``."""
    engine = engine or EngineOptions()
    loss_fn = loss_fn or PolicyLoss()
    usable = memory * (1 - HEADROOM)
    shape = ModelShape.from_config(config, state.tensor_parallel)
    dtype = state.activation_dtype
    step = StepData(tree, loss_fn)
    base = dataclasses.replace(engine, mode="dfs", activation="keep", activation_memory_budget=None)
    candidates = {"dfs keep": base}
    keep = _dfs("dfs keep", tree, base, step, rates, shape, dtype, config)
    kv = path_kv_bytes(config, tree.stats.max_depth_tokens, dtype)
    # auto's budget counts the path's keys/values and the saved tensors; the gradients of the path buffers and the
    # head's working set come on top
    budget = int(usable - state.total - kv - keep.head_working_set)
    if budget > kv:
        candidates["dfs auto"] = dataclasses.replace(base, activation="auto", activation_memory_budget=budget)
    for chunk in RECOMPUTE_CHUNKS:
        candidates[f"dfs recompute chunk {chunk}"] = dataclasses.replace(base, activation="recompute",
                                                                         chunk_size=chunk)
    fits = []
    for name, options in candidates.items():
        try:
            prediction = keep if name == "dfs keep" else _dfs(name, tree, options, step, rates, shape, dtype,
                                                              config)
        except ValueError:  # a budget below what the path needs
            continue
        peak = state.total + prediction.activations
        if peak <= usable:
            fits.append(Fit(prediction, peak))
    return sorted(fits, key=lambda f: f.prediction.flops)
