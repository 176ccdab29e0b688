"""Two CPU processes (gloo) give the same step as one process.

``dist_worker.py`` runs ``Trainer(strategy="dta", accelerator="cpu", devices=2)`` for one step; each process
also computed the single-process reference (plain ``tree_backward`` over all rollouts, clipping, SGD) before any
process group existed. Tolerance (float32): the two ranks run two smaller trees instead of one, so the DFS
forwards different segment groupings and adds the per-node gradients in a different order; that changes
results by a few float32 ulps per operation (measured max relative difference ~5e-7 of each tensor's largest
entry). rtol 1e-5 / atol 1e-6 leaves a 10-100x margin over that, while a missed rank, a mean instead of a sum,
a per-rank normaliser or clipping before the sum each change gradients by 10% or more.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lightning_dta as dta
from lightning_dta.distributed.collectives import all_gather_floats, all_reduce_sum, broadcast_module, sum_gradients
from lightning_dta.distributed.step import step_totals
from tests import helpers
from tests.helpers import free_port
from tests.helpers.lightning import clean_env, grpo_rollouts

RTOL, ATOL = 1e-5, 1e-6


def run_worker(tmp_path: Path, devices: int, empty_rank: int | None = None, critic: bool = False) -> list[dict]:
    cmd = [sys.executable, "-m", "tests.lightning.dist_worker", str(tmp_path), str(devices)]
    if empty_rank is not None:
        cmd.append(str(empty_rank))
    if critic:
        cmd.append("--critic")
    proc = subprocess.run(cmd, cwd=helpers.REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(devices)]


@pytest.mark.distributed
@pytest.mark.parametrize("empty_rank", [None, 1], ids=["split", "rank1-empty"])
def test_two_ranks_match_one_process(tmp_path: Path, empty_rank: int | None) -> None:
    ranks = run_worker(tmp_path, 2, empty_rank)
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert [r["had_tree"] for r in ranks] == ([True, True] if empty_rank is None else [True, False])
    ref = ranks[0]["reference"]
    assert ref["grad_norm"] > 0.05  # the clip threshold of the worker: clipping really happened
    for r in ranks:
        assert r["reference"]["loss"] == ref["loss"]  # same data and start on both ranks
        assert r["loss"] == pytest.approx(ref["loss"], rel=RTOL)  # the logged loss is the whole step's
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL)  # norm of the SUMMED gradient
        # the log-prob gap of the whole step (the largest over ranks, token-weighted means), from its definition
        assert r["logprob_gap"] == pytest.approx(ref["logprob_gap"], rel=RTOL), (r["logprob_gap"], ref)
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], grad, rtol=RTOL, atol=ATOL, msg=name)
            torch.testing.assert_close(r["weights"][name], ref["weights"][name], rtol=RTOL, atol=ATOL, msg=name)
    for name in ref["grads"]:  # the cross-rank sum leaves bit-identical gradients and weights everywhere
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name


@pytest.mark.distributed
def test_ppo_with_a_critic_on_two_ranks_matches_one(tmp_path: Path) -> None:
    """GAE from each rank's own rollouts, whitened with the step-wide mean and variance (all-reduced), the policy
    and the critic steps summed over ranks: 2 ranks end with the 1-rank weights of both models (the same float32
    tolerance as above), and the critic really moved."""
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    (one,) = run_worker(tmp_path / "one", 1, critic=True)
    two = run_worker(tmp_path / "two", 2, critic=True)
    moved = max(float((one["critic"][n] - w).abs().max()) for n, w in one["critic_initial"].items())
    assert moved > 1e-4, moved
    for rank in two:
        for name, weight in one["weights"].items():
            torch.testing.assert_close(rank["weights"][name], weight, rtol=RTOL, atol=ATOL, msg=name)
        for name, weight in one["critic"].items():
            torch.testing.assert_close(rank["critic"][name], weight, rtol=RTOL, atol=ATOL, msg=name)


def _collectives(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)  # different weights per rank before the broadcast
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
        model[2].double()  # a second dtype: buckets must split by dtype
        model.register_buffer("steps", torch.tensor([rank + 5]))
        broadcast_module(model, bucket_mb=1e-5)  # tiny buckets: one tensor per bucket
        w, b = model[0].weight, model[0].bias
        w.grad = torch.full_like(w, float(rank + 1))  # every rank has it: 1 + 2
        if rank == 1:
            b.grad = torch.ones_like(b)  # only rank 1 has it: rank 0 joins with zeros
        model[2].weight.grad = torch.full_like(model[2].weight, 0.5 * (rank + 1))
        # model[1] has no gradient on any rank: it must stay None, as on one process
        sum_gradients(model.parameters(), bucket_mb=1e-5)
        # reference log-probs on rank 1 only: the step carries them (a rank's share without any is no refusal)
        shares = [dataclasses.replace(r, ref_logprobs=None) if rank == 0 else r for r in grpo_rollouts(rank)[:3]]
        totals = step_totals(dta.PrefixTree.from_rollouts(shares), dta.PolicyLoss(kl_coef=0.1), "cpu")
        torch.save({"state": model.state_dict(), "grads": {n: p.grad for n, p in model.named_parameters()},
                    "sum": all_reduce_sum([rank, 0.5], "cpu"), "gather": all_gather_floats([rank * 2.0], "cpu"),
                    "totals": totals},
                   os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_collectives_two_ranks(tmp_path: Path) -> None:
    mp.spawn(_collectives, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    for key in r0["state"]:
        assert torch.equal(r0["state"][key], r1["state"][key]), key  # rank 0's weights and buffers everywhere
    assert int(r0["state"]["steps"]) == 5
    for grads in (r0["grads"], r1["grads"]):
        assert torch.equal(grads["0.weight"], torch.full((4, 3), 3.0))
        assert torch.equal(grads["0.bias"], torch.ones(4))
        assert grads["1.weight"] is None and grads["1.bias"] is None
        assert grads["2.weight"].dtype == torch.float64 and torch.equal(grads["2.weight"], torch.full((2, 2), 1.5,
                                                                                                   dtype=torch.float64))
    assert r0["sum"] == r1["sum"] == [1.0, 1.0]
    assert r0["gather"] == r1["gather"] == [[0.0], [2.0]]
    assert r0["totals"][1] == r1["totals"][1] == [3.0]  # rollouts of the step with ref_logprobs, over both ranks


def test_collectives_are_noops_on_one_process() -> None:
    model = torch.nn.Linear(2, 2)
    model.weight.grad = torch.ones(2, 2)
    sum_gradients(model.parameters())
    broadcast_module(model)
    assert torch.equal(model.weight.grad, torch.ones(2, 2)) and model.bias.grad is None
    assert all_reduce_sum([3.0]) == [3.0]
    assert all_gather_floats([1.0, 2.0]) == [[1.0, 2.0]]
