"""The device glue of ``DTAFSDPStrategy(cpu_offload=True)``: a collective over a mesh runs on the mesh's device.

FSDP2's CPU offload keeps the shards and their gradients in CPU memory on a CUDA mesh, whose groups are NCCL's, and
NCCL reduces CUDA tensors only: the gradient norm's all-reduce and the gathers of full parameters (the generator's
copy and weight refresh) used to hand it the CPU tensors. Here, on the CPU, a 1-rank gloo group stands in: the
device is chosen from the mesh (``mesh_device``: its device type, the current CUDA device for a CUDA mesh), and
each collective is handed its tensor on the device chosen for the tensor's own mesh. The same functions on a CUDA
rank with offloaded shards: tests/gpu/test_cpu_offload.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import lightning_dta as dta
import lightning_dta.distributed.sharding as sharding
import lightning_dta.distributed.step as step
from lightning_dta.distributed.collectives import mesh_device
from tests.helpers.lightning import grpo_rollouts, tiny_llama
from tests.helpers.tp import free_port

pytestmark = pytest.mark.distributed


def test_the_collective_device_is_the_meshs(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert mesh_device(init_device_mesh("cpu", (1,))) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # this process's GPU, as Lightning sets it
    assert mesh_device(SimpleNamespace(device_type="cuda")) == torch.device("cuda", 3)


def test_collectives_over_offloaded_shards_take_the_meshs_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gradient norm's all-reduce, and the full parameters gathered for a copy, are handed their tensor on the
    device chosen for the DTensor's own mesh (here the CPU, recorded)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    model = sharding.shard(tiny_llama(), mesh)
    dta.tree_step_backward(model, dta.PrefixTree.from_rollouts(grpo_rollouts()))
    expected = sum(float(p.grad.full_tensor().double().square().sum()) for p in model.parameters()) ** 0.5
    asked, reduced, gathered = [], [], []

    def chosen(of) -> torch.device:
        asked.append(of)
        return mesh_device(of)

    reduce, full_tensor = dist.all_reduce, DTensor.full_tensor

    def all_reduce(tensor: torch.Tensor, *args, **kwargs):
        reduced.append(tensor.device)
        return reduce(tensor, *args, **kwargs)

    def gather(self: DTensor, *args, **kwargs) -> torch.Tensor:
        gathered.append(self.device)
        return full_tensor(self, *args, **kwargs)

    for module in (step, sharding):
        monkeypatch.setattr(module, "mesh_device", chosen, raising=False)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(DTensor, "full_tensor", gather)

    norm = step.gradient_norm(model.parameters())
    assert norm == pytest.approx(expected, rel=1e-6)
    assert asked == [mesh] and reduced == [torch.device("cpu")]  # one mesh, one placement: one all-reduce
    asked.clear()
    copy = sharding.unsharded_copy(model)
    shards = [p for p in model.parameters() if isinstance(p, DTensor)]
    assert len(asked) == 1 + len(shards) and all(m is mesh for m in asked)  # the copy's device, then each gather
    assert gathered == [torch.device("cpu")] * len(shards)
    assert {p.device for p in copy.parameters()} == {torch.device("cpu")}
