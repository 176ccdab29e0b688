"""The background generation thread of asynchronous RL, and its hand-over to the training thread.

:class:`AsyncProducer` runs ``generate(index, version)`` for step after step in a daemon thread. Step ``i``
(counted from :meth:`AsyncProducer.start`) starts only once the policy version is at least
``base_version + i - max_staleness``; at most ``max_staleness + 1`` generated steps wait in the queue. The
training thread publishes versions (:meth:`~AsyncProducer.set_version`) and takes steps in order
(:meth:`~AsyncProducer.take`); a failure of the thread, or a loop that stopped publishing versions, raises
there with the cause. ``generation_lock`` is held during each generation, so that a weight copy never mixes
two versions into one generation.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

POLL_SEC = 0.05  # how often a waiting thread looks at the stop flag and the other thread's health


@dataclass
class Generated:
    """A generated step: its index, the policy version that generated it, its content and the wall time."""

    index: int
    version: int
    content: Any
    seconds: float


class AsyncProducer:
    """Generate steps ahead of training within a staleness bound (module docstring)."""

    def __init__(self, generate: Callable[[int, int], Generated], max_staleness: int) -> None:
        self.generate = generate
        self.max_staleness = max_staleness
        self.generation_lock = threading.Lock()
        self._condition = threading.Condition()
        self._queue: queue.Queue[Generated] = queue.Queue(maxsize=max_staleness + 1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._waiting_for: int | None = None  # the version the thread waits for (None: not waiting)
        self._version = 0
        self._base_version = 0
        self._first_index = 0

    @property
    def steps_ahead(self) -> int:
        """Generated steps waiting to be taken."""
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, first_index: int, version: int) -> None:
        """Start generating at step ``first_index`` with the weights of ``version``."""
        self._first_index, self._base_version, self._version = first_index, version, version
        self._thread = threading.Thread(target=self._run, name="lightning-dta-rollouts", daemon=True)
        self._thread.start()

    def set_version(self, version: int) -> None:
        """The policy is now at ``version``: let the thread start the steps it allows."""
        with self._condition:
            self._version = version
            self._condition.notify_all()

    def stop(self, timeout: float = 60.0) -> int:
        """Stop the thread and wait for it; returns the number of generated steps never taken."""
        self._stop.set()
        with self._condition:
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"the rollout generation thread did not stop within {timeout:.0f} s")
            self._thread = None
        return self._queue.qsize()

    def take(self, index: int) -> Generated:
        """The next generated step (``index``) from the thread; its failure or a stalled loop raises here."""
        while True:
            if self._error is not None:
                raise RuntimeError(f"the rollout generation thread failed: {self._error}") from self._error
            try:
                return self._queue.get(timeout=POLL_SEC)
            except queue.Empty:
                pass
            with self._condition:
                waiting_for = self._waiting_for
                stalled = waiting_for is not None and self._queue.empty() and self._error is None
                if stalled and self._version < waiting_for:
                    raise RuntimeError(
                        f"the trainer wants step {index} but the generation thread waits for policy version "
                        f"{waiting_for} and the policy is at version {self._version}: update_policy() is not "
                        "being called after each optimizer step. With Lightning add "
                        "lightning_dta.rl.OnlineRLCallback to the Trainer's callbacks; in a plain loop call "
                        "source.update_policy(model, version) after every optimizer.step()")
            if not self.alive and self._error is None:
                raise RuntimeError("the rollout generation thread has stopped (was the source closed?)")

    def _run(self) -> None:
        """Generate step after step, each once the policy version allows it, until stopped."""
        try:
            index = self._first_index
            while not self._stop.is_set():
                needed = self._base_version + (index - self._first_index) - self.max_staleness
                with self._condition:
                    while self._version < needed and not self._stop.is_set():
                        self._waiting_for = needed
                        self._condition.wait(POLL_SEC)
                    self._waiting_for = None
                if self._stop.is_set():
                    return
                with self.generation_lock:
                    generated = self.generate(index, self._version)
                while not self._stop.is_set():
                    try:
                        self._queue.put(generated, timeout=POLL_SEC)
                        break
                    except queue.Full:
                        continue
                index += 1
        except BaseException as error:  # handed to the training thread by take()
            self._error = error
