"""Stock: units a worker process takes ahead while its limits have plenty of room, so that
most of its tasks start without a round trip to Redis.

A pool child that decides a task itself (the worker's consumer found the task's limits
roomy and handed it over undecided: :mod:`throttle.celery.waiting`) pays one round trip
to Redis for a call that passes at once anyway; for a short task that round trip is most
of what throttling costs it. So while a process's last decision on a task's limits (and
keys) left room for at least :data:`ROOM_FACTOR` times a stock of them, its next
acquisition takes the units of several such tasks at once, under one recorded
acquisition (a *stock*), and the following tasks draw from it locally.

The bounds, which keep the limiter's guarantees:

- **Only with plenty of room.** A stock takes at most ``1 / ROOM_FACTOR`` of what every
  one of its limits had left, so it is never taken while a limit binds (then every task
  asks Redis, and waits in the consumer, as without stocks).
- **Units are drawn within** :data:`STOCK_S` of being taken, and within half the burst
  margin (``burst_margin``, 100 ms by default): a call lands at most that long after the
  instant its units were charged, as a task admitted just before a pause or a hold
  starts just after it. What is not drawn in time is given back (a settle of
  the stock's acquisition), as is what a task reported it did not use; a cost reported
  above the estimate is charged there too (debt is allowed, as for any settle).
- **Within the burst margin.** A call later than its charge is what ``burst_margin``
  keeps tokens in hand for (:func:`kept_units`): an upstream that enforces the same
  bucket and is full while a stock's calls are not made yet cannot bank its refill
  meanwhile, and is that much short when they come. That refill is at most the rate
  times the drawing time, half the margin, whatever the number of stocks in the fleet;
  where a high rate's margin is capped at half its burst, the refill is bounded by the
  stocks instead, and a stock is at most :data:`MARGIN_SHARE` of the margin
  (:func:`within_margin`). With ``burst_margin: 0`` there are no stocks.
- **Plain rate limits only**: token bucket and GCRA limits that are not fair, without
  the spacing guard, a concurrency limit, an adaptive rate or a learned estimate
  (:attr:`RuleSet.stockable <throttle.celery.ruleset.RuleSet.stockable>`). A window
  could see a stock's units drawn in the next window; the others need a record or a
  decision per task. A task that plans (:mod:`throttle.celery.plan`) stocks its plans'
  units with its limits', as its first acquisition takes them; a task back with a plan
  takes no stock.
- **A hold this process places** (an upstream's refusal reported from a body) closes its
  stocks of the held limits at once; a hold or pause placed elsewhere is seen when the
  stock ends, at most :data:`STOCK_S` later.

A process that exits (a pool child recycled by ``--max-tasks-per-child``, a worker's
warm shutdown: Celery's ``worker_process_shutdown`` and ``worker_shutdown`` signals)
first gives its open stocks back. One killed (SIGKILL, a crash) keeps what its stocks
took, as a task killed mid-call keeps its reservation.

The price: a task drawn from a stock has no acquisition record of its own, so a copy of it
redelivered after its worker died pays again (the redelivery's acquire finds no slot
under its id); and capacity a stock took for tasks that did not come is idle until the
stock is given back (at most :data:`STOCK_S`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery import signals

from throttle.decision import Acquisition, Decision
from throttle.errors import ThrottleError
from throttle.limiter import Limiter
from throttle.rules import Target
from throttle.spec import Limit

logger = logging.getLogger("throttle")

STOCK_S = 0.05
"""How long the units of a stock may be drawn after they were taken, in s."""
ROOM_FACTOR = 4.0
"""A stock is taken only when the last decision left every limit at least this many
times the stock's cost (a stock takes at most a quarter of the room)."""
MARGIN_SHARE = 0.125
"""Where a limit's burst margin is capped (at half its burst), a stock takes at most this
share of what a worker keeps in hand of it (:func:`within_margin`)."""
FRESH_S = 2 * STOCK_S
"""How old a decision may be and still say that the limits have room, in s. Longer than
:data:`STOCK_S`: a stock whose own acquisition left room is followed by the next one as
it ends, without a task's acquisition between the two to look at the room again (the
next stock's acquisition looks, and takes nothing if the room is gone)."""
MIN_TASKS = 2
MAX_TASKS = 32
"""The bounds of a stock's size, in tasks: it doubles when a stock is drawn out within
:data:`STOCK_S`, and halves when one ends with more than half of it left."""
KEYS_MAX = 1024
"""The most sets of limits and keys a process remembers room and stock sizes for: past
it, those it remembers are forgotten (many keys, each seen once, must not grow a worker's
memory)."""
STOCK_PREFIX = "stock-"
"""The acquisition ids of stocks (a task's is its task id)."""
EXIT_WAIT_S = 5.0
"""How long a process exiting waits for the settles in progress on other threads, in s."""
LEASE_S = 60.0
"""How long a stock's record lives, in s: it is settled when its last drawn task finished;
one whose tasks run longer finds no record, and gives back nothing."""

Pairs = tuple[tuple[str, str | None], ...]


@dataclass(eq=False)
class Stock:
    """Units taken ahead for the tasks of one set of limits and keys."""

    acquisition: Acquisition
    limits: tuple[Limit, ...]
    """The limits in force when it was taken (a rate set since ends the stock)."""
    left: list[float]
    """What is still to draw from each target, in its units."""
    used: list[float]
    """What the drawn tasks cost each target (as drawn, corrected by what they reported):
    what the stock is settled at."""
    until: float
    """When drawing ends (monotonic s)."""
    tasks: int
    """How many tasks' worth it was taken for."""
    drawn: int = 0
    running: int = 0
    """Drawn tasks not finished yet: the stock is settled once it is closed and they are."""
    closed: bool = False

    def fits(self, targets: Sequence[Target], now: float) -> bool:
        """Whether a task of ``targets`` may draw from this stock at ``now``."""
        if self.closed or now >= self.until:
            return False
        for i, (limit, _, cost) in enumerate(targets):
            if self.left[i] < cost:
                return False
            known = self.limits[i]
            if limit is not known and limit != known:
                return False
        return True

    def settled_at(self) -> list[float] | None:
        """What to settle the stock at, or None when it took exactly that (nothing to
        give back or charge: its record expires by itself, as a task's does)."""
        taken = self.acquisition.costs
        if all(abs(u - t) <= 1e-9 * max(t, 1.0) for u, t in zip(self.used, taken, strict=True)):
            return None
        return [max(u, 0.0) for u in self.used]


@dataclass(eq=False)
class Draw:
    """A task's share of a stock: what it took from each target."""

    book: Stocks
    stock: Stock
    costs: tuple[float, ...]

    def share(self) -> Acquisition:
        """The task's share as an acquisition of its own: its targets and costs, under the
        stock's id, with no keys (not recorded: it is settled with the stock)."""
        stock = self.stock.acquisition
        return Acquisition(stock.id, self.costs, stock.targets, ())

    def done(self, actuals: Sequence[float | None]) -> None:
        """The task finished: its actual cost per target (None: as drawn)."""
        self.book.done(self, actuals)


class Stocks:
    """The stocks of one process, one per set of limits and keys, for the tasks its pool
    runs. Thread safe: a threads or gevent pool draws from several threads."""

    def __init__(self, limiter: Limiter, margin_s: float) -> None:
        self.limiter = limiter
        self.margin_s = margin_s
        """``settings.burst_margin``, in s (0: no stocks)."""
        self.draw_s = min(STOCK_S, margin_s / 2)
        """How long a stock's units may be drawn, in s."""
        self._pid = -1
        self._mine()
        _books.add(self)

    def _mine(self) -> None:
        """A process forked from one with stocks starts with none (their records, and
        the closing thread, stay the parent's)."""
        pid = os.getpid()
        if pid == self._pid:
            return
        self._pid = pid
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stocks: dict[Pairs, Stock] = {}
        self._room: dict[Pairs, float] = {}
        """When the last decision on the pairs left room for a stock (monotonic s)."""
        self._size: dict[Pairs, int] = {}
        self._ending: deque[tuple[Pairs, Stock]] = deque()
        """Open stocks in the order they end (all last :data:`STOCK_S`)."""
        self._settling = 0
        """Closed stocks whose settle has not returned yet (the closing thread's, or a
        task's): a process exiting waits for them (:meth:`close_all`)."""
        self._settled = threading.Condition(self._lock)
        self._closer: threading.Thread | None = None

    def draw(self, targets: Sequence[Target]) -> Draw | None:
        """A task of ``targets`` takes its units: from this process's stock of them, or
        from a new stock when the last decision on them left room for one (one round
        trip, which then serves the next tasks); None when neither (the task acquires
        as without stocks)."""
        self._mine()
        pairs = tuple((limit.name, key) for limit, key, _ in targets)
        now = time.monotonic()
        with self._lock:
            stock = self._stocks.get(pairs)
            if stock is not None and stock.fits(targets, now):
                return self._take(stock, targets)
            if now - self._room.get(pairs, -math.inf) > FRESH_S:
                return None
            del self._room[pairs]  # one thread takes the new stock; the others acquire
            size = self._size.get(pairs, MIN_TASKS)
        if stock is not None:
            self._close(pairs, stock)
        return self._new(pairs, targets, size, now)

    def saw(self, targets: Sequence[Target], decision: Decision) -> None:
        """Note a decision a task of ``targets`` got from Redis: whether it left room for
        a stock of them."""
        self._mine()
        pairs = tuple((limit.name, key) for limit, key, _ in targets)
        with self._lock:
            if self._roomy(targets, decision, self._size.get(pairs, MIN_TASKS)):
                if len(self._room) >= KEYS_MAX:
                    self._room.clear()
                self._room[pairs] = time.monotonic()
            else:
                self._room.pop(pairs, None)

    def drop(self, names: set[str]) -> None:
        """Close the stocks of any of the limits ``names`` (a hold was placed on them)."""
        self._mine()
        with self._lock:
            found = [(p, s) for p, s in self._stocks.items() if any(n in names for n, _ in p)]
            for pairs in [p for p in self._room if any(n in names for n, _ in p)]:
                del self._room[pairs]
        for pairs, stock in found:
            self._close(pairs, stock)

    def close_all(self) -> None:
        """Close every open stock of this process (it is exiting): what their tasks did
        not draw goes back now (a stock whose tasks still run, when they finish)."""
        if self._pid != os.getpid():
            return  # forked: the stocks are the parent's
        with self._lock:
            found = list(self._stocks.items())
        for pairs, stock in found:
            self._close(pairs, stock)
        # A stock the closing thread took out of the book just before is being settled
        # there: that daemon thread dies with the process, so wait for its round trip.
        with self._lock:
            self._settled.wait_for(lambda: self._settling == 0, timeout=EXIT_WAIT_S)

    def done(self, draw: Draw, actuals: Sequence[float | None]) -> None:
        """A drawn task finished, with its actual cost per target (None, or none given:
        as drawn)."""
        stock = draw.stock
        with self._lock:
            for i, actual in enumerate(actuals):
                if actual is not None:
                    stock.used[i] += actual - draw.costs[i]
            stock.running -= 1
            last = stock.closed and stock.running == 0
            if last:
                self._settling += 1
        if last:
            self._settle(stock)

    # -- inside

    def _roomy(self, targets: Sequence[Target], decision: Decision, size: int) -> bool:
        """Whether ``decision`` admitted at once and left every limit :data:`ROOM_FACTOR`
        times a stock of ``size`` tasks of ``targets``, and whether such a stock fits in
        every limit's burst margin (:func:`within_margin`)."""
        if not decision.allowed or decision.wait_s > 0 or decision.held:
            return False
        limits = decision.limits
        if len(limits) != len(targets):
            return False
        for state, (limit, _, cost) in zip(limits, targets, strict=True):
            units = size * cost
            if state.remaining < ROOM_FACTOR * units:
                return False
            if not within_margin(limit, units, self.margin_s, self.draw_s):
                return False
        return True

    def _take(self, stock: Stock, targets: Sequence[Target]) -> Draw:
        costs = tuple(cost for _, _, cost in targets)
        for i, cost in enumerate(costs):
            stock.left[i] -= cost
            stock.used[i] += cost
        stock.drawn += 1
        stock.running += 1
        return Draw(self, stock, costs)

    def _new(self, pairs: Pairs, targets: Sequence[Target], size: int, now: float) -> Draw | None:
        """Take a stock of ``size`` tasks of ``targets`` (now or not at all), and draw the
        asking task's units from it."""
        decision = self.limiter.acquire_many(
            [(limit, key, cost * size) for limit, key, cost in targets],
            acquisition_id=STOCK_PREFIX + uuid.uuid4().hex,
            lease_s=LEASE_S,
        )
        acquisition = decision.acquisition
        if not decision.allowed or acquisition is None:
            return None
        stock = Stock(
            acquisition=acquisition,
            limits=tuple(limit for limit, _, _ in targets),
            left=list(acquisition.costs),
            used=[0.0] * len(targets),
            until=now + self.draw_s,
            tasks=size,
        )
        with self._lock:
            if self._roomy(targets, decision, size):
                self._room[pairs] = time.monotonic()
            old = self._stocks.get(pairs)
            self._stocks[pairs] = stock
            self._ending.append((pairs, stock))
            draw = self._take(stock, targets)
            if self._closer is None:
                self._closer = threading.Thread(
                    target=self._close_ended, name="throttle-stocks", daemon=True
                )
                self._closer.start()
            else:
                self._wake.notify()
        if old is not None:
            self._close(pairs, old)
        return draw

    def _close_ended(self) -> None:
        """The closing thread: close each stock when its time ends."""
        while True:
            with self._lock:
                while not self._ending:
                    self._wake.wait()
                pairs, stock = self._ending[0]
                left = stock.until - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                self._ending.popleft()
            try:
                self._close(pairs, stock)
            except Exception:  # the thread must outlive one stock's failure
                logger.exception("throttle: stock %s not closed", stock.acquisition.id)

    def _close(self, pairs: Pairs, stock: Stock) -> None:
        """No more draws from ``stock``; settled once its running tasks finished."""
        with self._lock:
            if stock.closed:
                return
            stock.closed = True
            if self._stocks.get(pairs) is stock:
                del self._stocks[pairs]
            size = self._size.pop(pairs, MIN_TASKS)
            if stock.drawn >= stock.tasks:
                size = min(size * 2, MAX_TASKS)
            elif stock.drawn * 2 < stock.tasks:
                size = max(size // 2, MIN_TASKS)
            if size > MIN_TASKS:
                if len(self._size) >= KEYS_MAX:
                    self._size.clear()
                self._size[pairs] = size
            last = stock.running == 0
            if last:
                self._settling += 1  # counted with the close: close_all sees it
        if last:
            self._settle(stock)

    def _settle(self, stock: Stock) -> None:
        """Give back what the stock's tasks did not use (or charge what they used
        beyond it): one round trip, none when they used what it took. Counted in
        ``_settling`` by the caller, under the lock that closed the stock."""
        try:
            with self._lock:
                actuals = stock.settled_at()
            if actuals is None:
                return
            try:
                self.limiter.settle(stock.acquisition, actuals)
            except ThrottleError as exc:  # the record expires by itself; what was left is lost
                logger.warning("throttle: stock %s not settled: %s", stock.acquisition.id, exc)
        finally:
            with self._lock:
                self._settling -= 1
                self._settled.notify_all()


def kept_units(limit: Limit, margin_s: float) -> float:
    """The tokens a worker keeps in hand of ``limit`` (``burst_margin``; ``limit`` is the
    one reduced by :meth:`Limit.with_margin`): ``margin_s`` of its refill, but at most
    what leaves its reduced burst 1 (the margin is at most half the burst beyond 1)."""
    return max(min(margin_s * limit.rate_per_s, limit.capacity - 1.0), 0.0)


def within_margin(limit: Limit, units: float, margin_s: float, draw_s: float) -> bool:
    """Whether a stock of ``units`` of ``limit``, drawn within ``draw_s``, fits in the
    worker's burst margin: the refill an upstream could not bank while its calls are out
    (``rate x draw_s``) within half the margin, or else the stock within
    :data:`MARGIN_SHARE` of it."""
    kept = kept_units(limit, margin_s)
    if kept <= 0:
        return False
    missed = limit.rate_per_s * draw_s
    return missed <= kept / 2 * (1 + 1e-9) or units <= MARGIN_SHARE * kept


_books: weakref.WeakSet[Stocks] = weakref.WeakSet()
"""Every stock book of this process (one per throttled app)."""


def close_all(**kwargs: Any) -> None:
    """Give back every open stock of this process: a pool child or a worker exiting."""
    for book in list(_books):
        try:
            book.close_all()
        except Exception:  # exiting: one app's failure must not keep the others' stocks
            logger.exception("throttle: stocks not given back at exit")


# A prefork pool child exiting (recycled, or its worker's warm shutdown) sends the first in
# the child; the worker itself (threads, gevent, eventlet, solo: the pool runs in it) the
# second, once its pool stopped.
signals.worker_process_shutdown.connect(close_all, weak=False, dispatch_uid="throttle-stocks")
signals.worker_shutdown.connect(close_all, weak=False, dispatch_uid="throttle-stocks")
