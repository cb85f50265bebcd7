"""When the worker's consumer decides a task before the pool, and what the pool child
makes of the decision (:mod:`throttle.celery.waiting`, :class:`Admission`): pure logic;
the worker itself is tested in tests/system/test_waiting.py."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest
from celery.app.task import Context

from throttle.celery import waiting
from throttle.celery.execution import Admission, carry, mark_clear, take_admission
from throttle.celery.waiting import (
    BUSY_S,
    FRESH_S,
    ROOM_TASKS,
    Look,
    Waiting,
    WaitingLine,
    has_room,
    line_room,
)
from throttle.decision import Acquisition, Decision, LimitState
from throttle.limiter import HOLD_PLACED
from throttle.spec import FAIR_NEAR_S, Limit

LIMIT = Limit.parse("10/s", name="api")


def decision(*, allowed: bool = True, wait_s: float = 0.0, remaining: float = 100.0,
             cost: float = 1.0, held: bool = False, late_s: float = 0.0) -> Decision:  # fmt: skip
    state = LimitState("api", allowed, remaining, 0.0 if allowed else 1.0, 0.0)
    acquisition = Acquisition("t1", (cost,), ((LIMIT, None),), ("k", "lease")) if allowed else None
    return Decision(allowed, remaining, 0.0 if allowed else 1.0, 0.0, wait_s, (state,),
                    acquisition, held, late_s)  # fmt: skip


@pytest.mark.parametrize(
    ("made", "roomy"),
    [
        pytest.param(decision(remaining=ROOM_TASKS), True, id="room for 20 more"),
        pytest.param(decision(remaining=ROOM_TASKS - 1), False, id="room for 19"),
        pytest.param(decision(remaining=50, cost=5), False, id="room for 10 of cost 5"),
        pytest.param(decision(wait_s=0.1), False, id="a wait"),
        pytest.param(decision(allowed=False), False, id="a denial"),
        pytest.param(decision(held=True), False, id="a reservation found again"),
    ],
)
def test_a_look_finds_room_only_for_a_task_admitted_at_once_with_room_left(
    made: Decision, roomy: bool
) -> None:
    assert has_room(made) is roomy


def test_a_look_with_room_is_trusted_for_a_while_and_a_busy_one_for_longer() -> None:
    look = Look()
    assert not look.roomy(0.0)  # never looked: the consumer decides
    look.saw(decision(), 10.0)
    assert look.roomy(10.0 + FRESH_S / 2)
    assert not look.roomy(10.0 + FRESH_S)  # stale: the consumer looks again
    look.saw(decision(wait_s=0.5), 11.0)
    look.saw(decision(), 11.1)  # room again, but the limits were busy a moment ago
    assert not look.roomy(11.1 + FRESH_S / 2)
    look.saw(decision(), 11.0 + BUSY_S)
    assert look.roomy(11.0 + BUSY_S + FRESH_S / 2)


def test_the_decision_travels_sealed_and_only_to_its_own_task() -> None:
    admission = Admission("t1", decision(wait_s=0.5), 1000.0)
    request_dict: dict[str, object] = {"id": "t1"}
    carry(request_dict, admission)
    # prefork pickles the request's dict to the child, where Celery makes it the task's
    # request (its unknown keys are the message's headers too)
    copied = pickle.loads(pickle.dumps(request_dict))
    request = Context(copied, called_directly=False)
    assert "throttle_admission" in request.headers
    assert take_admission(request) == admission
    assert take_admission(request) is None  # taken: a re-published copy carries none
    assert "throttle_admission" not in request.headers
    # another task's, or a forged one (a producer cannot know the seal), is ignored
    other = SimpleNamespace(id="t2", headers={}, throttle_admission=copied["throttle_admission"])
    assert take_admission(other) is None
    forged = SimpleNamespace(id="t1", headers={}, throttle_admission=("guess", admission))
    assert take_admission(forged) is None


def test_the_pool_child_reads_the_decision_as_of_its_own_time() -> None:
    admission = Admission("t1", decision(wait_s=0.5), 1000.0)
    early, slot_at = admission.as_of(1000.49)
    assert slot_at == pytest.approx(1000.5)
    assert early.wait_s == pytest.approx(0.01)
    assert early.late_s == 0.0
    late, _ = admission.as_of(1000.8)  # the pool started it 300 ms after its slot
    assert late.wait_s == 0.0
    assert late.late_s == pytest.approx(0.3)


def test_a_hold_announced_after_a_decision_makes_the_pool_look_again() -> None:
    line = WaitingLine(SimpleNamespace(), max_wait_s=60.0)
    pairs = (("api", "acme"), ("shared", None))
    # Not listening (no announcements, or not yet): nothing is known for sure
    assert not line.holds_clear(pairs, since=100.0)
    line.announcements = SimpleNamespace(listening_since=50.0)  # type: ignore[assignment]
    assert line.holds_clear(pairs, since=100.0)
    assert not line.holds_clear(pairs, since=40.0)  # decided before it listened
    # A hold placed on one of the limits (on any key of it) is noted at once, in the
    # listening thread, and wakes nobody
    line._announced({HOLD_PLACED, "shared"})
    assert line.held_at.keys() == {"shared"}
    assert not line.holds_clear(pairs, since=line.held_at["shared"] - 1.0)
    assert line.holds_clear(pairs, since=line.held_at["shared"] + 1.0)  # decided after it
    assert line.holds_clear((("api", "acme"),), since=line.held_at["shared"] - 1.0)
    # A listener that lost its subscription knows nothing
    line.announcements = SimpleNamespace(listening_since=None)  # type: ignore[assignment]
    assert not line.holds_clear((("api", "acme"),), since=1e12)


def test_the_hand_over_marks_the_carried_decision() -> None:
    request_dict: dict[str, object] = {"id": "t1"}
    mark_clear(request_dict, True)  # nothing carried: nothing to mark
    assert request_dict == {"id": "t1"}
    carry(request_dict, Admission("t1", decision(wait_s=0.5), 1000.0))
    mark_clear(request_dict, True)
    request = Context(pickle.loads(pickle.dumps(request_dict)), called_directly=False)
    taken = take_admission(request)
    assert taken is not None and taken.holds_clear
    assert taken.decided_at == 1000.0


def test_the_line_is_bounded_only_where_the_prefetch_count_cannot_be_raised() -> None:
    def consumer(driver: str, qos_global: bool, prefetch: int) -> SimpleNamespace:
        transport = SimpleNamespace(driver_type=driver)
        return SimpleNamespace(
            qos_global=qos_global, initial_prefetch_count=prefetch,
            connection=SimpleNamespace(transport=transport),
            pool=SimpleNamespace(num_processes=2),
        )  # fmt: skip

    # RabbitMQ quorum queues (Celery turns global QoS off): the slots beyond the pool's
    assert line_room(consumer("amqp", False, 8)) == 6
    assert line_room(consumer("amqp", False, 2)) == 0  # a multiplier of 1: none
    # a prefetch count Celery can raise (classic queues; Redis, whatever its QoS flag),
    # or no prefetch limit at all: no bound of the line's own
    assert line_room(consumer("amqp", True, 8)) is None
    assert line_room(consumer("redis", False, 8)) is None
    assert line_room(consumer("amqp", False, 0)) is None


class Request:
    """A request as Celery's state sets hold it (weakly)."""

    def __init__(self, task_id: str) -> None:
        self.id = task_id


def test_a_task_leaving_the_line_passes_its_raise_to_one_beyond_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    qos = SimpleNamespace(raised=0)
    qos.increment_eventually = lambda: setattr(qos, "raised", qos.raised + 1)
    qos.decrement_eventually = lambda: setattr(qos, "raised", qos.raised - 1)
    timer = SimpleNamespace(call_at=lambda *args, **kwargs: object(), cancel=lambda entry: None)
    line = WaitingLine(SimpleNamespace(qos=qos, timer=timer), max_wait_s=60.0)
    assert line.room is None  # a prefetch count raised per waiting task (Redis)
    monkeypatch.setattr(waiting, "LINE_MAX_TASKS", 3)
    gate = SimpleNamespace(execution=SimpleNamespace(deadline=None))
    # Given a flood of five tasks: three raise the prefetch count, two keep ordinary
    # prefetch slots (beyond the bound)
    for n in range(5):
        pending = SimpleNamespace(request=Request(f"t{n}"), gate=gate, held_since=None)
        line.join(pending, (("api", "a"),), priority=0)  # type: ignore[arg-type]
    waiters = list(line.line.waiters)
    assert qos.raised == 3
    assert [w.raised for w in waiters] == [True, True, True, False, False]

    def leave(waiter: Any) -> None:  # as a pass over the line takes a task out
        line._left(waiter)
        line.line._remove(waiter)

    # When a task beyond the bound leaves, nothing changes; when one that raised the count
    # leaves, its raise passes to a task beyond the bound still waiting: the ordinary
    # slots free up as the line drains, and the consumer receives other tasks again
    leave(waiters[4])
    leave(waiters[0])
    assert qos.raised == 3 and waiters[3].raised
    # and once none waits beyond the bound, the count comes down with the line
    leave(waiters[1])
    assert qos.raised == 2
    for waiter in (waiters[2], waiters[3]):
        leave(waiter)
    assert qos.raised == 0
    assert len(line.line) == 0


def near_s(*limits: Limit, sleep_max_s: float = 1.0, reserve_ahead_s: float = 0.25) -> float:
    """The consumer's near horizon for a task under ``limits`` (cost 1 each)."""
    waiting = object.__new__(Waiting)
    settings = SimpleNamespace(sleep_max_s=sleep_max_s, reserve_ahead_s=reserve_ahead_s)
    waiting.throttler = SimpleNamespace(settings=settings)  # type: ignore[assignment]
    gate = SimpleNamespace(execution=SimpleNamespace(targets=[(lim, "k", 1.0) for lim in limits]))
    return waiting.near_s(gate)  # type: ignore[arg-type]


def fair(spec: str) -> Limit:
    return Limit.parse(spec, name="llm", algorithm="gcra", fair=True)


@pytest.mark.parametrize(
    ("limits", "near"),
    [
        pytest.param((LIMIT,), 0.25, id="not fair: reserve_ahead"),
        # Three tenants on 6/s come due together and take the total's next three slots,
        # 1/6 s apart: the third is 0.33 s ahead. Asked within 0.25 s it was denied, its
        # turn moved on by a share interval: 4/s of 6/s used, one tenant at a third of its
        # share (repro/s9_order.py fair).
        pytest.param((fair("6/s burst 1"),), FAIR_NEAR_S, id="fair: the script's horizon"),
        pytest.param((fair("20/s burst 19"),), 1.0, id="fair: burst + 1 turns"),
        pytest.param((fair("1/s burst 1"),), 1.0, id="fair slow: one turn, past sleep_max"),
        pytest.param((fair("1/4s burst 1"),), 4.0, id="fair slower: one turn"),
    ],
)
def test_a_fair_limit_is_reserved_as_far_ahead_as_its_script_admits(
    limits: tuple[Limit, ...], near: float
) -> None:
    assert near_s(*limits) == pytest.approx(near)


def test_the_fair_horizon_stops_at_sleep_max() -> None:
    assert near_s(fair("6/s burst 1"), sleep_max_s=0.3) == pytest.approx(0.3)
