"""When one rank fails, or is told to stop by a signal, every rank stops: within seconds, or within a bound.

Without this, the other ranks of a failed run sit in their next collective until its timeout (30 minutes by
default): gloo notices a peer whose process exited, NCCL often does not, and a failed rank that does not exit
(stuck in teardown, an exception caught by user code) is noticed by neither. A signal is worse: a scheduler sends
SIGTERM to one process or to all of them at different moments, and a rank that stops at its own moment leaves the
others in a collective it never joins (measured: Lightning 2.6's SIGTERM handler calls a collective from inside
the signal handler, which then pairs with whatever collective the other rank is in, and a 2-process ``dta_fsdp``
run hung for good, see ``docs/traps.md``). :class:`FailureBroadcast` uses the process group's rendezvous store,
which every rank already reaches:

- the failing rank writes its error under its own key and bumps a counter (:meth:`FailureBroadcast.report`,
  called from the strategy's ``on_exception``);
- a rank that receives a signal writes it under its own key and bumps another counter (from its watchdog thread,
  not from the signal handler; a handler that only notes the signal is all it takes, :meth:`note_signal`);
- every rank runs a watchdog thread that reads both counters every ``poll_sec``. When another rank has failed (or
  the store's host, rank 0, is gone) it prints that rank's error on this rank's stderr, gives the main thread
  ``grace_sec`` to stop by itself, and then ends the process (``os._exit(1)``): a thread cannot interrupt a
  collective that waits in C++. When a rank received a signal, :attr:`stop_signal` says so on every rank, so the
  training loop can stop every rank at the same step (:mod:`lightning_dta.lightning.watchdog`); a rank that has not
  stopped ``signal_grace_sec`` after it learnt of the signal ends with status ``128 + signal`` (143 for SIGTERM),
  the status a process killed by that signal has.

The main thread may be inside a collective that never returns when the signal comes, and Python runs a signal
handler only between two bytecodes of the main thread. So the watchdog also listens on the interpreter's signal
wake-up file descriptor (``signal.set_wakeup_fd``), to which the interpreter writes the signal's number the moment
it arrives: the signal reaches every rank's watchdog even then.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch.distributed as dist

from lightning_dta.core.errors import UsageError

_PREFIX = "lightning_dta/failure"
_COUNT = f"{_PREFIX}/count"
_SIGNAL_PREFIX = "lightning_dta/signal"
_SIGNAL_COUNT = f"{_SIGNAL_PREFIX}/count"
STOP_SIGNALS = (signal.SIGTERM,)
"""the signals a run stops for together (SIGINT stays Lightning's: a KeyboardInterrupt on every rank)."""
DEFAULT_SIGNAL_GRACE_SEC = 30.0
"""after a signal, how long a rank may take to reach the end of its step and stop with the others (then it exits)."""


@dataclass(frozen=True)
class Stop:
    """The signal a run stops for and the rank that received it (the first one, when several did)."""

    signum: int
    rank: int

    @property
    def exit_status(self) -> int:
        """``128 + signal``: what a shell or a scheduler reads for a process ended by that signal."""
        return 128 + self.signum

    def describe(self) -> str:
        return f"{signal.Signals(self.signum).name} (received by rank {self.rank})"


_stopping: Stop | None = None  # process-wide, as a signal is


def stopping() -> Stop | None:
    """The signal this process is stopping for (``None``: none came), for the command's exit status."""
    return _stopping


def note_stopping(stop: Stop, agreed: bool = False) -> None:
    """Record that this process stops for ``stop``: the first record, until the ranks agree on one (``agreed``:
    the same on every rank when several received the signal)."""
    global _stopping
    if _stopping is None or agreed:
        _stopping = stop


def error_text(error: BaseException) -> str:
    """What another rank prints of this rank's error: the message of bad input (a :class:`UsageError` says what,
    where and the fix; a traceback adds nothing), the traceback of anything else (its last 4000 characters)."""
    if isinstance(error, UsageError):
        return f"{type(error).__name__}: {error}"
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))[-4000:]


class FailureBroadcast:
    """Report this rank's failure or signal to the others, and stop this rank when another one fails or a signal
    came and the run did not stop in time (module docstring)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, poll_sec: float = 0.5,
                 grace_sec: float = 5.0, signal_grace_sec: float = DEFAULT_SIGNAL_GRACE_SEC) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.poll_sec, self.grace_sec, self.signal_grace_sec = poll_sec, grace_sec, signal_grace_sec
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wakeup: tuple[socket.socket, socket.socket] | None = None  # (read end, write end)
        self._received: int | None = None  # a signal this rank received, not yet shared
        self._shared = False
        self._signal: Stop | None = None  # the signal the run stops for, once known here
        self._deadline = 0.0
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
        """Start the watchdog thread; on the main thread, also listen on the signal wake-up descriptor."""
        self._listen_for_signals()
        self._thread = threading.Thread(target=self._watch, name="lightning-dta-failure-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the watchdog (at a normal end of the run, before the process group goes away)."""
        self._stop.set()
        if self._wakeup is not None:
            try:
                self._wakeup[1].send(b"\0")  # wake the thread now (0 is no signal)
            except OSError:  # the buffer is full: the thread wakes anyway
                pass
        if self._thread is not None:
            self._thread.join(timeout=5 * self.poll_sec + 1)
            self._thread = None
        if self._wakeup is not None:
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:  # not the main thread: the descriptor stays until the process ends
                pass
            for end in self._wakeup:
                end.close()
            self._wakeup = None

    def _listen_for_signals(self) -> None:
        """Take the interpreter's signal wake-up descriptor, unless another part of the process (an asyncio loop)
        holds it or this is not the main thread: then signals are seen through :meth:`note_signal` only."""
        if threading.current_thread() is not threading.main_thread():
            return
        read, write = socket.socketpair()
        read.setblocking(False)
        write.setblocking(False)
        previous = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            read.close()
            write.close()
            return
        self._wakeup = (read, write)

    def note_signal(self, signum: int) -> None:
        """This rank received ``signum`` (call it from the signal handler: it only notes it; the watchdog thread
        tells the other ranks)."""
        if self._received is None:
            self._received = signum

    @property
    def stop_signal(self) -> Stop | None:
        """The signal the run stops for, received here or by another rank (``None``: none is known here)."""
        if self._signal is None and self._received is not None:
            return Stop(self._received, self.rank)
        return self._signal

    def report(self, error: BaseException) -> None:
        """Tell every rank that this one failed, with ``error`` (:func:`error_text`)."""
        self._stop.set()  # this rank is going down anyway: its own watchdog must not end it early
        try:
            self.store.set(f"{_PREFIX}/{self.rank}", error_text(error))
            self.store.add(_COUNT, 1)
        except Exception:  # the store may already be gone (rank 0 exited): nothing left to tell
            pass

    def failure_of_another_rank(self) -> tuple[int, str] | None:
        """The first other rank that reported a failure, and its error (``None``: none did)."""
        if self.store.add(_COUNT, 0) == 0:
            return None
        for other in range(self.world_size):
            key = f"{_PREFIX}/{other}"
            if other != self.rank and self.store.check([key]):
                return other, self.store.get(key).decode(errors="replace")
        return None

    def _signal_in_store(self) -> Stop | None:
        """The first rank that shared a signal, and which signal."""
        if self.store.add(_SIGNAL_COUNT, 0) == 0:
            return None
        for other in range(self.world_size):
            key = f"{_SIGNAL_PREFIX}/{other}"
            if self.store.check([key]):
                return Stop(int(self.store.get(key)), other)
        return None

    def _wait(self) -> None:
        """Sleep ``poll_sec``, or less when a signal arrives (its number comes on the wake-up descriptor)."""
        if self._wakeup is None:
            self._stop.wait(self.poll_sec)
            return
        ready, _, _ = select.select([self._wakeup[0]], [], [], self.poll_sec)
        if not ready:
            return
        try:
            numbers = self._wakeup[0].recv(4096)
        except BlockingIOError:
            return
        for number in numbers:
            if number in STOP_SIGNALS:
                self.note_signal(number)

    def _share_signal(self) -> None:
        if self._received is None or self._shared:
            return
        self._shared = True
        self.store.set(f"{_SIGNAL_PREFIX}/{self.rank}", str(self._received))
        self.store.add(_SIGNAL_COUNT, 1)

    def _learn_signal(self, stop: Stop) -> None:
        if self._signal is None:
            self._signal = stop
            self._deadline = time.monotonic() + self.signal_grace_sec
            note_stopping(stop)

    def _watch(self) -> None:
        while True:
            self._wait()
            if self._stop.is_set():
                return
            if self._signal is not None:  # known: the store has nothing more to say, only the deadline counts
                if time.monotonic() >= self._deadline:
                    self._exit_for_signal(self._signal)
                    return
                continue
            try:
                self._share_signal()
                failure = self.failure_of_another_rank()
                stop = self._signal_in_store()
            except Exception as error:  # noqa: BLE001 (any store error means its host is gone)
                if self._stop.is_set():
                    return
                stop = self.stop_signal
                if stop is not None:  # this rank's own signal, which it could not share: the deadline still counts
                    self._learn_signal(stop)
                    continue
                failure = (0, f"rank 0 (the host of the rendezvous store) is gone: {error}")
            if stop is not None:
                self._learn_signal(stop)
                continue
            if failure is not None:
                other, text = failure
                self.announced = True
                print(f"[rank{self.rank}] lightning_dta: stopping this rank because rank {other} failed:\n{text}",
                      file=sys.stderr, flush=True)
                if not self._stop.wait(self.grace_sec):
                    os._exit(1)
                return

    def _exit_for_signal(self, stop: Stop) -> None:
        """End this rank with the signal's exit status: it has not stopped ``signal_grace_sec`` after the signal."""
        print(f"[rank{self.rank}] lightning_dta: exiting with status {stop.exit_status}: {stop.describe()} came "
              f"{self.signal_grace_sec:g} s ago and this rank has not stopped (a step, a collective or a checkpoint "
              "that did not end in time)", file=sys.stderr, flush=True)
        os._exit(stop.exit_status)
