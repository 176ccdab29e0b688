"""The Accelerate adapter: one process and two gloo processes give the hand-written single-process step."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from accelerate import Accelerator

import lightning_dta as dta
from lightning_dta.accelerate import accelerate_tree_backward
from tests.helpers.lightning import grpo_rollouts, rank_batch, reference_step, tiny_llama

LOSS = dict(clip_eps=0.2, kl_coef=0.1)
LR, CLIP = 0.5, 0.05
RTOL, ATOL = 1e-5, 1e-6  # as in test_distributed: two trees instead of one reorder float32 sums


def accelerate_step(accelerator: Accelerator, rank: int, world_size: int, empty_rank: int | None = None) -> dict:
    model = tiny_llama()
    if rank == 1:
        with torch.no_grad():  # a different start on rank 1: prepare() (DDP) must broadcast rank 0's weights
            for p in model.parameters():
                p.add_(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    tree = rank_batch(grpo_rollouts(), rank, world_size, empty_rank).tree
    out = accelerate_tree_backward(accelerator, model, tree, dta.PolicyLoss(**LOSS))
    accelerator.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    inner = accelerator.unwrap_model(model)
    return {"weights": {n: p.detach().clone() for n, p in inner.named_parameters()}, "loss": out.loss,
            "grad_norm": out.grad_norm, "ddp": type(model).__name__}


def check(result: dict, ref: dict) -> None:
    assert result["loss"] == pytest.approx(ref["loss"], rel=RTOL)
    assert result["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL)
    for name, weight in ref["weights"].items():
        torch.testing.assert_close(result["weights"][name], weight, rtol=RTOL, atol=ATOL, msg=name)


def test_one_process_matches_the_hand_written_step() -> None:
    ref = reference_step(tiny_llama(), grpo_rollouts(), LOSS, lr=LR, clip=CLIP)
    result = accelerate_step(Accelerator(cpu=True), 0, 1)
    assert ref["grad_norm"] > CLIP  # clipping is active
    check(result, ref)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    results = {"type": accelerator.distributed_type.name,
               "split": accelerate_step(accelerator, rank, 2),
               "empty": accelerate_step(accelerator, rank, 2, empty_rank=1)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    accelerator.end_training()


@pytest.mark.distributed
def test_two_processes_match_one(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    ref = reference_step(tiny_llama(), grpo_rollouts(), LOSS, lr=LR, clip=CLIP)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for result in ranks:
        assert result["type"] == "MULTI_CPU"
        for case in ("split", "empty"):
            assert result[case]["ddp"] == "DistributedDataParallel"  # the adapter works through the wrapper
            check(result[case], ref)


def test_refuses_sharded_and_fp16_setups() -> None:
    class Fake:
        distributed_type = type("T", (), {"name": "FSDP"})()
        scaler = None

    with pytest.raises(NotImplementedError, match="FSDP"):
        accelerate_tree_backward(Fake(), torch.nn.Linear(1, 1), None)
    Fake.distributed_type.name, Fake.scaler = "MULTI_GPU", object()
    with pytest.raises(RuntimeError, match="fp16"):
        accelerate_tree_backward(Fake(), torch.nn.Linear(1, 1), None)
