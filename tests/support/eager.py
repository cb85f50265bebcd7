"""A Celery app in eager mode whose tasks take limits from a mapping, for tests that run
throttled tasks in the test process (no worker)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from celery import Celery

from throttle.celery import ThrottledTask


@contextlib.contextmanager
def eager_app(name: str, redis_url: str, prefix: str, limits: dict[str, Any]) -> Iterator[Celery]:
    """An eager app with ``limits`` (a limits file's ``limits:`` as a mapping) under
    ``prefix``; the throttler's connections are closed when it ends (an unclosed socket
    would warn whenever the app is collected)."""
    app = Celery(name, set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        task_always_eager=True,
        throttle_redis_url=redis_url,
        throttle_config={"settings": {"prefix": prefix}, "limits": limits},
    )
    try:
        yield app
    finally:
        close_throttler(app)


def close_throttler(app: Celery, *, forget: bool = False) -> None:
    """Close the connections of ``app``'s throttler, if one was built (an app dropped
    after a test with an unclosed socket would warn whenever it is collected); ``forget``:
    and drop it, so that the app builds a new one (an app shared by several tests)."""
    cached = getattr(app, "_throttler", None)
    if cached is not None:
        cached[1].limiter.client.close()
        if forget:
            del app._throttler
