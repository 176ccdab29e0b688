"""The prefix tree (a token-level radix tree) over a step's rollouts.

Every shared prefix is stored once. Nodes are split wherever a rollout ends, so a rollout that is a strict
prefix of another ends at the end of an internal node, and each rollout is exactly the concatenation of the
segments on one root-to-node path. Several trees (rollouts that share nothing) hang under a virtual root
that holds no tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from lightning_dta.core.rollout import Rollout, validate_rollouts


class TreeNode:
    """One segment of tokens, positions ``start .. end-1`` of every rollout that passes through it."""

    __slots__ = ("index", "parent", "children", "start", "end", "rep", "ends_here", "rollouts")

    def __init__(self, index: int, parent: TreeNode | None, start: int, end: int, rep: int) -> None:
        self.index = index
        self.parent = parent
        self.children: list[TreeNode] = []
        self.start = start
        self.end = end
        self.rep = rep  # a rollout that passes through this node: the segment is rollouts[rep][start:end]
        self.ends_here: list[int] = []  # rollouts whose last token is this node's last token
        self.rollouts: list[int] = []  # every rollout passing through this node (its subtree's rollouts)

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (f"TreeNode(index={self.index}, start={self.start}, end={self.end}, "
                f"children={len(self.children)}, rollouts={len(self.rollouts)})")


@dataclass
class TreeStats:
    """Size of a tree. ``compression_ratio`` bounds the speed-up of token-linear compute."""

    num_rollouts: int
    logical_tokens: int  # every rollout counted in full
    tree_tokens: int  # each shared token once
    num_nodes: int  # real nodes (the virtual root is not counted)
    max_depth_tokens: int  # the longest root-to-leaf path, in tokens

    @property
    def compression_ratio(self) -> float:
        return self.logical_tokens / max(self.tree_tokens, 1)


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D integer arrays."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class PrefixTree:
    """A forest of radix trees over token ids; ``root`` is virtual (no tokens)."""

    def __init__(self, rollouts: Sequence[Rollout], root: TreeNode, nodes: list[TreeNode],
                 token_tensors: list[torch.Tensor]) -> None:
        self.rollouts = list(rollouts)
        self.root = root
        self.nodes = nodes  # nodes[0] is the root; parents come before their children
        self.token_tensors = token_tensors  # one LongTensor per rollout, input order
        self.end_node = [root] * len(self.rollouts)  # the node at whose end each rollout ends
        for node in nodes:
            for r in node.ends_here:
                self.end_node[r] = node
        self.stats = TreeStats(
            num_rollouts=len(self.rollouts),
            logical_tokens=sum(len(t) for t in token_tensors),
            tree_tokens=sum(node.length for node in nodes),
            num_nodes=len(nodes) - 1,
            max_depth_tokens=max((len(t) for t in token_tensors), default=0),
        )

    @classmethod
    def from_rollouts(cls, rollouts: Sequence[Rollout], *, validate: bool = True, vocab_size: int | None = None,
                      max_positions: int | None = None) -> PrefixTree:
        """Build the tree. Rollouts are validated first (pass the model's limits to check ids and length).

        Construction sorts the rollouts lexicographically (a prefix sorts before its extensions), takes the
        longest common prefix of neighbours, and builds the radix tree with a stack, like a suffix tree from an
        LCP array: O(N log N) comparisons plus vectorised prefix comparisons, no per-token Python loop.
        """
        if validate:
            validate_rollouts(rollouts, vocab_size=vocab_size, max_positions=max_positions)
        arrays = [np.asarray(r.input_ids, dtype=np.int64) for r in rollouts]
        order = sorted(range(len(rollouts)), key=lambda i: tuple(rollouts[i].input_ids))
        root = TreeNode(0, None, 0, 0, -1)
        nodes = [root]
        stack = [root]  # the path to the previous rollout's end node
        previous = None
        for r in order:
            length = len(arrays[r])
            lcp = common_prefix_length(arrays[previous], arrays[r]) if previous is not None else 0
            while stack[-1].start >= lcp and stack[-1] is not root:
                stack.pop()
            top = stack[-1]
            if top.end > lcp:  # the shared part ends inside `top`: split it at lcp
                upper = TreeNode(len(nodes), top.parent, top.start, lcp, top.rep)
                nodes.append(upper)
                siblings = top.parent.children
                siblings[siblings.index(top)] = upper
                upper.children.append(top)
                top.parent = upper
                top.start = lcp
                stack[-1] = upper
                top = upper
            if length > lcp:
                node = TreeNode(len(nodes), top, lcp, length, r)
                nodes.append(node)
                top.children.append(node)
                stack.append(node)
                node.ends_here.append(r)
            else:  # identical to the previous rollout
                top.ends_here.append(r)
            previous = r
        nodes = cls._renumber(root)
        for node in reversed(nodes):  # children before parents
            node.rollouts = sorted(node.ends_here + [r for child in node.children for r in child.rollouts])
        token_tensors = [torch.as_tensor(a, dtype=torch.long) for a in arrays]
        return cls(rollouts, root, nodes, token_tensors)

    @staticmethod
    def _renumber(root: TreeNode) -> list[TreeNode]:
        """Number nodes in depth-first pre-order (parents first) and return them in that order."""
        nodes = []
        stack = [root]
        while stack:
            node = stack.pop()
            node.index = len(nodes)
            nodes.append(node)
            stack.extend(reversed(node.children))
        return nodes

    def tokens(self, node: TreeNode) -> torch.Tensor:
        """The node's token ids (a view into its representative rollout)."""
        return self.token_tensors[node.rep][node.start:node.end]

    def lexicographic_order(self) -> list[int]:
        """Rollout indices in depth-first (lexicographic) order: neighbours share the longest prefixes."""
        return [r for node in self.nodes for r in node.ends_here]

    def path(self, node: TreeNode) -> list[TreeNode]:
        """Real nodes from the top of the tree down to ``node``."""
        out = []
        while node is not None and node is not self.root:
            out.append(node)
            node = node.parent
        return out[::-1]

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Real nodes in depth-first pre-order."""
        return iter(self.nodes[1:])

    def subset(self, indices: Sequence[int]) -> PrefixTree:
        """A tree over some of the rollouts (in the given order), e.g. one rank's share of a step; the tree itself
        when that is every rollout in order (one rank, one pack)."""
        if list(indices) == list(range(len(self.rollouts))):
            return self
        return PrefixTree.from_rollouts([self.rollouts[i] for i in indices], validate=False)

    @cached_property
    def loss_masks(self) -> list[torch.Tensor]:
        """Each rollout's effective loss mask (float64); position 0 is never trained (it has no context).
        Built once per tree: the step normaliser and the engine both read it."""
        masks = []
        for rollout in self.rollouts:
            mask = torch.tensor(rollout.mask(), dtype=torch.float64)
            mask[0] = 0.0
            masks.append(mask)
        return masks

    def __repr__(self) -> str:
        s = self.stats
        return (f"PrefixTree(rollouts={s.num_rollouts}, logical_tokens={s.logical_tokens}, "
                f"tree_tokens={s.tree_tokens}, compression={s.compression_ratio:.2f}x, nodes={s.num_nodes})")


def causal_pairs(start: int, length: int) -> int:
    """(query, key) pairs of ``length`` new tokens after a prefix of ``start``: each attends to the prefix and to
    itself and the new tokens before it. The one count of attention work that the planner's FLOPs, the bench's
    FLOP-model limit and the partition's cost model share."""
    return length * start + length * (length + 1) // 2


def attention_pairs(tree: PrefixTree) -> int:
    """(query, key) pairs the DFS walk computes over ``tree``: every node's tokens against its prefix and itself."""
    return sum(causal_pairs(node.start, node.length) for node in tree.iter_nodes())
