"""The RL policy loss (its definition: ``docs/losses.md``), evaluated per (token, rollout) pair.

A shared token appears once in the tree but once per rollout in the loss, so every term is computed on a
``[rollouts, positions]`` grid built from the same log-probs: clipping stays exact when rollouts carry
different advantages or behaviour log-probs on a shared prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sum"]
AGGREGATIONS = get_args(Aggregation)

# Names of the raw sums every engine accumulates; metrics are ratios of these, so sums from several trees,
# micro-steps or ranks can be added before the ratios are taken.
METRIC_SUMS = ("trained_tokens", "clipped_tokens", "approx_kl_sum", "ref_kl_sum", "entropy_sum", "ratio_sum")


@dataclass
class TokenData:
    """Per-(rollout, position) inputs of the loss, each ``[R, L]`` (float unless noted).

    ``old``/``prox``/``ref`` hold NaN where the rollout did not provide the field.
    """

    mask: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor
    prox: torch.Tensor
    ref: torch.Tensor
    weight: torch.Tensor  # [R, 1]: the aggregation weight of each rollout
    any_ref: bool = False  # whether any rollout of the step has reference log-probs


@dataclass(frozen=True)
class PolicyLoss:
    """PPO-style clipped policy-gradient loss with decoupled-PPO weights, k3 KL and an entropy bonus.

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
    agg: Aggregation = "token-mean"
    """aggregation over the whole step: token-mean, seq-mean-token-mean, seq-mean-token-sum or sum."""

    def __post_init__(self) -> None:
        if self.agg not in AGGREGATIONS:
            raise ValueError(f"PolicyLoss.agg is {self.agg!r}; choose one of {AGGREGATIONS}")
        if self.clip_eps < 0 or (self.clip_eps_high is not None and self.clip_eps_high < 0):
            raise ValueError("PolicyLoss.clip_eps and clip_eps_high must be >= 0")

    @property
    def needs_entropy_grad(self) -> bool:
        return self.entropy_coef != 0.0

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
        return torch.ones_like(counts)

    def __call__(self, logp: torch.Tensor, entropy: torch.Tensor | None, data: TokenData,
                 sums: dict) -> torch.Tensor:
        """Weighted loss of a ``[R, L]`` grid of log-probs; adds metric sums into ``sums``.

        ``entropy`` is ``[1 or R, L]`` (or ``None`` when neither the loss nor the metrics need it).
        """
        mask = data.mask
        logp_d = logp.detach()
        old = torch.where(torch.isnan(data.old), logp_d, data.old)
        prox = torch.where(torch.isnan(data.prox), old, data.prox)
        adv = data.advantages
        log_ratio = logp - prox
        ratio = torch.exp(log_ratio)
        high = self.clip_eps if self.clip_eps_high is None else self.clip_eps_high
        clipped_ratio = ratio.clamp(1.0 - self.clip_eps, 1.0 + high)
        surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
        importance = torch.exp(prox - old)
        loss = -importance * surrogate
        has_ref = ~torch.isnan(data.ref)
        ref_kl = None
        if self.kl_coef != 0.0 and data.any_ref:
            diff = torch.where(has_ref, data.ref, logp_d) - logp
            ref_kl = torch.exp(diff) - diff - 1.0
            loss = loss + self.kl_coef * ref_kl
        if self.entropy_coef != 0.0:
            loss = loss - self.entropy_coef * entropy
        weighted = (loss * (mask * data.weight)).sum()

        with torch.no_grad():  # sums stay tensors: no device sync per node
            sums["trained_tokens"] += mask.sum()
            clipped = (ratio * adv - clipped_ratio * adv).abs() > 0
            sums["clipped_tokens"] += (clipped * mask).sum()
            behaviour_log_ratio = logp_d - old
            # k3 >= 0; clamped because exp(x) - 1 - x rounds to tiny negatives for x near 0 ("-1.9e-09")
            approx_kl = (torch.exp(behaviour_log_ratio) - 1.0 - behaviour_log_ratio).clamp_min(0.0)
            sums["approx_kl_sum"] += (approx_kl * mask).sum()
            sums["ratio_sum"] += (ratio.detach() * mask).sum()
            if ref_kl is not None:
                sums["ref_kl_sum"] += (ref_kl.detach() * mask * has_ref).sum()
            if entropy is not None:
                sums["entropy_sum"] += (entropy.detach() * mask).sum()
        return weighted


def metrics_from_sums(sums: dict) -> dict[str, float]:
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
    }


def empty_sums() -> dict[str, float]:
    return dict.fromkeys(METRIC_SUMS, 0.0)
