"""Advantage estimation over a whole optimizer step, before the step is partitioned across ranks.

Group-relative estimators (GRPO, a mean baseline) need every member of a group. A data-parallel partition
may put the members of one group on different ranks, so the advantages are computed here, on the full step
that every rank holds, and travel inside the rollouts; no rank ever normalises over a partial group.

Each estimator returns NEW :class:`~lightning_dta.Rollout` objects (``dataclasses.replace``) whose
``advantages`` is one float for the whole rollout; the input rollouts are left untouched, so a cached step
(e.g. a file read once and trained for several epochs) is never mutated.

Conventions, chosen so that the numbers are well defined for every input:

- the group standard deviation is the population one (``unbiased=False``: divide by ``n``, not ``n - 1``).
  TRL and verl call ``torch.std`` (``n - 1``); for a group of ``n`` the two differ by ``sqrt((n-1)/n)``
  (13% for ``n = 4``), which only rescales the advantages (the effective learning rate).
- a rollout alone in its group has no baseline but its own reward: its advantage is ``0`` (no learning
  signal), exactly like any group whose rewards are all equal. (verl instead returns the raw reward for a
  singleton group, which mixes an unnormalised scale into a normalised step.)
- a group whose rewards are all equal gets exactly ``0`` (not ``rounding error / eps``); ``eps`` is added to the
  standard deviation so that a nearly constant group cannot blow up.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Sequence
from functools import partial

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


def _centered(rewards: Sequence[float], groups: dict[Hashable, list[int]], scale_by_std: bool,
              eps: float) -> list[float]:
    """``(r - mean_g) / (std_g + eps)`` (or ``r - mean_g``) for every rollout, by group ``g``.

    Computed on the rewards divided by ``s``, the power of two just above the group's largest magnitude, so that
    no square, sum or difference overflows for any finite reward (``r ** 2`` does from about 1e154):
    ``(u - mean_u) / (std_u + eps / s)`` with ``u = r / s`` is the same quotient, and dividing by a power of two is
    exact, so ordinary rewards give bitwise the unscaled result. Without the std the centred reward keeps the
    reward's units, ``s * (u - mean_u)``, which overflows only when a group's rewards span more than the largest
    float: refused."""
    advantages = [0.0] * len(rewards)
    for members in groups.values():
        values = [rewards[i] for i in members]
        if min(values) == max(values):  # no signal (singletons included): exactly 0, whatever eps and rounding
            continue
        exponent = math.frexp(max(abs(v) for v in values))[1]  # s = 2 ** exponent, which may itself overflow
        units = [math.ldexp(v, -exponent) for v in values]
        mean = math.fsum(units) / len(units)
        if scale_by_std:
            std = math.sqrt(math.fsum((u - mean) ** 2 for u in units) / len(units))  # unbiased=False
            try:
                scaled_eps = math.ldexp(eps, -exponent)
            except OverflowError:  # rewards near the smallest floats: eps outweighs their spread by far
                scaled_eps = math.inf
            for i, u in zip(members, units):
                advantages[i] = (u - mean) / (std + scaled_eps)
            continue
        for i, u in zip(members, units):
            try:
                advantages[i] = math.ldexp(u - mean, exponent)
            except OverflowError:
                raise RolloutError(i, "reward", f"is {rewards[i]}, and minus its group's mean reward it overflows a "
                                   "float (the group's rewards span more than the largest float)",
                                   "rescale the rewards") from None
    return advantages


def grpo_advantages(rollouts: Sequence[Rollout], scale_by_std: bool = True, eps: float = 1e-6) -> list[Rollout]:
    """GRPO: each reward minus its group's mean, divided by the group's std (+ ``eps``) when ``scale_by_std``.

    Every rollout must have a ``group_id`` (the prompt it answers): GRPO's baseline is the other answers to the
    same prompt, and silently pooling ungrouped rollouts would compare answers to different prompts. See the
    module docstring for the std convention and for singleton groups (advantage 0).
    """
    if eps < 0:
        raise ConfigError(f"eps={eps} must be >= 0")
    rewards = _rewards(rollouts)
    for index, rollout in enumerate(rollouts):
        if rollout.group_id is None:
            raise RolloutError(index, "group_id", "is missing; GRPO normalises each reward within its group",
                               "set group_id (e.g. the prompt's id) on every rollout, or use "
                               "advantage_estimator='reinforce-baseline', which accepts ungrouped rollouts")
    groups = _groups([rollout.group_id for rollout in rollouts])
    return _with_advantages(rollouts, _centered(rewards, groups, scale_by_std, eps))


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


def check_advantage_estimator(method: str | None) -> None:
    """Refuse an estimator name that is not registered (``None``: keep the rollouts' own advantages)."""
    if method is not None and method not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(f"advantage_estimator={method!r} is unknown. Fix: one of {sorted(ADVANTAGE_ESTIMATORS)} or "
                          "null (keep the rollouts' own advantages)")


def estimate_advantages(rollouts: Sequence[Rollout], method: str | None) -> list[Rollout]:
    """Apply the estimator named ``method`` to one whole step; ``None`` keeps the rollouts' own advantages."""
    check_advantage_estimator(method)
    return list(rollouts) if method is None else ADVANTAGE_ESTIMATORS[method](rollouts)

