"""Online RL with tensor parallelism 2 on 2 gloo processes: the shipped toy config (configs/toy_rl_cpu.yaml),
unchanged but for ``--trainer.devices=2 --trainer.strategy=lightning_dta.DTAFSDPStrategy
--trainer.strategy.tensor_parallel_size=2``, against the same config on one process.

Both ranks form one tensor-parallel group (data-parallel size 1): each generates the step's blocks with an
unsharded copy of the policy (the same weights and seeds) and trains the whole step with half of every weight. So
each rank's rollouts are the 1-rank rollouts: the same tokens, loss masks, advantages and rewards in every recorded
step; the reward curve's first steps equal the 1-rank ones and the reward rises by the 1-process test's margin over
100 steps (tests/rl/test_toy.py).

What is bounded is what TP guarantees. Before any update (a run without the warm start: step 0's rollouts come from
the initial weights) the behaviour log-probs agree to float32 rounding. After the config's warm start (80 AdamW
steps, lr 3e-3, no clipping, on the demonstrations, every rank the whole tree) they do not: under TP each rank sums
the row-parallel halves in another order, and AdamW's normalised update turns those last-bit differences into
gaps that depend on the CPU (measured 1.7e-4 to 2.2e-4 on one machine, 3.1e-4 to 2.2e-3 on AVX-512 ones; bitwise on 2
data-parallel ranks, tests/rl/test_online_ranks.py). So after it the tokens, masks, advantages and rewards are
held equal and the log-prob gaps are printed, not bounded. Measured: reward 0.624 -> 0.810 (1 rank 0.624 -> 0.802;
0.827 on AVX-512), the first 33 steps' rewards equal. About 6.5 minutes on 2 busy cores (1 rank 48 s, TP 2 316 s,
the two runs without warm start 28 s; ``long``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.helpers.online import CONFIG, MARGIN, RECORDED, WINDOW, fit, merged_rollouts, records, rewards

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.long]
BLOCKS = "--data.source.init_args.generation_blocks=2"  # the blocks (and their seeds) do not depend on the ranks
TP2 = ("--trainer.strategy=lightning_dta.DTAFSDPStrategy", "--trainer.strategy.tensor_parallel_size=2")


LOGPROB_ATOL_BEFORE_UPDATES = 1e-5  # the same weights: float32 rounding of TP's reordered sums (measured 2.4e-7)


def test_tp2_generates_the_one_rank_rollouts_and_learns(tmp_path: Path) -> None:
    fresh = tmp_path / "no_warm_start.yaml"  # step 0's rollouts from the initial weights
    fresh.write_text(CONFIG.read_text().replace("sft_warmup_steps: 80", "sft_warmup_steps: 0"))
    one, pair, one_fresh, pair_fresh = (tmp_path / name for name in ("one", "tp2", "one_fresh", "tp2_fresh"))
    for path, devices, extra, config, steps in ((one_fresh, 1, (), fresh, 1), (pair_fresh, 2, TP2, fresh, 1),
                                                (one, 1, (), CONFIG, 100), (pair, 2, TP2, CONFIG, 100)):
        path.mkdir()
        proc, seconds = fit(path, devices, BLOCKS, *extra, config=config, steps=steps)
        assert proc.returncode == 0, proc.stdout[-5000:]
        print(f"{path.name}: {seconds:.0f} s")
    assert_same_rollouts_before_any_update(one_fresh, pair_fresh)
    assert_same_rollouts_and_learning(one, pair)


def assert_same_rollouts_before_any_update(one: Path, pair: Path) -> None:
    (single,) = records(one, 1)
    for rank in records(pair, 2):
        mine, theirs = rank["rollouts"][0], single["rollouts"][0]
        assert [(r[0], r[1], r[3], r[4]) for r in mine] == [(r[0], r[1], r[3], r[4]) for r in theirs]
        worst = max(abs(a - b) for x, y in zip(theirs, mine) for a, b in zip(x[2], y[2]))
        print(f"before any update: behaviour log-probs within {worst:.1e}")
        assert worst < LOGPROB_ATOL_BEFORE_UPDATES, worst


def assert_same_rollouts_and_learning(one: Path, pair: Path) -> None:
    single = merged_rollouts(records(one, 1))
    ranks = records(pair, 2)
    assert [r["world_size"] for r in ranks] == [2, 2]
    for rank in ranks:  # every tensor-parallel peer trained the whole step: the 1-rank rollouts
        mine = merged_rollouts([rank])
        for step in range(RECORDED):
            assert [(r[0], r[1], r[3], r[4]) for r in mine[step]] == [(r[0], r[1], r[3], r[4]) for r in single[step]]
            worst = max(abs(a - b) for x, y in zip(single[step], mine[step]) for a, b in zip(x[2], y[2]))
            print(f"after the warm start, step {step}: behaviour log-probs {worst:.1e} apart (reported, not bounded)")
    assert merged_rollouts([ranks[0]]) == merged_rollouts([ranks[1]])  # the peers' rollouts: identical
    curve, reference = rewards(pair), rewards(one)
    assert curve[:RECORDED] == reference[:RECORDED]
    first, last = statistics.fmean(curve[:WINDOW]), statistics.fmean(curve[-WINDOW:])
    print(f"reward {first:.3f} -> {last:.3f} (1 rank: {statistics.fmean(reference[:WINDOW]):.3f} -> "
          f"{statistics.fmean(reference[-WINDOW:]):.3f})")
    assert last - first >= MARGIN, (first, last)
    for rank in ranks:  # the step's metrics are the group's: the same reward on both peers
        assert [i["reward_mean"] for i in rank["infos"]] == [i["reward_mean"] for i in ranks[0]["infos"]]
