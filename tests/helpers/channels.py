"""Stand-ins for the NCCL group of ``weight_sync="vllm-nccl"`` on the CPU: a gloo group (a real broadcast, the way
vLLM's ``StatelessProcessGroup`` rendezvous works: a TCP store, rank 0 the trainer) and a recorder (no data plane).
"""

from __future__ import annotations

import base64
import datetime
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=30)


def join_gloo(master_address: str, master_port: int, rank: int, world_size: int) -> dist.ProcessGroup:
    """A gloo group of its own (not the default one, so a process can hold both ends in two threads), warmed up
    with vLLM's one-element all-reduce."""
    store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=TIMEOUT)
    group = dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)
    group.allreduce([torch.zeros(1)]).wait()
    return group


class GlooChannel:
    """The trainer's end (rank 0) over gloo: the fake server's workers join it from ``master_address/port``."""

    def __init__(self) -> None:
        self.store: dist.TCPStore | None = None
        self.group: Any = None
        self.world_size = 0

    def rendezvous(self) -> dict[str, Any]:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        return {"master_address": "127.0.0.1", "master_port": self.store.port}

    def join(self, world_size: int) -> None:
        self.group = dist.ProcessGroupGloo(self.store, 0, world_size, TIMEOUT)
        self.group.allreduce([torch.zeros(1)]).wait()
        self.world_size = world_size

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor.detach().contiguous(), 0).wait()

    def synchronize(self) -> None:
        pass  # every gloo broadcast above has completed


class RecordingChannel:
    """Records what would be sent, sends nothing (for control-plane tests: the fake server then receives nothing)."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.world_size = 0

    def rendezvous(self) -> dict[str, Any]:
        return {"nccl_unique_id_b64": base64.b64encode(bytes(128)).decode()}

    def join(self, world_size: int) -> None:
        self.world_size = world_size

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.sent.append(tensor.detach().clone())

    def synchronize(self) -> None:
        pass
