"""What one process gathers and writes at most every so often, from a thread of its own.

For events as frequent as the tasks themselves, where a write each (a Redis round trip, a
broker publish) would cost a worker as much as the throttling: they are gathered under a
lock, and the gatherer's thread writes them all ``every_s`` after the first of them. The
price: what was gathered reaches its destination up to ``every_s`` late, and what a
process that dies (or a pool child that exits) gathered within that time is lost; it is
for people. The thread (a greenlet under gevent and eventlet, which patch ``threading``)
is started by the first addition and then waits for the next: a thread started per write
would cost the adding task a thread's start (tens of us, and a switch to the new thread),
every ``every_s``. A forked child starts empty, its thread not yet started.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Generic, TypeVar

logger = logging.getLogger("throttle")

IDLE_CHECK_S = 30.0
"""How often an idle gatherer's thread checks that its gatherer still exists, in s."""

S = TypeVar("S")
"""What a gatherer takes out and writes at once."""


class Gathering(Generic[S]):
    """The locks, the thread, the flush and the fork hook of a gatherer. A subclass sets
    its empty state in :meth:`_reset`, adds to it under ``_lock`` and then calls
    :meth:`_arm`; :meth:`_take` hands what it gathered to :meth:`_write`."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._writing = threading.Lock()
        self._due = threading.Event()
        self._thread: threading.Thread | None = None
        self._reset()
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)  # the hook must not keep the gatherer alive

            def forget() -> None:
                gathering = ref()
                if gathering is not None:
                    gathering._forget()

            os.register_at_fork(after_in_child=forget)

    def _reset(self) -> None:
        """Start empty (called under the lock, or before any thread sees the object)."""
        raise NotImplementedError

    def _arm(self) -> None:
        """Have the thread flush within ``every_s`` unless it is due to already (under the
        lock)."""
        if not self._due.is_set():
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_flushing, args=(weakref.ref(self), self._due, self.every_s),
                    name=f"throttle-{type(self).__name__}", daemon=True,
                )  # fmt: skip
                self._thread.start()
            self._due.set()

    def _disarm(self) -> None:
        """Nothing is gathered any more (under the lock): the next addition arms again."""
        self._due.clear()

    def _take(self) -> S | None:
        """What was gathered, to be written (under the lock, before :meth:`_reset`); None
        when nothing was."""
        raise NotImplementedError

    def _write(self, gathered: S) -> None:
        """Write what :meth:`_take` took (outside the lock: adding goes on meanwhile)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Write what was gathered now (nothing when nothing was). One write at a time: a
        flush returns once what was gathered before it is written, whichever thread (this
        one, the gatherer's, another that flushed) took it."""
        with self._writing:
            with self._lock:
                gathered = self._take()
                self._reset()
                self._disarm()
            if gathered is not None:
                self._write(gathered)

    def _forget(self) -> None:
        """In a forked child: the parent's gatherings are the parent's to write, and its
        thread does not exist here."""
        self._lock = threading.Lock()
        self._writing = threading.Lock()
        self._due = threading.Event()
        self._thread = None
        self._reset()


def _flushing(ref: weakref.ref[Gathering[object]], due: threading.Event, every_s: float) -> None:
    """A gatherer's thread: ``every_s`` after it is armed, flush; until the gatherer is
    gone (it holds the gatherer only while it flushes; an idle thread looks every
    :data:`IDLE_CHECK_S`), or a fork replaced ``due``."""
    while True:
        if not due.wait(IDLE_CHECK_S):
            if ref() is None:
                return
            continue
        time.sleep(every_s)
        gathering = ref()
        if gathering is None or gathering._due is not due:
            return
        try:
            gathering.flush()
        except Exception:  # the thread must outlive one failed write: the next ones come
            logger.exception(
                "throttle: %s could not write what it gathered", type(gathering).__name__
            )
        del gathering
