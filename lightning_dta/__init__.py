"""lightning_dta: exact depth-first prefix-tree training for RL post-training of LLMs.

The public names, by where they live (``README.md`` has the layout):

- ``core/``: :class:`Rollout` and its files, :class:`PrefixTree`, the objectives :class:`PolicyLoss` and
  :class:`ValueLoss`, advantage estimators (:func:`grpo_advantages`, ...);
- ``engine/``: :func:`tree_backward`, :func:`tree_logprobs`, :func:`tree_values`, :class:`EngineOptions`;
- ``distributed/``: the step's gradient over every rank (:func:`tree_step_backward`, :func:`gradient_norm`),
  :func:`parallelize_model`;
- ``lightning/``: the strategies, :class:`DTAModule`, :class:`PPOCritic`, :class:`RolloutDataModule`, callbacks;
- ``models.py``: :func:`value_model` (a critic from any causal LM).

Importing the package registers the Lightning strategy names ``"dta"``, ``"dta_spawn"``, ``"dta_fork"`` and
``"dta_fsdp"``: Lightning finds no third-party strategy by itself (its own strategies register the same way, in
``register_strategies``). Nothing else happens on import: the filters for warnings Lightning prints although
nothing is wrong are installed by the ``lightning-dta`` command, or by :func:`quiet_known_warnings`.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dta.contracts import Objective, ParallelLayout, StepSource
from lightning_dta.core.advantages import grpo_advantages, reinforce_baseline_advantages
from lightning_dta.core.generation import GenerationBatches
from lightning_dta.core.losses import PolicyLoss, Rejection, ValueLoss
from lightning_dta.core.rollout import (
    Rollout,
    RolloutError,
    RolloutFaults,
    read_rollouts,
    validate_rollouts,
    write_rollouts,
)
from lightning_dta.core.tree import PrefixTree, TreeNode, TreeStats
from lightning_dta.distributed.parallelize import parallelize_model
from lightning_dta.distributed.step import StepOutput, gradient_norm, tree_step_backward
from lightning_dta.engine import (
    EngineOptions,
    ModelNotSupportedError,
    TreeBackwardOutput,
    tree_backward,
    tree_logprobs,
    tree_loss_normalizer,
    tree_values,
)
from lightning_dta.lightning.callbacks import PeakMemoryMonitor, TreeThroughputMonitor
from lightning_dta.lightning.critic import PPOCritic
from lightning_dta.lightning.data import RolloutDataModule
from lightning_dta.lightning.fsdp_strategy import DTAFSDPStrategy
from lightning_dta.lightning.module import DTAModule
from lightning_dta.lightning.quiet import install as quiet_known_warnings
from lightning_dta.lightning.step import DFSStepMixin, dfs_training_step
from lightning_dta.lightning.strategy import DTAStrategy
from lightning_dta.models import value_model

__version__ = "0.1.0"

DTAStrategy.register_strategies(StrategyRegistry)
DTAFSDPStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "DFSStepMixin",
    "DTAFSDPStrategy",
    "DTAModule",
    "DTAStrategy",
    "EngineOptions",
    "GenerationBatches",
    "ModelNotSupportedError",
    "Objective",
    "PPOCritic",
    "ParallelLayout",
    "PeakMemoryMonitor",
    "PolicyLoss",
    "Rejection",
    "PrefixTree",
    "Rollout",
    "RolloutDataModule",
    "RolloutError",
    "RolloutFaults",
    "StepOutput",
    "StepSource",
    "TreeBackwardOutput",
    "TreeNode",
    "TreeStats",
    "TreeThroughputMonitor",
    "ValueLoss",
    "dfs_training_step",
    "gradient_norm",
    "grpo_advantages",
    "parallelize_model",
    "quiet_known_warnings",
    "read_rollouts",
    "reinforce_baseline_advantages",
    "tree_backward",
    "tree_logprobs",
    "tree_loss_normalizer",
    "tree_step_backward",
    "tree_values",
    "validate_rollouts",
    "value_model",
    "write_rollouts",
]
