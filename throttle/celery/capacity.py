"""How capacity is handed out to the throttled tasks that wait for it in a worker.

A task that cannot have a slot within the near horizon (``reserve_ahead``) reserves nothing:
it waits in its worker's consumer, in a :class:`Line` (where it waits, and what its
waiting costs the broker, is :mod:`throttle.celery.waiting`'s), and asks again when
capacity should be there:

* **time passing**: a denial names, for each limit that denied, when it could admit the
  task's cost (``retry_after_s``); the task's limits are *blocked* until that time minus
  the near horizon, and the task asks again then;
* **capacity given back**: a refund or a charge settled below its estimate
  (``report_cost``), a concurrency unit released (both announced by ``lua/settle.lua``), a
  hold lifted, a rate set at run time for a limit or for one key (``celery throttle
  set``): each is published on the namespace's capacity channel
  (:meth:`throttle.redis.keys.KeySpace.capacity_channel`) with the names of the limits
  concerned. Every worker listens (:class:`Announcements`, one thread per consumer),
  unblocks those limits and asks again at once: a refund reaches a waiting task one
  Redis round trip (the publish) plus one wake-up of the consumer's loop after the settle,
  instead of at the time the task's last denial named;
* **a learned rate that rose**: an adaptive limit probing up after refusals
  (:mod:`throttle.adaptive`) is announced by nobody; every ``refresh_s`` a worker whose
  line holds tasks of one reads its learned rate again, and a rise wakes them
  (:meth:`throttle.celery.waiting.WaitingLine._probe`).

The order (:class:`Line`): the waiting tasks are asked in the order of their priority,
higher first (Celery's ``priority`` of the message), then of their arrival. A task is
skipped while one of its (limit, key) pairs is blocked: a tenant whose own limit, or
whose share of a fair limit (``lua/fair.lua`` denies a key over its weighted share),
denied it does not hold back the others, while two tasks that contend for the same limit
get it in that order. Nothing is reserved for the head of the line: when it asks and the
limit says no, every task behind it on that limit stays blocked too.

The price, and what is not covered: the order is each worker's. Two workers whose lines
wait for the same limit both ask when it frees, and the first to reach Redis takes it;
so across a fleet the order is by arrival at the limit, not by arrival in the queue.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("throttle")

Pair = tuple[str, str | None]
"""A (limit name, key) a waiting task needs capacity of."""

MIN_BLOCK_S = 0.001
"""The shortest a denial blocks a pair, in s: a limit that says "now" but denied (a window
about to turn) is not asked again in a busy loop."""


@dataclass(eq=False)
class Waiter:
    """One task in a line: what it needs, in what order it is served, since when it waits."""

    item: Any
    """The task (opaque here: what ``ask`` is called with)."""
    pairs: tuple[Pair, ...]
    priority: int
    seq: int
    since: float
    """When it joined the line (monotonic s)."""
    leave_at: float = math.inf
    """When it must leave the line (monotonic s): the line's ``max_wait_s`` after
    :attr:`since`, or its own deadline when earlier."""
    raised: bool = False
    """Whether its worker raised the prefetch count for it (undone when it leaves)."""
    gone: bool = False
    """Whether it left the line (a pass that began before does not ask for it again)."""

    def order(self) -> tuple[int, int]:
        return (-self.priority, self.seq)


Ask = Callable[[Waiter], "Mapping[Pair, float] | None"]
"""Asks the limiter for a waiting task: None when it left the line (admitted, sent on),
else how long each denying pair stays blocked, in s."""


@dataclass(eq=False)
class Line:
    """The waiting tasks of one consumer, served as capacity appears (see the module).

    Pure bookkeeping over a monotonic clock: ``ask`` talks to the limiter, and the caller
    runs :meth:`serve` when :meth:`due` says (and at once after :meth:`wake`)."""

    ask: Ask
    max_wait_s: float
    """How long a task may stay in the line, in s (past it, or past its own deadline,
    :meth:`expired` gives it up)."""
    waiters: list[Waiter] = field(default_factory=list)
    blocked: dict[Pair, float] = field(default_factory=dict)
    """Pair -> until when (monotonic s) no task asks for it."""
    counts: dict[Pair, int] = field(default_factory=dict)
    """Pair -> how many waiting tasks need it (so that a look costs no pass over the line)."""
    queues: dict[tuple[Pair, ...], list[Waiter]] = field(default_factory=dict)
    """The pairs of a waiting task -> the tasks that need just those, in order: when the
    next one may ask (:meth:`due`) and which asks next (:meth:`serve`) are found from the
    first task of each, without a pass over the line, which a worker serves hundreds of
    times a second at a high rate (a flood of one tenant, blocked, is a thousand tasks a
    pass would skip one by one)."""
    _ages: list[tuple[float, int, Waiter]] = field(default_factory=list)
    """A heap of (leave_at, seq, waiter): the first to leave first (:meth:`expired`); a
    waiter that left stays in it until it comes to the top, or the heap is rebuilt."""
    _seq: Iterator[int] = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self.waiters)

    def needs(self, pairs: Iterable[Pair]) -> bool:
        """Whether a task already waits for any of ``pairs``: a task arriving for them
        joins the line behind it instead of asking first."""
        return any(pair in self.counts for pair in pairs)

    def join(
        self,
        item: Any,
        pairs: Iterable[Pair],
        *,
        priority: int = 0,
        blocks: Mapping[Pair, float] | None = None,
        now: float,
        raised: bool = False,
        leave_by: float = math.inf,
    ) -> Waiter:
        """Add a task (``blocks``: what the denial it just had said, pair -> s;
        ``leave_by``: its own deadline, monotonic s, when it has one)."""
        leave_at = min(now + self.max_wait_s, leave_by)
        waiter = Waiter(item, tuple(pairs), priority, next(self._seq), now, leave_at, raised)
        key = waiter.order()
        _insert(self.waiters, waiter, key)
        _insert(self.queues.setdefault(waiter.pairs, []), waiter, key)
        for pair in waiter.pairs:
            self.counts[pair] = self.counts.get(pair, 0) + 1
        if len(self._ages) > 2 * len(self.waiters) + 64:  # mostly waiters that left
            self._ages = [(w.leave_at, w.seq, w) for w in self.waiters if w is not waiter]
            heapq.heapify(self._ages)
        heapq.heappush(self._ages, (waiter.leave_at, waiter.seq, waiter))
        if blocks:
            self.block(blocks, now)
        return waiter

    def block(self, blocks: Mapping[Pair, float], now: float) -> None:
        for pair, seconds in blocks.items():
            until = now + max(seconds, MIN_BLOCK_S)
            if until > self.blocked.get(pair, -math.inf):
                self.blocked[pair] = until

    def wake(self, names: Iterable[str] | None = None) -> bool:
        """Capacity appeared on the limits ``names`` (None: on any): unblock their pairs.
        Returns whether a waiting task needs one of them (then :meth:`serve` now)."""
        if names is None:
            self.blocked.clear()
            return bool(self.waiters)
        named = set(names)
        for pair in [pair for pair in self.blocked if pair[0] in named]:
            del self.blocked[pair]
        return any(pair[0] in named for pair in self.counts)

    def serve(self, now: float) -> None:
        """Ask for every waiting task that nothing blocks, in order (see the module): a
        denial blocks its pairs, and the tasks behind it that need them are skipped (once
        every task is blocked, the pass ends). Each step asks the first in order of the
        first tasks of each set of pairs that nothing blocks."""
        while (waiter := self._next(now)) is not None:
            try:
                blocks = self.ask(waiter)
            except Exception:  # the task is the caller's to send on; the line goes on
                logger.exception("throttle: serving a waiting task")
                blocks = None
            if blocks is None:
                self._remove(waiter)
            else:
                self.block(blocks or {pair: MIN_BLOCK_S for pair in waiter.pairs}, now)
                if not self._is_blocked(waiter, now):  # a denial that named other pairs
                    self.block(dict.fromkeys(waiter.pairs, MIN_BLOCK_S), now)

    def _next(self, now: float) -> Waiter | None:
        """The first waiting task in order that nothing blocks, or None."""
        blocked = self.blocked
        best: Waiter | None = None
        best_key: tuple[int, int] | None = None
        for shape, queue in self.queues.items():
            if any(blocked.get(pair, -math.inf) > now for pair in shape):
                continue
            key = queue[0].order()
            if best_key is None or key < best_key:
                best, best_key = queue[0], key
        return best

    def _is_blocked(self, waiter: Waiter, now: float) -> bool:
        blocked = self.blocked
        return any(blocked.get(pair, -math.inf) > now for pair in waiter.pairs)

    def _remove(self, waiter: Waiter) -> None:
        if waiter.gone:
            return
        waiter.gone = True
        with contextlib.suppress(ValueError):
            self.waiters.remove(waiter)
        queue = self.queues.get(waiter.pairs)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(waiter)
            if not queue:
                del self.queues[waiter.pairs]
        for pair in waiter.pairs:
            left = self.counts.get(pair, 0) - 1
            if left > 0:
                self.counts[pair] = left
            else:
                self.counts.pop(pair, None)
                self.blocked.pop(pair, None)  # nobody waits for it any more

    def due(self) -> float | None:
        """When :meth:`serve` (or :meth:`expired`) has something to do next (monotonic
        s; -inf: now), or None when nobody waits."""
        oldest = self._oldest()
        if oldest is None:
            return None
        blocked = self.blocked
        soonest = oldest.leave_at
        for shape in self.queues:
            soonest = min(soonest, max(blocked.get(pair, -math.inf) for pair in shape))
        return soonest

    def _oldest(self) -> Waiter | None:
        """The waiter that must leave first (None: nobody waits)."""
        ages = self._ages
        while ages and ages[0][2].gone:
            heapq.heappop(ages)
        return ages[0][2] if ages else None

    def free_at(self, waiter: Waiter) -> float:
        """When ``waiter`` may ask again, or must be sent on (monotonic s; -inf: now)."""
        blocked = self.blocked
        free = max(blocked.get(pair, -math.inf) for pair in waiter.pairs)
        return min(free, waiter.leave_at)

    def expired(self, now: float) -> list[Waiter]:
        """Take out, and return, the tasks that waited ``max_wait_s`` or longer, or whose
        own deadline came."""
        old = []
        while (oldest := self._oldest()) is not None and now >= oldest.leave_at:
            heapq.heappop(self._ages)
            old.append(oldest)
            self._remove(oldest)
        return old

    def blocked_for(self, waiter: Waiter, now: float) -> float:
        """How much longer ``waiter`` would stay blocked, in s (0: not blocked)."""
        until = max((self.blocked.get(pair, -math.inf) for pair in waiter.pairs), default=now)
        return max(until - now, 0.0)

    def clear(self) -> list[Waiter]:
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            waiter.gone = True
        self.blocked.clear()
        self.counts.clear()
        self.queues.clear()
        self._ages.clear()
        return waiters


def _insert(waiters: list[Waiter], waiter: Waiter, key: tuple[int, int]) -> None:
    """Insert ``waiter`` (of order ``key``) into ``waiters``, kept in order: from the end,
    where a task of the same priority goes."""
    index = len(waiters)
    while index > 0 and waiters[index - 1].order() > key:
        index -= 1
    waiters.insert(index, waiter)


class Announcements:
    """Listens to the namespace's capacity channel in a thread of the worker's main
    process (a greenlet under gevent and eventlet), and calls ``on_capacity(names)`` for
    each announcement (None after a lost connection: announcements may have been missed,
    every limit is looked at again). ``on_capacity`` runs in this thread: it must only
    hand the work to the consumer's loop.

    One connection per worker (a SUBSCRIBE holds it); a Redis that goes away is retried
    every :attr:`retry_s`."""

    retry_s = 1.0

    def __init__(
        self, client: Any, channel: str, on_capacity: Callable[[set[str] | None], None]
    ) -> None:
        self.client = client
        self.channel = channel
        self.on_capacity = on_capacity
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.heard = 0
        """Announcements heard (for tests and logs)."""
        self.listening_since: float | None = None
        """Since when this listener has been subscribed without a break (monotonic s);
        None while it is not."""

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="throttle-capacity", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()

    def _run(self) -> None:
        first = True
        while not self.stopping.is_set():
            pubsub = None
            try:
                pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                # Heard from the subscription's confirmation on (the first reply read,
                # within milliseconds): a hold placed before it may have been missed.
                message = pubsub.get_message(timeout=self.retry_s)
                self.listening_since = time.monotonic()
                if not first:
                    self.on_capacity(None)  # what was announced meanwhile is unknown
                first = False
                while not self.stopping.is_set():
                    if message is not None and message.get("type") == "message":
                        self.heard += 1
                        data = message.get("data") or b""
                        text = data.decode() if isinstance(data, bytes) else str(data)
                        self.on_capacity(set(text.split()) or None)
                    message = pubsub.get_message(timeout=self.retry_s)
            except Exception as exc:
                self.listening_since = None
                if self.stopping.is_set():
                    break
                logger.debug("throttle: capacity announcements interrupted: %r", exc)
                first = False
                self.stopping.wait(self.retry_s)
            finally:
                self.listening_since = None
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()


def blocks_of(
    pairs: tuple[Pair, ...],
    limits: Iterable[tuple[str, bool, float]],
    retry_after_s: float,
    horizon_s: float,
    exact: Collection[str] = (),
) -> dict[Pair, float]:
    """How long each pair stays blocked after a denial, in s: each denying limit's own
    ``retry_after_s`` (its ``limits``: name, allowed, retry_after_s, in the order of
    ``pairs``) less the near horizon ``horizon_s`` (asked then, the task can reserve its
    slot within the horizon); every pair for the whole decision's ``retry_after_s`` when
    the limits do not line up or none of them denied (a slot that fell into a later window).
    A limit that denied although it could admit within the horizon cannot reserve that
    time (a hold until then, a window that turns then): blocked for the whole of it, or
    the task would ask again and again until then. The limits named in ``exact`` (fair
    ones) are blocked for the whole of their retry: it names when the key may reserve
    within the horizon already, and a look before then is denied and moves the key's
    turn on by one share interval (lua/fair.lua's plan)."""
    states = list(limits)
    blocks: dict[Pair, float] = {}
    if len(states) == len(pairs):
        for pair, (name, allowed, retry) in zip(pairs, states, strict=True):
            if not allowed:
                blocks[pair] = _block_s(retry, 0.0 if name in exact else horizon_s)
    if not blocks:
        blocks = dict.fromkeys(pairs, _block_s(retry_after_s, horizon_s))
    return blocks


def _block_s(retry_s: float, horizon_s: float) -> float:
    return max(retry_s - horizon_s if retry_s > horizon_s else retry_s, MIN_BLOCK_S)
