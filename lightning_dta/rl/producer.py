"""The background generation thread of asynchronous RL, and its hand-over to the training thread.

:class:`AsyncProducer` runs ``generate(index, version)`` for generation batch after generation batch in a daemon
thread, pinned to versions. Staleness counts generation batches: with ``n`` optimizer steps per batch
(``steps_per_batch``), batch ``first + k`` is generated with the weights of exactly ``base + max(0, before + (k -
max_staleness) * n)`` (counted from :meth:`AsyncProducer.start`; ``before``: the steps of a batch begun before the
start, still to train), the weights that start training batch ``first + k - max_staleness``. Pinning makes the
version of every batch a function of its index only, so every rank of a run agrees on it (and a rerun repeats it),
and the bound holds by construction: a batch starts training at most ``max_staleness`` generation batches (``n *
max_staleness`` optimizer steps) after the weights that generated it.

The training thread publishes each new version with :meth:`~AsyncProducer.publish`: it waits until every step
that needs the weights loaded now has been generated, then runs ``load`` (copy the weights into the generator)
and lets the thread go on. With ``max_staleness=1`` and one step per batch that wait is for the batch the trainer
trains next, which it waits for anyway. Batches are taken in order with :meth:`~AsyncProducer.take`; a failure of
the thread, or a loop that stopped publishing versions, raises there with the cause.
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
    """Generate steps ahead of training within a staleness bound, each with its pinned version."""

    def __init__(self, generate: Callable[[int, int], Generated], max_staleness: int, steps_per_batch: int = 1
                 ) -> None:
        self.generate = generate
        self.max_staleness = max_staleness
        self.steps_per_batch = steps_per_batch
        self._condition = threading.Condition()
        self._queue: queue.Queue[Generated] = queue.Queue(maxsize=max_staleness + 1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._loaded = 0  # the version of the weights the generator holds
        self._base = 0
        self._first = 0
        self._before = 0  # optimizer steps of a batch begun before start(), trained before batch `first`
        self._generated = 0  # steps generated since start (the thread works on step first + generated)

    def version_of(self, index: int) -> int:
        """The pinned version of generation batch ``index`` (module docstring)."""
        return self._base + max(0, self._before + (index - self._first - self.max_staleness) * self.steps_per_batch)

    @property
    def steps_ahead(self) -> int:
        """Generated steps waiting to be taken."""
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, first_index: int, version: int, steps_before: int = 0) -> None:
        """Start generating at generation batch ``first_index`` with the weights of ``version`` (loaded in the
        generator); ``steps_before`` optimizer steps (of a batch begun earlier) are trained before that batch's."""
        self._first, self._base, self._loaded, self._generated = first_index, version, version, 0
        self._before = steps_before
        self._thread = threading.Thread(target=self._run, name="lightning-dta-rollouts", daemon=True)
        self._thread.start()

    def publish(self, version: int, load: Callable[[], None]) -> None:
        """The policy is at ``version``: once the steps that need the loaded weights are generated, ``load()`` the
        new ones (with the thread idle) and let the thread start the steps that need them."""
        with self._condition:
            while not self._stop.is_set() and self._error is None and self._pending_on_loaded():
                self._condition.wait(POLL_SEC)
            if self._error is not None:
                raise RuntimeError(f"the rollout generation thread failed: {self._error}") from self._error
            load()
            self._loaded = version
            self._condition.notify_all()

    def _pending_on_loaded(self) -> bool:
        """Whether the thread still has to generate a step pinned to the loaded version (or an older one)."""
        return self.version_of(self._first + self._generated) <= self._loaded and self.alive

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
                needed = self.version_of(self._first + self._generated)
                if self._queue.empty() and needed > self._loaded and self._error is None:
                    raise RuntimeError(
                        f"the trainer wants step {index} but the generation thread waits for policy version "
                        f"{needed} and the policy is at version {self._loaded}: update_policy() is not being called "
                        "after each optimizer step. With Lightning add lightning_dta.rl.OnlineRLCallback to the "
                        "Trainer's callbacks; in a plain loop call source.update_policy(model, version) after every "
                        "optimizer.step()")
            if not self.alive and self._error is None:
                raise RuntimeError("the rollout generation thread has stopped (was the source closed?)")

    def _run(self) -> None:
        """Generate step after step, each once its pinned version is loaded, until stopped."""
        try:
            while not self._stop.is_set():
                index = self._first + self._generated
                with self._condition:
                    while self.version_of(index) > self._loaded and not self._stop.is_set():
                        self._condition.wait(POLL_SEC)
                    if self._stop.is_set():
                        return
                    version = self._loaded
                # Generation runs outside the lock; publish() waits for it (the weights stay as they are).
                generated = self.generate(index, version)
                with self._condition:
                    self._generated += 1
                    self._condition.notify_all()
                while not self._stop.is_set():
                    try:
                        self._queue.put(generated, timeout=POLL_SEC)
                        break
                    except queue.Full:
                        continue
        except BaseException as error:  # handed to the training thread by take() and publish()
            self._error = error
            with self._condition:
                self._condition.notify_all()
