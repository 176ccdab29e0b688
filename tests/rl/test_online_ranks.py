"""The online RL loop on 2 gloo processes (the shipped toy config, unchanged but for the number of devices).

- 2 ranks generate exactly the rollouts of 1 rank (with a fixed ``generation_blocks``): step 0 bitwise (tokens,
  behaviour log-probs, rewards, advantages), later steps the same tokens, rewards and advantages with behaviour
  log-probs within float rounding (the weights after a 2-rank step differ from the 1-rank ones in the last bits:
  the gradient is summed from two trees); the reward rises as on one process;
- async mode with staleness 1 on 2 ranks: every rank trains step i with the version pinned for it (the same on both
  ranks, never more than 1 step stale) and the reward rises comparably.

The reward margin (0.1 between the first and the last 10 of 100 steps, seed 0) is the 1-process test's
(tests/rl/test_toy.py): 2 ranks run the same steps up to float rounding in the gradient sum. Faults, resume,
multi-turn episodes and sharded weights: tests/rl/test_online_mechanisms.py.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from tests.helpers.online import MARGIN, RECORDED, STEPS, WINDOW, fit, merged_rollouts, records, rewards

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("one_rank")
    proc, _ = fit(path, 1, "--data.source.init_args.generation_blocks=2")
    assert proc.returncode == 0, proc.stdout[-5000:]
    return path


def test_two_ranks_generate_the_one_rank_rollouts_and_learn(one_rank: Path, tmp_path: Path) -> None:
    proc, _ = fit(tmp_path, 2, "--data.source.init_args.generation_blocks=2")
    assert proc.returncode == 0, proc.stdout[-5000:]
    (single,), pair = records(one_rank, 1), records(tmp_path, 2)
    assert [r["world_size"] for r in pair] == [2, 2]
    assert all(rank["rollouts"][step] for rank in pair for step in range(RECORDED))  # both ranks trained
    one, two = merged_rollouts([single]), merged_rollouts(pair)
    assert two[0] == one[0]  # step 0, before any update: bitwise (tokens, masks, log-probs, advantages, rewards)
    for step in range(1, RECORDED):  # later steps: the weights differ by float rounding of the gradient sum
        assert [(r[0], r[1], r[3], r[4]) for r in two[step]] == [(r[0], r[1], r[3], r[4]) for r in one[step]]
        worst = max(abs(a - b) for x, y in zip(one[step], two[step]) for a, b in zip(x[2], y[2]))
        assert worst < 1e-5, (step, worst)  # measured 1.4e-6, 2.1e-6
    curve = rewards(tmp_path)
    assert curve[:RECORDED] == rewards(one_rank)[:RECORDED]
    first, last = statistics.fmean(curve[:WINDOW]), statistics.fmean(curve[-WINDOW:])
    assert last - first >= MARGIN, (first, last)
    for rank in pair:  # the step's metrics are the step's: the same reward on every rank
        assert [i["reward_mean"] for i in rank["infos"]] == [i["reward_mean"] for i in pair[0]["infos"]]
    for name, weight in pair[0]["weights"].items():
        assert torch.equal(weight, pair[1]["weights"][name]), name  # one gradient sum: identical weights


def test_async_two_ranks_staleness_one(tmp_path: Path) -> None:
    proc, _ = fit(tmp_path, 2, "--data.source.init_args.rollout_mode=async")
    assert proc.returncode == 0, proc.stdout[-5000:]
    pair = records(tmp_path, 2)
    for rank in pair:
        infos = rank["infos"]
        assert [i["index"] for i in infos] == list(range(STEPS))
        assert [i["trained_version"] - i["policy_version"] for i in infos] == [0] + [1] * (STEPS - 1)  # pinned
        assert all(i["prox_set"] for i in infos)  # decoupled PPO: prox log-probs on each rank's own share
    assert [i["policy_version"] for i in pair[0]["infos"]] == [i["policy_version"] for i in pair[1]["infos"]]
    curve = rewards(tmp_path)
    first, last = statistics.fmean(curve[:WINDOW]), statistics.fmean(curve[-WINDOW:])
    assert last - first >= MARGIN, (first, last)
