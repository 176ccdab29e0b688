"""Every rank of a Lightning run stops together: within seconds when one fails, at the end of the same step when one
receives SIGTERM. :mod:`lightning_dta.distributed.faults` is the mechanism (the rendezvous store, a watchdog thread
per rank); this is the Lightning side, mixed into both strategies.

Why Lightning's own SIGTERM handling is replaced on several processes (Lightning 2.6.6,
``trainer/connectors/signal_connector.py``; ``docs/traps.md``): its handler forwards the signal to the ranks it
launched and then calls ``dist.broadcast`` from inside the signal handler, i.e. in the middle of whatever the main
thread was doing, also inside another collective; the broadcast then pairs with the other rank's next collective.
Measured: a 2-process ``dta_fsdp`` run signalled while it wrote a checkpoint hung for good (rank 0 in the handler's
broadcast inside the checkpoint's scatter, rank 1 in that scatter). The flag it sets
(``trainer.received_sigterm``) is also read by the loops at the end of each batch on each rank on its own, so ranks
that got the signal at different moments stop at different batches. And ``SIGTERMException`` is a ``SystemExit``
without a code: the process exits with status 0, which a scheduler reads as success.

What :class:`RankWatchdogMixin` does instead, on several processes:

- at ``on_train_start`` (just after Lightning installed its handlers) it installs a SIGTERM handler that only notes
  the signal; the rank's watchdog thread tells the others through the store;
- after each training step every rank shares what it knows in one tiny collective (a few floats), and when a signal
  came to any rank it sets the flag Lightning's loops read, on every rank at the same point: the loop then raises
  ``SIGTERMException`` at the end of that batch, after its checkpoint callbacks, on every rank, so ``on_exception``
  hooks (``OnExceptionCheckpoint``) run together and their collectives pair;
- the exception's code becomes ``128 + signal`` (143): the process's exit status says it was a signal;
- a rank that has not stopped ``signal_grace_sec`` after it learnt of the signal exits with that status anyway.

On one process Lightning's handler stays (it calls no collective there); only the exit status is set.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_dta.core.errors import ConfigError
from lightning_dta.distributed.collectives import all_gather_floats
from lightning_dta.distributed.faults import (
    DEFAULT_SIGNAL_GRACE_SEC,
    FailureBroadcast,
    Stop,
    error_text,
    note_stopping,
    stopping,
)

_NOT_REPLACED = object()


def check_signal_grace(seconds: float) -> float:
    """``signal_grace_sec`` of a strategy: a positive number of seconds."""
    if not seconds > 0:
        raise ConfigError(f"signal_grace_sec={seconds!r}: after SIGTERM a rank that has not stopped within this many "
                          "seconds exits. Fix: a positive number (default 30)")
    return float(seconds)


class RankWatchdogMixin:
    """For a Lightning strategy (module docstring): start the watchdog once the process group exists
    (:meth:`_start_watchdog`), stop every rank at the same step after a signal, report a failure in
    ``on_exception``, stop the watchdog in ``teardown``."""

    signal_grace_sec: float = DEFAULT_SIGNAL_GRACE_SEC
    _watchdog: FailureBroadcast | None = None
    _lightning_handler: Any = _NOT_REPLACED  # Lightning's SIGTERM handler while ours is installed

    def _start_watchdog(self) -> None:
        self._watchdog = FailureBroadcast.for_default_group(signal_grace_sec=self.signal_grace_sec)
        if self._watchdog is not None:
            self._watchdog.start()

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._watchdog is not None and threading.current_thread() is threading.main_thread():
            self._lightning_handler = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._watchdog is not None:
            self._watchdog.note_signal(signum)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        self._stop_with_the_others()
        return output

    def _stop_with_the_others(self) -> None:
        """One collective per step: if any rank knows of a signal, every rank sets Lightning's flag now, so that
        the loop stops every rank at the end of this batch."""
        if self._watchdog is None:
            return
        known = self._watchdog.stop_signal
        ranks = all_gather_floats([known.signum, known.rank] if known else [0, -1], self.root_device)
        signalled = [Stop(int(signum), int(rank)) for signum, rank in ranks if signum]
        if signalled:
            note_stopping(signalled[0], agreed=True)  # the lowest rank that received it, on every rank
            # Lightning keeps the flag its loops check in the signal connector and offers no setter; the same
            # attribute its own handler sets (Lightning 2.6.6)
            self.lightning_module.trainer._signal_connector.received_sigterm = True

    def on_exception(self, exception: BaseException) -> None:
        """A stop for a signal: the exit status says which. A failure: tell the other ranks (they stop within
        seconds); if another rank failed first, print its error here."""
        if isinstance(exception, SIGTERMException):
            stop = stopping() or Stop(signal.SIGTERM, self.global_rank)
            note_stopping(stop)
            exception.code = stop.exit_status  # a SystemExit's code is the process's exit status
        elif self._watchdog is not None and self._watchdog.stop_signal is None:
            try:
                first = self._watchdog.failure_of_another_rank()
            except Exception:  # noqa: BLE001 (the store is gone with rank 0)
                first = None
            if first is not None and not self._watchdog.announced and first[1] != error_text(exception):
                print(f"[rank{self._watchdog.rank}] lightning_dta: rank {first[0]} failed first:\n{first[1]}",
                      file=sys.stderr, flush=True)
            self._watchdog.report(exception)
        super().on_exception(exception)

    def teardown(self) -> None:
        if self._lightning_handler is not _NOT_REPLACED and threading.current_thread() is threading.main_thread():
            previous = signal.SIG_DFL if self._lightning_handler is None else self._lightning_handler
            signal.signal(signal.SIGTERM, previous)  # Lightning's teardown then restores its own original
            self._lightning_handler = _NOT_REPLACED
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        super().teardown()
