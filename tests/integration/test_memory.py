"""The in-memory limiter against the scripts where test_model.py does not reach: holds,
peek, and a reservation voided by a hold, on the same test clock."""

from __future__ import annotations

import redis

from tests.support.clock import FakeClock
from throttle import Limit, Limiter
from throttle.memory import MemoryLimiter


def test_holds_peek_and_voided_reservations_match_the_scripts(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    real = Limiter(client, prefix=prefix, clock_us=clock)
    memory = MemoryLimiter(prefix=prefix, clock_us=clock)
    gcra = Limit.parse("5/s burst 1", name="api", algorithm="gcra")
    conc = Limit.parse("2 concurrent", name="slots")

    def both(call: str, *args: object, **kwargs: object) -> object:
        answers = [getattr(one, call)(*args, **kwargs) for one in (real, memory)]
        assert answers[0] == answers[1], (call, args, kwargs)
        return answers[0]

    both("acquire", gcra, "k")
    both("acquire_many", [(gcra, "k")], max_wait_s=1, acquisition_id="t1")  # reserved ahead
    both("peek", gcra, "k")
    clock.advance(0.05)
    both("hold", gcra, "k", 2)
    both("hold", gcra, None, 1)  # shorter than the key's: both stand
    both("holds")
    both("peek", gcra, "k")
    both("acquire", gcra, "k")  # denied until the hold ends
    both("acquire_many", [(gcra, "k")], max_wait_s=1, acquisition_id="t1")  # voided
    clock.advance(2.5)
    both("holds")
    both("acquire_many", [(gcra, "k")], max_wait_s=1, acquisition_id="t2")
    both("hold", gcra)  # a pause
    both("holds")
    both("acquire", gcra, "other")
    both("unhold", gcra)
    both("holds")
    held = both("acquire_many", [(conc, None), (gcra, "x")], acquisition_id="c1")
    both("peek", conc)
    clock.advance(1)
    both("settle", held.acquisition, [None, 0.5])  # type: ignore[attr-defined]
    both("peek", conc)
