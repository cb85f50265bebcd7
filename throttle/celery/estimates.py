"""Estimated costs reserved as the calls really cost: the share of its estimate a limit's
calls use, learned from what they report.

A tokens limit whose cost is an estimate (``cost: estimate``, typically the prompt plus
``max_tokens``) reserves the estimate before the call, and the reported usage settles the
difference after it (:func:`throttle.celery.report_cost`). In a steady state the refunds
make the sum exact. But they come back only when a call ends, while the tasks already
waiting hold slots spaced by the whole estimate: the slots reserved ahead are that much
too far apart. When the provider lowers its limit (a limit that follows its dimension,
``upstream: tokens``), the fleet then calls for seconds at the new rate divided by the
estimate: calls that use 200 of an estimate of 250 tokens get 80 % of the new rate, until
the refunds catch up (seen in ``bench/providers.py``).

So a limit that follows a dimension of its upstream (``upstream:`` set) and whose cost is
an estimate reserves the estimate times the share its calls used (:class:`Estimates`),
learned in each process from the costs its tasks report, and settles the actual cost as
before. Each process that learns writes its share to Redis (a hash,
:meth:`~throttle.redis.keys.KeySpace.estimate_shares_key`) at most every ``refresh_s``,
and a process that has seen too few reports of its own (a worker's consumer, which
decides the reservations of the tasks it holds but settles none; a pool child just
started) reads the fleet's from there, as often. A call that uses more than it
reserved is charged the difference, and the next slots move back by it. The share rises
at once to a larger one and falls slowly (:data:`FALL`), never above 1 (the estimate) nor
below :data:`FLOOR`, and is applied only after :data:`MIN_SAMPLES` reports. A body that
reports no cost is charged its whole estimate at the settle (as reserving it would have):
a stream left before its end errs on the safe side still.

Trade-off: between a call that uses more than its share and its settle, the fleet may be
ahead of the provider by that difference (the provider's own bucket, a minute's worth for
OpenAI and Anthropic, absorbs it); limits without ``upstream:`` keep reserving the whole
estimate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from throttle.errors import BackendError
from throttle.redis.client import RedisClient, wrap_errors
from throttle.redis.keys import KeySpace
from throttle.rules import Rule, Target

logger = logging.getLogger("throttle")

__all__ = ["FALL", "FLOOR", "MIN_SAMPLES", "Estimates", "learns"]

MIN_SAMPLES = 3
"""Reports of a limit seen in this process before its share is applied."""
FALL = 0.2
"""How far one report of a smaller share moves the share towards it (a larger share is
taken at once): after a change to smaller calls, the reservations follow within ~10
reports."""
FLOOR = 0.1
"""The smallest share of its estimate a call reserves: calls that report (nearly) no
usage do not make the limit reserve nothing."""
KEEP_S = 86400.0
"""How long the fleet's shares stay in Redis after the last write, in s: a limit whose
tasks stopped coming starts from its whole estimate again the next day."""


def learns(rule: Rule) -> bool:
    """Whether ``rule``'s reservations follow the share of their estimate its calls use:
    a cost that is an estimate, on a limit that follows a dimension of its upstream."""
    return rule.estimated and rule.upstream is not None


@dataclass
class _Share:
    value: float = 1.0
    samples: int = 0


class Estimates:
    """The share of their estimate the calls of each learning limit used: this process's
    own, and the fleet's (one per :class:`~throttle.celery.runtime.Throttler`).

    ``client`` None: this process's own only (no Redis), for tests of the arithmetic.
    ``refresh_s``: how often the fleet's shares are read and this process's written, at
    most (one round trip each, and only for tasks with a learning limit)."""

    def __init__(
        self,
        client: RedisClient | None = None,
        keyspace: KeySpace | None = None,
        *,
        refresh_s: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._shares: dict[str, _Share] = {}
        self._fleet: dict[str, float] = {}
        self._lock = threading.Lock()  # a threads pool settles from several threads
        self._client = client
        self._key = (keyspace or KeySpace()).estimate_shares_key()
        self.refresh_s = refresh_s
        self._monotonic = monotonic
        self._read_at = -float("inf")
        self._written_at: dict[str, float] = {}

    def share(self, name: str) -> float:
        """The share of its estimate a call of limit ``name`` reserves: this process's,
        once it has seen :data:`MIN_SAMPLES` reports, else the fleet's, else 1.0."""
        found = self._shares.get(name)
        if found is None or found.samples < MIN_SAMPLES:
            return self._fleet.get(name, 1.0)
        return found.value

    def refresh(self) -> None:
        """Read the fleet's shares when the last read is ``refresh_s`` old; a Redis error
        keeps the last ones (a reservation at the whole estimate is the safe side)."""
        now = self._monotonic()
        if self._client is None or now - self._read_at < self.refresh_s:
            return
        self._read_at = now
        client = self._client
        try:
            raw = wrap_errors(lambda: client.hgetall(self._key))
        except BackendError as exc:
            logger.debug("throttle: the fleet's estimate shares were not read: %s", exc)
            return
        fleet: dict[str, float] = {}
        for name, value in raw.items():
            try:
                share = float(value)
            except ValueError:  # written by hand: ignored
                continue
            if FLOOR <= share <= 1.0:
                fleet[name.decode() if isinstance(name, bytes) else str(name)] = share
        self._fleet = fleet

    def _publish(self, name: str) -> None:
        """Write this process's share of ``name`` for the fleet, at most every
        ``refresh_s``; a Redis error loses the write, not the task."""
        found = self._shares.get(name)
        now = self._monotonic()
        if self._client is None or found is None or found.samples < MIN_SAMPLES:
            return
        if now - self._written_at.get(name, -float("inf")) < self.refresh_s:
            return
        self._written_at[name] = now
        client, value = self._client, f"{found.value:.4f}"

        def write() -> None:
            with client.pipeline(transaction=False) as pipe:
                pipe.hset(self._key, name, value)
                pipe.pexpire(self._key, int(KEEP_S * 1000))
                pipe.execute()

        try:
            wrap_errors(write)
        except BackendError as exc:
            logger.debug("throttle: the estimate share of %s was not written: %s", name, exc)

    def observe(self, name: str, estimate: float, actual: float) -> None:
        """A call of limit ``name`` estimated at ``estimate`` reported ``actual`` (both in
        the limit's units); an estimate of 0 says nothing."""
        if not estimate > 0:
            return
        seen = min(max(actual / estimate, FLOOR), 1.0)
        with self._lock:
            found = self._shares.setdefault(name, _Share(seen, 0))
            if seen >= found.value or found.samples == 0:
                found.value = seen
            else:
                found.value += FALL * (seen - found.value)
            found.samples += 1

    def scaled(
        self, rules: Sequence[Rule], targets: Sequence[Target]
    ) -> tuple[list[Target], dict[str, float]]:
        """``targets`` (each rule's limit, key, cost, in order) with the learning rules'
        costs scaled by their share, and the estimates scaled (rule name -> the whole
        estimate), for :meth:`settle_costs`."""
        self.refresh()
        scaled: list[Target] = []
        estimates: dict[str, float] = {}
        for rule, (limit, key, cost) in zip(rules, targets, strict=True):
            reserved = cost
            if learns(rule):
                estimates[rule.name] = cost
                reserved = cost * self.share(rule.name)
            scaled.append((limit, key, reserved))
        return scaled, estimates

    def settled(self, estimates: Mapping[str, float], actuals: Mapping[str, float]) -> None:
        """Learn from a settled call: ``actuals`` is the cost reported per rule name."""
        for name, estimate in estimates.items():
            actual = actuals.get(name)
            if actual is not None:
                self.observe(name, estimate, actual)
                self._publish(name)
