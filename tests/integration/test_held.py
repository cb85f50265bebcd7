"""A task held in a worker's consumer for its near slot (throttle/celery/waiting.py), when
its slot comes: whatever fails then, the task goes on to the pool. A real redis-server;
the consumer is a stand-in that records what it hands to the pool."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.worker import state

from tests.support.eager import close_throttler
from throttle.celery import throttled
from throttle.celery.waiting import Pending, Undecided, Waiting
from throttle.errors import BackendUnavailable
from throttle.limiter import Limiter


class Request(SimpleNamespace):  # celery's reserved requests are a WeakSet
    __hash__ = object.__hash__


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery("held", set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {"api": {"algorithm": "gcra", "rate": "10/s", "burst": 1}},
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
    request = Request(
        id="t-held", args=(), kwargs={}, delivery_info={"routing_key": "celery"},
        request_dict={"id": "t-held", "headers": {}}, revoked=lambda: revoked,
    )  # fmt: skip
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
