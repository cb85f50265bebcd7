"""When a paused limit's task comes back (throttle/celery/comeback.py): after
``pause_recheck``; soon, to wait in a worker's line, when the consumer had admitted it
before the pause; and never after its deadline. A real redis-server for the clock; the
re-publish itself is recorded, not sent."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery, Task, signals
from celery.exceptions import Retry

from tests.support.eager import close_throttler
from throttle.celery import comeback, defer_task, throttled
from throttle.celery.comeback import PAUSE_TO_LINE_S, come_back
from throttle.celery.execution import Refusal, current_ticket
from throttle.celery.gate import Gate
from throttle.celery.message import H_PLANNED
from throttle.celery.runtime import Throttler
from throttle.celery.task import gated_call
from throttle.decision import Decision
from throttle.errors import RequestError

RECHECK_S = 30.0


class Deferred(Exception):
    def __init__(self, countdown_s: float) -> None:
        self.countdown_s = countdown_s


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery("comeback", set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix, "pause_recheck": f"{RECHECK_S}s"},
            "limits": {"api": {"algorithm": "gcra", "rate": "10/s", "burst": 1}},
        },
    )
    yield app
    close_throttler(app)


@pytest.mark.parametrize(
    ("expires_in_s", "to_line", "low", "high"),
    [
        (600.0, False, RECHECK_S, RECHECK_S * 1.5),  # stopped in the pool: the recheck
        (600.0, True, PAUSE_TO_LINE_S, PAUSE_TO_LINE_S * 1.5),  # admitted: back to a line
        (5.0, False, 0.0, 5.0),  # its deadline first: back at it, to expire there
    ],
)
def test_a_paused_task_comes_back_for_the_recheck_a_line_or_its_deadline(
    app: Celery,
    monkeypatch: pytest.MonkeyPatch,
    expires_in_s: float,
    to_line: bool,
    low: float,
    high: float,
) -> None:
    @app.task(name="comeback.call", shared=False)
    @throttled("api")
    def call() -> None: ...

    def deferred(execution: object, countdown_s: float, *args: object, **kwargs: object) -> None:
        raise Deferred(countdown_s)

    monkeypatch.setattr(comeback, "defer", deferred)
    expires = datetime.now(timezone.utc) + timedelta(seconds=expires_in_s)
    call.push_request(id="t-paused", expires=expires.isoformat(), headers={},
                      delivery_info={}, called_directly=False)  # fmt: skip
    try:
        gate = Gate(call, None, call.run, (), {})
        gate.evaluate()
        with pytest.raises(Deferred) as caught:
            come_back(gate.execution, Decision.denial(("api",), math.inf), to_line=to_line)
    finally:
        call.pop_request()
    assert low <= caught.value.countdown_s <= high


@pytest.mark.parametrize("how", ["defer_task", "retry", "refusal"])
def test_a_copy_sent_from_the_body_finds_the_runs_acquisition_settled(
    app: Celery, client: redis.Redis, prefix: str, how: str
) -> None:
    # Given a task under a roomy limit (burst 3: a copy that found this run's reservation
    # would call at once, beside the next slot's call) whose body sends a copy of itself
    # at once: defer_task(0), self.retry(countdown=0), or an upstream's refusal that holds
    # nothing (the task comes back for the limit's next free slot)
    app.conf.broker_url = app.conf.throttle_redis_url
    app.conf.throttle_config["limits"]["roomy"] = {"algorithm": "gcra", "rate": "3/s", "burst": 3}
    lease = Throttler.of(app).limiter.keyspace.lease_key("t-copied")
    seen: list[bytes | None] = []

    @app.task(name="comeback.copied", shared=False, bind=True, max_retries=3)
    @throttled("roomy")
    def copied(self: Task) -> None:
        assert client.hget(lease, "s") == b"1", "the run holds its own reservation"
        if how == "defer_task":
            defer_task(0)
        elif how == "retry":
            raise self.retry(countdown=0)
        ticket = current_ticket()
        assert ticket is not None
        ticket.refusal = Refusal(0.0, ("roomy",))
        raise RuntimeError("the SDK's own error around the 429")

    def published(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers is not None and headers.get("id") == "t-copied":
            seen.append(client.hget(lease, "s"))

    signals.before_task_publish.connect(published, weak=False)
    copied.push_request(id="t-copied", headers={}, delivery_info={"routing_key": "copied"},
                        called_directly=False, is_eager=False, retries=0)  # fmt: skip
    try:
        with pytest.raises(Retry):
            copied()
    finally:
        copied.pop_request()
        signals.before_task_publish.disconnect(published)
        client.delete("copied", "celery")
    # Then, when the copy was sent, this run's acquisition was settled already: the copy
    # acquires a slot of its own under the same id instead of running on this one's
    assert seen, "a copy was sent"
    assert seen[0] is not None and seen[0] != b"1", seen


@pytest.mark.parametrize(
    ("acks_late", "soft_time_limit", "most_s"),
    [
        (True, None, 0.5),  # sleep_max: the plan's time, up to it
        (True, 0.6, 0.06),  # a tenth of the time limit, which the sleep would spend
        (False, None, 0.05),  # acknowledged at its start: 50 ms at most
    ],
)
def test_a_task_back_with_a_plan_sleeps_in_its_pool_slot_what_the_slot_allows(
    app: Celery, acks_late: bool, soft_time_limit: float | None, most_s: float
) -> None:
    config = app.conf.throttle_config
    config["settings"]["sleep_max"] = "0.5s"
    # a keyed limit beside the shared one: a task that cannot run soon plans on its key
    config["limits"]["tenant"] = {"algorithm": "gcra", "rate": "10/s", "key": "{tenant}"}

    @app.task(name="comeback.planned", shared=False, acks_late=acks_late,
              soft_time_limit=soft_time_limit)  # fmt: skip
    @throttled("api", "tenant")
    def planned(tenant: str) -> None: ...

    # Given a task back with a plan 2 s ahead (Redis clock)
    throttler = Throttler.of(app)
    at = throttler.clock.now() + 2.0
    planned.push_request(id="t-planned", headers={H_PLANNED: at}, delivery_info={},
                         called_directly=False)  # fmt: skip
    try:
        declared, fn, args, kwargs = gated_call(planned, ("acme",), {}) or pytest.fail("gated")
        gate = Gate(planned, declared, fn, args, kwargs)
        gate.evaluate()
        # Then its pool slot sleeps toward it no longer than that slot may sleep
        assert gate.plan_wait_s(gate._sleep_max_s()) == pytest.approx(most_s, abs=0.005)
    finally:
        planned.pop_request()


@pytest.fixture
def east_of_utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's local time 9 hours ahead of UTC (a POSIX TZ: no tz database needed)."""
    monkeypatch.setenv("TZ", "JST-9")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("east_of_utc")
def test_a_naive_expires_is_read_as_utc_as_celery_reads_it(app: Celery) -> None:
    # Given a task whose producer gave a naive `expires` (datetime.utcnow() + 10 min:
    # Celery's worker reads a naive expires as UTC), on a worker whose local time is
    # 9 hours ahead of UTC
    @app.task(name="comeback.naive", shared=False)
    @throttled("api")
    def naive() -> None: ...

    expires = datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(minutes=10)
    naive.push_request(id="t-naive", expires=expires.isoformat(), headers={},
                       delivery_info={}, called_directly=False)  # fmt: skip
    try:
        # When the gate evaluates its deadlines
        gate = Gate(naive, None, naive.run, (), {})
        gate.evaluate()
        # Then it expires in 10 minutes, not 9 hours before that (in the past)
        assert gate.execution.expires is not None
        left = gate.execution.expires - Throttler.of(app).clock.now()
        assert 590.0 < left <= 600.0
    finally:
        naive.pop_request()


def test_an_expires_written_with_a_z_is_utc(app: Celery) -> None:
    # A producer in another language writes UTC as a trailing Z (Python 3.10 refuses it)
    @app.task(name="comeback.zulu", shared=False)
    @throttled("api")
    def zulu() -> None: ...

    expires = (datetime.now(timezone.utc) + timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M:%SZ")
    zulu.push_request(id="t-zulu", expires=expires, headers={}, delivery_info={},
                      called_directly=False)  # fmt: skip
    try:
        gate = Gate(zulu, None, zulu.run, (), {})
        gate.evaluate()
        assert gate.execution.expires is not None
        left = gate.execution.expires - Throttler.of(app).clock.now()
        assert 588.0 < left <= 600.0
    finally:
        zulu.pop_request()


@pytest.mark.parametrize("countdown", [math.nan, math.inf, 4e8, "soon", None])
def test_defer_task_refuses_a_countdown_that_is_no_time(app: Celery, countdown: Any) -> None:
    @app.task(name="comeback.deferring", shared=False)
    @throttled("api")
    def deferring() -> None:
        defer_task(countdown)

    # A body asking to come back at no time fails with an error naming the value, before
    # anything is settled or sent (NaN reached Celery's ETA arithmetic after the settle)
    with pytest.raises(RequestError, match=r"defer_task: countdown_s .*got"):
        deferring.apply(throw=True).get()
