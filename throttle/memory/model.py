"""The model limiter: lua/acquire.lua and lua/settle.lua in Python, over the algorithms'
models (several limits at once, all or nothing; lease records; settling a reservation at its
actual cost)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from throttle.memory.concurrency import Concurrency
from throttle.memory.fair import Fair
from throttle.memory.fixed_window import FixedWindow
from throttle.memory.gcra import Gcra
from throttle.memory.prelude import Algorithm, Check, Params, ceil_us
from throttle.memory.sliding_window import SlidingWindow
from throttle.memory.token_bucket import TokenBucket
from throttle.spec import Limit


@dataclass
class Record:
    """A lease record of acquire.lua: what an acquisition took, for settle and redelivery."""

    settled: bool
    costs: tuple[float, ...]
    slot: float
    keys: tuple[str, ...]
    marks: tuple[str, ...]
    expires_at: float = math.inf
    """When the record expires, in us of the server's clock
    (:class:`~throttle.memory.MemoryRedis`)."""
    found: bool = False
    """Whether an acquire under the same id found it since it was made (acquire.lua's
    ``f``)."""


Summary = tuple[Any, ...]
Spec = tuple[str, Params, str]
"""A limit as the scripts see it: its algorithm code, its numbers, its (first) state key."""


def _specs(targets: Sequence[tuple[Limit, str]]) -> list[Spec]:
    # The keys here are state keys, not key values: a fair limit's keys all weigh 1.
    return [(limit.code, Params.of(limit), key) for limit, key in targets]


class ModelLimiter:
    """The acquire/settle operations of lua/acquire.lua and lua/settle.lua, in Python.

    ``targets`` are (limit, state_key) pairs: the caller supplies the key names.
    """

    def __init__(self) -> None:
        self.algos: dict[str, Algorithm] = {
            "tb": TokenBucket(),
            "gcra": Gcra(),
            "fw": FixedWindow(),
            "sw": SlidingWindow(),
            "conc": Concurrency(),
            "fair": Fair(),
        }
        self.records: dict[str, Record] = {}

    def acquire(
        self,
        targets: list[tuple[Limit, str]],
        *,
        now: int,
        cost: float | list[float],
        max_wait_us: int = 0,
        acq: str | None = None,
        lease_us: int = 300_000_000,
    ) -> Summary:
        """-> (allowed, held, wait_us, retry_us, per-limit (allowed, remaining, retry, reset));
        a held acquisition on other keys -> "mismatch"."""
        costs = cost if isinstance(cost, list) else [cost] * len(targets)
        outcome = self.decide(
            _specs(targets), now=now, costs=costs, max_wait_us=max_wait_us, acq=acq,
            record=acq, lease_us=lease_us,
        )  # fmt: skip
        if outcome[0] == "redelivered":
            return (True, True, outcome[1], outcome[2], ())
        return outcome

    def decide(
        self,
        specs: Sequence[Spec],
        *,
        now: float,
        costs: Sequence[float],
        max_wait_us: float = 0,
        acq: str | None = None,
        record: str | None = None,
        lease_us: float = 300_000_000,
        holds: Sequence[float] = (),
    ) -> Summary:
        """acquire.lua on ``specs``, with ``acq`` the acquisition id (the concurrency holder)
        and ``record`` the name of its lease record; ``holds``: each limit's hold, until (us).

        -> ``("mismatch",)``, ``("voided", i, retry_us)`` (limit number i, from 1),
        ``("redelivered", wait_us, retry_us, reserved costs)``, or the decision:
        (allowed, False, wait_us, retry_us, per-limit (allowed, remaining, retry, reset))."""
        holds = tuple(holds) or (0.0,) * len(specs)
        if record is not None:
            held = self.records.get(record)
            if held is not None and not held.settled:
                if held.keys != tuple(key for _, _, key in specs):
                    return ("mismatch",)
                for i, hold in enumerate(holds, start=1):
                    if hold > held.slot and hold > now:
                        return ("voided", i, ceil_us(hold - now))
                held.found = True
                return (
                    "redelivered",
                    ceil_us(held.slot - now),
                    ceil_us(now - held.slot),
                    held.costs,
                )
        checks = []
        for (code, p, key), c, hold in zip(specs, costs, holds, strict=True):
            algo = self.algos[code]
            if hold > now:
                # A held limit denies without reading its state.
                r: Check = {"allowed": 0, "wait": 0, "retry": ceil_us(hold - now)}
                r.update(remaining=0.0, reset=0)
            else:
                r = algo.check(key, p, now, c, max_wait_us)
            checks.append((algo, key, p, r))
        allowed = all(r["allowed"] for *_, r in checks)
        wait = max(r["wait"] for *_, r in checks)
        retry = max(max(r["retry"], r["wait"]) for *_, r in checks)
        # The earliest time every limit conforms; a window denies a slot past its window.
        slot = now + wait
        if allowed and wait > 0:
            for algo, _, p, r in checks:
                ends = getattr(algo, "ends", None)
                if ends is not None and slot >= ends(p, r):
                    allowed, r["allowed"], r["retry"] = False, 0, wait
        if allowed:
            marks = tuple(
                algo.commit(
                    key,
                    p,
                    now,
                    c,
                    r,
                    holder=acq or "",
                    expiry=slot + lease_us,
                    at=slot if slot > now + r["wait"] else None,
                )
                for (algo, key, p, r), c in zip(checks, costs, strict=True)
            )
            if record is not None:
                keys = tuple(key for _, _, key in specs)
                self.records[record] = Record(False, tuple(costs), slot, keys, marks)
            retry = 0
        else:
            wait = 0
            for (algo, key, p, r), c in zip(checks, costs, strict=True):
                if not r["allowed"] and "mode" in r and isinstance(algo, Fair):
                    algo.deny(key, p, now, c, r)
        per_limit = tuple(
            (bool(r["allowed"]), r["remaining"], r["retry"], r["reset"]) for *_, r in checks
        )
        return (allowed, False, wait, retry, per_limit)

    def settle(
        self,
        acq: str,
        targets: list[tuple[Limit, str]],
        *,
        now: int,
        actual: float | list[float | None] | None,
    ) -> tuple[str, tuple[float, ...]]:
        actuals = actual if isinstance(actual, list) else [actual] * len(targets)
        return self.finish(acq, acq, _specs(targets), now=now, actuals=actuals)

    def finish(
        self,
        record_name: str,
        holder: str,
        specs: Sequence[Spec],
        *,
        now: float,
        actuals: Sequence[float | None],
        unless_found: bool = False,
    ) -> tuple[str, tuple[float, ...]]:
        """settle.lua: the record ``record_name`` of holder ``holder`` settled at ``actuals``
        (None: as reserved) -> (status, deltas); with ``unless_found``, nothing if an
        acquire found the record since it was made."""
        record = self.records.get(record_name)
        if record is None:
            return ("unknown", ())
        if record.settled:
            return ("already_settled", ())
        if len(record.keys) != len(specs):
            return ("mismatch", ())
        if unless_found and record.found:
            return ("already_settled", ())
        if record.keys != tuple(key for _, _, key in specs):
            return ("mismatch", ())
        deltas = tuple(
            0.0 if a is None else a - c for a, c in zip(actuals, record.costs, strict=True)
        )
        for (code, p, key), mark, delta in zip(specs, record.marks, deltas, strict=True):
            if delta != 0 or code == "conc":
                self.algos[code].adjust(key, p, now, delta, mark, holder)
        record.settled = True
        return ("settled", deltas)
