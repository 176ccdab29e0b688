"""Cost model and partition of one optimizer step's rollouts across data-parallel ranks.

A data-parallel step is as fast as its slowest rank, so the partition minimises the largest predicted rank
cost. Every rank runs the same deterministic code on the same step and gets the same answer: no collective
is needed to agree on who trains what.

Cost model. The DFS engine forwards (and backwards) each tree token once, and a token at position ``p``
attends to ``p + 1`` keys (its ancestors' cached keys and itself). A node covering positions
``start .. end-1`` (``n = end - start`` tokens) therefore costs

    n  +  attention_weight * sum_{p=start}^{end-1} (p + 1)  =  n + attention_weight * n * (start + end + 1) / 2

and a tree costs the sum over its nodes. The first term is the token-linear work (projections, MLP, head);
the second is attention. Per layer and token a transformer spends about ``24 d^2`` FLOPs in its linear
layers (``~12 d^2`` weights, two FLOPs each) and ``4 d`` per attended key (``q.k`` and the weighted sum of
``v``), so ``attention_weight ~ 4d / 24d^2 = 1 / (6 d)`` for hidden size ``d``: see
:func:`attention_weight_for`. Kernels are not equally efficient on both terms, and each forward call has a
fixed cost (it reads every weight), so :class:`CostModel` adds a per-branch term and :class:`CostCalibrator`
fits all three coefficients to the run's measured step times (the data module feeds it every step).

Two partitioners, both deterministic, both returning the rollout indices of each rank as sorted lists:

- ``contiguous`` (the AReaL-DTA recipe, the default): rollouts in lexicographic (DFS) order, cut into
  ``world_size`` contiguous pieces, the cut chosen by binary search on the cost threshold so that the
  largest piece is as cheap as possible. Neighbours in that order share the longest prefixes, so a cut loses
  little sharing, and a huge tree can be split across ranks.
- ``greedy``: whole trees (the components under the virtual root) assigned largest first to the least loaded
  rank (LPT). Sharing is kept in full, but one huge tree bounds the step time.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from lightning_dta.core.errors import ConfigError
from lightning_dta.core.rollout import Rollout
from lightning_dta.core.tree import PrefixTree, attention_pairs, causal_pairs, common_prefix_length


def attention_weight_for(hidden_size: int) -> float:
    """The attention coefficient of the cost model for a model of hidden size ``d``: ``1 / (6 d)``."""
    if hidden_size <= 0:
        raise ValueError(f"hidden_size={hidden_size} must be positive")
    return 1.0 / (6.0 * hidden_size)


DEFAULT_ATTENTION_WEIGHT = attention_weight_for(4096)
"""The coefficient for a 7-8B model (hidden size 4096); attention then matters from a few thousand tokens on."""


@dataclass(frozen=True)
class CostModel:
    """The predicted cost of DFS-training a tree: ``token`` per tree token, ``attention`` per (query, key) pair
    and ``branch`` per distinct rollout (each adds a branch: about one more forward call and backward, whose fixed
    cost dominates small nodes on a CPU or a small model).

    Uncalibrated (the default) the unit is one token: ``token=1``, the attention weight of a 7-8B model, no
    branch cost. :class:`CostCalibrator` fits all three to measured step times, in seconds.
    """

    token: float = 1.0
    """cost of one tree token (linear layers, head)"""
    attention: float = DEFAULT_ATTENTION_WEIGHT
    """cost of one (query, key) pair of attention"""
    branch: float = 0.0
    """cost of one distinct rollout of a rank (its branch of the tree: a forward call and its backward)"""

    def __post_init__(self) -> None:
        if min(self.token, self.attention, self.branch) < 0 or self.token + self.attention + self.branch <= 0:
            raise ConfigError(f"{self} must have non-negative coefficients, not all zero")

    @classmethod
    def coerce(cls, value: CostModel | float) -> CostModel:
        """A cost model, or a bare attention weight (token 1, no branch cost)."""
        return value if isinstance(value, CostModel) else cls(attention=float(value))

    def segment(self, start: int, end: int) -> float:
        """Cost of forwarding positions ``start .. end-1`` with the positions before them cached."""
        return self.token * (end - start) + self.attention * causal_pairs(start, end - start)

    def of(self, features: TreeFeatures) -> float:
        """Cost of a tree with these features."""
        return self.token * features.tokens + self.attention * features.pairs + self.branch * features.branches


class TreeFeatures(NamedTuple):
    """What a tree's DFS costs depend on: its tokens, attention pairs and branches (distinct rollouts). A tuple, so
    that Lightning's batch conversions (precision, device) pass it through a ``StepBatch`` untouched."""

    tokens: int = 0
    pairs: int = 0
    branches: int = 0


def tree_features(tree: PrefixTree) -> TreeFeatures:
    """The tokens, attention pairs and distinct rollouts of ``tree``: what :meth:`CostModel.of` prices."""
    distinct = sum(1 for node in tree.iter_nodes() if node.ends_here)
    return TreeFeatures(tree.stats.tree_tokens, attention_pairs(tree), distinct)


def _nonnegative_least_squares(features: np.ndarray, times: np.ndarray) -> np.ndarray:
    """``argmin ||features @ x - times||`` over ``x >= 0``, by dropping the most negative coefficient until none is
    (an active-set pass that is exact for the three well-separated features used here)."""
    active = list(range(features.shape[1]))
    coefficients = np.zeros(features.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(features[:, active], times, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coefficients


class CostCalibrator:
    """Fit the cost model to the run's own timings: every rank's DFS seconds against its features, over the last
    ``window`` observations. Every rank feeds it the same all-gathered numbers, so every rank fits the same
    model and the next partitions agree without a collective.
    """

    def __init__(self, window: int = 64, min_observations: int = 6) -> None:
        self.window, self.min_observations = window, min_observations
        self.observations: list[tuple[TreeFeatures, float]] = []

    def observe(self, features: Sequence[TreeFeatures], seconds: Sequence[float]) -> None:
        """One step: each rank's features and measured DFS seconds (ranks without work are skipped)."""
        if len(features) != len(seconds):
            raise ValueError(f"got features of {len(features)} ranks but times of {len(seconds)}")
        for f, t in zip(features, seconds):
            if f.tokens > 0 and t > 0:
                self.observations.append((f, float(t)))
        del self.observations[:-self.window]

    def fit(self) -> CostModel | None:
        """The fitted model in seconds, or ``None`` while the observations cannot tell the terms apart."""
        if len(self.observations) < self.min_observations:
            return None
        features = np.array([[f.tokens, f.pairs, f.branches] for f, _ in self.observations], dtype=np.float64)
        times = np.array([t for _, t in self.observations])
        scale = features.max(axis=0)
        scale[scale == 0] = 1.0
        token, attention, branch = _nonnegative_least_squares(features / scale, times) / scale
        if token <= 0 and attention <= 0:
            return None  # the times do not grow with the work (noise or a fixed overhead): keep the current model
        return CostModel(token=float(token), attention=float(attention), branch=float(branch))


def _as_tree(rollouts: Sequence[Rollout] | PrefixTree) -> PrefixTree:
    return rollouts if isinstance(rollouts, PrefixTree) else PrefixTree.from_rollouts(rollouts)


@dataclass
class _Chain:
    """Rollouts in lexicographic order with each one's common prefix length with its predecessor.

    For sorted sequences, the trie of any subset in that order holds ``sum(len - lcp with the previous member)``
    tokens, and the lcp of two members is the minimum of the neighbour lcps between them. So one pass over the
    chain prices any piece or rank without building its tree.
    """

    order: list[int]
    lengths: list[int]
    lcps: list[int]  # lcps[k]: common prefix of order[k-1] and order[k] (0 for k = 0)

    @classmethod
    def of(cls, tree: PrefixTree) -> _Chain:
        order = tree.lexicographic_order()
        arrays = [tree.token_tensors[r].numpy() for r in order]
        lcps = [0] + [common_prefix_length(arrays[k - 1], arrays[k]) for k in range(1, len(order))]
        return cls(order, [len(a) for a in arrays], lcps)


def partition_contiguous(rollouts: Sequence[Rollout] | PrefixTree, world_size: int,
                         cost_model: CostModel | float = DEFAULT_ATTENTION_WEIGHT, slack: float = 0.0
                         ) -> list[list[int]]:
    """Cut the lexicographic order into ``world_size`` contiguous pieces with the smallest maximum cost.

    Appending a rollout to a piece adds the cost of its positions ``lcp .. len-1`` (``lcp`` with the previous
    rollout of the piece), and dropping a piece's first rollout never makes it dearer; so a greedy sweep
    decides whether a threshold is feasible, and a binary search on the threshold finds the smallest one
    (to a relative 1e-9). When fewer pieces than ranks would do, pieces are still split so that every rank
    gets work while rollouts remain (the maximum stays the same; memory and the other ranks' time drop).

    Among the cuts whose pieces all cost at most ``1 + slack`` times that optimum, the ones that lose the fewest
    shared tokens are chosen (:func:`_least_sharing_lost`): a cut then falls between episodes or GRPO groups
    rather than inside the history of one multi-turn episode, whose calls stay in one tree where possible. The
    default ``slack=0`` never makes the slowest rank slower for it.

    Args:
        rollouts: the step's rollouts, or their :class:`PrefixTree` if it is already built.
        world_size: number of data-parallel ranks.
        cost_model: the :class:`CostModel` (or a bare attention weight).
        slack: how much dearer than the optimum a piece may be to keep more sharing (default 0: not at all).

    Returns:
        For each rank, the sorted indices (into ``rollouts``) of its rollouts; a rank may get none.
    """
    _check_world_size(world_size)
    if slack < 0:
        raise ValueError(f"slack={slack} must be >= 0")
    cost = CostModel.coerce(cost_model)
    tree = _as_tree(rollouts)
    chain = _Chain.of(tree)
    n = len(chain.order)
    alone = [cost.segment(0, length) + cost.branch for length in chain.lengths]
    added = [cost.segment(lcp, length) + (cost.branch if length > lcp else 0.0)
             for lcp, length in zip(chain.lcps, chain.lengths)]

    def cut(threshold: float, reserve: bool) -> list[int] | None:
        """Piece end positions of the greedy sweep, or None if ``world_size`` pieces do not cover the chain."""
        ends = []
        pos = 0
        for piece in range(world_size):
            if pos < n:
                cost = alone[pos]
                pos += 1
                reserved = world_size - piece - 1 if reserve else 0  # rollouts kept for the later ranks
                while pos < n and n - pos > reserved and cost + added[pos] <= threshold:
                    cost += added[pos]
                    pos += 1
            ends.append(pos)
        return ends if pos == n else None

    low, high = max(alone), sum(added)  # the dearest rollout alone / the whole step on one rank
    if cut(low, reserve=False) is not None:
        high = low
    while high - low > 1e-9 * high:
        middle = (low + high) / 2
        if cut(middle, reserve=False) is None:
            low = middle
        else:
            high = middle
    pieces = min(world_size, n)
    ends = _least_sharing_lost(alone, added, chain.lcps, pieces, high * (1 + slack))
    if ends is None:  # the greedy cut at `high` is feasible, so a cut within high * (1 + slack) exists
        raise RuntimeError(f"partition_contiguous found no cut of {n} rollouts into {pieces} pieces within the cost "
                           f"{high * (1 + slack):.6g} that a greedy cut meets: this is a bug, please report it")
    ends = ends + [n] * (world_size - len(ends))
    starts = [0] + ends[:-1]
    return [sorted(chain.order[a:b]) for a, b in zip(starts, ends)]


def _least_sharing_lost(alone: list[float], added: list[float], lcps: list[int], pieces: int,
                        bound: float) -> list[int] | None:
    """End positions of ``pieces`` non-empty contiguous pieces, each costing at most ``bound``, that lose the fewest
    shared tokens at the cuts (a cut before position ``b`` loses ``lcps[b]``); ``None`` if none exists.

    Dynamic programming over (pieces, end): the admissible starts of a piece ending at ``b`` form a window that
    only moves right as ``b`` grows, so a monotone queue gives each entry in O(1): O(pieces x rollouts).
    """
    n = len(alone)
    bound *= 1 + 1e-12
    prefix = [0.0]
    for value in added:
        prefix.append(prefix[-1] + value)

    def piece_cost(a: int, b: int) -> float:  # rollouts a .. b-1 as one piece
        return alone[a] + prefix[b] - prefix[a + 1]

    inf = float("inf")
    best = [0.0 if piece_cost(0, b) <= bound else inf for b in range(n + 1)]  # one piece covering 0 .. b-1
    best[0] = inf
    choices: list[list[int]] = []
    for k in range(2, pieces + 1):
        previous, best = best, [inf] * (n + 1)
        choice = [-1] * (n + 1)
        window: collections.deque[int] = collections.deque()  # starts a, by increasing lost sharing
        low = k - 1
        nxt = k - 1
        for b in range(k, n + 1):
            while nxt <= b - 1:  # admit start a = b - 1 (and any skipped)
                value = previous[nxt] + lcps[nxt]
                while window and previous[window[-1]] + lcps[window[-1]] >= value:
                    window.pop()
                window.append(nxt)
                nxt += 1
            while low < b - 1 and piece_cost(low, b) > bound:  # the cheapest admissible start moves right
                low += 1
            while window and window[0] < low:
                window.popleft()
            if window and piece_cost(window[0], b) <= bound and previous[window[0]] < inf:
                best[b] = previous[window[0]] + lcps[window[0]]
                choice[b] = window[0]
        choices.append(choice)
    if best[n] == inf:
        return None
    ends, b = [n], n
    for choice in reversed(choices):
        b = choice[b]
        ends.append(b)
    return ends[::-1]


def partition_greedy(rollouts: Sequence[Rollout] | PrefixTree, world_size: int,
                     cost_model: CostModel | float = DEFAULT_ATTENTION_WEIGHT) -> list[list[int]]:
    """Assign whole trees, largest first, each to the currently least loaded rank (LPT scheduling).

    Ties are broken by content (a tree's first token, which is distinct for every tree under the virtual root)
    and then by the lower rank, so the result depends on the rollouts, not on their input order. With fewer
    trees than ranks some ranks get nothing.

    Returns:
        For each rank, the sorted indices (into ``rollouts``) of its rollouts; a rank may get none.
    """
    _check_world_size(world_size)
    tree = _as_tree(rollouts)
    cost = CostModel.coerce(cost_model)
    subtree_cost = [cost.segment(node.start, node.end) + (cost.branch if node.ends_here else 0.0)
                    for node in tree.nodes]
    for node in reversed(tree.nodes[1:]):  # pre-order: children come after their parents
        subtree_cost[node.parent.index] += subtree_cost[node.index]
    trees = sorted(tree.root.children, key=lambda top: (-subtree_cost[top.index], int(tree.tokens(top)[0])))
    loads = [(0.0, rank) for rank in range(world_size)]
    assignment: list[list[int]] = [[] for _ in range(world_size)]
    for top in trees:
        load, rank = heapq.heappop(loads)
        assignment[rank].extend(top.rollouts)
        heapq.heappush(loads, (load + subtree_cost[top.index], rank))
    return [sorted(indices) for indices in assignment]


PARTITIONERS: dict[str, Callable[..., list[list[int]]]] = {
    "contiguous": partition_contiguous,
    "greedy": partition_greedy,
}


def check_partition_method(method: str) -> None:
    if method not in PARTITIONERS:
        raise ConfigError(f"partition_method={method!r} is unknown. Fix: one of {sorted(PARTITIONERS)}")


def partition(rollouts: Sequence[Rollout] | PrefixTree, world_size: int, method: str = "contiguous",
              cost_model: CostModel | float = DEFAULT_ATTENTION_WEIGHT) -> list[list[int]]:
    """Split one step's rollouts across ``world_size`` ranks with the partitioner named ``method``."""
    check_partition_method(method)
    return PARTITIONERS[method](rollouts, world_size, cost_model)


@dataclass
class PartitionReport:
    """What a partition predicts: per-rank cost and size, balance, and the sharing it kept."""

    assignment: list[list[int]]
    rank_costs: list[float]
    rank_logical_tokens: list[int]
    rank_tree_tokens: list[int]
    rank_features: list[TreeFeatures]  # what each rank's cost is made of (for the calibration)
    step_cost: float  # the whole step on one rank
    step_tree_tokens: int  # the whole step's tree, before the cut
    lower_bound: float  # no partition can do better: max(step_cost / world_size, dearest single rollout)

    @property
    def max_cost(self) -> float:
        return max(self.rank_costs)

    @property
    def imbalance(self) -> float:
        """max / mean of the rank costs (1.0 = perfectly balanced; empty ranks count as 0)."""
        total = sum(self.rank_costs)
        return self.max_cost * len(self.rank_costs) / total if total > 0 else 1.0

    @property
    def max_over_bound(self) -> float:
        """The slowest rank's cost over :attr:`lower_bound` (1.0 = provably optimal)."""
        return self.max_cost / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def compression_before(self) -> float:
        """logical / tree tokens of the whole step."""
        return sum(self.rank_logical_tokens) / max(self.step_tree_tokens, 1)

    @property
    def compression_after(self) -> float:
        """logical / tree tokens summed over the ranks: the sharing the training actually exploits."""
        return sum(self.rank_logical_tokens) / max(sum(self.rank_tree_tokens), 1)


def partition_report(rollouts: Sequence[Rollout] | PrefixTree, assignment: Sequence[Sequence[int]],
                     cost_model: CostModel | float = DEFAULT_ATTENTION_WEIGHT) -> PartitionReport:
    """Price every rank of ``assignment`` (which must hold every rollout exactly once) without building trees."""
    tree = _as_tree(rollouts)
    n = len(tree.rollouts)
    owner = [-1] * n
    for rank, indices in enumerate(assignment):
        for index in indices:
            if not 0 <= index < n:
                raise ValueError(f"rank {rank} holds rollout {index}, but the step has {n} rollouts")
            if owner[index] != -1:
                raise ValueError(f"rollout {index} is assigned to ranks {owner[index]} and {rank}")
            owner[index] = rank
    if -1 in owner:
        raise ValueError(f"rollout {owner.index(-1)} is assigned to no rank")
    world_size = len(assignment)
    cost = CostModel.coerce(cost_model)
    chain = _Chain.of(tree)
    logical = [0] * world_size
    tokens, pairs, branches = [0] * world_size, [0] * world_size, [0] * world_size
    last = [-1] * world_size  # chain position of each rank's previous rollout
    for pos, (rollout, length) in enumerate(zip(chain.order, chain.lengths)):
        rank = owner[rollout]
        lcp = min(chain.lcps[last[rank] + 1:pos + 1]) if last[rank] >= 0 else 0
        logical[rank] += length
        tokens[rank] += length - lcp
        pairs[rank] += (length * (length + 1) - lcp * (lcp + 1)) // 2  # positions lcp .. length-1, each p + 1 keys
        branches[rank] += int(length > lcp)
        last[rank] = pos
    features = [TreeFeatures(t, p, b) for t, p, b in zip(tokens, pairs, branches)]
    step_cost = cost.of(tree_features(tree))
    dearest = max(cost.segment(0, length) + cost.branch for length in chain.lengths)
    return PartitionReport(
        assignment=[list(indices) for indices in assignment], rank_costs=[cost.of(f) for f in features],
        rank_logical_tokens=logical, rank_tree_tokens=tokens, rank_features=features, step_cost=step_cost,
        step_tree_tokens=tree.stats.tree_tokens, lower_bound=max(step_cost / world_size, dearest))


def _check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
