"""What one process gathers and writes at most every so often, from a timer thread.

For events as frequent as the tasks themselves, where a write each (a Redis round trip, a
broker publish) would cost a worker as much as the throttling: they are gathered under a
lock, and a timer started by the first of them writes them all ``every_s`` later. The
price: what was gathered reaches its destination up to ``every_s`` late, and what a
process that dies (or a pool child that exits) gathered within that time is lost; it is
for people. The timer is a thread (a greenlet under gevent and eventlet, which patch
``threading``); a forked child starts empty.
"""

from __future__ import annotations

import os
import threading
import weakref


class Gathering:
    """The lock, the timer and the fork hook of a gatherer. A subclass sets its empty state
    in :meth:`_reset`; adds to it under ``_lock``, then calls :meth:`_arm`; and in
    :meth:`flush` takes the state out under the lock (its own, then :meth:`_reset` and
    :meth:`_disarm`) and writes it outside."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
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
        """Have the timer flush within ``every_s`` unless it is set already (under the
        lock)."""
        if self._timer is None:
            self._timer = threading.Timer(self.every_s, self.flush)
            self._timer.daemon = True
            self._timer.start()

    def _disarm(self) -> threading.Timer | None:
        """Take the timer out (under the lock): the next addition sets a new one."""
        timer, self._timer = self._timer, None
        return timer

    def flush(self) -> None:
        raise NotImplementedError

    def _forget(self) -> None:
        """In a forked child: the parent's gatherings are the parent's to write, and its
        timer thread does not exist here."""
        self._lock = threading.Lock()
        self._timer = None
        self._reset()
