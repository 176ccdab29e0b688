"""Advantage estimation over a whole optimizer step, before the step is partitioned across ranks.

Group-relative estimators (GRPO, a mean baseline) need every member of a group. A data-parallel partition
may put the members of one group on different ranks, so the advantages are computed here, on the full step
that every rank holds, and travel inside the rollouts; no rank ever normalises over a partial group. With
several optimizer steps per generation batch (:mod:`lightning_dta.core.generation`) the sources call these on the
whole generation batch, before it is split: "the step" below is then the generation batch (a ``std_over="step"``
std covers all of it, as TRL's, verl's and AReaL's do).

Each estimator returns NEW :class:`~lightning_dta.Rollout` objects (``dataclasses.replace``) whose
``advantages`` is one float for the whole rollout; the input rollouts are left untouched, so a cached step
(e.g. a file read once and trained for several epochs) is never mutated.

Conventions, chosen so that the numbers are well defined for every input:

- the group standard deviation is the population one by default (divide by ``n``); ``std_unbiased=True`` divides
  by ``n - 1`` as TRL and verl do (``torch.std``). For a group of ``n`` the two differ by ``sqrt((n-1)/n)`` (13%
  for ``n = 4``), which only rescales the advantages (the effective learning rate).
- a rollout alone in its group has no baseline but its own reward: its advantage is ``0`` (no learning
  signal), exactly like any group whose rewards are all equal. (verl instead returns ``r / (1 + eps)`` for a
  singleton group (mean 0, std 1), which mixes an unnormalised scale into a normalised step; its converter refuses
  ``rollout.n = 1`` with GRPO.)
- a group whose rewards are all equal gets exactly ``0`` (not ``rounding error / eps``); ``eps`` is added to the
  standard deviation so that a nearly constant group cannot blow up.
- ``weighting="token"`` weighs each rollout by its trained tokens in the means and the std (AReaL normalises
  per-token advantages, so a long answer counts once per token).

GAE's advantages can be whitened over the whole step (verl's ``masked_whiten``): :func:`advantage_sums` and
:func:`whiten_advantages`, with the step-wide sums all-reduced by the caller (``PPOCritic``), so N ranks whiten
exactly as 1 rank does.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Literal

from lightning_dta.core.errors import ConfigError
from lightning_dta.core.rollout import Rollout, RolloutError

AdvantageEstimator = Callable[[Sequence[Rollout]], list[Rollout]]


def _rewards(rollouts: Sequence[Rollout]) -> list[float]:
    """Every rollout's reward as a float; a missing or non-finite reward names the rollout."""
    rewards = []
    for index, rollout in enumerate(rollouts):
        reward = rollout.reward
        if reward is None:
            raise RolloutError(index, "reward", "is missing, and the advantage estimator needs it",
                               "give every rollout a reward, or use advantage_estimator=None to keep the "
                               "rollouts' own advantages")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RolloutError(index, "reward", f"is {reward!r}, not a finite number", "check the reward function")
        rewards.append(float(reward))
    return rewards


def _groups(keys: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Indices of the rollouts sharing each key, in input order (so results do not depend on dict order)."""
    groups: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        groups.setdefault(key, []).append(index)
    return groups


def _with_advantages(rollouts: Sequence[Rollout], advantages: Sequence[float]) -> list[Rollout]:
    return [dataclasses.replace(rollout, advantages=float(a)) for rollout, a in zip(rollouts, advantages)]


def _mean(values: Sequence[float], weights: Sequence[float]) -> float:
    total = math.fsum(weights)
    return math.fsum(w * v for w, v in zip(weights, values)) / total if total > 0 else 0.0


def _std(values: Sequence[float], weights: Sequence[float], unbiased: bool) -> float:
    """The (weighted) standard deviation around the set's own mean: divide by the weight sum, or that minus 1."""
    total = math.fsum(weights)
    mean = _mean(values, weights)
    count = total - 1.0 if unbiased else total
    return math.sqrt(math.fsum(w * (v - mean) ** 2 for w, v in zip(weights, values)) / count) if count > 0 else 0.0


def _centered(rewards: Sequence[float], groups: dict[Hashable, list[int]], scale_by_std: bool,
              eps: float, *, weights: Sequence[float] | None = None, unbiased: bool = False,
              std_over: str = "group", mean_over: str | None = "group") -> list[float]:
    """``(r - mean) / (std + eps)`` (or ``r - mean``) for every rollout, the mean of its group (or of the step)
    and the std of its group (or of the whole step, around the step's mean).

    Each set is computed on its rewards divided by ``s``, the power of two just above the set's largest magnitude,
    so that no square, sum or difference overflows for any finite reward (``r ** 2`` does from about 1e154):
    ``(u - mean_u) / (std_u + eps / s)`` with ``u = r / s`` is the same quotient, and dividing by a power of two is
    exact, so ordinary rewards give bitwise the unscaled result. Without the std the centred reward keeps the
    reward's units, ``s * (u - mean_u)``, which overflows only when a set's rewards span more than the largest
    float: refused."""
    weights = [1.0] * len(rewards) if weights is None else list(weights)
    everyone = list(range(len(rewards)))
    sets = {"group": list(groups.values()), "step": [everyone]}
    # r - mean in units of 2 ** exponent (mean_over=None: the reward itself)
    centred, exponents = list(rewards), [0] * len(rewards)
    silent = set()  # rollouts whose centring set has no signal: exactly 0, whatever eps and rounding
    for members in sets.get(mean_over, []):
        values = [rewards[i] for i in members]
        if min(values) == max(values):
            silent.update(members)
            continue
        exponent = _exponent(values)
        units = [math.ldexp(v, -exponent) for v in values]
        mean = _mean(units, [weights[i] for i in members])
        for i, u in zip(members, units):
            centred[i], exponents[i] = u - mean, exponent
    stds, std_exponents = [1.0] * len(rewards), [0] * len(rewards)
    if scale_by_std:
        for members in sets[std_over]:
            exponent = _exponent([rewards[i] for i in members])
            std = _std([math.ldexp(rewards[i], -exponent) for i in members], [weights[i] for i in members], unbiased)
            try:
                scaled_eps = math.ldexp(eps, -exponent)
            except OverflowError:  # rewards near the smallest floats: eps outweighs their spread by far
                scaled_eps = math.inf
            for i in members:
                stds[i], std_exponents[i] = std + scaled_eps, exponent
    advantages = []
    for i in everyone:
        try:
            advantages.append(0.0 if i in silent else
                              math.ldexp(centred[i] / stds[i], exponents[i] - std_exponents[i]))
        except OverflowError:
            raise RolloutError(i, "reward", f"is {rewards[i]}, and minus its baseline it overflows a float (the "
                               "rewards span more than the largest float)", "rescale the rewards") from None
    return advantages


def _exponent(values: Sequence[float]) -> int:
    """``e`` with ``2 ** e`` just above the largest magnitude of ``values`` (``2 ** e`` itself may overflow)."""
    return math.frexp(max(abs(v) for v in values))[1]


def _trained_tokens(rollout: Rollout) -> float:
    return float(sum(rollout.mask()[1:]))


def grpo_advantages(rollouts: Sequence[Rollout], scale_by_std: bool = True, eps: float = 1e-6, *,
                    std_unbiased: bool = False, std_over: Literal["group", "step"] = "group",
                    mean_over: Literal["group", "step"] | None = "group",
                    weighting: Literal["rollout", "token"] = "rollout") -> list[Rollout]:
    """GRPO: each reward minus its group's mean, divided by the group's std (+ ``eps``) when ``scale_by_std``.

    Every rollout must have a ``group_id`` (the prompt it answers): GRPO's baseline is the other answers to the
    same prompt, and silently pooling ungrouped rollouts would compare answers to different prompts. See the
    module docstring for the std convention and for singleton groups (advantage 0).

    Args:
        std_unbiased: divide the variance by ``n - 1`` (TRL, verl, AReaL) instead of ``n``.
        std_over: ``"group"``, or ``"step"``: one std over the whole step's rewards around the step's mean (TRL's
            ``scale_rewards="batch"``).
        mean_over: ``"group"``, ``"step"`` (the whole step's mean as the baseline: AReaL's ``mean_level: batch``)
            or ``None`` (no baseline, no scaling: the reward itself, AReaL without ``adv_norm``).
        weighting: ``"rollout"``, or ``"token"``: each rollout counts once per trained token in the means and the
            std (AReaL's ``adv_norm`` over per-token advantages).
    """
    if eps < 0:
        raise ConfigError(f"eps={eps} must be >= 0")
    for name, value, allowed in (("std_over", std_over, ("group", "step")), ("mean_over", mean_over,
                                 ("group", "step", None)), ("weighting", weighting, ("rollout", "token"))):
        if value not in allowed:
            raise ConfigError(f"{name}={value!r}; choose one of {allowed}")
    if mean_over is None and scale_by_std:
        raise ConfigError("mean_over=None (the reward itself) scales by nothing. Fix: scale_by_std=False, or a "
                         "mean_over")
    rewards = _rewards(rollouts)
    if mean_over == "group" or (scale_by_std and std_over == "group"):
        for index, rollout in enumerate(rollouts):
            if rollout.group_id is None:
                raise RolloutError(index, "group_id", "is missing; GRPO normalises each reward within its group",
                                   "set group_id (e.g. the prompt's id) on every rollout, or use "
                                   "advantage_estimator='reinforce-baseline', which accepts ungrouped rollouts")
    groups = _groups([rollout.group_id for rollout in rollouts])
    weights = [_trained_tokens(r) for r in rollouts] if weighting == "token" else None
    return _with_advantages(rollouts, _centered(rewards, groups, scale_by_std, eps, weights=weights,
                                                unbiased=std_unbiased, std_over=std_over, mean_over=mean_over))


def reinforce_baseline_advantages(rollouts: Sequence[Rollout]) -> list[Rollout]:
    """REINFORCE with a mean baseline: each reward minus the mean reward of its group.

    Rollouts are grouped by ``group_id``; the rollouts without one form a single group of their own, so a
    step with no group ids at all is baselined by the mean reward of the whole step. No std scaling: the
    advantages keep the reward's units.
    """
    rewards = _rewards(rollouts)
    groups = _groups([rollout.group_id for rollout in rollouts])
    return _with_advantages(rollouts, _centered(rewards, groups, scale_by_std=False, eps=0.0))


def gae_advantages(rollouts: Sequence[Rollout], gamma: float = 1.0, lam: float = 1.0) -> list[Rollout]:
    """Generalised advantage estimation per rollout, from its reward and the critic's values (``old_values``).

    The rollout's trained tokens ``t_1 < ... < t_K`` are its time steps (in a multi-turn rollout the tokens the
    environment wrote between turns are not steps). The reward arrives on the last one: ``r_K = reward``, the
    others 0. With ``V_k = old_values[t_k]`` (the value of the state token ``t_k`` is emitted from) and
    ``V_{K+1} = 0``: ``delta_k = r_k + gamma V_{k+1} - V_k``, ``A_k = delta_k + gamma lam A_{k+1}``, and the critic's
    target ``R_k = A_k + V_k``. Returns copies with per-token ``advantages`` and ``returns`` (0 off the steps).
    """
    rewards = _rewards(rollouts)
    out = []
    for index, (rollout, reward) in enumerate(zip(rollouts, rewards)):
        if rollout.old_values is None:
            raise RolloutError(index, "old_values", "is missing, and GAE needs the critic's value of every step",
                               "fill them with tree_values(critic, tree) (DTAModule(critic=...) does) or give them")
        steps = [t for t, trained in enumerate(rollout.mask()) if trained]
        advantages = [0.0] * len(rollout)
        returns = [0.0] * len(rollout)
        following_value, following_advantage = 0.0, 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            value = float(rollout.old_values[t])
            delta = (reward if k == len(steps) - 1 else 0.0) + gamma * following_value - value
            following_advantage = delta + gamma * lam * following_advantage
            following_value = value
            advantages[t], returns[t] = following_advantage, following_advantage + value
        out.append(dataclasses.replace(rollout, advantages=advantages, returns=returns))
    return out


def advantage_sums(rollouts: Sequence[Rollout], center: float | None = None) -> tuple[float, float]:
    """Over every trained (token, rollout) pair of per-token advantages: ``(sum of A, count)``, or with ``center``
    ``(sum of (A - center)^2, count)``; the sums a step-wide whitening all-reduces (two passes: the mean first,
    then the squares around it, which stays accurate where a sum of squares would cancel)."""
    total, count = [], 0
    for rollout in rollouts:
        for t, trained in enumerate(rollout.mask()):
            if trained and t > 0:
                value = float(rollout.advantages[t])
                total.append(value if center is None else (value - center) ** 2)
                count += 1
    return math.fsum(total), float(count)


def whiten_advantages(rollouts: Sequence[Rollout], mean: float, variance: float, eps: float = 1e-8
                      ) -> list[Rollout]:
    """Copies whose per-token advantages are ``(A - mean) / sqrt(variance + eps)`` on trained tokens (verl's
    ``masked_whiten`` with the step's mean and unbiased variance); returns are untouched."""
    scale = 1.0 / math.sqrt(variance + eps)
    out = []
    for rollout in rollouts:
        mask = rollout.mask()
        advantages = [(float(a) - mean) * scale if mask[t] and t > 0 else float(a)
                      for t, a in enumerate(rollout.advantages)]
        out.append(dataclasses.replace(rollout, advantages=advantages))
    return out


def _critic_estimated(rollouts: Sequence[Rollout]) -> list[Rollout]:
    """``"gae"`` on the data side: the rewards pass through; the module's critic estimates the advantages in the
    training step, when its values are known (:class:`~lightning_dta.lightning.module.DTAModule` with ``critic=``). The
    rewards are checked now, so a missing one is reported with its step."""
    _rewards(rollouts)
    return list(rollouts)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": grpo_advantages,
    "grpo-no-std": partial(grpo_advantages, scale_by_std=False),
    "reinforce-baseline": reinforce_baseline_advantages,
    "gae": _critic_estimated,
}
"""The estimators ``estimate_advantages`` knows by name; add an entry to register your own."""


def check_advantage_estimator(method: str | None, options: dict | None = None) -> None:
    """Refuse an estimator name that is not registered (``None``: keep the rollouts' own advantages), and options
    that it does not take."""
    if method is not None and method not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(f"advantage_estimator={method!r} is unknown. Fix: one of {sorted(ADVANTAGE_ESTIMATORS)} or "
                          "null (keep the rollouts' own advantages)")
    if options and method in (None, "gae"):
        raise ConfigError(f"advantage_options={options!r} are given, but advantage_estimator={method!r} takes none "
                         "(GAE's gamma, lam and whiten are PPOCritic's). Fix: drop advantage_options")
    if options:
        estimator = ADVANTAGE_ESTIMATORS[method]
        try:
            inspect.signature(estimator).bind([], **options)
        except TypeError as error:
            raise ConfigError(f"advantage_options={options!r} do not fit advantage_estimator={method!r}: {error}. "
                             f"Fix: use the keyword arguments of {method!r}'s estimator") from None


def estimate_advantages(rollouts: Sequence[Rollout], method: str | None, options: dict | None = None
                        ) -> list[Rollout]:
    """Apply the estimator named ``method`` (with its keyword ``options``, e.g. ``{"std_unbiased": True}``) to one
    whole step; ``None`` keeps the rollouts' own advantages."""
    check_advantage_estimator(method, options)
    return list(rollouts) if method is None else ADVANTAGE_ESTIMATORS[method](rollouts, **(options or {}))

