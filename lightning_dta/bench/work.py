"""What a bench run computes, in FLOPs, before it runs: the planner's FLOP model applied to the bench's passes.

A run that must end within a fixed window (``benchmarks/gpu.sh``) sizes its time budget from this estimate. Per
training pass of a mode on a tree (:func:`step_flops`, from :class:`~lightning_dta.plan.flops.ModelShape`):
forward and backward (three forwards) of the tokens it computes, the (query, key) pairs it attends and the positions
it projects to the vocabulary, plus one body forward for what activation checkpointing or recompute re-runs (an
upper bound for ``auto``). The per-rollout baselines compute every rollout (padded micro-batches: rows x longest
row); the tree modes compute every tree token once; the tree mask attends every pair of its packed sequence. A
bench run (:func:`bench_flops`) makes, per workload and mode, one checked pass, ``warmup - 1`` untimed and
``repeats`` timed ones, the forward-only log-prob rows, the memory sweep and the long rollout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dta.bench.runner import long_rollout_modes, memory_sweep_modes
from lightning_dta.core.tree import PrefixTree, attention_pairs, causal_pairs
from lightning_dta.engine.step_data import StepData
from lightning_dta.engine.vanilla import micro_batches
from lightning_dta.plan.flops import ModelShape
from lightning_dta.shapes.modes import ModeSpec
from lightning_dta.shapes.workloads import GRPOWorkload, LongSequenceWorkload


def trained_positions(tree: PrefixTree) -> int:
    """Positions whose next token is trained, per rollout (what per-rollout training projects to the vocabulary)."""
    return int(sum(int(mask[1:].sum()) for mask in tree.loss_masks))


def tree_positions(tree: PrefixTree) -> int:
    """Positions of the tree whose next token some rollout through them trains (what a tree walk projects: a
    shared position once, e.g. a GRPO prompt's last token, which predicts every response's first)."""
    step = StepData(tree)
    return sum(step.targets(node.rollouts, node.start, node.length).columns.numel() for node in tree.iter_nodes()
               if node.length)


def step_flops(shape: ModelShape, tree: PrefixTree, spec: ModeSpec) -> float:
    """One training pass (forward and backward) of ``spec`` on ``tree`` (module docstring)."""
    engine = spec.engine
    if engine.mode == "vanilla":
        lengths = [len(t) for t in tree.token_tensors]
        tokens = pairs = 0
        for batch in micro_batches(lengths, engine.vanilla_batch_tokens):
            width = max(lengths[r] for r in batch)
            tokens += len(batch) * width
            pairs += len(batch) * causal_pairs(0, width)
        rerun = shape.forward_flops(tokens, pairs, 0) if spec.activation_checkpointing else 0.0
        return 3 * shape.forward_flops(tokens, pairs, trained_positions(tree)) + rerun
    tokens, positions = tree.stats.tree_tokens, tree_positions(tree)
    pairs = tokens * tokens if engine.mode == "mask" else attention_pairs(tree)  # a masked kernel scores every pair
    rerun = shape.forward_flops(tokens, pairs, 0) if engine.activation != "keep" or spec.activation_checkpointing \
        else 0.0
    return 3 * shape.forward_flops(tokens, pairs, positions) + rerun


def logprob_flops(shape: ModelShape, tree: PrefixTree, repeats: int) -> float:
    """The forward-only rows: the per-rollout reference, then each of the two ways once checked and ``repeats``
    times timed."""
    lengths = [len(t) for t in tree.token_tensors]
    per_rollout = shape.forward_flops(sum(lengths), sum(causal_pairs(0, n) for n in lengths), sum(lengths))
    walked = shape.forward_flops(tree.stats.tree_tokens, attention_pairs(tree), tree.stats.tree_tokens)
    return (2 + repeats) * per_rollout + (1 + repeats) * walked


@dataclass(frozen=True)
class BenchWork:
    """FLOPs of one bench run, by part (``workloads``: the training and log-prob rows of each workload)."""

    workloads: dict[str, float]
    memory_sweep: float
    long_rollout: float

    @property
    def total(self) -> float:
        return sum(self.workloads.values()) + self.memory_sweep + self.long_rollout


def bench_flops(shape: ModelShape, workloads: dict[str, tuple[PrefixTree, dict[str, ModeSpec]]], *, repeats: int,
                warmup: int, logprobs: bool, memory_leaves: Sequence[int], long_len: int, recompute_chunk: int,
                vocab: int, seed: int, mask_in_sweep: bool) -> BenchWork:
    """The FLOPs of ``lightning-dta bench`` over ``workloads`` (each a tree and the modes that run on it), as
    :func:`~lightning_dta.bench.runner.run_bench` schedules them."""
    passes = 1 + max(warmup - 1, 0) + repeats
    per_workload = {}
    for name, (tree, modes) in workloads.items():
        work = passes * sum(step_flops(shape, tree, spec) for spec in modes.values())
        per_workload[name] = work + (logprob_flops(shape, tree, repeats) if logprobs else 0.0)
    sweep = 0.0
    for leaves in memory_leaves:
        tree = PrefixTree.from_rollouts(GRPOWorkload(1, leaves, (400, 400), (128, 128)).generate(vocab, seed))
        sweep += sum(step_flops(shape, tree, spec) for spec in memory_sweep_modes(None, mask_in_sweep).values())
    long = 0.0
    if long_len:
        tree = PrefixTree.from_rollouts(LongSequenceWorkload(1, long_len).generate(vocab, seed))
        long = sum(step_flops(shape, tree, spec) for spec in long_rollout_modes(recompute_chunk).values())
    return BenchWork(per_workload, sweep, long)
