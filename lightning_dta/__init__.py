"""lightning_dta: exact depth-first prefix-tree training for RL post-training of LLMs."""

from lightning_dta.engine import (
    ModelNotSupportedError,
    TreeBackwardOutput,
    tree_backward,
    tree_logprobs,
    tree_loss_normalizer,
)
from lightning_dta.losses import PolicyLoss
from lightning_dta.rollout import Rollout, RolloutError, read_rollouts, validate_rollouts, write_rollouts
from lightning_dta.tree import PrefixTree, TreeNode, TreeStats

__version__ = "0.1.0"

__all__ = [
    "ModelNotSupportedError",
    "PolicyLoss",
    "PrefixTree",
    "Rollout",
    "RolloutError",
    "TreeBackwardOutput",
    "TreeNode",
    "TreeStats",
    "read_rollouts",
    "tree_backward",
    "tree_logprobs",
    "tree_loss_normalizer",
    "validate_rollouts",
    "write_rollouts",
]
