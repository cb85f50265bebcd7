"""A pytest plugin for testing a project's throttled tasks: fixtures under a ``throttle_``
prefix, inert until a test asks for one.

Installed with the package as the ``throttle`` plugin (entry point ``pytest11``); nothing
happens unless a test names one of its fixtures. Without the entry point (``-p
no:throttle``, or ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), enable it with ``-p
throttle.pytest_plugin`` or ``pytest_plugins = ["throttle.pytest_plugin"]``.

The fixtures work on *the app under test*: the ``throttle_app`` fixture, which by default
is Celery's ``celery_app`` fixture (``celery.contrib.pytest``); a project whose tests use
their own app overrides it in a ``conftest.py``::

    @pytest.fixture
    def throttle_app():
        from proj.celery import app
        return app

- ``throttle_memory``: the app on a fresh in-memory limiter (``memory://``: buckets full,
  no holds), for this test; the :class:`~throttle.testing.MemoryLimiter`.
- ``throttle_off``: throttling off for this test (``throttle_enabled = False``).
- ``throttle_redis``: the app's limiter on a real Redis under a prefix of this test's own
  (``THROTTLE_TEST_REDIS_URL``, else the ``--throttle-redis-url`` option); the test fails
  with a clear message when neither is given. Its keys are deleted afterwards.
- ``throttle_recorder``: a :class:`~throttle.testing.Recorder` of the app's limiter (the
  in-memory one, unless the test also asks for ``throttle_redis``): which tasks were
  throttled and how long they were told to wait.
- ``throttle_upstream``: :func:`throttle.testing.upstream_response`, a factory of a
  provider's refusals (429 with OpenAI's, Anthropic's, GitHub's, Stripe's, Discord's or
  the generic headers), to test a task's reaction without a network.

Each fixture puts the app's settings back as they were when the test ends. A test asks
for one of ``throttle_memory``, ``throttle_off`` and ``throttle_redis`` (two fail the
test: they would contradict each other).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

REDIS_URL_ENV = "THROTTLE_TEST_REDIS_URL"
"""The environment variable naming the Redis of the ``throttle_redis`` fixture."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--throttle-redis-url",
        default=None,
        help=f"the Redis of the throttle_redis fixture (else ${REDIS_URL_ENV})",
    )


@pytest.fixture
def throttle_app(request: pytest.FixtureRequest) -> Any:
    """The Celery app the ``throttle_*`` fixtures act on: Celery's ``celery_app`` fixture
    by default; override this fixture to name your own app."""
    try:
        return request.getfixturevalue("celery_app")
    except pytest.FixtureLookupError:
        pytest.fail(
            "the throttle_* fixtures need the app under test: define a throttle_app fixture "
            "that returns it (or use celery.contrib.pytest's celery_app)",
            pytrace=False,
        )


_SETTINGS = ("throttle_redis_url", "throttle_enabled")


class _Saved:
    """The app's throttle settings and throttler, put back when the test ends."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.values = {name: app.conf.get(name) for name in _SETTINGS}
        self.throttler = getattr(app, "_throttler", None)

    def restore(self) -> None:
        for name, value in self.values.items():
            self.app.conf[name] = value
        self.app._throttler = self.throttler


_EXCLUSIVE = ("throttle_memory", "throttle_off", "throttle_redis")
"""The fixtures that each set the app's limiter: a test asks for one of them."""


def _alone(request: pytest.FixtureRequest, name: str) -> None:
    """Fail the test when it also asks for another fixture that sets the app's limiter:
    whichever was set up last would win, silently."""
    asked = request.fixturenames
    if name == "throttle_recorder":  # (it sets up throttle_memory or throttle_redis)
        others = ["throttle_off"] if "throttle_off" in asked else []
    else:
        others = [f for f in _EXCLUSIVE if f != name and f in asked]
    if name == "throttle_off" and "throttle_recorder" in asked:
        others.append("throttle_recorder")  # nothing to record with throttling off
    if others:
        pytest.fail(
            f"{name} and {', '.join(others)} contradict each other: each sets how the app "
            "is throttled in this test; ask for one",
            pytrace=False,
        )


@pytest.fixture
def throttle_memory(throttle_app: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """``throttle_app`` on a fresh in-memory limiter for this test (full buckets, no holds,
    no run-time rates); yields the :class:`~throttle.testing.MemoryLimiter`. Eager tasks
    and Celery's test worker (``celery_worker``, ``start_worker``) both use it."""
    from throttle.testing import use_memory  # noqa: PLC0415 (inert until asked for)

    _alone(request, "throttle_memory")
    saved = _Saved(throttle_app)
    throttle_app.conf.throttle_enabled = True
    try:
        yield use_memory(throttle_app)
    finally:
        saved.restore()


@pytest.fixture
def throttle_off(throttle_app: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """Throttling off for this test (``throttle_enabled = False``): throttled tasks run at
    once, nothing connects to a Redis. Yields the app."""
    _alone(request, "throttle_off")
    saved = _Saved(throttle_app)
    throttle_app.conf.throttle_enabled = False
    throttle_app._throttler = None
    try:
        yield throttle_app
    finally:
        saved.restore()


@pytest.fixture
def throttle_redis(throttle_app: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """``throttle_app``'s limiter on a real Redis, under a key prefix of this test's own
    (its keys deleted afterwards; nothing else touched): ``$THROTTLE_TEST_REDIS_URL`` or
    ``--throttle-redis-url``. Yields the :class:`~throttle.Limiter`."""
    from throttle.celery.runtime import Throttler  # noqa: PLC0415
    from throttle.config import ThrottleConfig  # noqa: PLC0415
    from throttle.limiter import Limiter  # noqa: PLC0415

    _alone(request, "throttle_redis")
    url = os.environ.get(REDIS_URL_ENV) or request.config.getoption("--throttle-redis-url")
    if not url:
        pytest.fail(
            f"throttle_redis needs a Redis: set ${REDIS_URL_ENV} or --throttle-redis-url "
            "(a database the tests may write to; only keys under a fresh prefix are used)",
            pytrace=False,
        )
    saved = _Saved(throttle_app)
    throttle_app.conf.throttle_enabled = True
    throttle_app.conf.throttle_redis_url = url
    config = ThrottleConfig.from_source(throttle_app.conf.get("throttle_config"))
    prefix = f"throttle-test-{uuid.uuid4().hex[:12]}"
    config = dataclasses.replace(
        config, settings=dataclasses.replace(config.settings, prefix=prefix)
    )
    limiter = Limiter.from_url(url, prefix=prefix, namespace=config.settings.namespace)
    throttle_app._throttler = (os.getpid(), Throttler(throttle_app, config, limiter))
    try:
        yield limiter
    finally:
        saved.restore()
        client = limiter.client
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)


@pytest.fixture
def throttle_recorder(throttle_app: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A :class:`~throttle.testing.Recorder` of ``throttle_app``'s limiter for this test:
    ``recorder.throttled(task_id)``, ``recorder.wait_s(task_id)``,
    ``recorder.denied_by(task_id)``. The in-memory limiter (``throttle_memory``) unless
    the test asks for ``throttle_redis``."""
    from throttle.celery.runtime import Throttler  # noqa: PLC0415
    from throttle.testing import Recorder  # noqa: PLC0415

    _alone(request, "throttle_recorder")
    if "throttle_redis" in request.fixturenames:
        request.getfixturevalue("throttle_redis")
    else:
        request.getfixturevalue("throttle_memory")
    recorder = Recorder(Throttler.of(throttle_app).limiter)
    try:
        yield recorder
    finally:
        recorder.stop()


@pytest.fixture
def throttle_upstream() -> Any:
    """:func:`throttle.testing.upstream_response`: ``throttle_upstream("openai",
    dimension="tokens", retry_after_s=20)`` is the ``httpx.Response`` of OpenAI's 429 of
    spent tokens."""
    from throttle.testing import upstream_response  # noqa: PLC0415

    return upstream_response
