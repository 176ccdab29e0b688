"""Step preparation, pure: played episodes -> rollouts ready to train (advantages, log-probs), and their stats.

Nothing here holds state or threads: the same episodes give the same rollouts on every rank.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from lightning_dta.core.advantages import estimate_advantages
from lightning_dta.core.rollout import Rollout
from lightning_dta.core.tree import PrefixTree
from lightning_dta.engine import EngineOptions, tree_logprobs
from lightning_dta.rl.environment import Episode


@dataclass
class StepInfo:
    """What the source knows about one step it handed out, for logging and for the staleness check.

    Times are wall-clock seconds. ``generation_sec``: generating and scoring the step (in async mode it overlaps
    training). ``wait_sec``: how long the trainer waited for the step (in sync mode, the generation itself).
    ``prepare_sec``: advantages and the forward-only walks for ``prox``/``ref`` log-probs. ``requested_at``:
    ``time.perf_counter()`` when the trainer asked for the step (start of its end-to-end time).
    """

    index: int
    policy_version: int  # the version of the weights that generated the step
    trained_version: int  # the trainer's version when the step was handed out
    rewards: list[float]  # one per episode
    response_tokens: list[int]  # generated tokens per episode (all its calls)
    calls: int
    logical_tokens: int
    tree_tokens: int
    correct: list[bool] = field(default_factory=list)  # episodes whose info says "correct" (when reported)
    finishes: dict[str, int] = field(default_factory=dict)
    generation_sec: float = 0.0
    wait_sec: float = 0.0
    prepare_sec: float = 0.0
    requested_at: float = 0.0

    @property
    def staleness(self) -> int:
        return self.trained_version - self.policy_version

    @property
    def compression_ratio(self) -> float:
        return self.logical_tokens / max(self.tree_tokens, 1)

    @property
    def reward_mean(self) -> float:
        return statistics.fmean(self.rewards)

    @property
    def reward_std(self) -> float:
        return statistics.pstdev(self.rewards)


def episode_rollouts(episodes: list[Episode], advantage_estimator: str | None,
                     advantage_options: dict | None = None) -> list[Rollout]:
    """Every call of every episode as a rollout, with advantages estimated per episode (one entry per episode
    in its group, so an episode with more calls does not weigh more) and copied to each of its calls."""
    if advantage_estimator is None:
        return [call for episode in episodes for call in episode.calls]
    if advantage_estimator == "gae":  # the module's critic estimates them; each call carries its episode's reward
        return [dataclasses.replace(call, reward=episode.reward) for episode in episodes for call in episode.calls]
    stand_ins = [Rollout(input_ids=[0, 0], reward=e.reward, group_id=e.prompt_index) for e in episodes]
    estimated = estimate_advantages(stand_ins, advantage_estimator, advantage_options)
    return [dataclasses.replace(call, advantages=estimate.advantages)
            for episode, estimate in zip(episodes, estimated) for call in episode.calls]


def step_info(index: int, policy_version: int, trained_version: int, episodes: list[Episode],
              tree: PrefixTree) -> StepInfo:
    """The statistics of a step from its episodes and its whole tree."""
    return StepInfo(
        index=index, policy_version=policy_version, trained_version=trained_version,
        rewards=[e.reward for e in episodes], response_tokens=[e.generated_tokens for e in episodes],
        calls=tree.stats.num_rollouts, logical_tokens=tree.stats.logical_tokens, tree_tokens=tree.stats.tree_tokens,
        correct=[bool(e.info["correct"]) for e in episodes if "correct" in e.info],
        finishes=dict(Counter(e.finish for e in episodes)))


def fill_logprobs(tree: PrefixTree, model: nn.Module, field_name: str, engine: EngineOptions | None = None) -> None:
    """Set ``field_name`` of every rollout of ``tree`` to ``model``'s log-probs, from one forward-only walk.

    ``tree_logprobs`` gives entry ``t-1`` = log p(x_t | x_<t); the rollout field has one entry per token with
    entry 0 unused, hence the leading 0.0.
    """
    for rollout, values in zip(tree.rollouts, tree_logprobs(model, tree, engine=engine)):
        setattr(rollout, field_name, [0.0] + values.double().cpu().tolist())


