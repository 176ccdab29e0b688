"""Moving a step's host-side data to the accelerator without stalling it, and the one deliberate sync.

The engine builds its per-chunk inputs (token ids, positions, loss inputs, varlen offsets) on the CPU, where
indexing is cheap. A plain ``tensor.to("cuda")`` from pageable memory makes the host wait for the copy (a
device synchronisation per chunk, which starves the GPU between kernels); :func:`to_device` stages through
pinned memory and copies asynchronously instead (PyTorch's caching host allocator keeps the pinned block
alive until the copy is done). A step's only host read is its result at the end (:func:`host_values`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (on the CPU) on ``device``: a non-blocking copy from pinned memory on CUDA, as is elsewhere."""
    if device.type != "cuda" or tensor.device == device:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@contextmanager
def expected_sync(device: torch.device) -> Iterator[None]:
    """A deliberate host read (a step's result): allowed under ``torch.cuda.set_sync_debug_mode("error")``,
    which tests use to prove that the walk itself never waits for the device."""
    if device.type != "cuda":
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def host_values(values: Sequence[torch.Tensor | float], device: torch.device) -> list[float]:
    """Python floats of 0-d tensors (or floats) with one device-to-host transfer for all of them."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    with expected_sync(device):
        read = iter(torch.stack([t.detach().to(device=device, dtype=torch.float64) for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
