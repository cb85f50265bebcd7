"""A task held in a worker's consumer for its near slot (throttle/celery/waiting.py), when
its slot comes: whatever fails then, the task goes on to the pool. A real redis-server;
the consumer is a stand-in that records what it hands to the pool."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
from celery import Celery
from celery.worker import state

from tests.support.eager import close_throttler
from throttle.celery import throttled
from throttle.celery.execution import ADMISSION_KEY
from throttle.celery.runtime import Throttler
from throttle.celery.waiting import Pending, Undecided, Waiting, WaitingLine, pairs_of
from throttle.errors import BackendUnavailable
from throttle.limiter import Limiter


class Request(SimpleNamespace):  # celery's reserved requests are a WeakSet
    __hash__ = object.__hash__


def request_of(task_id: str, *, deferrals: int = 0, revoked: bool = False) -> Request:
    """A worker's request of a task without arguments (``deferrals``: sent back that many
    times, as its header says)."""
    headers = {"throttle_deferrals": deferrals} if deferrals else {}
    return Request(
        id=task_id, args=(), kwargs={}, delivery_info={"routing_key": "celery"},
        request_dict={"id": task_id, "headers": headers}, headers=headers,
        revoked=lambda: revoked,
    )  # fmt: skip


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery("held", set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {
                "api": {"algorithm": "gcra", "rate": "10/s", "burst": 1},
                # a slot a second ahead: a slow host does not reach it before the test does
                "slow": {"algorithm": "gcra", "rate": "1/s", "burst": 1},
            },
        },
    )
    yield app
    close_throttler(app)


@pytest.mark.parametrize("revoked", [False, True])
def test_a_held_task_whose_slot_passed_while_redis_is_away_goes_to_the_pool(
    app: Celery, monkeypatch: pytest.MonkeyPatch, revoked: bool
) -> None:
    @app.task(name="held.call", shared=False)
    @throttled("api")
    def call() -> None: ...

    handed: list[Any] = []
    qos = SimpleNamespace(increment_eventually=lambda: None, decrement_eventually=lambda: None)
    timer = SimpleNamespace(call_at=lambda *args, **kwargs: None)
    consumer = SimpleNamespace(on_task_request=handed.append, qos=qos, timer=timer)
    waiting = Waiting(call, consumer, Undecided(consumer))
    request = request_of("t-held", revoked=revoked)
    # Given a task admitted with a slot that the consumer held it for
    gate = waiting._gate(request)
    assert gate is not None
    decision = gate.admit()
    assert decision.allowed and decision.acquisition is not None

    # When its timer fires after the slot passed (a busy consumer), the limiter's Redis
    # gone meanwhile
    def away(*args: Any, **kwargs: Any) -> Any:
        raise BackendUnavailable("Redis is unreachable")

    monkeypatch.setattr(Limiter, "settle", away)
    monkeypatch.setattr(Limiter, "acquire_many", away)
    try:
        waiting._release(
            request, decision, Pending(waiting, request, gate, None), slot_at=time.time() - 60
        )
        # Then the task goes to the pool (whose gate applies on_redis_down), not left in
        # the consumer until the broker's visibility timeout; a revoked one nowhere
        assert handed == ([] if revoked else [request])
    finally:
        state.reserved_requests.discard(request)


def consumer_of(handed: list[Any], timed: list[tuple[float, Any, tuple[Any, ...]]]) -> Any:
    """A worker's consumer as the waiting step uses it: it records what it hands to the
    pool and what it holds in its timer."""
    qos = SimpleNamespace(increment_eventually=lambda: None, decrement_eventually=lambda: None)
    timer = SimpleNamespace(
        call_at=lambda at, fn, args=(), **kwargs: timed.append((at, fn, args)),
        cancel=lambda entry: None,
    )
    return SimpleNamespace(on_task_request=handed.append, qos=qos, timer=timer)


class Consumer(NamedTuple):
    """A slow task's consumer side with a line (:func:`consumer_of`), and what it recorded."""

    waiting: Waiting
    line: WaitingLine
    handed: list[Any]
    timed: list[tuple[float, Any, tuple[Any, ...]]]


def with_line(app: Celery) -> Consumer:
    """The consumer side of a task under ``slow``, with a line of 60 s."""

    @app.task(name="held.call", shared=False)
    @throttled("slow")
    def call() -> None: ...

    handed: list[Any] = []
    timed: list[tuple[float, Any, tuple[Any, ...]]] = []
    consumer = consumer_of(handed, timed)
    line = WaitingLine(consumer, 60.0)
    return Consumer(Waiting(call, consumer, Undecided(consumer), line), line, handed, timed)


def test_a_task_back_for_its_reserved_slot_asks_before_it_joins_the_line(app: Celery) -> None:
    waiting, line, handed, timed = with_line(app)

    # Given a task that reserved a slot a second ahead and went back through the broker
    # for it (a come-back to its slot), and a task waiting in the line for the same limit
    back = request_of("t-back", deferrals=1)
    gate = waiting._gate(back)
    assert gate is not None
    first = Throttler.of(app).limiter.acquire_many(
        gate.execution.targets, max_wait_s=0.0, acquisition_id="t-first"
    )
    assert first.allowed
    reserved = Throttler.of(app).limiter.acquire_many(
        gate.execution.targets, max_wait_s=5.0, acquisition_id="t-back", lease_s=60.0
    )
    assert reserved.allowed and 0.0 < reserved.wait_s <= 1.0 + 0.01
    waiter = request_of("t-waiting")
    waiter_gate = waiting._gate(waiter)
    assert waiter_gate is not None
    line.line.join(
        Pending(waiting, waiter, waiter_gate, None), pairs_of(waiter_gate), now=time.monotonic()
    )
    try:
        # When it comes back
        waiting._decide(back, gate)
        # Then it finds its reservation and is held for it (or handed to the pool), not
        # put behind the waiting task in the line, whose pass would come after its slot
        assert len(line.line) == 1
        held = [args[0].id for _, _, args in timed if args]  # (not the line's own pass)
        assert held + [r.id for r in handed] == ["t-back"]
    finally:
        for one in (back, waiter):
            state.reserved_requests.discard(one)
            state.scheduled_requests.discard(one)


def test_a_task_decided_while_the_line_is_full_sees_a_hold_placed_before_its_slot(
    app: Celery,
) -> None:
    waiting, line, handed, timed = with_line(app)
    line.announcements = SimpleNamespace(listening_since=0.0)  # listening since ever
    back = request_of("t-full")
    gate = waiting._gate(back)
    assert gate is not None
    # Given a task back for the slot it reserved a second ahead, decided where the line has
    # no room (a quorum queue's fixed prefetch), and held in the consumer for that slot
    limiter = Throttler.of(app).limiter
    limiter.acquire_many(gate.execution.targets, acquisition_id="t-first")
    limiter.acquire_many(
        gate.execution.targets, max_wait_s=5.0, acquisition_id="t-full", lease_s=60.0
    )
    waiting.decide_in_pool(Pending(waiting, back, gate, None))
    ((_, release, args),) = [entry for entry in timed if entry[2]]
    try:
        # When a pause of its limit is announced before its slot, then the slot comes
        line.held_at["slow"] = time.monotonic()
        release(*args)
        # Then the pool child is told that a hold came since the decision: it looks at
        # Redis again before it calls (told "clear", it would call through the pause)
        assert handed == [back]
        admission = back.request_dict[ADMISSION_KEY][1]
        assert admission.holds_clear is False
    finally:
        state.reserved_requests.discard(back)
        state.scheduled_requests.discard(back)
