"""The objectives the engine trains (definitions: ``docs/losses.md``), evaluated per (token, rollout) pair.

:class:`PolicyLoss` (the RL policy loss) and :class:`ValueLoss` (the critic's) implement
:class:`~lightning_dta.contracts.Objective`, the engine's one view of a loss: the engine never asks which of the
two it runs.

A shared token appears once in the tree but once per rollout in the loss, so every term is computed on a
``[rollouts, positions]`` grid built from the same log-probs: clipping stays exact when rollouts carry
different advantages or behaviour log-probs on a shared prefix. Sequence-level quantities (GSPO's ratio, a
sequence-level importance weight) are per rollout, computed before the walk and broadcast over the grid.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args

import torch

from lightning_dta.contracts import StepTokens, TokenData
from lightning_dta.core.errors import ConfigError
from lightning_dta.core.rollout import RolloutError

if TYPE_CHECKING:  # the converters import this module
    from lightning_dta.core.conversions import Converted

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "sum"]
AGGREGATIONS = get_args(Aggregation)
AggRollouts = Literal["trained", "all"]
AGG_ROLLOUTS = get_args(AggRollouts)
LossMode = Literal["ppo", "gspo", "cispo"]
LOSS_MODES = get_args(LossMode)
WeightMode = Literal["truncate", "mask"]
WEIGHT_MODES = get_args(WeightMode)
Level = Literal["token", "sequence", "sequence-product", "none"]
LEVELS = get_args(Level)
KLEstimator = Literal["k3", "low_var_kl", "k3+"]
KL_ESTIMATORS = get_args(KLEstimator)
AdvantageLevel = Literal["token", "sequence-mean"]
ADVANTAGE_LEVELS = get_args(AdvantageLevel)
RejectionMetric = Literal["ratio", "k2", "k3"]
REJECTION_METRICS = get_args(RejectionMetric)
RejectionLevel = Literal["token", "sequence-sum", "sequence-mean", "sequence-max"]
REJECTION_LEVELS = get_args(RejectionLevel)

# verl's guard on log-ratios before exp (rollout_corr_helper.SAFETY_BOUND): rejection statistics use it too, so that
# a converted verl setting decides exactly as verl does.
LOG_RATIO_BOUND = 20.0

# Names of the raw sums every engine accumulates; metrics are ratios of these, so sums from several trees,
# micro-steps or ranks can be added before the ratios are taken. METRIC_MAXIMA are the few raw statistics that
# are maxima instead: kept as the largest over chunks, trees and ranks (never added).
METRIC_SUMS = ("trained_tokens", "clipped_tokens", "approx_kl_sum", "ref_kl_sum", "entropy_sum", "ratio_sum",
               "ratio_deviation_sq_sum", "importance_weight_sum", "capped_tokens", "nonfinite_tokens", "value_sum",
               "value_error_sq_sum", "value_clipped_tokens", "logprob_gap_tokens", "logprob_gap_abs_sum",
               "logprob_gap_k3_sum")
METRIC_MAXIMA = ("logprob_gap_max",)


def per_rollout_sum(values: torch.Tensor, owner: torch.Tensor, num_rollouts: int) -> torch.Tensor:
    """The sum of a flat per-token tensor over each rollout's tokens ``[R]`` (float64)."""
    return torch.zeros(num_rollouts, dtype=torch.float64).index_add_(0, owner, values.to(torch.float64))


@dataclass(frozen=True, kw_only=True)
class StepAggregation:
    """How per-(token, rollout) terms become the step's loss: shared by the policy and the value loss, with the
    parts of :class:`~lightning_dta.contracts.Objective` they have in common.

    The normalisers are three counts that add over trees and ranks: trained (token, rollout) pairs, rollouts with a
    trained token, and rollouts; each ``agg`` divides by the one it needs."""

    metric_sums: ClassVar[tuple[str, ...]] = METRIC_SUMS + METRIC_MAXIMA
    metric_maxima: ClassVar[tuple[str, ...]] = METRIC_MAXIMA
    token_fields: ClassVar[tuple[str, ...]] = ()
    required_fields: ClassVar[tuple[str, ...]] = ()

    agg: Aggregation = "token-mean"
    """aggregation over the whole step: token-mean, seq-mean-token-mean, seq-mean-token-sum,
    seq-mean-token-sum-norm (Dr. GRPO: token sums divided by the constant agg_norm_length) or sum."""
    agg_norm_length: int | None = None
    """seq-mean-token-sum-norm only (required there): the constant length L each rollout's token sum is divided by."""
    agg_rollouts: AggRollouts = "trained"
    """seq-mean-* only: the rollouts the mean runs over: "trained" (those with at least one trained token) or "all"
    (every rollout of the step: TRL's grpo/dr_grpo/luspo and verl's trainer count a row that trains nothing, e.g. a
    truncated completion masked out, or one whose tokens were all rejected)."""

    def _norm_aggs(self) -> tuple[str, ...]:
        """The aggregations this objective uses (its own; the policy loss adds its entropy bonus's)."""
        return (self.agg,)

    def __post_init__(self) -> None:
        name = type(self).__name__
        if self.agg not in AGGREGATIONS:
            raise ConfigError(f"{name}.agg is {self.agg!r}; choose one of {AGGREGATIONS}")
        if self.agg_rollouts not in AGG_ROLLOUTS:
            raise ConfigError(f"{name}.agg_rollouts is {self.agg_rollouts!r}; choose one of {AGG_ROLLOUTS}")
        normed = "seq-mean-token-sum-norm" in self._norm_aggs()
        if normed != (self.agg_norm_length is not None):
            raise ConfigError(f"{name}.agg_norm_length is required by agg='seq-mean-token-sum-norm' "
                             f"and used by nothing else (agg={self.agg!r}, agg_norm_length={self.agg_norm_length!r})")
        if self.agg_norm_length is not None and self.agg_norm_length < 1:
            raise ConfigError(f"{name}.agg_norm_length={self.agg_norm_length} . Fix: a length >= 1")

    def prepare(self, tokens: StepTokens) -> StepTokens:
        """Nothing to decide before the walk: every trained token counts, as given."""
        return tokens

    def normalizer(self, masks: Sequence[torch.Tensor]) -> tuple[float, float, float]:
        """This tree's share of the step's normalisers from per-rollout masks: (trained (token, rollout) pairs,
        rollouts with at least one trained token, rollouts).

        A distributed step sums these over ranks and passes the totals to ``tree_backward(normalizer=...)``.
        """
        return (float(sum(int(m.sum()) for m in masks)), float(sum(1 for m in masks if m.sum() > 0)),
                float(len(masks)))

    def _agg_weights(self, agg: str, counts: torch.Tensor, normalizer: Sequence[float]) -> torch.Tensor:
        tokens, trained, rollouts = (float(n) for n in normalizer)
        if agg == "sum":
            return torch.ones_like(counts)
        if agg == "token-mean":
            return torch.full_like(counts, 1.0 / max(tokens, 1e-30))
        norm = max(trained if self.agg_rollouts == "trained" else rollouts, 1e-30)
        if agg == "seq-mean-token-mean":
            return torch.where(counts > 0, 1.0 / (norm * counts.clamp(min=1)), torch.zeros_like(counts))
        if agg == "seq-mean-token-sum":
            return torch.full_like(counts, 1.0 / norm)
        return torch.full_like(counts, 1.0 / (norm * self.agg_norm_length))

    def rollout_weights(self, token_counts: torch.Tensor, normalizer: Sequence[float]) -> torch.Tensor:
        """Weights ``[R, K]`` of each rollout's per-token loss sums, one column per aggregation in use, so that the
        step's loss is a weighted sum."""
        counts = token_counts.to(torch.float64)
        return torch.stack([self._agg_weights(agg, counts, normalizer) for agg in self._norm_aggs()], dim=1)

    def metrics(self, sums: Mapping[str, float]) -> dict[str, float]:
        """The reported metrics from the raw sums (:func:`metrics_from_sums`)."""
        return metrics_from_sums(sums)


@dataclass(frozen=True)
class Rejection:
    """A rule that rejects (token, rollout) pairs from the loss AND from its normalisers before the walk (verl's
    ``rollout_rs``), decided from ``d = prox - old`` (the log of the weight w = pi_prox / pi_old), clamped to
    [-20, 20] as verl does. A rule keeps a pair when its statistic lies within the bounds; several rules must all
    keep it."""

    metric: RejectionMetric = "ratio"
    """ratio: the weight w = exp(d), kept in [lower, upper]; k2: d^2 / 2, kept <= upper; k3: w - 1 - d, kept
    <= upper."""
    level: RejectionLevel = "token"
    """token: each token's own statistic; sequence-sum / sequence-mean / sequence-max: the rollout's sum / mean /
    max of it over its trained tokens, which keeps or rejects the whole rollout (for ratio, the sum is the log of
    the product of the token weights, the mean that of their geometric mean, the max their largest)."""
    lower: float | None = None
    """ratio only: the smallest weight kept (null: no lower bound)."""
    upper: float | None = None
    """the largest value kept (required for k2/k3; for ratio, null: no upper bound)."""

    def __post_init__(self) -> None:
        if self.metric not in REJECTION_METRICS:
            raise ConfigError(f"Rejection.metric is {self.metric!r}; choose one of {REJECTION_METRICS}")
        if self.level not in REJECTION_LEVELS:
            raise ConfigError(f"Rejection.level is {self.level!r}; choose one of {REJECTION_LEVELS}")
        for name in ("lower", "upper"):
            value = getattr(self, name)  # this dataclass's own two fields
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"Rejection.{name}={value} must be a positive number (or null)")
        if self.metric == "ratio":
            if self.lower is None and self.upper is None:
                raise ConfigError("Rejection(metric='ratio') needs lower, upper or both")
            if self.lower is not None and self.upper is not None and self.lower > self.upper:
                raise ConfigError(f"Rejection.lower={self.lower} must be <= upper={self.upper}")
        elif self.upper is None or self.lower is not None:
            raise ConfigError(f"Rejection(metric={self.metric!r}) takes an upper bound only (got lower={self.lower}, "
                             f"upper={self.upper})")

    def keep(self, log_weight: torch.Tensor, trained: torch.Tensor, owner: torch.Tensor, num_rollouts: int
             ) -> torch.Tensor:
        """Which of the flat trained tokens this rule keeps (``True`` off the trained tokens)."""
        d = log_weight.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        stat = d if self.metric == "ratio" else 0.5 * d.square() if self.metric == "k2" else torch.exp(d) - 1.0 - d
        if self.level != "token":
            masked = torch.where(trained, stat, 0.0)
            if self.level == "sequence-max":
                seq = torch.full((num_rollouts,), -math.inf, dtype=torch.float64).scatter_reduce_(
                    0, owner, torch.where(trained, stat, -math.inf), reduce="amax")
            else:
                seq = per_rollout_sum(masked, owner, num_rollouts)
                if self.level == "sequence-mean":
                    seq = seq / per_rollout_sum(trained, owner, num_rollouts).clamp(min=1)
            stat = seq[owner]
        if self.metric == "ratio":
            keep = torch.ones_like(trained)
            if self.lower is not None:
                keep &= stat >= math.log(self.lower)
            if self.upper is not None:
                keep &= stat <= math.log(self.upper)
        else:
            keep = stat <= self.upper
        return keep | ~trained


@dataclass(frozen=True, kw_only=True)
class PolicyLoss(StepAggregation):
    """Clipped policy-gradient loss (PPO, GSPO or CISPO) with decoupled-PPO importance weights (optionally
    bounded), rejection, dual clipping, a KL to the reference and an entropy bonus; definitions in
    ``docs/losses.md``.

    For a trained token with log-prob ``logp`` (``old`` defaults to ``logp`` detached, ``prox`` to ``old``):
    ``ratio = exp(logp - prox)``, ``w = exp(prox - old)``,
    ``pg = -w * min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)``,
    ``kl = exp(ref - logp) - (ref - logp) - 1``, ``loss = pg + kl_coef * kl - entropy_coef * entropy``,
    aggregated over the whole step with ``agg``. SFT is ``advantages=1`` with no old log-probs.

    Converters from other trainers' settings: :meth:`from_trl`, :meth:`from_verl`, :meth:`from_areal`.
    """

    clip_eps: float = 0.2
    """PPO clip range below 1: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float | None = None
    """PPO clip range above 1 ("clip-higher"); null: clip_eps."""
    kl_coef: float = 0.0
    """weight of the KL to the rollouts' ref_logprobs (estimator: kl_estimator)."""
    kl_estimator: KLEstimator = "k3"
    """k3: exp(ref - logp) - (ref - logp) - 1 (TRL's); low_var_kl: verl's k3, with ref - logp clamped to [-20, 20]
    and the value to [-10, 10] (no gradient where a clamp binds); k3+: verl's k3+, low_var_kl's value with the
    gradient of k2 = (logp - ref)^2 / 2."""
    kl_ratio_weighted: bool = False
    """multiply each token's KL by the ratio exp(logp - prox), its gradient included (TRL's
    use_bias_correction_kl: the current policy's KL estimated from the rollout policy's samples)."""
    entropy_coef: float = 0.0
    """weight of the entropy bonus."""
    entropy_agg: Aggregation | None = None
    """the entropy bonus's own aggregation over the step; null: agg (verl). TRL: token-mean, whatever its
    loss_type."""
    loss_mode: LossMode = "ppo"
    """ppo: the token-level clipped ratio; gspo: the sequence-level ratio exp(mean_t(logp - prox)) of the current
    weights in its token form; cispo: -w * sg(clip(ratio)) * A * logp (the clipped ratio only weights the gradient)."""
    advantage_level: AdvantageLevel = "token"
    """token: each token's advantage; sequence-mean: every token of a rollout takes the mean advantage of its
    trained tokens (AReaL's GSPO)."""
    dual_clip: float | None = None
    """ppo only: for A < 0 the surrogate is bounded by dual_clip * A (dual-clip PPO; > 1, e.g. 3)."""
    importance_weight_cap: float | None = None
    """upper bound C >= 1 of the decoupled-PPO weight w = exp(prox - old) (stale async rollouts, inference/trainer
    log-prob mismatch); null: no cap."""
    importance_weight_floor: float | None = None
    """lower bound F in (0, 1] of the weight (TRL's vllm_importance_sampling_clip_min, verl's IcePop lower
    bound); null: none."""
    importance_weight_mode: WeightMode = "truncate"
    """truncate: clamp w to [F, C] (TIS); mask: w * [F <= w <= C] (MIS, drops the token's policy term; the token
    stays in the normaliser)."""
    importance_level: Level = "token"
    """token: w per token; sequence: w_i = exp(mean over the rollout's trained tokens of (prox - old)) (their
    geometric mean); sequence-product: w_i = exp(sum of them) (the product of the token weights: TRL's sequence_*
    modes, verl's rollout_is: sequence); none: no weight (prox - old then only feeds rejection)."""
    rejection: tuple[Rejection, ...] = ()
    """rules that drop (token, rollout) pairs from the loss and its normalisers before the walk (verl's
    rollout_rs), e.g. [{metric: ratio, level: token, lower: 0.5, upper: 2.0}]; every rule must keep a pair."""
    rejection_keeps_normalizer: bool = False
    """rejected pairs still count in the normalisers (AReaL's rejection_sampling action: mask) instead of leaving
    them (verl's rollout_rs)."""

    def _norm_aggs(self) -> tuple[str, ...]:
        return (self.agg,) if self.entropy_agg is None else (self.agg, self.entropy_agg)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.entropy_agg is not None and self.entropy_agg not in AGGREGATIONS:
            raise ConfigError(f"PolicyLoss.entropy_agg is {self.entropy_agg!r}; choose one of {AGGREGATIONS} or null")
        for name, value, choices in (("loss_mode", self.loss_mode, LOSS_MODES),
                                     ("importance_weight_mode", self.importance_weight_mode, WEIGHT_MODES),
                                     ("importance_level", self.importance_level, LEVELS),
                                     ("kl_estimator", self.kl_estimator, KL_ESTIMATORS),
                                     ("advantage_level", self.advantage_level, ADVANTAGE_LEVELS)):
            if value not in choices:
                raise ConfigError(f"PolicyLoss.{name}={value!r} is unknown. Fix: one of {choices}")
        if self.clip_eps < 0 or (self.clip_eps_high is not None and self.clip_eps_high < 0):
            raise ConfigError(f"PolicyLoss.clip_eps={self.clip_eps!r}, clip_eps_high={self.clip_eps_high!r}: the clip "
                              "range below and above a ratio of 1. Fix: numbers >= 0 (e.g. 0.2 and 0.28)")
        if self.dual_clip is not None and (self.dual_clip <= 1 or self.loss_mode != "ppo"):
            raise ConfigError(f"PolicyLoss.dual_clip={self.dual_clip}. Fix: a bound > 1 (e.g. 3) with loss_mode='ppo', "
                              "or null")
        if self.importance_weight_cap is not None and not self.importance_weight_cap >= 1:
            raise ConfigError(f"PolicyLoss.importance_weight_cap={self.importance_weight_cap} must be >= 1 (or null); "
                             "below 1 it would shrink weights that are already on-policy")
        floor = self.importance_weight_floor
        if floor is not None and not 0 < floor <= 1:
            raise ConfigError(f"PolicyLoss.importance_weight_floor={floor} must lie in (0, 1] (or null); above 1 it "
                             "would raise weights that are already on-policy")
        if self.importance_level == "none" and (floor is not None or self.importance_weight_cap is not None):
            raise ConfigError("PolicyLoss.importance_level='none' applies no weight, so importance_weight_cap and "
                             "importance_weight_floor bound nothing. Fix: leave them null, or choose a level")
        rules = tuple(r if isinstance(r, Rejection) else Rejection(**r) for r in self.rejection)  # YAML: mappings
        object.__setattr__(self, "rejection", rules)
        if self.rejection_keeps_normalizer and not rules:
            raise ConfigError("PolicyLoss.rejection_keeps_normalizer is set but there is no rejection rule")

    head: ClassVar[str] = "logprobs"

    @classmethod
    def from_trl(cls, config: Any) -> Converted:
        """A TRL ``GRPOConfig`` (or its dict): this loss, the advantage settings and the notes, or a
        :class:`~lightning_dta.core.conversions.ConversionError` naming the setting it cannot express
        (:func:`lightning_dta.core.conversions.trl.from_trl`)."""
        from lightning_dta.core.conversions.trl import from_trl

        return from_trl(config)

    @classmethod
    def from_verl(cls, actor: Any, algorithm: Any = None, rollout: Any = None, data: Any = None,
                  trainer: Any = None) -> Converted:
        """verl's ``actor_rollout_ref.actor`` config, ``algorithm`` config, (for the temperature)
        ``actor_rollout_ref.rollout`` config and (for the mini-batches) ``data`` and ``trainer`` configs, as objects
        or dicts (:func:`lightning_dta.core.conversions.verl.from_verl`)."""
        from lightning_dta.core.conversions.verl import from_verl

        return from_verl(actor, algorithm, rollout, data, trainer)

    @classmethod
    def from_areal(cls, actor: Any) -> Converted:
        """AReaL's ``PPOActorConfig`` (``actor:`` in its YAML), as an object or a dict
        (:func:`lightning_dta.core.conversions.areal.from_areal`)."""
        from lightning_dta.core.conversions.areal import from_areal

        return from_areal(actor)

    @property
    def needs_entropy_grad(self) -> bool:
        return self.entropy_coef != 0.0

    @property
    def step_fields(self) -> tuple[str, ...]:
        """The KL term needs the reference log-probs: a step without any is refused (kl_coef > 0)."""
        return ("ref_logprobs",) if self.kl_coef != 0.0 else ()

    @property
    def advantage_only(self) -> bool:
        """Without KL and entropy terms, every term is a multiple of an advantage."""
        return self.kl_coef == 0.0 and self.entropy_coef == 0.0

    @property
    def needs_sequence_ratio(self) -> bool:
        """GSPO's ratio is a statistic of the whole rollout under the current weights: the engine computes it in a
        forward-only pass before the walk."""
        return self.loss_mode == "gspo"

    def prepare(self, tokens: StepTokens) -> StepTokens:
        """Before the walk, from old/prox alone: the rejection rules' kept pairs, the sequence-level log-weight
        (over the rollout's trained tokens before rejection, as verl computes it), and the sequence-mean
        advantages (over the kept tokens, as AReaL does)."""
        trained = tokens.mask > 0
        owner, count = tokens.owner, tokens.num_rollouts
        sequence = self.importance_level in ("sequence", "sequence-product")
        log_weight = None
        if sequence or self.rejection:
            missing = torch.isnan(tokens.old) & ~torch.isnan(tokens.prox) & trained
            if bool(missing.any()):
                what = "the sequence-level importance weight" if sequence else "rejection"
                raise RolloutError(int(owner[torch.nonzero(missing)[0]]), "old_logprobs", f"is missing where "
                                   f"prox_logprobs is given, so {what} (from prox - old, before the walk) is "
                                   "undefined", "give the behaviour log-probs, or use importance_level='token' "
                                   "without rejection")
            known = ~torch.isnan(tokens.old) & ~torch.isnan(tokens.prox) & trained
            log_weight = torch.where(known, tokens.prox - tokens.old, 0.0)
        kept = trained
        for rule in self.rejection:
            kept = kept & rule.keep(log_weight, trained, owner, count)
        seq_log_weight = None
        if sequence:
            seq_log_weight = per_rollout_sum(log_weight, owner, count)
            if self.importance_level == "sequence":
                seq_log_weight = seq_log_weight / per_rollout_sum(trained, owner, count).clamp(min=1)
        advantages = tokens.advantages
        if self.advantage_level == "sequence-mean":
            means = per_rollout_sum(torch.where(kept, advantages, 0.0), owner, count) / \
                per_rollout_sum(kept, owner, count).clamp(min=1)
            advantages = torch.where(kept, means[owner], advantages)
        mask = kept.to(tokens.mask.dtype)
        return dataclasses.replace(tokens, mask=mask, advantages=advantages, seq_log_weight=seq_log_weight,
                                   normalizer_mask=tokens.mask if self.rejection_keeps_normalizer else None)

    def _importance_weight(self, old: torch.Tensor, prox: torch.Tensor, data: TokenData
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (bounded) decoupled weight and where a bound acted."""
        if self.importance_level == "none":
            return torch.ones_like(old), torch.zeros_like(old, dtype=torch.bool)
        log_weight = prox - old if self.importance_level == "token" else data.seq_log_weight
        weight = torch.exp(log_weight).expand_as(old)
        cap, floor = self.importance_weight_cap, self.importance_weight_floor
        bounded = torch.zeros_like(weight, dtype=torch.bool)
        if cap is not None:
            bounded = bounded | (weight > cap)
        if floor is not None:
            bounded = bounded | (weight < floor)
        if self.importance_weight_mode == "truncate":
            return weight.clamp(min=floor, max=cap) if cap is not None or floor is not None else weight, bounded
        return torch.where(bounded, torch.zeros_like(weight), weight), bounded

    def _kl(self, logp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """The per-token KL estimate to the reference (``kl_estimator``)."""
        diff = ref - logp
        if self.kl_estimator == "k3":
            return torch.exp(diff) - diff - 1.0
        clamped = diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        low_var = (torch.exp(clamped) - clamped - 1.0).clamp(-10.0, 10.0)
        if self.kl_estimator == "low_var_kl":
            return low_var
        k2 = 0.5 * diff.square()  # k3+: k2's gradient, low_var_kl's value
        return k2 - k2.detach() + low_var.detach()

    def __call__(self, logp: torch.Tensor, entropy: torch.Tensor | None, data: TokenData,
                 sums: dict) -> torch.Tensor:
        """Weighted loss of a ``[R, L]`` grid of log-probs; adds metric sums into ``sums``.

        ``entropy`` is ``[1 or R, L]`` (or ``None`` when neither the loss nor the metrics need it). ``data.weight``'s
        first column weighs the policy and KL terms, its last the entropy bonus (one column when they share ``agg``).
        """
        mask = data.mask
        trained = mask > 0
        logp_d = logp.detach()
        # Untrained entries of the grid (positions another rollout of the chunk trains) take the current log-prob
        # as old/prox/ref: their terms are then finite, so an extreme filler value there (a -1e4 behaviour
        # log-prob on a prompt token) cannot turn the chunk's loss or gradient into inf * 0 = NaN.
        old = torch.where(trained & ~torch.isnan(data.old), data.old, logp_d)
        prox = torch.where(trained & ~torch.isnan(data.prox), data.prox, old)
        adv = data.advantages
        token_ratio = torch.exp(logp - prox)
        if self.loss_mode == "gspo":  # value exp(mean_t(logp - prox)) of the rollout, gradient s_i * grad logp
            ratio = torch.exp(data.seq_log_ratio) * torch.exp(logp - logp_d)
        else:
            ratio = token_ratio
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        clipped_ratio = ratio.clamp(1.0 - self.clip_eps, 1.0 + high)
        importance, capped = self._importance_weight(old, prox, data)
        if self.loss_mode == "cispo":
            loss = -importance * clipped_ratio.detach() * adv * logp
        else:
            surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
            if self.dual_clip is not None:
                surrogate = torch.where(adv < 0, torch.maximum(surrogate, self.dual_clip * adv), surrogate)
            loss = -importance * surrogate
        has_ref = ~torch.isnan(data.ref) & trained
        ref_kl = None
        if self.kl_coef != 0.0 and data.any_ref:
            ref_kl = self._kl(logp, torch.where(has_ref, data.ref, logp_d))
            kl_term = ref_kl * token_ratio if self.kl_ratio_weighted else ref_kl
            loss = loss + self.kl_coef * kl_term
        weighted = (torch.where(trained, loss, 0.0) * (mask * data.weight[:, :1])).sum()
        if self.entropy_coef != 0.0:
            bonus = torch.where(trained, entropy.expand_as(mask), 0.0) * (mask * data.weight[:, -1:])
            weighted = weighted - self.entropy_coef * bonus.sum()

        with torch.no_grad():  # sums stay tensors: no device sync per node
            sums["trained_tokens"] += mask.sum()
            changed = (ratio != clipped_ratio) if self.loss_mode == "cispo" else \
                (ratio * adv - clipped_ratio * adv).abs() > 0
            sums["clipped_tokens"] += (changed * mask).sum()
            behaviour_log_ratio = logp_d - old
            # k3 >= 0; clamped because exp(x) - 1 - x rounds to tiny negatives for x near 0 ("-1.9e-09")
            approx_kl = (torch.exp(behaviour_log_ratio) - 1.0 - behaviour_log_ratio).clamp_min(0.0)
            sums["approx_kl_sum"] += (approx_kl * mask).sum()
            sums["ratio_sum"] += (ratio.detach() * mask).sum()
            # about 1, not about 0: summed squares of ratio - 1 keep a small spread that squares of the ratio lose
            sums["ratio_deviation_sq_sum"] += ((ratio.detach() - 1.0).square() * mask).sum()
            sums["importance_weight_sum"] += (importance * mask).sum()
            sums["capped_tokens"] += (capped * mask).sum()
            sums["nonfinite_tokens"] += (~torch.isfinite(loss.detach()) * mask).sum()
            if ref_kl is not None:
                sums["ref_kl_sum"] += (ref_kl.detach() * mask * has_ref).sum()
            if entropy is not None:
                sums["entropy_sum"] += (entropy.detach() * mask).sum()
            self._logprob_gap(logp_d, data.old, trained, sums)
        return weighted

    @staticmethod
    def _logprob_gap(logp: torch.Tensor, behaviour: torch.Tensor, trained: torch.Tensor, sums: dict) -> None:
        """The trainer's log-probs against the behaviour (generator's) ones on the trained pairs that carry them:
        ``r = logp - behaviour``; ``|r|`` summed and its maximum, and ``k3 = exp(r) - 1 - r``. On tokens sampled
        from the generator's distribution q, ``E_q[exp(r) - 1 - r] = E_q[p/q] - 1 + E_q[log q - log p] =
        KL(q || p)``: the KL of the generator's distribution against the trainer's (p). Counted per (token,
        rollout) pair, unweighted: a figure of the engines, not of the loss's weighting."""
        carried = trained & ~torch.isnan(behaviour)
        gap = torch.where(carried, logp - behaviour, 0.0)
        size = gap.abs()
        sums["logprob_gap_tokens"] += carried.sum()
        sums["logprob_gap_abs_sum"] += size.sum()
        # k3 >= 0; clamped because exp(x) - 1 - x rounds to tiny negatives for x near 0
        sums["logprob_gap_k3_sum"] += (torch.exp(gap) - 1.0 - gap).clamp_min(0.0).sum()
        if size.numel():
            sums["logprob_gap_max"] = torch.clamp(size.max(), min=sums["logprob_gap_max"])


@dataclass(frozen=True, kw_only=True)
class ValueLoss(StepAggregation):
    """The critic's clipped value loss per (token, rollout): ``0.5 * max((v - R)^2, (clip(v, old - e, old + e) - R)^2)``
    with ``R`` the rollout's ``returns`` and ``old`` its ``old_values`` (without them, or with ``clip_eps=None``:
    ``0.5 * (v - R)^2``), aggregated over the step like the policy loss. ``v`` is the value head's output at the
    position before the token (the state the token is emitted from), as log-probs are indexed."""

    clip_eps: float | None = 0.2
    """clip range of the value around old_values (PPO's value clipping); null: no clipping."""

    head: ClassVar[str] = "values"
    token_fields: ClassVar[tuple[str, ...]] = ("returns", "old_values")
    required_fields: ClassVar[tuple[str, ...]] = ("returns",)
    step_fields: ClassVar[tuple[str, ...]] = ()
    needs_entropy_grad: ClassVar[bool] = False
    needs_sequence_ratio: ClassVar[bool] = False
    advantage_only: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip_eps is not None and self.clip_eps < 0:
            raise ConfigError(f"ValueLoss.clip_eps={self.clip_eps}. Fix: a clip range >= 0, or null")

    def __call__(self, values: torch.Tensor, entropy: torch.Tensor | None, data: TokenData,
                 sums: dict) -> torch.Tensor:
        """Weighted loss of a ``[R, L]`` grid of values; adds metric sums into ``sums``."""
        mask = data.mask
        trained = mask > 0
        returns = torch.where(trained, data.returns, values.detach())  # untrained entries: no term, no NaN
        error = (values - returns).square()
        loss = 0.5 * error
        clipped_error = None
        if self.clip_eps is not None and data.old_values is not None:
            has_old = ~torch.isnan(data.old_values) & trained
            old = torch.where(has_old, data.old_values, values.detach())
            clipped = old + (values - old).clamp(-self.clip_eps, self.clip_eps)
            clipped_error = (clipped - returns).square()
            loss = 0.5 * torch.maximum(error, clipped_error)
        weighted = (torch.where(trained, loss, 0.0) * (mask * data.weight)).sum()
        with torch.no_grad():
            sums["trained_tokens"] += mask.sum()
            sums["value_sum"] += (values.detach() * mask).sum()
            sums["value_error_sq_sum"] += (error.detach() * mask).sum()
            sums["nonfinite_tokens"] += (~torch.isfinite(loss.detach()) * mask).sum()
            if clipped_error is not None:
                sums["value_clipped_tokens"] += ((clipped_error > error) * mask).sum()
        return weighted


def metrics_from_sums(sums: Mapping[str, float]) -> dict[str, float]:
    """Turn raw sums (floats or 0-d tensors) into the reported metrics: means over trained (token, rollout)
    pairs, plus the trained-token count."""
    sums = {key: float(value) for key, value in sums.items()}
    n = max(sums.get("trained_tokens", 0.0), 1.0)
    ratio_offset = sums.get("ratio_sum", 0.0) / n - 1.0 if sums.get("trained_tokens", 0.0) else 0.0
    return {
        "trained_tokens": sums.get("trained_tokens", 0.0),
        "clip_fraction": sums.get("clipped_tokens", 0.0) / n,
        "approx_kl": sums.get("approx_kl_sum", 0.0) / n,
        "ref_kl": sums.get("ref_kl_sum", 0.0) / n,
        "entropy": sums.get("entropy_sum", 0.0) / n,
        "ratio_mean": sums.get("ratio_sum", 0.0) / n,
        "ratio_std": math.sqrt(max(sums.get("ratio_deviation_sq_sum", 0.0) / n - ratio_offset ** 2, 0.0)),
        "importance_weight_mean": sums.get("importance_weight_sum", 0.0) / n,
        "capped_fraction": sums.get("capped_tokens", 0.0) / n,
        "nonfinite_tokens": sums.get("nonfinite_tokens", 0.0),
    } | ({  # the trainer against the generator, on the pairs with behaviour log-probs (PolicyLoss._logprob_gap)
        "logprob_gap_max": sums.get("logprob_gap_max", 0.0),
        "logprob_gap_mean": sums.get("logprob_gap_abs_sum", 0.0) / sums["logprob_gap_tokens"],
        "logprob_gap_kl": sums.get("logprob_gap_k3_sum", 0.0) / sums["logprob_gap_tokens"],
    } if sums.get("logprob_gap_tokens", 0.0) else {}) | ({  # a critic's step (ValueLoss)
        "value_mean": sums.get("value_sum", 0.0) / n,
        "value_mse": sums.get("value_error_sq_sum", 0.0) / n,
        "value_clip_fraction": sums.get("value_clipped_tokens", 0.0) / n,
    } if sums.get("value_error_sq_sum", 0.0) or sums.get("value_sum", 0.0) else {})


def empty_sums() -> dict[str, float]:
    return dict.fromkeys(METRIC_SUMS + METRIC_MAXIMA, 0.0)
