"""Fixture overrides that run Celery's own integration tests (t/integration of Celery's
sdist, at the pinned version) with every task a ``ThrottledTask`` and the session worker
throttled (``install``): star-imported at the end of Celery's t/integration/conftest.py by
bench/celery_suite.py, so that these definitions replace Celery's.

Before each test the next :data:`TAKEN_SLOTS` slots of the limit ``celery`` are taken, so
that the limit binds from the test's first task on: that task waits beyond ``sleep_max``
and is re-published, whatever the test before left (a test of a single task would
otherwise run it at once, never deferred).

The limits file is ``THROTTLE_CONFIG``; the broker and result backend Celery's
``TEST_BROKER`` and ``TEST_BACKEND`` (the test's private redis-server, also the limiter's).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.pytest import _create_app

from throttle.celery import ThrottledTask, Throttler, install

__all__ = [
    "ZZZZ_binding_limit",
    "ZZZZ_set_app_current",
    "celery_config",
    "celery_parameters",
    "celery_session_app",
]


@pytest.fixture(scope="session")
def celery_config() -> dict[str, Any]:
    """Celery's integration config (its conftest's), plus the throttler's."""
    backend = os.environ["TEST_BACKEND"]
    return {
        "broker_url": os.environ["TEST_BROKER"],
        "result_backend": backend,
        "result_extended": True,
        "task_create_missing_queues": False,
        "throttle_config": os.environ["THROTTLE_CONFIG"],
        "throttle_redis_url": backend,
    }


@pytest.fixture(scope="session")
def celery_parameters() -> dict[str, Any]:
    return {"task_cls": ThrottledTask}


@pytest.fixture(scope="session")
def celery_session_app(
    request: pytest.FixtureRequest,
    celery_config: dict[str, Any],
    celery_parameters: dict[str, Any],
    celery_enable_logging: bool,
    use_celery_app_trap: bool,
) -> Iterator[Celery]:
    """celery.contrib.pytest's, with ``install(app)`` before the session worker starts."""
    mark = request.node.get_closest_marker("celery")
    config = dict(celery_config, **mark.kwargs if mark else {})
    with _create_app(
        enable_logging=celery_enable_logging,
        use_trap=use_celery_app_trap,
        parameters=celery_parameters,
        **config,
    ) as app:
        install(app)
        if not use_celery_app_trap:
            app.set_default()
            app.set_current()
        yield app


@pytest.fixture(autouse=True)
def ZZZZ_set_app_current(app: Celery, celery_session_app: Celery) -> Iterator[None]:  # noqa: N802
    """Celery's, without its check that the apps know no queue but ``celery``: the
    worker's app knows the lane ``celery.throttled`` too."""
    app.set_current()
    app.set_default()
    yield


TAKEN_SLOTS = 5
"""Slots of the limit ``celery`` taken before each test (GCRA 10/s burst 1: 0.5 s, beyond
``sleep_max``, even once a loaded host took a while to deliver the task)."""


@pytest.fixture(autouse=True)
def ZZZZ_binding_limit(celery_session_app: Celery, celery_session_worker: Any) -> None:  # noqa: N802
    """Take the next :data:`TAKEN_SLOTS` slots of the limit ``celery`` (see the module),
    once the session worker runs (its start takes longer than the slots)."""
    limiter = Throttler.of(celery_session_app).limiter
    limit = limiter.limits["celery"]
    for _ in range(TAKEN_SLOTS):
        limiter.acquire(limit, max_wait_s=1.0)
