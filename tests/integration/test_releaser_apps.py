"""A parking lot shared by two apps (the same limiter Redis, prefix and namespace): each
app's releaser publishes only the parked tasks it defines, against a real redis-server."""

from __future__ import annotations

from typing import Any

import pytest
from celery.canvas import Signature

from tests.support.eager import eager_app
from throttle.celery import Throttler
from throttle.celery.message import parked_payload
from throttle.celery.releaser import Releaser


def test_a_releaser_leaves_another_apps_parked_task_to_that_app(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        eager_app("first", redis_url, prefix, {"api": {"rate": "1/s"}}) as first,
        eager_app("second", redis_url, prefix, {"api": {"rate": "1/s"}}) as second,
    ):

        @second.task(name="second.call", shared=False)
        def call(x: int) -> int:
            return x

        # Given a task of the second app parked, due now, in the lot both apps share
        lot = Throttler.of(first).parking
        assert Throttler.of(second).parking.keyspace == lot.keyspace
        signature = dict(second.signature("second.call", args=(1,)))
        lot.park(parked_payload(signature, "json"), 0.0, task_id="t-1")
        published: list[Any] = []
        monkeypatch.setattr(
            Signature, "apply_async", lambda sig, **kw: published.append(sig["task"])
        )
        # When the first app's releaser polls: it does not publish it (its broker would
        # discard a task it does not define), and says so once
        assert Releaser(first).release_once() == 0
        assert published == []
        assert "parked tasks of second.call, which this app does not define" in caplog.text
        assert lot.find("t-1") is not None  # still parked
        # Then the second app's releaser publishes it once the first one's claim expires
        claims = lot.keyspace.parking_keys()[2]
        lot.client.zadd(claims, dict.fromkeys(lot.client.zrange(claims, 0, -1), 0))  # expired
        assert Releaser(second).release_once() == 1
        assert published == ["second.call"]
