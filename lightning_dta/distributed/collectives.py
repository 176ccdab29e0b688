"""The few collectives a DFS step needs, on plain ``torch.distributed`` (no DDP wrapper).

Why not DDP: a DFS step runs one backward per tree node. DDP reduces gradients from hooks that fire during
backward, so it would either all-reduce once per node (slow) or, under ``no_sync``, leave a parameter touched
only in ``no_sync`` backwards silently unsynced (``docs/traps.md``). Instead every rank runs its whole DFS,
then the gradients are summed once, in a few large flattened buckets. Each rank divides its loss by the
step-wide normaliser, so the cross-rank SUM (not the mean) is the full-step gradient; gloo has no AVG anyway.

Every function here is a no-op on a single process, so the same code path serves 1 and N ranks. Every rank
must call them in the same order with the same parameter list, including a rank that trained nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_dta.contracts import DEFAULT_BUCKET_MB


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks taking part (1 when ``torch.distributed`` is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank (0 when ``torch.distributed`` is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def all_gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's ``obj`` (picklable), index = rank; ``[obj]`` on one process."""
    n = world_size(group)
    if n == 1:
        return [obj]
    out: list = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: object, src: int = 0, group: dist.ProcessGroup | None = None) -> object:
    """Rank ``src``'s ``obj`` on every rank (the others pass anything, e.g. ``None``)."""
    if world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def collective_device(tensor_or_module: torch.Tensor | nn.Module) -> torch.device:
    """Where small collective tensors must live: NCCL only reduces CUDA tensors, gloo reduces CPU ones."""
    device = tensor_or_module.device if isinstance(tensor_or_module, torch.Tensor) else \
        next(tensor_or_module.parameters()).device
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def mesh_device(mesh) -> torch.device:
    """Where the tensors of a collective over ``mesh`` (a ``DeviceMesh``) must live: on the mesh's device type (NCCL's
    mesh: this process's CUDA device), whatever the device of the tensor they come from. A DTensor's local part
    need not be there: FSDP2's CPU offload keeps shards and their gradients in CPU memory on a CUDA mesh."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so that wall-clock time covers it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce_sum(values: Sequence[float], device: torch.device | str = "cpu",
                   group: dist.ProcessGroup | None = None) -> list[float]:
    """Sum a short vector of floats over ranks in float64 (token counts stay exact up to 2**53)."""
    if world_size(group) == 1:
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor.tolist()


def all_gather_floats(values: Sequence[float], device: torch.device | str = "cpu",
                      group: dist.ProcessGroup | None = None) -> list[list[float]]:
    """Every rank's copy of a short float vector, index = rank (one collective for sums, maxima and spreads)."""
    n = world_size(group)
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if n == 1:
        return [tensor.tolist()]
    out = [torch.empty_like(tensor) for _ in range(n)]
    dist.all_gather(out, tensor, group=group)
    return [t.tolist() for t in out]


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive groups of same-device, same-dtype tensors of at most ``bucket_bytes`` (one tensor may exceed)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (size + nbytes > bucket_bytes or tensor.dtype != bucket[0].dtype
                       or tensor.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket


def _flat_collective(tensors: list[torch.Tensor], bucket_mb: float, op) -> None:
    """Run ``op(flat)`` on each flattened bucket and copy the result back into the tensors in place."""
    for bucket in _buckets(tensors, int(bucket_mb * 2**20)):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        op(flat)
        for tensor, chunk in zip(bucket, flat.split([t.numel() for t in bucket])):
            tensor.copy_(chunk.view_as(tensor))


def sum_gradients(parameters: Iterable[nn.Parameter], *, bucket_mb: float = DEFAULT_BUCKET_MB,
                  group: dist.ProcessGroup | None = None) -> None:
    """Replace each ``.grad`` by its sum over ranks: one small flag collective, then flattened buckets.

    A rank whose DFS never touched a parameter (or that had no tree at all) has ``grad=None`` there; it joins
    with zeros so the collectives line up. A parameter that no rank touched keeps ``grad=None``, exactly as on
    one process, so optimizers that skip ``None`` gradients (weight decay, moments) behave the same.
    """
    params = [p for p in parameters if p.requires_grad]
    if world_size(group) == 1 or not params:
        return
    device = collective_device(params[0])
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device)
    dist.all_reduce(present, op=dist.ReduceOp.SUM, group=group)
    grads = []
    for param, anywhere in zip(params, present.tolist()):
        if anywhere == 0:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    _flat_collective(grads, bucket_mb, lambda flat: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group))


def broadcast_module(module: nn.Module, *, src: int = 0, bucket_mb: float = DEFAULT_BUCKET_MB,
                     group: dist.ProcessGroup | None = None) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank, so that all ranks start from identical weights
    (what the DDP constructor does, without keeping a DDP wrapper around)."""
    broadcast_tensors([t.data for t in module.parameters()] + list(module.buffers()), src=src, bucket_mb=bucket_mb,
                      group=group)


def broadcast_tensors(tensors: Sequence[torch.Tensor], *, src: int = 0, bucket_mb: float = DEFAULT_BUCKET_MB,
                      group: dist.ProcessGroup | None = None) -> None:
    """Overwrite ``tensors`` in place with rank ``src``'s (a global rank), in flattened buckets. A bucket the backend
    cannot reach where it lies (NCCL and a CPU tensor) travels through :func:`collective_device` and back."""
    if world_size(group) == 1 or not tensors:
        return

    def broadcast(flat: torch.Tensor) -> None:
        staged = flat.to(collective_device(flat))
        dist.broadcast(staged, src=src, group=group)
        if staged is not flat:
            flat.copy_(staged)

    _flat_collective(list(tensors), bucket_mb, broadcast)
