"""The log-prob gap: how far the trainer's log-probs of the sampled tokens are from the generator's, and its bound.

Why watch it: the generator's (behaviour) log-probs are the denominator of every PPO ratio and decoupled-PPO weight.
A generator that samples with other weights or other numerics than the trainer trains (a weight sync that did not
reach it, a server whose prefix cache still holds keys/values of the old weights, a bf16 engine beside a float32
trainer) makes those ratios wrong without any error. The training step's own forward computes the trainer's
log-prob of every trained token, so :class:`~lightning_dta.PolicyLoss` measures the gap there, at no extra forward,
and ``DTAModule`` logs it every step (``train/logprob_gap_max``, ``train/logprob_gap_mean``,
``train/logprob_gap_kl``; over the step's (token, rollout) pairs that carry behaviour log-probs, reduced over the
ranks: the largest, and the token-weighted means).

The gap is the engines' alone on a step trained with the weights that generated it (staleness 0: every step in
sync mode with one step per generation batch, the first step of a generation batch, async with ``max_staleness:
0``); on a later step it also holds the policy's own change since. So the bound (``OnlineRolloutSource``'s
``max_logprob_gap``) is checked on staleness-0 steps only, and the metric is logged on every step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_dta.core.errors import ConfigError, UsageError


class LogprobGapError(UsageError, RuntimeError):
    """The generator's log-probs are further from the trainer's than ``max_logprob_gap`` allows."""


@dataclass(frozen=True)
class LogprobGap:
    """One step's gap (``PolicyLoss``'s definitions): the largest and the mean ``|logp_trainer - logp_generator|``
    over the trained tokens, and the mean k3 estimate of ``KL(generator || trainer)`` on them (the tokens are
    samples of the generator's distribution)."""

    max: float
    mean: float
    kl: float

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> LogprobGap | None:
        """The gap of a step's metrics (``StepOutput.metrics``); ``None`` when no trained token had behaviour
        log-probs."""
        if "logprob_gap_max" not in metrics:
            return None
        return cls(metrics["logprob_gap_max"], metrics["logprob_gap_mean"], metrics["logprob_gap_kl"])


def check_max_logprob_gap(value: float | None) -> None:
    """``max_logprob_gap``: ``None`` (no bound) or a positive number."""
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"max_logprob_gap={value!r}: the largest |trainer - generator| log-prob of a sampled token "
                          "an on-policy step may show. Fix: a number > 0 (e.g. 1e-3 for float32 engines), or null "
                          "for no bound")


def check_logprob_gap(gap: LogprobGap, threshold: float | None, step: int, staleness: int) -> None:
    """Stop the run when an on-policy step's largest gap exceeds ``threshold`` (module docstring)."""
    if threshold is None or staleness != 0 or gap.max <= threshold:
        return
    raise LogprobGapError(
        f"step {step}: the trainer's log-probs of the sampled tokens are up to {gap.max:.4g} from the generator's "
        f"(mean {gap.mean:.4g}, KL(generator || trainer) {gap.kl:.4g} per token), above max_logprob_gap="
        f"{threshold:g}, on a step trained with the very weights that generated it: the generator samples from "
        "other weights or other numerics than the trainer trains, so every PPO ratio of the step is off. Fix: "
        "check that the generator's weights follow the trainer's (its weight_sync; a server must drop the caches "
        "it computed with older weights); for a lower-precision engine on purpose, raise max_logprob_gap (or set "
        "it to null) and bound the weights with PolicyLoss.importance_weight_cap")
