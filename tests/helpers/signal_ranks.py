"""``python -m tests.helpers.signal_ranks RANK PORT``: one of two gloo ranks whose training is stuck, for the
signal test of :class:`~lightning_dta.distributed.faults.FailureBroadcast` (no Lightning).

Rank 0 waits in an all-reduce that rank 1 never joins: its main thread is inside C++, where Python cannot run a
signal handler. Rank 1 sleeps in Python. SIGTERM to rank 0 must still reach both watchdogs (through the signal
wake-up descriptor and the store), and both ranks must exit with status 143 once ``signal_grace_sec`` is over.
"""

import signal
import sys
import time

import torch
import torch.distributed as dist

from lightning_dta.distributed.faults import FailureBroadcast

GRACE_SEC = 2.0

if __name__ == "__main__":
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    watchdog = FailureBroadcast.for_default_group(poll_sec=0.1, signal_grace_sec=GRACE_SEC).start()
    signal.signal(signal.SIGTERM, lambda signum, frame: watchdog.note_signal(signum))
    print(f"rank {rank} ready", flush=True)
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # never returns: rank 1 does not join
    time.sleep(120)
    sys.exit(3)  # not reached when the watchdog works
