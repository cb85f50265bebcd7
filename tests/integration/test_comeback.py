"""When a paused limit's task comes back (throttle/celery/comeback.py): after
``pause_recheck``; soon, to wait in a worker's line, when the consumer had admitted it
before the pause; and never after its deadline. A real redis-server for the clock; the
re-publish itself is recorded, not sent."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery

from tests.support.eager import close_throttler
from throttle.celery import comeback, throttled
from throttle.celery.comeback import PAUSE_TO_LINE_S, come_back
from throttle.celery.gate import Gate
from throttle.decision import Decision

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
