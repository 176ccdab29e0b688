"""The prefix tree: structure, statistics and the cases that break naive tries."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_dta as dta


def tree_of(*sequences: list[int]) -> dta.PrefixTree:
    return dta.PrefixTree.from_rollouts([dta.Rollout(input_ids=list(s)) for s in sequences])


def path_tokens(tree: dta.PrefixTree, r: int) -> list[int]:
    return [t for node in tree.path(tree.end_node[r]) for t in tree.tokens(node).tolist()]


def check_invariants(tree: dta.PrefixTree) -> None:
    seqs = [r.input_ids for r in tree.rollouts]
    for r, ids in enumerate(seqs):
        assert path_tokens(tree, r) == ids, f"rollout {r} is not the concatenation of its path"
        assert tree.end_node[r].end == len(ids)
    for node in tree.iter_nodes():
        assert node.length > 0
        assert node.start == (node.parent.end if node.parent is not tree.root else 0)
        if node.is_leaf:
            assert node.ends_here, "a leaf must end at least one rollout"
        else:
            assert len({int(tree.tokens(c)[0]) for c in node.children}) == len(node.children), "siblings must diverge"
            if not node.ends_here:
                assert len(node.children) >= 2, "an unbranched node with no rollout ending must be merged"
        assert node.rollouts == [r for r in range(len(seqs)) if _below(tree.end_node[r], node)]
    # each distinct prefix is one tree token
    prefixes = {tuple(ids[: i + 1]) for ids in seqs for i in range(len(ids))}
    assert tree.stats.tree_tokens == len(prefixes)
    assert tree.stats.logical_tokens == sum(len(s) for s in seqs)
    assert tree.stats.max_depth_tokens == max(len(s) for s in seqs)


def _below(node: dta.TreeNode, ancestor: dta.TreeNode) -> bool:
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


def test_identical_rollouts_share_everything():
    tree = tree_of([1, 2, 3], [1, 2, 3], [1, 2, 3])
    check_invariants(tree)
    assert tree.stats.num_nodes == 1 and tree.stats.tree_tokens == 3
    assert tree.stats.compression_ratio == pytest.approx(3.0)
    assert tree.end_node[0] is tree.end_node[1] is tree.end_node[2]


def test_strict_prefix_ends_at_an_internal_node():
    tree = tree_of([1, 2, 3, 4, 5], [1, 2, 3])
    check_invariants(tree)
    prefix_end = tree.end_node[1]
    assert not prefix_end.is_leaf and prefix_end.end == 3
    assert tree.end_node[0].parent is prefix_end


def test_disjoint_rollouts_form_a_forest():
    tree = tree_of([1, 2], [3, 4, 5], [6, 7])
    check_invariants(tree)
    assert len(tree.root.children) == 3 and tree.stats.compression_ratio == 1.0


def test_single_token_divergence():
    tree = tree_of([1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9, 4])
    check_invariants(tree)
    assert tree.stats.tree_tokens == 7  # [1 2] [3] [4] [5] [9 4]
    assert sorted(n.length for n in tree.iter_nodes()) == [1, 1, 1, 2, 2]


def test_lexicographic_order_visits_prefixes_first():
    tree = tree_of([2, 1], [1, 2, 3], [1, 2])
    assert tree.lexicographic_order() == [2, 1, 0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=12), min_size=1, max_size=25))
def test_random_rollouts_property(sequences):
    check_invariants(tree_of(*sequences))


def test_subset_keeps_only_the_given_rollouts():
    rng = random.Random(0)
    seqs = [[rng.randrange(4) for _ in range(rng.randint(2, 9))] for _ in range(20)]
    tree = tree_of(*seqs)
    sub = tree.subset([3, 1, 7])
    assert [r.input_ids for r in sub.rollouts] == [seqs[3], seqs[1], seqs[7]]
    check_invariants(sub)


def test_subset_of_every_rollout_in_order_is_the_tree_itself():
    """One rank (or one mask pack) takes the whole step: no rebuild."""
    tree = tree_of([1, 2, 3], [1, 2, 4], [5, 6])
    assert tree.subset([0, 1, 2]) is tree
    assert tree.subset([1, 0, 2]) is not tree  # another order is another tree
