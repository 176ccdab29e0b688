"""lightning_dta: exact depth-first prefix-tree training for RL post-training of LLMs."""

from lightning_dta.core.losses import PolicyLoss, ValueLoss
from lightning_dta.core.rollout import (
    Rollout,
    RolloutError,
    RolloutFaults,
    read_rollouts,
    validate_rollouts,
    write_rollouts,
)
from lightning_dta.core.tree import PrefixTree, TreeNode, TreeStats
from lightning_dta.engine import (
    EngineOptions,
    ModelNotSupportedError,
    TreeBackwardOutput,
    tree_backward,
    tree_logprobs,
    tree_loss_normalizer,
    tree_values,
)
from lightning_dta.models import value_model

__version__ = "0.1.0"

# The Lightning side. Lightning finds no third-party strategy by itself, so importing the package registers
# the strategy names "dta", "dta_spawn", "dta_fork" and "dta_fsdp" (as Lightning's own strategies do in
# `register_strategies`).
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_dta.lightning import quiet  # noqa: E402
from lightning_dta.lightning.callbacks import PeakMemoryMonitor, TreeThroughputMonitor  # noqa: E402
from lightning_dta.lightning.fsdp_strategy import DTAFSDPStrategy  # noqa: E402
from lightning_dta.lightning.module import DTAModule  # noqa: E402
from lightning_dta.lightning.step import DFSStepMixin, StepOutput, dfs_training_step, tree_step_backward  # noqa: E402
from lightning_dta.lightning.strategy import DTAStrategy  # noqa: E402

quiet.install()
DTAStrategy.register_strategies(StrategyRegistry)
DTAFSDPStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "DFSStepMixin",
    "DTAFSDPStrategy",
    "DTAModule",
    "DTAStrategy",
    "PeakMemoryMonitor",
    "StepOutput",
    "TreeThroughputMonitor",
    "EngineOptions",
    "ModelNotSupportedError",
    "PolicyLoss",
    "PrefixTree",
    "Rollout",
    "RolloutError",
    "RolloutFaults",
    "TreeBackwardOutput",
    "TreeNode",
    "TreeStats",
    "dfs_training_step",
    "read_rollouts",
    "tree_backward",
    "tree_logprobs",
    "tree_loss_normalizer",
    "tree_step_backward",
    "tree_values",
    "value_model",
    "ValueLoss",
    "validate_rollouts",
    "write_rollouts",
]
