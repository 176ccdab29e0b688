"""Tensor-parallel peers walk the same trees: checked each step, by a digest of the rollouts compared over the group.

Why: the peers of a tensor-parallel group run every forward and backward of a walk together, so the collectives
inside each layer pair up only if every peer walks the same tree. Peers handed different trees (a step source that
differs between ranks, a partition computed from different numbers, generations that diverged) pair one chunk's
all-reduce with another chunk's: the run hangs until the collective timeout, or trains on wrong gradients without a
word. So before any walk of a step the peers exchange a 64-bit digest of the rollouts they are about to walk (one
all-gather of one integer over the group) and, where the digests differ, every peer stops with all of them named.

The digest covers what the data side decides: each rollout's tokens, loss mask and advantages, in order. Not the
log-probs or values a model fills in later (a proximal or reference walk, a critic): the peers compute those
together, in lockstep, and a check of their last bits could stop a correct run.

The exchange waits at most ``timeout`` (:data:`PEER_TIMEOUT`): a peer that never reaches the check (it walks a
different number of steps, or is stuck elsewhere) ends the wait with an error instead of the collective timeout's
half hour. A mismatch itself never waits: every peer reaches the check once per step, whatever its trees hold.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from lightning_dta.core.errors import UsageError
from lightning_dta.core.rollout import Rollout
from lightning_dta.distributed.collectives import collective_device

PEER_TIMEOUT = datetime.timedelta(minutes=5)  # far above the peers' skew in one step (they walk in lockstep)


class TensorParallelMismatch(UsageError, RuntimeError):
    """The peers of a tensor-parallel group hold different rollouts for one step (or one did not reach the check)."""


def rollouts_digest(rollouts: Sequence[Rollout]) -> int:
    """A 64-bit digest (signed, to travel in an int64 tensor) of the rollouts' tokens, loss masks and advantages,
    in order: equal on two ranks exactly when they would walk the same trees with the same data."""
    digest = hashlib.blake2b(digest_size=8)
    for rollout in rollouts:
        for field, dtype in ((rollout.input_ids, np.int64), (rollout.loss_mask, np.int64),
                             (rollout.advantages, np.float64)):
            if field is None:
                digest.update(b"n")
                continue
            values = np.asarray(field, dtype=dtype)
            digest.update(b"%d|" % values.size)
            digest.update(values.tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


def check_peers_agree(rollouts: Sequence[Rollout], group: dist.ProcessGroup | None, where: str, *,
                      timeout: datetime.timedelta = PEER_TIMEOUT) -> None:
    """Stop (:class:`TensorParallelMismatch`, on every peer) unless every peer of ``group`` holds the same
    ``rollouts`` (:func:`rollouts_digest`); ``where`` names the step in the message. ``group=None``: no tensor
    parallelism, nothing to check. Every peer must call it at the same point, also one without rollouts."""
    if group is None or dist.get_world_size(group) == 1:
        return
    mine = torch.tensor([rollouts_digest(rollouts)], dtype=torch.int64)
    mine = mine.to(collective_device(mine))
    digests = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    ranks = dist.get_process_group_ranks(group)
    work = dist.all_gather(digests, mine, group=group, async_op=True)
    try:
        work.wait(timeout=timeout)
    except RuntimeError as error:
        raise TensorParallelMismatch(
            f"{where}: rank {dist.get_rank()} waited {timeout.total_seconds():g} s for its tensor-parallel peers "
            f"(ranks {ranks}) to compare the rollouts they are about to walk, and not all of them came ({error}). A "
            "peer that walks another number of steps would pair the collectives inside each layer wrongly. Fix: give "
            "every rank the same steps (the same source, length and settings), and look at the other ranks' "
            "errors") from error
    values = [int(d.item()) for d in digests]
    if len(set(values)) > 1:
        named = ", ".join(f"rank {r}: {v & (2**64 - 1):016x}" for r, v in zip(ranks, values))
        raise TensorParallelMismatch(
            f"{where}: the tensor-parallel peers hold different rollouts ({named}; seen from rank {dist.get_rank()}). "
            "Peers walk one tree together, so the collectives inside each layer would pair up wrongly: a hang or "
            "wrong gradients. Fix: make every input of the step identical on every rank of a tensor-parallel group: "
            "the same step source, seed and settings (a Python source must not depend on the rank), generation "
            "seeded from the step and not from the rank, and the same weights on every peer")
