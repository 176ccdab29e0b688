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


class _FSDP2Accelerator:
    """What accelerate_tree_backward reads from an Accelerator prepared with FullyShardedDataParallelPlugin
    (fsdp_version=2). On a CPU Accelerate falls back to DDP, so the CPU test shards the model the way Accelerate's
    FSDP2 path does (each decoder layer, then the root; gradients averaged by default)."""

    distributed_type = type("T", (), {"name": "FSDP"})()
    state = type("S", (), {"fsdp_plugin": type("P", (), {"fsdp_version": 2})()})()
    scaler = None

    @staticmethod
    def unwrap_model(model):
        return model


def _fsdp2_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lightning_dta.distributed.sharding import full_parameters

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    tree = rank_batch(grpo_rollouts(), rank, 2).tree
    result = accelerate_tree_backward(_FSDP2Accelerator(), model, tree, dta.PolicyLoss(**LOSS))
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    weights = {n: t.detach().clone() for n, t in full_parameters(model) if n in dict(model.named_parameters())}
    torch.save({"weights": weights, "loss": result.loss, "grad_norm": result.grad_norm},
               os.path.join(out, f"fsdp{rank}.pt"))
    dist.barrier()  # neither rank tears gloo down while the other still has a collective in flight
    dist.destroy_process_group()


@pytest.mark.distributed
def test_fsdp2_plugin_on_two_processes(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp2_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    ref = reference_step(tiny_llama(), grpo_rollouts(), LOSS, lr=LR, clip=CLIP)
    for rank in range(2):
        check(torch.load(tmp_path / f"fsdp{rank}.pt", weights_only=False), ref)


@pytest.mark.gpu
def test_fsdp2_plugin_of_accelerate_on_a_gpu() -> None:
    """The real FullyShardedDataParallelPlugin(fsdp_version=2) path (one GPU process: Accelerate prepares FSDP only
    on CUDA); the multi-GPU run is ``accelerate launch`` of examples/accelerate_loop.py."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    accelerator = Accelerator(fsdp_plugin=plugin)
    result = accelerate_step(accelerator, 0, 1)
    check(result, reference_step(tiny_llama(), grpo_rollouts(), LOSS, lr=LR, clip=CLIP))
