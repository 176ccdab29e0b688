"""The seams between the package's parts, as typed contracts: who offers what to whom.

Each part talks to the next through one of these and never by probing for attribute names, so the type checker,
an IDE and the import graph all see the handshake:

- :class:`Objective`: what a loss offers the engine. ``engine/`` imports this and never a concrete loss; the
  policy loss and the critic's value loss (``core/losses.py``) both implement it. :class:`StepTokens` is what the
  objective decides before the walk (which tokens count, per-rollout weights), :class:`TokenData` what the engine
  hands it for one chunk.
- :class:`StepSource`: what a source of steps offers ``RolloutDataModule``: whole steps whose advantages are
  already estimated, a length when it knows one, its state for resume, and a hook on each rank's share;
  :class:`TreeDataModule`: what such a data module offers the training module (the model's limits in, the
  measured step times back), and :class:`EstimatesAdvantages` which estimator its steps went through.
- :class:`ParallelLayout` and :class:`TreeParallelStrategy`: what a strategy offers the DFS step and the module's
  ``configure_model``: the device mesh, the data-parallel group the step's sums run over, whether (and how) the
  weights are sharded, the gradient reduction's bucket size.

This module imports nothing from Lightning and nothing from the rest of the package.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:  # only for annotations: a contract must not pull in its implementations
    from torch import nn
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_dta.core.batch import StepBatch
    from lightning_dta.core.rollout import Rollout

HeadOutput = Literal["logprobs", "values"]

DEFAULT_BUCKET_MB = 256.0
DATA_PARALLEL, TENSOR_PARALLEL = "data_parallel", "tensor_parallel"  # the mesh dimensions (Lightning's names)


@dataclass
class TokenData:
    """Per-(rollout, position) inputs of an objective for one chunk, each ``[R, L]`` (float unless noted).

    ``old``/``prox``/``ref`` hold NaN where the rollout did not provide the field. ``weight`` has one column per
    term the objective aggregates on its own (:meth:`Objective.rollout_weights`). ``seq_log_weight`` and
    ``seq_log_ratio`` are ``[R, 1]`` per-rollout values (``None`` unless the objective asks for them); ``returns``
    and ``old_values`` are grids of the per-token fields an objective names in ``token_fields``.
    """

    mask: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor
    prox: torch.Tensor
    ref: torch.Tensor
    weight: torch.Tensor  # [R, K]: the aggregation weights of each rollout, one column per separately aggregated term
    any_ref: bool = False  # whether any rollout of the step has reference log-probs
    seq_log_weight: torch.Tensor | None = None  # [R, 1]: the objective's per-rollout log-weight (StepTokens)
    seq_log_ratio: torch.Tensor | None = None  # [R, 1]: mean over the rollout's trained tokens of logp - prox
    returns: torch.Tensor | None = None  # [R, L]: the critic's targets
    old_values: torch.Tensor | None = None  # [R, L]: the critic's values at generation time, NaN where not given


@dataclass
class StepTokens:
    """The per-token inputs of a tree's rollouts, flat (rollout after rollout, token 0 included), in float64 on the
    CPU: what an objective decides from before the walk (:meth:`Objective.prepare`).

    ``mask`` is the loss mask (0/1), ``old``/``prox`` hold NaN where not given, ``owner`` is each token's rollout.
    ``prepare`` returns these with what it decided: ``mask`` the (token, rollout) pairs the loss trains,
    ``normalizer_mask`` the ones the step's normalisers count (``None``: ``mask``), ``advantages`` as the loss uses
    them, and ``seq_log_weight`` a per-rollout log-weight ``[R]`` it asks the engine to carry into every chunk.
    Decisions made here are made once per step, before the walk, identically on every rank and in every mode.
    """

    mask: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor
    prox: torch.Tensor
    owner: torch.Tensor
    num_rollouts: int
    normalizer_mask: torch.Tensor | None = None
    seq_log_weight: torch.Tensor | None = None

    @property
    def counted(self) -> torch.Tensor:
        """The mask the normalisers count."""
        return self.mask if self.normalizer_mask is None else self.normalizer_mask


@runtime_checkable
class Objective(Protocol):
    """What the tree engine asks of a loss. The engine evaluates it per (token, rollout) on a ``[R, L]`` grid of
    each chunk, adds the weighted terms of every chunk into one scalar per backward and the metric sums into one
    dict per step; the objective decides what the head's outputs mean and how the step is normalised."""

    agg: str
    """the step-wide aggregation (``token-mean``, ``seq-mean-*``, ``sum``): ``sum`` has no normaliser to share."""

    head: HeadOutput
    """what the model's head outputs are turned into: the targets' log-probs and entropies (``"logprobs"``), or
    the scalar value at each position (``"values"``, a critic)."""

    needs_entropy_grad: bool
    """whether the entropy's gradient is part of the loss (otherwise it is computed detached, for the metric)."""

    needs_sequence_ratio: bool
    """whether each rollout's ratio of the current weights is needed before the walk (a forward-only pass)."""

    token_fields: tuple[str, ...]
    """per-token rollout fields to gather into :class:`TokenData` beyond the policy's own (e.g. ``returns``)."""

    required_fields: tuple[str, ...]
    """those of ``token_fields`` that every rollout with a trained token must carry."""

    step_fields: tuple[str, ...]
    """rollout fields a term of the loss needs that a whole step must carry somewhere (``PolicyLoss`` with
    ``kl_coef > 0``: ``ref_logprobs``): a step where no rollout carries one would train without that term, in silence,
    so the step refuses it."""

    advantage_only: bool
    """whether the loss is 0 when every advantage is 0 (then a step of zero advantages trains nothing: warned)."""

    metric_sums: tuple[str, ...]
    """names of the raw statistics the objective accumulates: sums (added over chunks, trees and ranks before
    ratios), and the maxima among them that ``metric_maxima`` names."""

    metric_maxima: tuple[str, ...]
    """those of ``metric_sums`` that are maxima: the loss keeps the largest over its chunks, a distributed step
    the largest over ranks (e.g. the largest log-prob gap of the step)."""

    def prepare(self, tokens: StepTokens) -> StepTokens:
        """What the loss decides before the walk from the rollouts alone: which (token, rollout) pairs it trains and
        which its normalisers count, per-rollout weights, the advantages it uses. The engine calls it once per tree
        (for the normaliser too, so that N ranks count what 1 rank counts)."""

    def normalizer(self, masks: Sequence[torch.Tensor]) -> tuple[float, ...]:
        """This tree's share of the step's loss normalisers, from per-rollout masks (``StepTokens.counted``): counts
        that add over trees and ranks (a distributed step sums them elementwise)."""

    def rollout_weights(self, token_counts: torch.Tensor, normalizer: Sequence[float]) -> torch.Tensor:
        """Each rollout's weights ``[R, K]`` of its per-token loss sums (one column per separately aggregated term),
        so that the step's loss is one weighted sum; ``token_counts`` counts ``StepTokens.counted``."""

    def metrics(self, sums: Mapping[str, float]) -> dict[str, float]:
        """The reported metrics from the (step-wide) raw sums."""

    def __call__(self, outputs: torch.Tensor, entropy: torch.Tensor | None, data: TokenData,
                 sums: dict) -> torch.Tensor:
        """The weighted loss of one chunk's ``[R, L]`` grid of head outputs; adds into ``sums``."""


@dataclass(frozen=True)
class ModelLimits:
    """What every rollout is checked against at the boundary: the model's vocabulary and positions (``None``:
    unchecked)."""

    vocab_size: int | None = None
    max_positions: int | None = None


@runtime_checkable
class StepSource(Protocol):
    """What ``RolloutDataModule`` takes steps from: a file, a Python iterable, or online generation.

    A step is the whole optimizer step's rollouts (every rank reads the same steps), validated against the model's
    limits and with its advantages already estimated (over its whole generation batch, when one feeds several steps:
    :mod:`lightning_dta.core.generation`): the source owns advantage estimation (a critic's GAE is the
    critic's job, in the training step)."""

    advantage_estimator: str | None
    """the estimator the source applies (``"gae"``: it leaves the advantages to a critic); ``None``: none."""

    def steps(self, epoch: int, start: int, limits: ModelLimits) -> Iterator[tuple[str, list[Rollout]]]:
        """The steps of ``epoch`` from position ``start`` on, each with a label for error messages."""

    def __len__(self) -> int:
        """Steps per epoch. A source that cannot know raises ``TypeError`` (Lightning's "no length")."""

    def prepare_batch(self, batch: StepBatch) -> None:
        """Complete this rank's share of a step before it is trained (every rank calls it, also without a tree); a
        source whose generation batches feed several steps sets ``batch.generation``, the step's place in its batch
        (what a critic estimates once per batch, :class:`~lightning_dta.core.generation.GenerationContext`)."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue where this one stopped."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


@runtime_checkable
class EstimatesAdvantages(Protocol):
    """Whatever says which advantage estimator the steps it hands out went through (a step source, a data module)."""

    @property
    def advantage_estimator(self) -> str | None:
        """The estimator applied (``"gae"``: the rollouts carry rewards and a critic estimates in the training step;
        ``None``: the rollouts' own advantages)."""


@runtime_checkable
class TreeDataModule(Protocol):
    """What a data module of tree steps offers the training module: the model's limits flow in (a config states
    them once, in the model) and the measured step times flow back (the partition's cost model learns from them)."""

    def connect_model(self, model: nn.Module) -> None:
        """Check rollouts against ``model``'s limits from now on."""

    def observe_step(self, batch: StepBatch, rank_seconds: Sequence[float]) -> None:
        """Every rank's measured DFS seconds of ``batch`` (the same on every rank)."""


@dataclass(frozen=True)
class Sharding:
    """How a strategy asks the module to shard its causal LM with FSDP2 (applied by
    :func:`lightning_dta.distributed.collectives.parallelize.parallelize_model` in ``configure_model``)."""

    wrap_modules: tuple[str, ...] | None = None  # the blocks to shard one by one (None: the model's _no_split_modules)
    reshard_after_forward: bool = True
    offload: bool = False  # FSDP2's CPUOffloadPolicy
    param_dtype: torch.dtype | None = None  # cast the weights before sharding (the "-true" precisions)
    mp_policy: Any = None  # FSDP2's MixedPrecisionPolicy, or None


@dataclass(frozen=True)
class TensorParallelism:
    """How a strategy asks the module to split its causal LM over the ``tensor_parallel`` mesh dimension (applied by
    :func:`lightning_dta.distributed.tensor_parallel.tensor_parallel` before FSDP2). The peers of a tensor-parallel
    group walk the same tree, so the collectives inside each layer line up."""

    size: int
    vocab_parallel: bool = True  # the input embedding and the LM head split by vocabulary (the logits gathered)
    plan_overrides: tuple[tuple[str, str], ...] = ()  # (module pattern, transformers style) replacing the model's plan


@dataclass(frozen=True)
class ParallelLayout:
    """How the ranks of a step are laid out.

    Every data-parallel rank walks its own tree (with tensor parallelism, every rank of its tensor-parallel group
    walks that same tree); the step's sums (loss normaliser, metrics, gradients of replicated weights) and the
    partition of a step run over ``data_parallel_group``. ``None`` there means the default group (or a single
    process). ``sharding`` is set when the strategy shards the weights, ``tensor_parallelism`` when it splits them
    over a ``tensor_parallel`` dimension; ``device_mesh`` is the strategy's mesh (dimensions ``"data_parallel"``,
    ``"tensor_parallel"``) when it has one.
    """

    data_parallel_group: ProcessGroup | None = None
    device_mesh: DeviceMesh | None = None
    sharding: Sharding | None = None
    tensor_parallelism: TensorParallelism | None = None
    bucket_mb: float = DEFAULT_BUCKET_MB

    @property
    def shards_weights(self) -> bool:
        return self.sharding is not None

    @property
    def data_parallel_rank(self) -> int:
        """This rank's place among the ranks that walk different trees (0 on a single process)."""
        import torch.distributed as dist

        return dist.get_rank(self.data_parallel_group) if dist.is_available() and dist.is_initialized() else 0

    @property
    def data_parallel_size(self) -> int:
        """How many ranks walk different trees: the step is partitioned over them (1 on a single process)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.data_parallel_group)

    @property
    def tensor_parallel_group(self) -> ProcessGroup | None:
        """The peers that walk this rank's trees with it (the mesh's ``tensor_parallel`` dimension), or ``None``
        without tensor parallelism (no mesh, no such dimension, or a dimension of size 1)."""
        mesh = self.device_mesh
        if mesh is None or TENSOR_PARALLEL not in (mesh.mesh_dim_names or ()) or mesh[TENSOR_PARALLEL].size() < 2:
            return None
        return mesh[TENSOR_PARALLEL].get_group()


@runtime_checkable
class TreeParallelStrategy(Protocol):
    """A strategy that runs DFS steps (``DTAStrategy``, ``DTAFSDPStrategy``): what it offers the step."""

    @property
    def parallel_layout(self) -> ParallelLayout:
        """The layout of this run's ranks (valid once the strategy's environment is set up)."""


def parallel_layout(strategy: object) -> ParallelLayout:
    """The layout a strategy offers; a strategy that is not a :class:`TreeParallelStrategy` (Lightning's single-device
    strategy, say) runs one process with replicated weights: the default layout."""
    return strategy.parallel_layout if isinstance(strategy, TreeParallelStrategy) else ParallelLayout()
