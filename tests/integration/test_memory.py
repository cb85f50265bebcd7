"""The in-memory limiter against the scripts where test_model.py does not reach: holds,
peek, and a reservation voided by a hold, on the same test clock."""

from __future__ import annotations

import pytest
import redis

from tests.support.clock import FakeClock
from throttle import Algorithm, Decision, KeySpace, Limit, Limiter, RequestError
from throttle.adaptive import Adaptive, LearnedRates
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


def test_asks_of_one_limit_and_key_together_match_the_scripts(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    # lua/acquire_series.lua and its model: asks dated back, a hold, a cost above the
    # capacity, every algorithm that takes it
    real = Limiter(client, prefix=prefix, clock_us=clock)
    memory = MemoryLimiter(prefix=prefix, clock_us=clock)
    limits = [
        Limit.parse("5/s burst 2", name="g", algorithm="gcra"),
        Limit.parse("5/s burst 2", name="b"),
        Limit.parse("3/s", name="f", algorithm="fixed_window"),
        Limit.parse("3/s", name="s", algorithm="sliding_window"),
    ]
    asks = [(limit, key, cost) for limit in limits for key in ("k", None) for cost in (1.0, 3.0)]
    ago = [0.3 * i / len(asks) for i in range(len(asks), 0, -1)]

    def both(**kwargs: object) -> None:
        answers = [
            [d if isinstance(d, Decision) else (type(d).__name__, str(d)) for d in decided]
            for decided in (
                one.acquire_each(asks * 2, max_wait_s=0.5, **kwargs) for one in (real, memory)
            )
        ]
        assert answers[0] == answers[1], kwargs
        kinds = {d.allowed if isinstance(d, Decision) else d[0] for d in answers[0]}
        assert kinds == {True, False, "CostExceedsCapacity"}, kinds  # a mix, every time

    both(ago_s=ago * 2)
    clock.advance(0.2)
    both()
    for one in (real, memory):
        one.hold(limits[0], "k", 0.1)
        one.hold(limits[2], None, 1.0)
    both(ago_s=ago * 2)  # the asks dated before the hold's end: denied by it
    clock.advance(0.15)
    both()


def test_reserve_until_is_a_deadline_on_the_scripts_clock(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    # Given a 10/s burst-1 limit whose next free slot is 0.1 s away (test clock, us exact)
    real = Limiter(client, prefix=prefix, clock_us=clock)
    memory = MemoryLimiter(prefix=prefix, clock_us=clock)
    shared = Limit.parse("10/s burst 1", name="api", algorithm="gcra")
    tenant = Limit.parse("100/s burst 1", name="tenant", algorithm="gcra")
    now_s = clock.now_us / 1e6
    for limiter in (real, memory):
        assert limiter.acquire_many([(shared, None)], acquisition_id="first").allowed
        # When the deadline falls 1 us before that slot: denied, nothing taken
        early = limiter.acquire_many(
            [(shared, None), (tenant, "a")], acquisition_id="t1", reserve_until=now_s + 0.099999
        )
        assert not early.allowed
        assert early.retry_after_s == pytest.approx(0.1)
        # on the slot itself: reserved, whatever the window max_wait_s would have given
        on = limiter.acquire_many(
            [(shared, None), (tenant, "a")], acquisition_id="t2", reserve_until=now_s + 0.1
        )
        assert on.allowed
        assert on.wait_s == pytest.approx(0.1)
        # and a deadline already passed reserves nothing ahead
        passed = limiter.acquire_many([(shared, None)], reserve_until=now_s - 5)
        assert not passed.allowed
    # The memory limiter decides as the script does
    assert real.peek(shared) == memory.peek(shared)


def test_reserve_until_must_be_a_positive_time(client: redis.Redis, prefix: str) -> None:
    limiter = Limiter(client, prefix=prefix)
    limit = Limit.parse("10/s", name="api")
    with pytest.raises(RequestError, match="reserve_until"):
        limiter.acquire_many([(limit, None)], reserve_until=float("nan"))


def test_clear_forgets_the_learned_rates() -> None:
    # Given an adaptive limit that learned a lower rate on the in-memory server
    memory = MemoryLimiter()
    api = Limit.parse("20/s burst 1", name="api", algorithm="gcra")
    learn = Adaptive(floor_per_s=2.0, decrease=0.5, recover_s=10.0)
    book = LearnedRates(memory.client, KeySpace("throttle", "default"))
    assert book.refused(api, None, learn).rate_per_s == pytest.approx(10.0)
    # When the server is cleared (throttle.testing.reset does it between tests)
    memory.server.clear()
    # Then the limit is back at its ceiling
    assert book.read(api, None, learn).rate_per_s == pytest.approx(20.0)


def test_asks_dated_in_the_past_are_taken_as_of_then() -> None:
    # The in-memory server reads a negative time as "that long ago" as the scripts do
    memory = MemoryLimiter()
    gcra = Limit.parse("10/s burst 1", name="api", algorithm="gcra")
    dated = memory.acquire_each([(gcra, "k", 1.0)] * 3, max_wait_s=10, ago_s=[0.2, 0.1, 0.0])
    assert [d.wait_s for d in dated] == [0.0, 0.0, 0.0]  # type: ignore[union-attr]
    at_once = memory.acquire_each([(gcra, "n", 1.0)] * 2, max_wait_s=10)
    assert [d.wait_s for d in at_once][1] == pytest.approx(0.1, abs=0.01)  # type: ignore[union-attr]


def test_a_give_back_leaves_a_record_found_since_to_its_finder_as_the_scripts_do(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    real = Limiter(client, prefix=prefix, clock_us=clock)
    memory = MemoryLimiter(prefix=prefix, clock_us=clock)
    conc = Limit.parse("1 concurrent", name="one")

    def give_back(limiter: Limiter, decision: Decision) -> object:
        # what the asyncio limiter sends for a cancelled acquire's take
        assert decision.acquisition is not None
        script, keys, args, decode = limiter._settle_request(
            decision.acquisition, 0.0, unless_found=True
        )
        return decode(limiter._call(script, keys, args))

    for limiter in (real, memory):
        taken = limiter.acquire_many([(conc, "a")], acquisition_id="t1")
        untouched = limiter.acquire_many([(conc, "b")], acquisition_id="t2")
        found = limiter.acquire_many([(conc, "a")], acquisition_id="t1")  # a retry
        assert taken.allowed and found.held
        # The give-back of the first call leaves the unit to the retry that found it...
        assert give_back(limiter, taken).status == "already_settled"  # type: ignore[attr-defined]
        assert limiter.peek(conc, "a").remaining == 0
        # ...and one of a record nobody found gives it back
        assert give_back(limiter, untouched).status == "settled"  # type: ignore[attr-defined]
        assert limiter.peek(conc, "b").remaining == 1
        assert found.acquisition is not None
        assert limiter.settle(found.acquisition, 0.0).status == "settled"


def test_a_window_whose_period_changed_counts_in_the_new_period(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    # A window limit's period changed at run time (1 per 50 ms, then 1 per minute). The
    # stored window index is in the old period's units: read as the new one's, it was a
    # window thousands of years ahead (a retry read as a pause, until the key expired).
    # The state keeps its period: the old window's count stays counted while that window
    # runs, in the new period's window; then the new period counts afresh. Redis and the
    # model agree at each step.
    for algorithm in (Algorithm.SLIDING_WINDOW, Algorithm.FIXED_WINDOW):
        fast = Limit(f"w-{algorithm.value}", algorithm, 1.0, 0.05)
        slow = Limit(f"w-{algorithm.value}", algorithm, 1.0, 60.0)
        limiters = (
            Limiter(client, prefix=prefix, clock_us=clock),
            MemoryLimiter(prefix=prefix, clock_us=clock),
        )
        first = [(one.acquire(fast), one.acquire(slow), one.peek(slow)) for one in limiters]
        assert first[1] == first[0]
        admitted, denied, _ = first[0]
        assert admitted.allowed and not denied.allowed
        # The end of the minute (a sliding window's count weighs on the next one too), not
        # years; an overstatement while the old window runs, never an understatement.
        assert (
            0 < denied.retry_after_s <= (120.0 if algorithm is Algorithm.SLIDING_WINDOW else 60.0)
        )
        clock.advance(0.05)  # the 50 ms window has ended: its count no longer weighs
        after = [one.acquire(slow) for one in limiters]
        assert after[1] == after[0]
        assert after[0].allowed
        clock.advance(60.0)


def test_text_replies_carry_durations_as_lua_writes_them(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    # peek.lua's reply and acquire.lua's held and voided replies are text, their durations
    # written by Lua's '..' ('%.14g'): exact up to 1e14 us (3 years), 14 digits beyond.
    # A hold of 5 years (not a pause, which reads as inf) shows it: the model wrote every
    # digit, and a peek's retry_after_s differed by 5 us (found by test_model_more.py).
    gcra = Limit.parse("5/s burst 1", name="api", algorithm="gcra")
    both = (
        Limiter(client, prefix=prefix, clock_us=clock),
        MemoryLimiter(prefix=prefix, clock_us=clock),
    )
    answers: list[list[object]] = []
    for one in both:
        reserved = one.acquire_many([(gcra, "k")], max_wait_s=1, acquisition_id="t1")
        again = one.acquire_many([(gcra, "k")], max_wait_s=1, acquisition_id="t2")
        answers.append([reserved, again, one.hold(gcra, "k", 5 * 365 * 86400.0)])
    clock.now_us += 12_345  # the hold's end is 15 digits of us away, and not round
    for one, answer in zip(both, answers, strict=True):
        answer.append(one.peek(gcra, "k"))
        answer.append(one.acquire_many([(gcra, "k")], max_wait_s=1, acquisition_id="t2"))
    assert answers[1] == answers[0]
    voided = answers[0][-1]
    assert isinstance(voided, Decision) and voided.held and not voided.allowed


def test_a_gcra_limit_moved_or_settled_rounds_its_tat_as_the_script_does(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    # gcra.lua moves a TAT by cost * period_us / count (committed as of another limit's
    # later slot) and by delta * period_us / count (a settle); the model multiplied by
    # the interval (period_us / count) computed first, which may round apart. Added to a
    # TAT of 1.76e15 us (steps of 0.25 us) the two may land on neighbouring doubles:
    # these costs do, on a 7 per 3 s limit (found by reviewing the operations' order
    # after the property tests; random costs almost never hit it).
    bucket = Limit.parse("2/s burst 1", name="tb")
    gcra = Limit("g", Algorithm.GCRA, 7.0, 3.0)
    answers = []
    for limiter in (
        Limiter(client, prefix=prefix, clock_us=clock),
        MemoryLimiter(prefix=prefix, clock_us=clock),
    ):
        # committed 0.5 s ahead, at the bucket's slot
        limiter.acquire(bucket)
        late = limiter.acquire_many(
            [(bucket, None), (gcra, None, 0.23333362500000002)], max_wait_s=1.0
        )
        # settled above its reservation
        taken = limiter.acquire_many([(gcra, "k")], acquisition_id="t1")
        assert taken.acquisition is not None
        settled = limiter.settle(taken.acquisition, 1.2752064583333333)
        answers.append((late, settled, limiter.peek(gcra), limiter.peek(gcra, "k")))
    assert answers[1] == answers[0]


def test_a_give_back_of_a_new_acquisition_under_an_id_used_before_gives_it_back(
    client: redis.Redis, prefix: str, clock: FakeClock
) -> None:
    # An id acquired, found by a retry (the record's 'f'), settled; acquired again: a new
    # acquisition, nobody has found it. Its give-back (the asyncio limiter's, for a
    # cancelled acquire) must give it back, as the model does; Redis said
    # "already_settled", from the first record's 'f', and the tokens stayed taken
    # (lua/acquire.lua wrote the new record over the settled one, which it now deletes).
    bucket = Limit.parse("2/s", name="api")
    answers = []
    for limiter in (
        Limiter(client, prefix=prefix, clock_us=clock),
        MemoryLimiter(prefix=prefix, clock_us=clock),
    ):
        first = limiter.acquire_many([(bucket, None)], acquisition_id="t1")
        assert limiter.acquire_many([(bucket, None)], acquisition_id="t1").held  # found
        assert first.acquisition is not None
        assert limiter.settle(first.acquisition, None).status == "settled"
        again = limiter.acquire_many([(bucket, None)], acquisition_id="t1")
        assert again.acquisition is not None and not again.held
        script, keys, args, decode = limiter._settle_request(
            again.acquisition, 0.0, unless_found=True
        )
        answers.append((decode(limiter._call(script, keys, args)), limiter.peek(bucket)))
    assert answers[0] == answers[1]
    assert answers[1][0].status == "settled"  # the model: given back
