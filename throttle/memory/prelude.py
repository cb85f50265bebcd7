"""What every model shares, as prelude.lua is what every script shares: the rounding of
durations, a limit's numbers as a script reads them, and the functions an algorithm's model
offers (:class:`Algorithm`: check, commit, adjust, those of an algorithm file of ``lua/``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from throttle.redis.wire import target_args
from throttle.spec import Limit

_WHOLE = 2.0**52
"""From here on every double is a whole number (or infinity)."""


def ceil_us(x: float) -> float:
    """A duration in us rounded up to a whole us, never negative (prelude.lua's): an int,
    but a duration of 2**52 us (142 years) or more is returned as it is, as the script
    returns it (a double that large is whole already; infinity has no int), not capped."""
    if x <= 0:
        return 0
    return x if x >= _WHOLE else math.ceil(x)


@dataclass
class Params:
    """A limit's numbers as its script reads them from ARGV."""

    count: float
    period_us: float
    burst: float

    @classmethod
    def of(cls, limit: Limit) -> Params:
        # Exactly what the script receives (a fair limit: for a key of weight 1).
        _, count, period_us, burst = target_args(limit, None)
        return cls(float(count), float(period_us), float(burst))


Check = dict[str, Any]
"""What an algorithm's check found: its decision and the state it read, for its commit."""


class Algorithm(Protocol):
    """The three functions of an algorithm file of ``lua/`` (see prelude.lua)."""

    def check(self, key: str, p: Params, now: float, cost: float, max_wait: float) -> Check: ...

    def commit(
        self,
        key: str,
        p: Params,
        now: float,
        cost: float,
        r: Check,
        *,
        holder: str,
        expiry: float,
        at: float | None = None,
    ) -> str:
        """``at``: None = at the limit's own slot; a later time (us): as of that time."""
        ...

    def adjust(
        self, key: str, p: Params, now: float, delta: float, mark: str, holder: str
    ) -> None: ...
