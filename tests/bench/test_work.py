"""The bench's FLOP estimate (what ``benchmarks/gpu.sh`` sizes its budgets from) against the planner's walks."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_dta.bench.cli import estimate
from lightning_dta.bench.work import step_flops, trained_positions, tree_positions
from lightning_dta.core.tree import PrefixTree, causal_pairs
from lightning_dta.plan.flops import ModelShape
from lightning_dta.plan.predict import predict_mode
from lightning_dta.plan.rates import ActivationRates
from lightning_dta.plan.state import TrainingState
from lightning_dta.shapes.models import model_config
from lightning_dta.shapes.modes import compared_modes
from lightning_dta.shapes.workloads import AgentWorkload, GRPOWorkload

CONFIG = model_config(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, arch="qwen3")
SHAPE = ModelShape.from_config(CONFIG)
NO_RATES = ActivationRates(*[0.0] * 8, layers=2, vocab=256, packed=True)  # FLOPs do not depend on the rates


@pytest.mark.parametrize("workload", [GRPOWorkload(2, 4, (40, 60), (8, 16)), AgentWorkload(1, 3, 96)],
                         ids=["grpo", "agent"])
def test_training_passes_match_the_planner(workload):
    """vanilla, vanilla-ckpt and dfs (keep) are what the planner's dry walks count; recompute is an upper bound
    (it re-runs every chunk's body, the planner only the inner chunks')."""
    tree = PrefixTree.from_rollouts(workload.generate(256, 0))
    state = TrainingState(1, precision="32-true")
    modes = compared_modes(recompute_chunk=16)
    for name in ("vanilla", "vanilla-ckpt", "dfs"):
        planned = predict_mode(name, modes[name], tree, CONFIG, NO_RATES, state).flops
        assert step_flops(SHAPE, tree, modes[name]) == pytest.approx(planned, rel=1e-12), name
    planned = predict_mode("dfs-recompute", modes["dfs-recompute"], tree, CONFIG, NO_RATES, state).flops
    assert planned <= step_flops(SHAPE, tree, modes["dfs-recompute"]) <= 4 / 3 * step_flops(SHAPE, tree, modes["dfs"])


def test_padded_micro_batches_and_the_tree_mask_count_what_their_kernels_compute():
    tree = PrefixTree.from_rollouts(GRPOWorkload(1, 3, (20, 20), (4, 10)).generate(256, 1))
    lengths = sorted(len(t) for t in tree.token_tensors)
    modes = compared_modes()
    batched = dataclasses.replace(modes["vanilla"], engine=dataclasses.replace(modes["vanilla"].engine,
                                                                               vanilla_batch_tokens=10_000))
    one_batch = 3 * SHAPE.forward_flops(3 * lengths[-1], 3 * causal_pairs(0, lengths[-1]), trained_positions(tree))
    assert step_flops(SHAPE, tree, batched) == one_batch  # all three rows padded to the longest
    tokens = tree.stats.tree_tokens
    assert step_flops(SHAPE, tree, modes["mask"]) == 3 * SHAPE.forward_flops(tokens, tokens**2, tree_positions(tree))
    assert tree_positions(tree) == trained_positions(tree) - 2  # the prompt's last position, once for 3 responses


def test_a_bench_run_is_its_passes():
    """One checked pass and ``repeats`` timed ones per mode, the forward-only rows, the sweeps; modes that are
    skipped on a workload (the one-level peer off GRPO, or without its kernels) count nothing."""
    argv = ["--arch", "qwen3", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", "256",
            "--device", "cpu", "--workloads", "grpo", "--grpo-prompts", "2", "--grpo-group", "4", "--grpo-prompt-len",
            "40,60", "--grpo-response-len", "8,16", "--repeats", "2", "--modes", "vanilla,dfs,prefix-grouper",
            "--memory-leaves", "", "--long-len", "0", "--no-logprobs"]
    work, config = estimate(argv)
    tree = PrefixTree.from_rollouts(GRPOWorkload(2, 4, (40, 60), (8, 16)).generate(256, 0))
    modes = compared_modes()
    want = 3 * (step_flops(SHAPE, tree, modes["vanilla"]) + step_flops(SHAPE, tree, modes["dfs"]))
    assert work.workloads == {"grpo": pytest.approx(want, rel=1e-12)} and work.total == pytest.approx(want)
    with_more, _ = estimate([*argv[:-5], "--memory-leaves", "2,4", "--long-len", "64"])
    assert with_more.workloads["grpo"] > work.workloads["grpo"]  # + the log-prob rows
    assert with_more.memory_sweep > 0 and with_more.long_rollout > 0


def test_a_run_of_several_models_is_the_sum_of_their_runs():
    argv = ["--layers", "4", "--hidden", "32", "--heads", "2", "--vocab", "256", "--device", "cpu", "--workloads",
            "grpo", "--grpo-prompts", "1", "--grpo-group", "3", "--grpo-prompt-len", "24,30", "--grpo-response-len",
            "4,9", "--repeats", "2", "--modes", "vanilla,mask,dfs", "--memory-leaves", "2", "--long-len", "64"]
    hybrid, _ = estimate(["--arch", "qwen3_5", *argv])
    plain, _ = estimate(["--arch", "llama", *argv])
    both, config = estimate(["--arch", "qwen3_5", "--also-arch", "llama", *argv])
    assert config.model_type == "qwen3_5_text"
    assert both.total == pytest.approx(hybrid.total + plain.total, rel=1e-12)
    assert both.workloads["grpo"] == pytest.approx(hybrid.workloads["grpo"] + plain.workloads["grpo"], rel=1e-12)
