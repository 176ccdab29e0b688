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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import torch

from lightning_dta.contracts import TokenData
from lightning_dta.core.errors import ConfigError

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "sum"]
AGGREGATIONS = get_args(Aggregation)
LossMode = Literal["ppo", "gspo", "cispo"]
LOSS_MODES = get_args(LossMode)
WeightMode = Literal["truncate", "mask"]
WEIGHT_MODES = get_args(WeightMode)
Level = Literal["token", "sequence"]
LEVELS = get_args(Level)

# Names of the raw sums every engine accumulates; metrics are ratios of these, so sums from several trees,
# micro-steps or ranks can be added before the ratios are taken.
METRIC_SUMS = ("trained_tokens", "clipped_tokens", "approx_kl_sum", "ref_kl_sum", "entropy_sum", "ratio_sum",
               "importance_weight_sum", "capped_tokens", "nonfinite_tokens", "value_sum", "value_error_sq_sum",
               "value_clipped_tokens")


@dataclass(frozen=True, kw_only=True)
class StepAggregation:
    """How per-(token, rollout) terms become the step's loss: shared by the policy and the value loss, with the
    parts of :class:`~lightning_dta.contracts.Objective` they have in common."""

    metric_sums: ClassVar[tuple[str, ...]] = METRIC_SUMS
    token_fields: ClassVar[tuple[str, ...]] = ()
    required_fields: ClassVar[tuple[str, ...]] = ()

    agg: Aggregation = "token-mean"
    """aggregation over the whole step: token-mean, seq-mean-token-mean, seq-mean-token-sum,
    seq-mean-token-sum-norm (Dr. GRPO: token sums divided by the constant agg_norm_length) or sum."""
    agg_norm_length: int | None = None
    """seq-mean-token-sum-norm only (required there): the constant length L each rollout's token sum is divided by."""

    def __post_init__(self) -> None:
        if self.agg not in AGGREGATIONS:
            raise ConfigError(f"{type(self).__name__}.agg={self.agg!r} is unknown. Fix: one of {AGGREGATIONS}")
        if (self.agg == "seq-mean-token-sum-norm") != (self.agg_norm_length is not None):
            raise ConfigError(f"{type(self).__name__}.agg_norm_length is required by agg='seq-mean-token-sum-norm' "
                             f"and used by nothing else (agg={self.agg!r}, agg_norm_length={self.agg_norm_length!r})")
        if self.agg_norm_length is not None and self.agg_norm_length < 1:
            raise ConfigError(f"{type(self).__name__}.agg_norm_length={self.agg_norm_length}. Fix: a length >= 1")

    def normalizer(self, masks: Sequence[torch.Tensor]) -> float:
        """The step's loss normaliser from per-rollout loss masks: trained tokens for ``token-mean``,
        rollouts with at least one trained token for the ``seq-mean-*`` modes, 1 for ``sum``.

        A distributed step sums this over ranks and passes the total to ``tree_backward(normalizer=...)``.
        """
        if self.agg == "token-mean":
            return float(sum(int(m.sum()) for m in masks))
        if self.agg.startswith("seq-mean"):
            return float(sum(1 for m in masks if m.sum() > 0))
        return 1.0

    def rollout_weights(self, token_counts: torch.Tensor, normalizer: float) -> torch.Tensor:
        """Weight of each rollout's per-token loss sum, so that the step's loss is a weighted sum."""
        counts = token_counts.to(torch.float64)
        norm = max(float(normalizer), 1e-30)
        if self.agg == "token-mean":
            return torch.full_like(counts, 1.0 / norm)
        if self.agg == "seq-mean-token-mean":
            return torch.where(counts > 0, 1.0 / (norm * counts.clamp(min=1)), torch.zeros_like(counts))
        if self.agg == "seq-mean-token-sum":
            return torch.full_like(counts, 1.0 / norm)
        if self.agg == "seq-mean-token-sum-norm":
            return torch.full_like(counts, 1.0 / (norm * self.agg_norm_length))
        return torch.ones_like(counts)

    def metrics(self, sums: Mapping[str, float]) -> dict[str, float]:
        """The reported metrics from the raw sums (:func:`metrics_from_sums`)."""
        return metrics_from_sums(sums)


@dataclass(frozen=True, kw_only=True)
class PolicyLoss(StepAggregation):
    """Clipped policy-gradient loss (PPO, GSPO or CISPO) with decoupled-PPO importance weights (optionally
    capped), dual clipping, k3 KL and an entropy bonus; the definitions are in ``docs/losses.md``.

    For a trained token with log-prob ``logp`` (``old`` defaults to ``logp`` detached, ``prox`` to ``old``):
    ``ratio = exp(logp - prox)``, ``w = exp(prox - old)``,
    ``pg = -w * min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)``,
    ``kl = exp(ref - logp) - (ref - logp) - 1``, ``loss = pg + kl_coef * kl - entropy_coef * entropy``,
    aggregated over the whole step with ``agg``. SFT is ``advantages=1`` with no old log-probs.
    """

    clip_eps: float = 0.2
    """PPO clip range below 1: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float | None = None
    """PPO clip range above 1 ("clip-higher"); null: clip_eps."""
    kl_coef: float = 0.0
    """weight of the k3 KL to the rollouts' ref_logprobs."""
    entropy_coef: float = 0.0
    """weight of the entropy bonus."""
    loss_mode: LossMode = "ppo"
    """ppo: the token-level clipped ratio; gspo: the sequence-level ratio exp(mean_t(logp - prox)) of the current
    weights in its token form; cispo: -w * sg(clip(ratio)) * A * logp (the clipped ratio only weights the gradient)."""
    dual_clip: float | None = None
    """ppo only: for A < 0 the surrogate is bounded by dual_clip * A (dual-clip PPO; > 1, e.g. 3)."""
    importance_weight_cap: float | None = None
    """cap C >= 1 of the decoupled-PPO weight w = exp(prox - old) (stale async rollouts, inference/trainer
    log-prob mismatch); null: no cap."""
    importance_weight_mode: WeightMode = "truncate"
    """truncate: min(w, C) (TIS); mask: w * [w <= C] (MIS, drops the token's term)."""
    importance_level: Level = "token"
    """token: w per token; sequence: w_i = exp(mean over the rollout's trained tokens of (prox - old))."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, value, choices in (("loss_mode", self.loss_mode, LOSS_MODES),
                                     ("importance_weight_mode", self.importance_weight_mode, WEIGHT_MODES),
                                     ("importance_level", self.importance_level, LEVELS)):
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

    head: ClassVar[str] = "logprobs"

    @property
    def needs_entropy_grad(self) -> bool:
        return self.entropy_coef != 0.0

    @property
    def needs_sequence_weights(self) -> bool:
        return self.importance_level == "sequence"

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

    def _importance_weight(self, old: torch.Tensor, prox: torch.Tensor, data: TokenData
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (capped) decoupled weight and where the cap acted."""
        log_weight = data.seq_log_weight if self.importance_level == "sequence" else prox - old
        weight = torch.exp(log_weight).expand_as(old)
        if self.importance_weight_cap is None:
            return weight, torch.zeros_like(weight, dtype=torch.bool)
        capped = weight > self.importance_weight_cap
        if self.importance_weight_mode == "truncate":
            return weight.clamp(max=self.importance_weight_cap), capped
        return torch.where(capped, torch.zeros_like(weight), weight), capped

    def __call__(self, logp: torch.Tensor, entropy: torch.Tensor | None, data: TokenData,
                 sums: dict) -> torch.Tensor:
        """Weighted loss of a ``[R, L]`` grid of log-probs; adds metric sums into ``sums``.

        ``entropy`` is ``[1 or R, L]`` (or ``None`` when neither the loss nor the metrics need it).
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
        if self.loss_mode == "gspo":  # value exp(mean_t(logp - prox)) of the rollout, gradient s_i * grad logp
            ratio = torch.exp(data.seq_log_ratio) * torch.exp(logp - logp_d)
        else:
            ratio = torch.exp(logp - prox)
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
            diff = torch.where(has_ref, data.ref, logp_d) - logp
            ref_kl = torch.exp(diff) - diff - 1.0
            loss = loss + self.kl_coef * ref_kl
        if self.entropy_coef != 0.0:
            loss = loss - self.entropy_coef * entropy
        weighted = (torch.where(trained, loss, 0.0) * (mask * data.weight)).sum()

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
            sums["importance_weight_sum"] += (importance * mask).sum()
            sums["capped_tokens"] += (capped * mask).sum()
            sums["nonfinite_tokens"] += (~torch.isfinite(loss.detach()) * mask).sum()
            if ref_kl is not None:
                sums["ref_kl_sum"] += (ref_kl.detach() * mask * has_ref).sum()
            if entropy is not None:
                sums["entropy_sum"] += (entropy.detach() * mask).sum()
        return weighted


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
    needs_sequence_weights: ClassVar[bool] = False
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
    return {
        "trained_tokens": sums.get("trained_tokens", 0.0),
        "clip_fraction": sums.get("clipped_tokens", 0.0) / n,
        "approx_kl": sums.get("approx_kl_sum", 0.0) / n,
        "ref_kl": sums.get("ref_kl_sum", 0.0) / n,
        "entropy": sums.get("entropy_sum", 0.0) / n,
        "ratio_mean": sums.get("ratio_sum", 0.0) / n,
        "importance_weight_mean": sums.get("importance_weight_sum", 0.0) / n,
        "capped_fraction": sums.get("capped_tokens", 0.0) / n,
        "nonfinite_tokens": sums.get("nonfinite_tokens", 0.0),
    } | ({  # a critic's step (ValueLoss)
        "value_mean": sums.get("value_sum", 0.0) / n,
        "value_mse": sums.get("value_error_sq_sum", 0.0) / n,
        "value_clip_fraction": sums.get("value_clipped_tokens", 0.0) / n,
    } if sums.get("value_error_sq_sum", 0.0) or sums.get("value_sum", 0.0) else {})


def empty_sums() -> dict[str, float]:
    return dict.fromkeys(METRIC_SUMS, 0.0)
