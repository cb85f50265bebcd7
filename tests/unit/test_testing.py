"""Users' own tests: eager tasks on the in-memory limiter, and throttling switched off.

No redis-server: every Redis URL points at a closed port, and any connection attempt fails
the test. Times are judged on the limiter's clock (slot_time, the memory server's clock).
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import redis
from celery import Celery

from throttle import ConfigError, Limit, RequestError, ThrottleTimeout
from throttle.celery import ThrottledTask, install, report_cost, slot_time, throttled
from throttle.celery.outage import POOL_ENV, WORKER_ENV
from throttle.celery.runtime import Throttler
from throttle.celery.steps import LaneStep, MetricsStep, ThrottleStep, pool_name
from throttle.cli.task import _task_limits, finished
from throttle.testing import (
    PROVIDERS,
    MemoryLimiter,
    UpstreamError,
    memory_limiter,
    rebuild,
    reset,
    upstream_response,
    use_memory,
)
from throttle.upstream import read_response

LIMITS = {
    "five": {"algorithm": "gcra", "rate": "5/s", "burst": 1},
    "hourly": {"algorithm": "gcra", "rate": "1/h", "burst": 1, "max_wait": "1s"},
    "budget": {"rate": "1000/d", "key": "{tenant}", "cost": "estimate"},
    "single": {"algorithm": "concurrency", "rate": "1 concurrent"},
}


@pytest.fixture
def closed_url() -> str:
    """A Redis URL nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


@pytest.fixture(autouse=True)
def no_redis(monkeypatch: pytest.MonkeyPatch, closed_url: str) -> list[Any]:
    """Any Redis connection attempt is recorded and fails; THROTTLE_REDIS_URL is closed."""
    attempts: list[Any] = []

    def connect(self: Any) -> None:
        attempts.append(self)
        raise AssertionError("a Redis connection was attempted")

    monkeypatch.setattr(redis.connection.AbstractConnection, "connect", connect)
    monkeypatch.setenv("THROTTLE_REDIS_URL", closed_url)
    monkeypatch.delenv("THROTTLE_ENABLED", raising=False)
    monkeypatch.setenv(WORKER_ENV, "")  # the worker steps write these: restored after
    monkeypatch.setenv(POOL_ENV, "")
    return attempts


class DjangoTestSettings:
    """What a Django project's test settings say (read with namespace="CELERY")."""

    CELERY_TASK_ALWAYS_EAGER = True
    CELERY_THROTTLE_REDIS_URL = "memory://"
    CELERY_THROTTLE_CONFIG: ClassVar[dict[str, Any]] = {"limits": LIMITS}


@pytest.fixture
def app(closed_url: str, no_redis: list[Any]) -> Iterator[Celery]:
    app = Celery("memory", set_as_current=False, task_cls=ThrottledTask)
    app.config_from_object(DjangoTestSettings, namespace="CELERY")
    app.conf.broker_url = closed_url
    yield app
    assert no_redis == []


def test_eager_tasks_wait_for_their_slots_on_the_memory_limiter(app: Celery) -> None:
    # Given a 5/s burst-1 limit on the in-memory limiter, whose clock stands still (so that
    # the slots do not depend on how fast this host runs the calls between them)
    frozen = memory_limiter(app).server.clock_us()
    memory_limiter(app).server.clock_us = lambda: frozen

    @app.task(shared=False)
    @throttled("five")
    def ping(x: int) -> float | None:
        return slot_time()

    # When four eager tasks run back to back
    slots: list[float] = [ping.delay(i).get() for i in range(4)]

    # Then each waited for its own slot, 0.2 s after the previous one
    assert all(slot is not None for slot in slots)
    gaps = [b - a for a, b in itertools.pairwise(slots)]
    assert all(gap >= 0.2 - 1e-3 for gap in gaps), gaps
    assert isinstance(memory_limiter(app), MemoryLimiter)


def test_a_deadline_raises_throttle_timeout(app: Celery) -> None:
    @app.task(shared=False)
    @throttled("hourly")
    def once(x: int) -> int:
        return x

    assert once.delay(1).get() == 1
    with pytest.raises(ThrottleTimeout, match="hourly would admit the task in"):
        once.delay(2).get()


def test_reported_costs_settle_and_concurrency_units_come_back(app: Celery) -> None:
    limiter = use_memory(app)
    clock = limiter.server.clock_us
    budget = Limit.parse("1000/d", name="budget")

    @app.task(shared=False)
    @throttled("budget")
    def call(tenant: str, estimate: int, used: int) -> None:
        report_cost(used)

    started = clock()
    call.delay("acme", 300, 120).get()
    remaining = limiter.peek(budget, "acme").remaining
    refilled = (clock() - started) / 1e6 * 1000 / 86400  # on the limiter's clock
    assert 880 - 1e-6 <= remaining <= 880 + refilled + 1e-6

    # Several calls under one estimate: each reports its cost, and the task settles on
    # their sum (the last alone would under-charge the limit).
    @app.task(shared=False)
    @throttled("budget")
    def calls(tenant: str, estimate: int, used: list[int]) -> None:
        for cost in used:
            report_cost(cost)

    started = clock()
    calls.delay("bigco", 300, [120, 80, 50]).get()
    remaining = limiter.peek(budget, "bigco").remaining
    refilled = (clock() - started) / 1e6 * 1000 / 86400
    assert 750 - 1e-6 <= remaining <= 750 + refilled + 1e-6

    single = Limit.parse("1 concurrent", name="single")

    @app.task(shared=False)
    @throttled("single")
    def inside() -> float:
        return limiter.peek(single).remaining

    assert inside.delay().get() == 0  # the task held the one unit while it ran
    assert limiter.peek(single).remaining == 1  # and gave it back when it returned

    # reset(): a new test starts with full buckets
    reset(app)
    assert memory_limiter(app).peek(budget, "acme").remaining == 1000


def test_a_hold_on_the_memory_limiter_holds_eager_tasks(app: Celery) -> None:
    @app.task(shared=False)
    @throttled("hourly")
    def once(x: int) -> int:
        return x

    memory_limiter(app).hold("hourly", None, 3600)
    with pytest.raises(ThrottleTimeout):
        once.delay(1).get()
    assert memory_limiter(app).holds() == {("hourly", None): pytest.approx(3600, abs=1)}


@pytest.mark.parametrize(
    "switch",
    [
        pytest.param({"throttle_enabled": False}, id="app.conf"),
        pytest.param({"CELERY_THROTTLE_ENABLED": False}, id="django-settings"),
        pytest.param({"env": "0"}, id="THROTTLE_ENABLED=0"),
    ],
)
def test_switched_off_tasks_run_unthrottled_without_redis(
    switch: dict[str, Any], closed_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = Celery("off", set_as_current=False, task_cls=ThrottledTask)
    settings: dict[str, Any] = {
        "CELERY_TASK_ALWAYS_EAGER": True,
        "CELERY_THROTTLE_REDIS_URL": closed_url,
        "CELERY_THROTTLE_CONFIG": {"limits": LIMITS},
    }
    if "env" in switch:
        monkeypatch.setenv("THROTTLE_ENABLED", switch["env"])
    elif "CELERY_THROTTLE_ENABLED" in switch:
        settings.update(switch)
    app.config_from_object(SimpleNamespace(**settings), namespace="CELERY")
    if "throttle_enabled" in switch:
        app.conf.update(switch)
    install(app)

    @app.task(shared=False)
    @throttled("hourly")
    def once(x: int) -> tuple[int, float | None]:
        report_cost(3)  # nothing to settle: a no-op
        return x, slot_time()

    # Ten calls of a 1/h limit with max_wait 1 s: all run, none has a slot
    assert [once.delay(i).get() for i in range(10)] == [(i, None) for i in range(10)]
    assert getattr(app, "_throttler", None) is None  # no limiter was built

    # The worker's steps start and stop without Redis
    worker = SimpleNamespace(app=app, hostname="w@test", concurrency=2)
    step = ThrottleStep(worker)
    step.start(worker)
    assert step.releaser is None
    step.stop(worker)
    LaneStep(SimpleNamespace(app=app)).start(SimpleNamespace(app=app))
    metrics = MetricsStep(worker)
    metrics.start(worker)
    assert metrics.server is None
    assert getattr(app, "_throttler", None) is None


def test_a_prefork_worker_of_several_children_refuses_the_memory_limiter(app: Celery) -> None:
    worker = SimpleNamespace(app=app, hostname="w@test", concurrency=2, pool_cls="prefork")
    with pytest.raises(ConfigError, match="serves one process: the prefork pool with 2 child"):
        ThrottleStep(worker)


@pytest.mark.parametrize(
    ("pool", "concurrency"),
    [("solo", 1), ("threads", 8), ("gevent", 100), ("eventlet", 100), ("prefork", 1)],
)
def test_a_one_process_worker_takes_the_memory_limiter(
    app: Celery, pool: str, concurrency: int
) -> None:
    worker = SimpleNamespace(app=app, hostname="w@test", concurrency=concurrency, pool_cls=pool)
    _own_tasks_only(app)
    step = ThrottleStep(worker)
    assert step.in_memory  # no fence, no releaser: nothing is parked in memory
    step.start(worker)
    assert step.releaser is None


def test_a_stopped_worker_step_puts_the_worker_environment_back(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Celery's test worker runs in the test process: the throttlers built after it (a
    # later test's) must not think they run in a worker (the restart fence would stall
    # their first task)
    monkeypatch.delenv(WORKER_ENV)
    monkeypatch.setenv(POOL_ENV, "3")
    worker = SimpleNamespace(app=app, hostname="w@test", concurrency=1, pool_cls="solo")
    _own_tasks_only(app)
    step = ThrottleStep(worker)
    step.start(worker)
    assert os.environ[WORKER_ENV] == str(os.getpid()) and os.environ[POOL_ENV] == "1"
    step.stop(worker)
    assert WORKER_ENV not in os.environ and os.environ[POOL_ENV] == "3"


def test_rebuild_makes_the_next_call_read_the_app_s_conf_again(
    app: Celery, closed_url: str
) -> None:
    first = Throttler.of(app)
    assert first.in_memory
    app.conf.throttle_redis_url = closed_url  # a test's fixture changes the URL...
    assert Throttler.of(app) is first  # ...which the throttler built already does not see
    rebuild(app)
    assert not Throttler.of(app).in_memory  # built again from app.conf (nothing connects)


def _own_tasks_only(app: Celery) -> None:
    """Drop the shared tasks other test modules registered (``@shared_task`` reaches every
    app): their limits are not this app's, and a worker validates every task's."""
    for name in list(app.tasks):
        if not name.startswith(("celery.", __name__)):
            del app.tasks[name]


def test_the_pool_is_named_from_an_alias_or_a_class() -> None:
    from celery.concurrency.solo import TaskPool as Solo  # noqa: PLC0415
    from celery.concurrency.thread import TaskPool as Threads  # noqa: PLC0415

    assert pool_name(SimpleNamespace(pool_cls=Solo)) == "solo"
    assert pool_name(SimpleNamespace(pool_cls=Threads)) == "threads"
    assert pool_name(SimpleNamespace(pool_cls="threads")) == "threads"
    assert pool_name(SimpleNamespace(pool_cls="celery.concurrency.prefork:TaskPool")) == "prefork"


def test_peek_takes_a_limits_name_as_hold_does(app: Celery) -> None:
    @app.task(shared=False)
    @throttled("20/s burst 1", algorithm="gcra")
    def inline() -> None: ...

    limiter = memory_limiter(app)
    assert limiter.peek("five").remaining == 1  # the file's limit, by name
    (own,) = (name for name in limiter.limits if name.endswith("_hold_does.<locals>.inline"))
    assert limiter.peek(own).remaining == 1
    limiter.hold("five", None, 60)
    assert limiter.peek("five").retry_after_s == pytest.approx(60, abs=1)
    with pytest.raises(RequestError, match="unknown limit 'nope': peek needs its rate; known"):
        limiter.peek("nope")


def test_a_task_state_shows_a_plans_limit_once() -> None:
    base = "throttle:{default}:"
    keys: list[bytes | None] = [
        f"{base}tb:openai-tokens:acme".encode(),
        f"{base}tb:openai-tokens.plan:acme".encode(),
        f"{base}gcra:github".encode(),
        None,
    ]
    assert _task_limits(keys, base) == ["openai-tokens", "github"]


def test_a_finished_task_is_told_by_the_result_backend() -> None:
    app = Celery("results", set_as_current=False, backend="cache+memory://")
    app.backend.mark_as_done("done-id", 42)
    app.backend.mark_as_started("running-id")
    assert finished(app, "done-id") == "SUCCESS"
    assert finished(app, "running-id") is None
    assert finished(app, "never-seen") is None
    assert finished(Celery("none", set_as_current=False), "done-id") is None  # no backend


@pytest.mark.parametrize("provider", PROVIDERS)
def test_the_upstream_responses_speak_each_providers_dialect(provider: str) -> None:
    now = 1_800_000_000.0
    response = upstream_response(
        provider, retry_after_s=None, reset_s=30, dimension="tokens", now=now
    )
    signal = read_response(response, now=now)
    assert signal is not None and signal.refused, provider
    assert signal.hold_s == pytest.approx(30, abs=1) or provider == "stripe", signal
    with_retry = read_response(upstream_response(provider, retry_after_s=7, now=now), now=now)
    assert with_retry is not None and with_retry.hold_s == pytest.approx(7, abs=1), provider
    error = UpstreamError(response)
    assert (error.status_code, error.response) == (429, response)
    with pytest.raises(ValueError, match="unknown provider 'acme'; one of generic, openai"):
        upstream_response("acme")


@pytest.mark.parametrize("provider", PROVIDERS)
def test_the_upstream_responses_need_no_http_client(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # requests and httpx are no dependencies: the fallback must work without either
    monkeypatch.setitem(sys.modules, "httpx", None)
    monkeypatch.setitem(sys.modules, "requests", None)
    monkeypatch.setitem(sys.modules, "requests.structures", None)
    now = 1_800_000_000.0
    response = upstream_response(provider, retry_after_s=7, now=now)
    assert response.headers.get("RETRY-AFTER") == "7" or provider == "openai"
    signal = read_response(response, now=now)
    assert signal is not None and signal.refused and signal.hold_s == pytest.approx(7, abs=1)


@pytest.mark.parametrize(
    ("namespace", "settings"),
    [
        pytest.param(None, {}, id="unset"),
        pytest.param(None, {"throttle_enabled": "off"}, id="config-object"),
        pytest.param("CELERY", {"CELERY_THROTTLE_ENABLED": False}, id="django-namespace"),
        pytest.param("CELERY", {"CELERY_BROKER_URL": "memory://"}, id="namespace-unset"),
    ],
)
def test_the_switch_is_read_as_celery_reads_its_settings(
    namespace: str | None, settings: dict[str, Any]
) -> None:
    from throttle.celery.runtime import _setting  # noqa: PLC0415

    app = Celery("switch", set_as_current=False)
    app.config_from_object(SimpleNamespace(**settings), namespace=namespace)
    # As the configuration reads it, before and after a change made at run time (a test
    # that switches throttling off, then on again), and for a setting no map has
    for value in (None, False, True):
        if value is not None:
            app.conf.throttle_enabled = value
        assert _setting(app.conf, "throttle_enabled") == app.conf.get("throttle_enabled")
    assert _setting(app.conf, "throttle_no_such_setting") is None
    assert _setting(app.conf, "task_default_queue") == app.conf.get("task_default_queue")


def test_the_switch_in_the_environment_is_read_as_os_environ_has_it_now(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from throttle.celery.runtime import throttling_enabled  # noqa: PLC0415

    app = Celery("env-switch", set_as_current=False)
    monkeypatch.delenv("THROTTLE_ENABLED", raising=False)
    assert throttling_enabled(app)
    # set, changed and removed at run time (a test's monkeypatch, os.environ itself)
    for value, enabled in (("off", False), ("1", True), (" No ", False)):
        monkeypatch.setenv("THROTTLE_ENABLED", value)
        assert throttling_enabled(app) is enabled, value
    os.environ.pop("THROTTLE_ENABLED")
    assert throttling_enabled(app)
    # and os.environ replaced by another mapping is read through it
    monkeypatch.setattr(os, "environ", {"THROTTLE_ENABLED": "false"})
    assert not throttling_enabled(app)


def test_a_gcra_rate_raised_shortens_the_debt_on_the_memory_limiter_as_in_lua() -> None:
    # The in-memory model of lua/gcra.lua keeps the interval a state was written under, as
    # the script does since a rate raised at run time shortens the debt ahead in proportion
    # (tests/integration/test_limiter.py runs the same sequence on a real Redis).
    now_us = [1_700_000_000_000_000]
    limiter = MemoryLimiter(clock_us=lambda: now_us[0])
    slow = Limit.parse("1/h burst 1", name="github", algorithm="gcra")
    fast = Limit.parse("5000/h burst 10", name="github", algorithm="gcra")
    assert limiter.acquire(slow).allowed
    assert limiter.acquire(slow).retry_after_s == pytest.approx(3600.0)
    assert [limiter.acquire(fast).allowed for _ in range(10)] == [True] * 9 + [False]
    assert limiter.acquire(slow).retry_after_s == pytest.approx(7.2, abs=0.01)


def test_a_key_moved_to_a_faster_plan_keeps_its_calls_not_its_time_in_memory() -> None:
    # docs/tenants.md: a free key that spent its burst of 5 and is upgraded to pro has 45
    # of pro's 50 at once (the in-memory limiter gave it none: it kept the free plan's time)
    limiter = MemoryLimiter(clock_us=lambda: 1_700_000_000_000_000)
    free = Limit.parse("10/s burst 5", name="api", algorithm="gcra")
    pro = Limit.parse("100/s burst 50", name="api", algorithm="gcra")
    assert [limiter.acquire(free, "acme").allowed for _ in range(6)] == [True] * 5 + [False]
    assert sum(limiter.acquire(pro, "acme").allowed for _ in range(50)) == 45


def test_a_fair_limit_s_rate_raised_shortens_its_schedules_on_the_memory_limiter() -> None:
    # lua/fair.lua keeps the interval its schedules were written under ('T') and shortens
    # them in proportion when the rate is raised; its in-memory model now does the same
    now_us = [1_700_000_000_000_000]
    limiter = MemoryLimiter(clock_us=lambda: now_us[0])
    slow = Limit.parse("1/h burst 1", name="f", algorithm="gcra", fair=True)
    fast = Limit.parse("5000/h burst 10", name="f", algorithm="gcra", fair=True)
    assert limiter.acquire(slow, "k").allowed
    assert limiter.acquire(slow, "k").retry_after_s == pytest.approx(3600.0)
    assert [limiter.acquire(fast, "k").allowed for _ in range(10)] == [True] * 9 + [False]
