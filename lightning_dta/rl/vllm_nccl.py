"""``weight_sync="vllm-nccl"``: the policy's weights to a vLLM GPU server over NCCL, no checkpoint on disk.

vLLM 0.32 serves a weight-transfer API in dev mode (``VLLM_SERVER_DEV_MODE=1``; the routes are in
``vllm/entrypoints/rl/online/api_router.py``) when started with ``--weight-transfer-config '{"backend": "nccl"}'``
(otherwise every call fails with "Weight transfer not configured"). The trainer joins a NCCL group with the
server's workers as its rank 0 and broadcasts each tensor; HTTP carries only the control messages
(``vllm/distributed/weight_transfer/nccl_engine.py``, ``nccl_common.py``, ``clients.py``):

1. once: ``GET /get_world_size`` (the workers, data-parallel replicas included), then ``POST
   /init_weight_transfer_engine {"init_info": {"nccl_unique_id_b64": ..., "rank_offset": 1, "world_size": 1 +
   workers, "packed": false}}``. The call returns only once every worker has joined the group, so the trainer
   joins (``ncclCommInitRank`` as rank 0, then the one-element float32 ``all_reduce`` every vLLM communicator
   issues right after init) while the call is in flight.
2. every version: ``POST /start_weight_update`` (the worker prepares a layerwise reload), ``POST /update_weights
   {"update_info": {"names", "dtype_names", "shapes"}}``, which returns once the workers have received one
   broadcast per parameter in that order (so the broadcasts are issued while the call is in flight), then ``POST
   /finish_weight_update {"weight_version": "N"}`` (the reload is finalized: kernels' weight layouts rebuilt).
3. then ``POST /reset_prefix_cache``, whose ``success`` is read (the caller's
   :meth:`~lightning_dta.rl.server.OpenAICompatibleGenerator.reset_prefix_cache`): ``finish_weight_update``
   leaves the prefix cache as it was, with keys and values of the old weights.

The rendezvous is vLLM's "unique id" mode (an ``ncclUniqueId`` minted here and sent base64-encoded), meant for
trainers that cannot import vLLM: the trainer needs only its own torch's NCCL (``torch.cuda.nccl``), so vLLM stays
in its own environment. The other mode (``master_address``/``master_port``, vLLM's ``StatelessProcessGroup``)
would need vLLM importable here. Unpacked broadcasts (one per parameter, as vLLM's worker receives them with
``packed: false``): vLLM's packed wire format is its own code's, and a second implementation of it here could
drift from it silently.

The communicator is behind :class:`WeightChannel` so tests run the whole sequence on the CPU with a gloo group
(``tests/helpers/channels.py``); :class:`NcclChannel` is the real one. Never run against a real GPU server yet
(docs/rl.md says so): NCCL refuses two ranks on one GPU, so it needs a trainer GPU besides the server's.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from lightning_dta.core.errors import ConfigError
from lightning_dta.distributed.collectives import rank
from lightning_dta.distributed.sharding import full_parameters


class WeightChannel(Protocol):
    """The trainer's end of the group it shares with the server's workers: it is rank 0 and sends to all."""

    def rendezvous(self) -> dict[str, Any]:
        """The ``init_info`` fields that tell the workers how to join (e.g. ``nccl_unique_id_b64``)."""

    def join(self, world_size: int) -> None:
        """Join as rank 0 of ``world_size`` (blocks until every worker has joined), warm-up included."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send ``tensor`` to every worker (may return before it is sent: see :meth:`synchronize`)."""

    def synchronize(self) -> None:
        """Wait until every broadcast issued so far has completed."""


def require_nccl() -> None:
    """Refuse, with the fix, a process that cannot send over NCCL (no CUDA device, or a torch without NCCL)."""
    if not torch.cuda.is_available():
        reason = "this process has no CUDA device"
    elif not hasattr(torch._C, "_nccl_init_rank"):  # torch's NCCL bindings: absent from builds without NCCL
        reason = "this torch build has no NCCL"
    else:
        return
    raise ConfigError(f"weight_sync='vllm-nccl' broadcasts the weights over NCCL from a GPU, and {reason}. Fix: "
                      "weight_sync='vllm' (the weights through a directory the server reads)")


class NcclChannel:
    """:class:`WeightChannel` over the NCCL that ships with torch (``torch.cuda.nccl``), in vLLM's unique-id
    rendezvous: no vLLM import in the trainer's environment. Both sides should run the same NCCL version."""

    def __init__(self, device: torch.device | int | None = None) -> None:
        require_nccl()
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else
                                   torch.device("cuda", device).index)
        self.unique_id: bytes | None = None
        self.comm: Any = None

    def rendezvous(self) -> dict[str, Any]:
        self.unique_id = torch.cuda.nccl.unique_id()
        return {"nccl_unique_id_b64": base64.b64encode(self.unique_id).decode()}  # standard base64, as vLLM asks

    def join(self, world_size: int) -> None:
        if self.unique_id is None:
            raise RuntimeError("NcclChannel.join before rendezvous()")
        with torch.cuda.device(self.device):  # may run in another thread than the broadcasts: set the device here
            self.comm = torch.cuda.nccl.init_rank(world_size, self.unique_id, 0)
            warm_up = torch.zeros(1, device=self.device)  # vLLM's PyNcclCommunicator all_reduces this after init
            torch.cuda.nccl.all_reduce([warm_up], comms=[self.comm])
            torch.cuda.current_stream(self.device).synchronize()

    def broadcast(self, tensor: torch.Tensor) -> None:
        # contiguous: NCCL sends numel elements from data_ptr. Freed after the call, the memory is reused only on
        # this same stream, after the broadcast.
        tensor = tensor.detach().to(self.device).contiguous()
        with torch.cuda.device(self.device):
            torch.cuda.nccl.broadcast([tensor], root=0, comms=[self.comm])

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


class VLLMWeightTransfer:
    """Drives vLLM's weight-transfer routes for one server (module docstring): :meth:`connect` once on rank 0,
    :meth:`send` every version on every rank that syncs (a sharded policy's full tensors are gathered collectively;
    only rank 0 talks to the server and broadcasts).

    ``post(path, body)`` is the caller's HTTP client, not retried (a retried ``/update_weights`` would wait for
    broadcasts already sent); ``get(path)`` reads JSON; ``timeout`` bounds each wait for the server (seconds).
    """

    def __init__(self, post: Callable[[str, dict[str, Any]], Any], get: Callable[[str], Any],
                 make_channel: Callable[[], WeightChannel], timeout: float) -> None:
        self.post, self.get, self.make_channel, self.timeout = post, get, make_channel, timeout
        self.channel: WeightChannel | None = None

    def connect(self) -> None:
        """Join the server's workers' group (rank 0 only; once)."""
        if self.channel is not None:
            return
        reply = self.get("/get_world_size")
        workers = reply.get("world_size") if isinstance(reply, dict) else None
        if not isinstance(workers, int) or workers < 1:
            raise RuntimeError(f"GET /get_world_size answered {reply!r}, not a worker count")
        channel = self.make_channel()
        init_info = channel.rendezvous() | {"rank_offset": 1, "world_size": 1 + workers, "packed": False}
        joining = _Background(channel.join, 1 + workers)  # blocks until the workers join, which the POST makes
        self.post("/init_weight_transfer_engine", {"init_info": init_info})  # returns once every worker has joined
        joining.result(self.timeout, "joining the weight-transfer group")
        self.channel = channel

    def send(self, policy: nn.Module, version: int) -> None:
        """Broadcast every parameter of ``policy`` (gathered one at a time when sharded) as version ``version``."""
        sender = rank() == 0
        if sender and self.channel is None:
            raise RuntimeError("VLLMWeightTransfer.send before connect()")
        params = dict(policy.named_parameters())  # the names vLLM's load_weights maps; tied weights once
        receiving = None
        if sender:
            self.post("/start_weight_update", {})
            update_info = {"names": list(params), "dtype_names": [str(p.dtype).removeprefix("torch.")
                                                                 for p in params.values()],
                           "shapes": [list(p.shape) for p in params.values()]}  # a sharded one's global shape
            receiving = _Background(self.post, "/update_weights", {"update_info": update_info})
        channel = self.channel
        for name, tensor in full_parameters(policy):  # a collective per sharded tensor: every rank iterates
            if receiving is not None and channel is not None and name in params:
                if receiving.done():  # the server gave up early (e.g. refused the metadata): say why, do not hang
                    receiving.result(0.0, "receiving the weights")
                channel.broadcast(tensor)
        if receiving is not None and channel is not None:
            receiving.result(self.timeout, "receiving the weights")  # the server has every tensor
            channel.synchronize()
            self.post("/finish_weight_update", {"weight_version": str(version)})


class _Background:
    """A call in a daemon thread: a peer that never answers must not keep the process alive at exit."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(function, *args), daemon=True,
                                       name="lightning-dta-weight-transfer")
        self.thread.start()

    def _run(self, function: Callable[..., Any], *args: Any) -> None:
        try:
            function(*args)
        except BaseException as error:  # re-raised by result() in the caller's thread
            self.error = error

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self, timeout: float, what: str) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"{what} took longer than {timeout:.0f} s: the server's workers and this process "
                               "are out of step (the weight-transfer group is unusable; restart the server)")
        if self.error is not None:
            raise self.error
