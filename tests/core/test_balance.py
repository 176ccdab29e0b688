"""Cost model and partition across ranks: exact costs, optimal contiguous cuts, balance on skewed steps."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dta import PrefixTree, Rollout
from lightning_dta.core.balance import (
    CostCalibrator,
    CostModel,
    attention_weight_for,
    partition,
    partition_contiguous,
    partition_greedy,
    partition_report,
    tree_features,
)
from lightning_dta.core.tree import attention_pairs


def segment_cost(start: int, end: int, weight: float = CostModel().attention) -> float:
    return CostModel.coerce(weight).segment(start, end)


def tree_cost(tree: PrefixTree, weight: float = CostModel().attention) -> float:
    return CostModel.coerce(weight).of(tree_features(tree))

METHODS = ("contiguous", "greedy")


def group(rng, prompt_len, size, response_range):
    prompt = [rng.randrange(256) for _ in range(prompt_len)]
    return [Rollout(input_ids=prompt + [rng.randrange(256) for _ in range(rng.randint(*response_range))])
            for _ in range(size)]


def skewed_step(seed=0):
    """Three huge GRPO groups (32 answers of 200-600 tokens to a 500-token prompt) and 40 small ones."""
    rng = random.Random(seed)
    rollouts = []
    for _ in range(3):
        rollouts += group(rng, 500, 32, (200, 600))
    for _ in range(40):
        rollouts += group(rng, rng.randint(50, 200), 4, (20, 80))
    return rollouts


def small_groups_step(seed=0, groups=120):
    rng = random.Random(seed)
    return [r for _ in range(groups) for r in group(rng, rng.randint(64, 256), 8, (16, 128))]


def subtree_cost(rollouts, indices, weight):
    return tree_cost(PrefixTree.from_rollouts([rollouts[i] for i in indices]), weight) if indices else 0.0


def honest_bound(rollouts, world_size, weight):
    """No partition beats max(the whole step's cost / ranks, the dearest rollout alone)."""
    alone = max(segment_cost(0, len(r), weight) for r in rollouts)
    return max(tree_cost(PrefixTree.from_rollouts(rollouts), weight) / world_size, alone)


def check_partition(assignment, n, world_size):
    assert len(assignment) == world_size
    assert all(indices == sorted(indices) for indices in assignment)
    assert sorted(i for indices in assignment for i in indices) == list(range(n))  # every rollout exactly once


sequences = st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=9), min_size=1, max_size=14)


def rollouts_of(seqs):
    return [Rollout(input_ids=list(s)) for s in seqs]


def test_tree_cost_by_hand():
    # one rollout of 4 tokens: 4 tokens + 1+2+3+4 = 10 attended keys
    assert tree_cost(PrefixTree.from_rollouts([Rollout(input_ids=[5, 6, 7, 8])]), 1.0) == 14.0
    # [5,6,7] and [5,6,9]: node [5,6] (positions 0-1: 3 keys), two leaves at position 2 (3 keys each)
    tree = PrefixTree.from_rollouts([Rollout(input_ids=[5, 6, 7]), Rollout(input_ids=[5, 6, 9])])
    assert attention_pairs(tree) == 3 + 3 + 3
    assert tree_cost(tree, 0.5) == 4 + 0.5 * 9
    assert tree_cost(tree, 0.0) == tree.stats.tree_tokens
    assert attention_weight_for(4096) == pytest.approx(1 / 24576)


@settings(max_examples=80, deadline=None)
@given(sequences, st.integers(1, 4), st.randoms(use_true_random=False))
def test_report_prices_any_assignment_like_its_tree(seqs, world_size, rng):
    """The report's incremental lcp pricing equals building each rank's tree and pricing its nodes."""
    rollouts = rollouts_of(seqs)
    assignment = [[] for _ in range(world_size)]
    for i in range(len(rollouts)):
        assignment[rng.randrange(world_size)].append(i)
    report = partition_report(rollouts, assignment, 0.3)
    for rank, indices in enumerate(assignment):
        assert report.rank_costs[rank] == pytest.approx(subtree_cost(rollouts, indices, 0.3), rel=1e-12)
        expected_tokens = PrefixTree.from_rollouts([rollouts[i] for i in indices]).stats.tree_tokens if indices else 0
        assert report.rank_tree_tokens[rank] == expected_tokens
        assert report.rank_logical_tokens[rank] == sum(len(rollouts[i]) for i in indices)
    assert report.step_cost == pytest.approx(tree_cost(PrefixTree.from_rollouts(rollouts), 0.3), rel=1e-12)


@settings(max_examples=80, deadline=None)
@given(sequences, st.integers(1, 3))
def test_contiguous_is_the_optimal_contiguous_cut(seqs, world_size):
    """Brute force over every way to cut the lexicographic order into `world_size` pieces (empty allowed)."""
    rollouts = rollouts_of(seqs)
    order = PrefixTree.from_rollouts(rollouts).lexicographic_order()
    n = len(order)
    best = min(
        max(subtree_cost(rollouts, order[a:b], 0.1) for a, b in zip((0, *cuts), (*cuts, n)))
        for cuts in itertools.combinations_with_replacement(range(n + 1), world_size - 1))
    assignment = partition_contiguous(rollouts, world_size, 0.1)
    check_partition(assignment, n, world_size)
    got = max(subtree_cost(rollouts, indices, 0.1) for indices in assignment)
    assert got <= best * (1 + 1e-9), f"contiguous max cost {got} > optimum {best}"
    position = {r: k for k, r in enumerate(order)}  # each rank holds one contiguous run of the order
    runs = [sorted(position[i] for i in indices) for indices in assignment if indices]
    assert [p for run in runs for p in run] == list(range(n))


@settings(max_examples=60, deadline=None)
@given(sequences, st.integers(1, 9), st.sampled_from(METHODS))
def test_every_rollout_exactly_once(seqs, world_size, method):
    rollouts = rollouts_of(seqs)
    assignment = partition(rollouts, world_size, method)
    check_partition(assignment, len(rollouts), world_size)
    report = partition_report(rollouts, assignment)
    assert sum(report.rank_logical_tokens) == sum(len(r) for r in rollouts)


def test_contiguous_balances_a_skewed_step():
    rollouts = skewed_step()
    weight = attention_weight_for(2048)
    for world_size in (2, 4, 8):
        report = partition_report(rollouts, partition_contiguous(rollouts, world_size, weight), weight)
        bound = honest_bound(rollouts, world_size, weight)
        figures = (f"world_size={world_size}: max/mean={report.imbalance:.3f}, "
                   f"max/bound={report.max_cost / bound:.3f}, "
                   f"compression {report.compression_before:.2f} -> {report.compression_after:.2f}")
        assert report.lower_bound == pytest.approx(bound, rel=1e-12)
        assert report.max_cost <= 1.15 * bound, figures  # measured 1.015 / 1.038 / 1.090
        assert report.imbalance <= 1.05, figures  # measured 1.006 / 1.011 / 1.034
        assert report.compression_after >= 0.9 * report.compression_before, figures  # 0.99 / 0.97 / 0.95


def test_greedy_keeps_trees_whole_and_balances_many_small_trees():
    rollouts = small_groups_step()
    for world_size in (2, 4, 8):
        report = partition_report(rollouts, partition_greedy(rollouts, world_size))
        figures = f"world_size={world_size}: max/mean={report.imbalance:.4f}, max/bound={report.max_over_bound:.4f}"
        assert report.max_over_bound <= 1.05, figures  # measured 1.006 / 1.017 / 1.039 (LPT: ~ one small tree)
        assert report.compression_after == report.compression_before  # no tree is cut: all sharing kept


def test_greedy_cannot_split_a_huge_tree_but_contiguous_can():
    rollouts = skewed_step()
    greedy = partition_report(rollouts, partition_greedy(rollouts, 8))
    contiguous = partition_report(rollouts, partition_contiguous(rollouts, 8))
    huge = tree_cost(PrefixTree.from_rollouts(rollouts[:32]))
    assert greedy.max_cost >= huge  # a whole huge tree sits on one rank
    assert contiguous.max_cost < 0.6 * greedy.max_cost, (contiguous.imbalance, greedy.imbalance)


def test_sharing_is_kept_on_grpo_shaped_steps():
    rollouts = small_groups_step(groups=16)
    for world_size in (2, 4):
        report = partition_report(rollouts, partition_contiguous(rollouts, world_size))
        assert report.compression_before > 2.0
        assert report.compression_after >= 0.95 * report.compression_before, (world_size, report.compression_after)


@pytest.mark.parametrize("method", METHODS)
def test_deterministic_and_independent_of_input_order(method):
    rollouts = skewed_step(seed=3)[::3] + small_groups_step(seed=4, groups=6)
    rollouts += [Rollout(input_ids=list(rollouts[0].input_ids)), Rollout(input_ids=rollouts[5].input_ids[:40])]
    first = partition(rollouts, 5, method)
    assert partition(rollouts, 5, method) == first
    shuffled = list(range(len(rollouts)))
    random.Random(0).shuffle(shuffled)
    again = partition([rollouts[i] for i in shuffled], 5, method)

    def content(assignment, rs):
        return [sorted(tuple(rs[i].input_ids) for i in indices) for indices in assignment]

    assert content(again, [rollouts[i] for i in shuffled]) == content(first, rollouts)


@pytest.mark.parametrize("method", METHODS)
def test_one_rank_gets_everything(method):
    rollouts = small_groups_step(groups=3)
    assert partition(rollouts, 1, method) == [list(range(len(rollouts)))]


def test_more_ranks_than_rollouts():
    rollouts = group(random.Random(1), 30, 3, (5, 9)) + group(random.Random(2), 20, 2, (5, 9))
    contiguous = partition(rollouts, 8, "contiguous")
    check_partition(contiguous, 5, 8)
    assert sorted(len(indices) for indices in contiguous) == [0, 0, 0, 1, 1, 1, 1, 1]
    greedy = partition(rollouts, 8, "greedy")
    check_partition(greedy, 5, 8)
    assert sorted(len(indices) for indices in greedy) == [0, 0, 0, 0, 0, 0, 2, 3]  # two whole trees
    report = partition_report(rollouts, greedy)
    assert report.rank_costs.count(0.0) == 6 and report.imbalance == pytest.approx(8 * report.max_cost /
                                                                                   sum(report.rank_costs))


def test_contiguous_uses_every_rank_while_rollouts_remain():
    rollouts = small_groups_step(groups=4)  # 32 rollouts, fewer pieces would already reach the optimum
    assignment = partition_contiguous(rollouts, 16)
    assert all(assignment), [len(a) for a in assignment]


def test_bad_arguments_are_refused():
    rollouts = small_groups_step(groups=1)
    with pytest.raises(ValueError, match="unknown"):
        partition(rollouts, 2, "round-robin")
    with pytest.raises(ValueError, match="world_size"):
        partition(rollouts, 0)
    with pytest.raises(ValueError, match="rollout 3 is assigned to ranks 0 and 1"):
        partition_report(rollouts, [[0, 1, 2, 3], [3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match="rollout 7 is assigned to no rank"):
        partition_report(rollouts, [[0, 1, 2, 3], [4, 5, 6]])


def brute_force(rollouts, world_size, weight):
    """Every contiguous cut of the lexicographic order: the optimal maximum cost, and the fewest shared tokens lost
    by a cut achieving it."""
    tree = PrefixTree.from_rollouts(rollouts)
    order = tree.lexicographic_order()
    results = []
    for cuts in itertools.combinations(range(1, len(order)), world_size - 1):
        pieces = [order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))]
        report = partition_report(rollouts, [sorted(p) for p in pieces], weight)
        results.append((report.max_cost, sum(report.rank_tree_tokens)))
    best = min(cost for cost, _ in results)
    return best, min(tokens for cost, tokens in results if cost <= best * (1 + 1e-9))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), world_size=st.integers(2, 4))
def test_contiguous_keeps_the_most_sharing_among_the_most_balanced_cuts(seed, world_size):
    rng = random.Random(seed)
    rollouts = []
    for _ in range(rng.randint(2, 4)):  # multi-turn episodes: each call extends the previous one
        history = [rng.randrange(3)] + [rng.randrange(256) for _ in range(rng.randint(5, 40))]
        for _ in range(rng.randint(1, 4)):
            history = history + [rng.randrange(256) for _ in range(rng.randint(3, 30))]
            rollouts.append(Rollout(input_ids=list(history)))
    if len(rollouts) < world_size:
        return
    best_cost, best_tokens = brute_force(rollouts, world_size, 0.01)
    report = partition_report(rollouts, partition_contiguous(rollouts, world_size, 0.01), 0.01)
    assert report.max_cost <= best_cost * (1 + 1e-6)
    assert sum(report.rank_tree_tokens) == best_tokens  # no balanced cut loses fewer shared tokens


def test_multi_turn_episodes_stay_on_one_rank():
    """Calculator-style episodes (a shared system prompt, each call the whole history plus a new turn): the cuts
    fall between episodes, so no episode's history is computed on two ranks."""
    rng = random.Random(7)
    system = [rng.randrange(256) for _ in range(60)]
    rollouts, episode_of = [], []
    for episode in range(12):
        history = system + [rng.randrange(256) for _ in range(rng.randint(10, 30))]
        for _ in range(rng.randint(2, 4)):
            history = history + [rng.randrange(256) for _ in range(rng.randint(8, 40))]
            rollouts.append(Rollout(input_ids=list(history)))
            episode_of.append(episode)
    for world_size in (2, 3, 4):
        assignment = partition_contiguous(rollouts, world_size, attention_weight_for(2048))
        ranks_of = {e: {r for r, indices in enumerate(assignment) for i in indices if episode_of[i] == e}
                    for e in set(episode_of)}
        assert all(len(ranks) == 1 for ranks in ranks_of.values()), (world_size, ranks_of)


def test_calibrator_recovers_the_cost_of_tokens_attention_and_branches():
    true = CostModel(token=2e-5, attention=4e-9, branch=3e-3)
    calibrator = CostCalibrator(min_observations=6)
    rng = random.Random(3)
    steps = [skewed_step(seed=s)[:: rng.randint(1, 4)] for s in range(4)]
    for rollouts in steps:
        report = partition_report(rollouts, partition_contiguous(rollouts, 4, 0.01), 0.01)
        calibrator.observe(report.rank_features, [true.of(f) for f in report.rank_features])
    fitted = calibrator.fit()
    for name in ("token", "attention", "branch"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    assert CostCalibrator().fit() is None  # nothing observed yet: keep the current model
    with pytest.raises(ValueError, match="non-negative"):
        CostModel(token=-1.0)


def test_calibration_balances_what_the_default_model_mispredicts():
    """Many tiny GRPO groups beside a few long rollouts: if each forward call has a fixed cost (as on a CPU or a
    small model) the token-only default puts too many branches on one rank. Fitted to (simulated) measured times,
    the model balances the measured time."""
    rng = random.Random(0)
    rollouts = [r for _ in range(60) for r in group(rng, 8, 4, (4, 8))]  # 240 tiny rollouts
    rollouts += [Rollout(input_ids=[255] + [rng.randrange(256) for _ in range(700)]) for _ in range(6)]
    true = CostModel(token=1e-5, attention=2e-9, branch=2e-3)

    def measured_imbalance(model):
        report = partition_report(rollouts, partition_contiguous(rollouts, 2, model), model)
        times = [true.of(f) for f in report.rank_features]
        return max(times) * len(times) / sum(times), report

    before, report = measured_imbalance(CostModel())
    calibrator = CostCalibrator(min_observations=2)
    calibrator.observe(report.rank_features, [true.of(f) for f in report.rank_features])
    calibrator.observe(*[(r.rank_features, [true.of(f) for f in r.rank_features]) for r in
                         [partition_report(rollouts, partition_contiguous(rollouts, 3, 0.0), 0.0)]][0])
    after, _ = measured_imbalance(calibrator.fit())
    assert before > 1.3 and after < 1.05, (before, after)
