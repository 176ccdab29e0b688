"""When one rank fails, every rank stops within seconds, with the original error shown on every rank.

Without this, the other ranks of a failed run sit in their next collective until its timeout (30 minutes by
default): gloo notices a peer whose process exited, NCCL often does not, and a failed rank that does not exit
(stuck in teardown, an exception caught by user code) is noticed by neither. :class:`FailureBroadcast` uses the
process group's rendezvous store, which every rank already reaches:

- the failing rank writes its traceback under its own key and bumps a counter (:meth:`FailureBroadcast.report`,
  called from ``DTAStrategy.on_exception``);
- every rank runs a watchdog thread that reads the counter every ``poll_sec``; when another rank has failed
  (or the store's host, rank 0, is gone) it prints that rank's error on this rank's stderr, gives the main thread
  ``grace_sec`` to stop by itself, and then ends the process (``os._exit``): a thread cannot interrupt a
  collective that waits in C++.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback

import torch.distributed as dist

_PREFIX = "lightning_dta/failure"
_COUNT = f"{_PREFIX}/count"


class FailureBroadcast:
    """Report this rank's failure to the others, and stop this rank when another one fails (module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, poll_sec: float = 0.5,
                 grace_sec: float = 5.0) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.poll_sec, self.grace_sec = poll_sec, grace_sec
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.announced = False  # whether another rank's failure was printed here already

    @classmethod
    def for_default_group(cls, **kwargs: float) -> FailureBroadcast | None:
        """A watchdog on the default process group's store; ``None`` on one process or without a store."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError):
            return None
        return cls(store, dist.get_rank(), dist.get_world_size(), **kwargs)

    def start(self) -> FailureBroadcast:
        self._thread = threading.Thread(target=self._watch, name="lightning-dta-failure-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the watchdog (at a normal end of the run, before the process group goes away)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.poll_sec + 1)
            self._thread = None

    def report(self, error: BaseException) -> None:
        """Tell every rank that this one failed, with ``error``'s traceback (its last 4000 characters)."""
        self._stop.set()  # this rank is going down anyway: its own watchdog must not end it early
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-4000:]
        try:
            self.store.set(f"{_PREFIX}/{self.rank}", text)
            self.store.add(_COUNT, 1)
        except Exception:  # the store may already be gone (rank 0 exited): nothing left to tell
            pass

    def failure_of_another_rank(self) -> tuple[int, str] | None:
        """The first other rank that reported a failure, and its traceback (``None``: none did)."""
        if self.store.add(_COUNT, 0) == 0:
            return None
        for other in range(self.world_size):
            key = f"{_PREFIX}/{other}"
            if other != self.rank and self.store.check([key]):
                return other, self.store.get(key).decode(errors="replace")
        return None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_sec):
            try:
                failure = self.failure_of_another_rank()
            except Exception as error:  # noqa: BLE001 (any store error means its host is gone)
                if self._stop.is_set():
                    return
                failure = (0, f"rank 0 (the host of the rendezvous store) is gone: {error}")
            if failure is None:
                continue
            other, text = failure
            self.announced = True
            print(f"[rank{self.rank}] lightning_dta: stopping this rank because rank {other} failed:\n{text}",
                  file=sys.stderr, flush=True)
            if not self._stop.wait(self.grace_sec):
                os._exit(1)
            return


class FailureWatchdogMixin:
    """For a Lightning strategy: start a :class:`FailureBroadcast` once the process group exists
    (:meth:`_start_failure_watchdog`), report this rank's failure in ``on_exception``, stop it in ``teardown``."""

    _failures: FailureBroadcast | None = None

    def _start_failure_watchdog(self) -> None:
        self._failures = FailureBroadcast.for_default_group()
        if self._failures is not None:
            self._failures.start()

    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks (they stop within seconds); if another rank failed first, print its error here."""
        if self._failures is not None:
            try:
                first = self._failures.failure_of_another_rank()
            except Exception:  # noqa: BLE001 (the store is gone with rank 0)
                first = None
            if first is not None and not self._failures.announced:
                print(f"[rank{self._failures.rank}] lightning_dta: rank {first[0]} failed first:\n{first[1]}",
                      file=sys.stderr, flush=True)
            self._failures.report(exception)
        super().on_exception(exception)

    def teardown(self) -> None:
        if self._failures is not None:
            self._failures.stop()
            self._failures = None
        super().teardown()
