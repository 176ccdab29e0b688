"""Measuring memory without a GPU: bytes that autograd holds for backward, and the process's peak RSS.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an operation saves for its backward. The meter
counts each storage once while any saved reference to it is alive and records the peak, so it measures
what a training mode keeps for backward (parameters excluded), independent of the allocator and of noise.
"""

from __future__ import annotations

import re
import resource
import sys

import torch
from torch import nn

try:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    AsyncCollectiveTensor = DTensor = None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds the bytes: a DTensor's (tensor-parallel or FSDP) own shard on this rank, the
    result of a collective (a row-parallel layer's all-reduced output, saved as it is by the next op that saves its
    input, as an RMSNorm computing in the model's dtype does). Their own ``untyped_storage()`` is an invalid wrapper
    storage."""
    if DTensor is not None and isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    if AsyncCollectiveTensor is not None and isinstance(tensor, AsyncCollectiveTensor):
        return tensor.trigger_wait()  # done by now: the op that saves it has run
    return tensor


class _Saved:
    __slots__ = ("meter", "key", "tensor", "__weakref__")

    def __init__(self, meter: SavedTensorMeter, key: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Context manager: ``peak_bytes`` is the largest total size of tensors saved for backward at once."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self._params = {_local(p).data_ptr() for p in model.parameters()} if model is not None else set()
        self._live: dict[int, list[int]] = {}  # storage pointer -> [references, bytes]
        self.current_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = _local(tensor).untyped_storage()
        key = storage.data_ptr()
        if key in self._params:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, storage.nbytes()]
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        else:
            entry[0] += 1
        # Keep a detached alias: holding a saved *output* with its grad_fn would form a cycle through C++
        # (node -> saved handle -> tensor -> node) that Python's GC cannot break, so graph branches that
        # backward never reaches would look leaked. The alias shares storage, so the count is unchanged.
        return _Saved(self, key, tensor.detach())

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current_bytes -= entry[1]
            del self._live[key]

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter of this process; ``False`` where the platform does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (since the last :func:`reset_peak_rss`, where it worked)."""
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"^VmHWM:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
        if match:
            return int(match.group(1)) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def current_rss_bytes() -> int | None:
    """Resident set size of this process now (``None`` where ``/proc`` is not available)."""
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"^VmRSS:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
        return int(match.group(1)) * 1024 if match else None
    except OSError:
        return None
