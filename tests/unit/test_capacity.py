"""How capacity is handed out to the tasks waiting in a worker's line
(:class:`throttle.celery.capacity.Line`): pure bookkeeping over an injected clock; the
worker itself is tested in tests/system/test_capacity.py."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import pytest

from throttle.celery.capacity import MIN_BLOCK_S, Line, Pair, Waiter, blocks_of

SHARED: Pair = ("shared", None)
A: Pair = ("tenant", "a")
B: Pair = ("tenant", "b")


class Limits:
    """A stand-in for the limiter: which pairs have room, and what was asked, in order."""

    def __init__(self) -> None:
        self.room: dict[Pair, int] = {}
        self.asked: list[str] = []

    def ask(self, waiter: Waiter) -> Mapping[Pair, float] | None:
        self.asked.append(waiter.item)
        short = [pair for pair in waiter.pairs if self.room.get(pair, 0) <= 0]
        if short:
            return dict.fromkeys(short, 1.0)  # denied: blocked a second
        for pair in waiter.pairs:
            self.room[pair] -= 1
        return None  # admitted: it leaves the line


def line(limits: Limits, max_wait_s: float = 60.0) -> Line:
    return Line(limits.ask, max_wait_s)


def test_higher_priority_first_then_arrival() -> None:
    limits = Limits()
    waiting = line(limits)
    for tag, priority in [("a1", 0), ("a2", 0), ("b1", 9), ("b2", 9)]:
        waiting.join(tag, [SHARED], priority=priority, now=0.0)
    limits.room[SHARED] = 3
    waiting.serve(0.0)
    # Given room for three: the two of priority 9, then the first of priority 0; the last
    # asked and was denied, and stays
    assert limits.asked == ["b1", "b2", "a1", "a2"]
    assert [w.item for w in waiting.waiters] == ["a2"]


def test_a_denial_blocks_the_tasks_behind_it_on_the_same_limit_only() -> None:
    limits = Limits()
    waiting = line(limits)
    waiting.join("a1", [SHARED, A], now=0.0)
    waiting.join("a2", [SHARED, A], now=0.0)
    waiting.join("b1", [SHARED, B], now=0.0)
    # Given tenant a's own limit without room, the shared one and b's with room
    limits.room.update({SHARED: 5, B: 5})
    waiting.serve(0.0)
    # Then a1 is denied (a is blocked), a2 is not asked at all, and b1 runs
    assert limits.asked == ["a1", "b1"]
    assert [w.item for w in waiting.waiters] == ["a1", "a2"]
    assert waiting.blocked[A] == pytest.approx(1.0)
    assert SHARED not in waiting.blocked


def test_capacity_announced_unblocks_its_limit_and_nothing_else() -> None:
    limits = Limits()
    waiting = line(limits)
    waiting.join("a1", [A], blocks={A: 30.0}, now=0.0)
    waiting.join("b1", [B], blocks={B: 30.0}, now=0.0)
    assert waiting.due() == pytest.approx(30.0)
    limits.room.update({A: 1, B: 1})
    # When capacity of a's limit is announced (a refund): a asks again now, b waits
    assert waiting.wake({"tenant-other"}) is False
    assert waiting.wake({"tenant"}) is True
    waiting.serve(0.1)
    assert limits.asked == ["a1", "b1"]  # both pairs are of limit "tenant"
    assert not waiting.waiters
    # A lost connection (None): everything is looked at again
    waiting.join("a2", [A], blocks={A: 30.0}, now=1.0)
    assert waiting.wake(None) is True
    assert not waiting.blocked


def test_a_task_that_waited_too_long_is_given_up_and_the_timer_knows_when() -> None:
    limits = Limits()
    waiting = line(limits, max_wait_s=10.0)
    waiting.join("a1", [A], blocks={A: 60.0}, now=0.0)
    waiting.join("a2", [A], now=5.0)
    # due: the first of its limit's block's end and the oldest task's time-out
    assert waiting.due() == pytest.approx(10.0)
    assert [w.item for w in waiting.expired(9.9)] == []
    assert [w.item for w in waiting.expired(10.0)] == ["a1"]
    assert waiting.blocked_for(waiting.waiters[0], 10.0) == pytest.approx(50.0)
    assert waiting.due() == pytest.approx(15.0)


def test_a_task_leaves_at_its_own_deadline_wherever_it_stands_in_the_line() -> None:
    limits = Limits()
    waiting = line(limits, max_wait_s=10.0)
    waiting.join("a1", [A], blocks={A: 60.0}, now=0.0)
    waiting.join("a2", [A], now=1.0, leave_by=3.0)  # its max_wait, or expires, comes first
    waiting.join("a3", [A], now=2.0, leave_by=30.0)  # later than the line's own bound
    assert waiting.due() == pytest.approx(3.0)
    assert waiting.free_at(waiting.waiters[1]) == pytest.approx(3.0)
    assert [w.item for w in waiting.expired(2.9)] == []
    assert [w.item for w in waiting.expired(3.0)] == ["a2"]
    assert [w.item for w in waiting.waiters] == ["a1", "a3"]
    assert waiting.due() == pytest.approx(10.0)
    assert [w.item for w in waiting.expired(12.0)] == ["a1", "a3"]


def test_a_task_not_blocked_is_due_now() -> None:
    waiting = line(Limits())
    waiting.join("a1", [A], now=0.0)
    assert waiting.due() == -float("inf")
    assert waiting.needs([A, SHARED]) is True
    assert waiting.needs([B]) is False


@pytest.mark.parametrize(
    ("states", "retry", "expected"),
    [
        pytest.param(
            [("shared", True, 0.0), ("tenant", False, 5.0)], 5.0, {A: 4.0}, id="one denies"
        ),
        pytest.param(
            [("shared", False, 0.5), ("tenant", False, 5.0)],
            5.0,
            {SHARED: 0.5, A: 4.0},
            id="both deny, one within the horizon (a hold: asked again at its end)",
        ),
        pytest.param(
            [("shared", True, 0.0), ("tenant", True, 0.0)],
            3.0,
            {SHARED: 2.0, A: 2.0},
            id="none denies alone (a later window)",
        ),
        pytest.param(
            [("shared", False, 0.0), ("tenant", True, 0.0)],
            0.0,
            {SHARED: MIN_BLOCK_S},
            id="denied now for now: asked again after the shortest block",
        ),
    ],
)
def test_a_denial_blocks_each_limit_until_it_could_admit_within_the_horizon(
    states: list[tuple[str, bool, float]], retry: float, expected: dict[Pair, float]
) -> None:
    assert blocks_of((SHARED, A), states, retry, horizon_s=1.0) == pytest.approx(expected)


def test_the_line_s_indexes_agree_with_a_pass_over_it() -> None:
    """``due``, ``expired`` and ``serve`` keep indexes (per shape of pairs, a heap of
    ages) instead of passing over the line: what they answer is what a pass over every
    waiting task would, through random joins, blocks, wakes, admissions and expiries."""
    rng = random.Random(7)
    limits = Limits()
    waiting = line(limits, max_wait_s=5.0)
    shapes = [(SHARED,), (A,), (SHARED, A), (SHARED, B), (B,)]
    now = 0.0
    for step in range(3000):
        now += rng.uniform(0.0, 0.05)
        roll = rng.random()
        if roll < 0.45:
            waiting.join(f"t{step}", rng.choice(shapes), priority=rng.choice((0, 0, 5)), now=now)
        elif roll < 0.6:
            waiting.block({rng.choice((SHARED, A, B)): rng.uniform(0.0, 0.5)}, now)
        elif roll < 0.7:
            waiting.wake(rng.choice((None, ["shared"], ["tenant"])))
        elif roll < 0.85:
            limits.room = {pair: rng.randint(0, 3) for pair in (SHARED, A, B)}
            waiting.serve(now)
            # served until every task left is blocked: none that nothing blocks was skipped
            assert all(
                any(waiting.blocked.get(pair, -1.0) > now for pair in w.pairs)
                for w in waiting.waiters
            )
        else:
            old = {w.item for w in waiting.waiters if now - w.since >= 5.0}
            assert {w.item for w in waiting.expired(now)} == old
        naive = min(
            (min(max(waiting.blocked.get(p, -math.inf) for p in w.pairs), w.since + 5.0)
             for w in waiting.waiters),
            default=None,
        )  # fmt: skip
        assert waiting.due() == naive
    assert len(waiting._ages) <= 2 * len(waiting) + 65
