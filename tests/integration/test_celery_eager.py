"""Eager mode, direct calls and the in-process API of throttle.celery (no worker needed)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from tests.support.clock import redis_now_s
from throttle import BackendUnavailable, ConfigError, Limit, Limiter, ThrottleTimeout
from throttle.celery import ThrottledTask, Throttler, report_cost, slot_time, throttled


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery("eager", set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        task_always_eager=True,
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {
                "five": {"algorithm": "gcra", "rate": "5/s", "burst": 1},
                "hourly": {"algorithm": "gcra", "rate": "1/h", "burst": 1, "max_wait": "1s"},
                "budget": {"rate": "1000/d", "key": "{tenant}", "cost": "estimate"},
            },
            "tasks": {"eager.mapped": ["five"]},
        },
    )
    yield app
    close_throttler(app)


def close_throttler(app: Celery) -> None:
    """Close the connections of the app's throttler, if one was built (the app is dropped
    after the test, and an unclosed socket would warn whenever it is collected)."""
    cached = getattr(app, "_throttler", None)
    if cached is not None:
        cached[1].limiter.client.close()


def count_acquires(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = Limiter.acquire_many

    def spy(self: Limiter, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Limiter, "acquire_many", spy)
    return calls


def test_eager_tasks_wait_for_their_slot_without_spinning(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.task(shared=False)
    @throttled("five")
    def ping(x: int) -> int:
        return x

    calls = count_acquires(monkeypatch)
    started = time.monotonic()
    assert [ping.delay(i).get() for i in range(6)] == list(range(6))
    elapsed = time.monotonic() - started
    # 5/s burst 1: the 6th call comes 1 s after the first, and each call asked Redis once
    # (a reservation and one sleep), not in a loop.
    assert elapsed >= 0.95
    assert calls[0] == 6


def test_a_deadline_in_eager_mode_raises_throttle_timeout(app: Celery) -> None:
    @app.task(shared=False)
    @throttled("hourly")
    def once(x: int) -> int:
        return x

    assert once.delay(1).get() == 1
    started = time.monotonic()
    with pytest.raises(ThrottleTimeout, match="hourly would admit the task in"):
        once.delay(2).get()
    assert time.monotonic() - started < 0.5  # known at once: the slot is an hour away


def test_direct_calls_and_task_names_mapped_in_the_file(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not decorated: the file's `tasks:` maps this task's name to limit "five".
    @app.task(name="eager.mapped", shared=False)
    def mapped(x: int) -> int:
        return x

    calls = count_acquires(monkeypatch)
    assert mapped(1) == 1  # a direct call goes through the limiter too
    assert mapped.apply((2,)).get() == 2
    assert calls[0] == 2


def test_report_cost_settles_the_estimate(
    app: Celery, redis_url: str, prefix: str, client: redis.Redis
) -> None:
    @app.task(shared=False)
    @throttled("budget")
    def call(tenant: str, estimate: int, used: int) -> float | None:
        report_cost(used)
        return slot_time()

    started = redis_now_s(client)
    assert call.delay("acme", 300, 120).get() == pytest.approx(time.time(), abs=1)
    limiter = Throttler.of(app).limiter
    budget = Throttler.of(app).config.rule("budget").limit
    remaining = limiter.acquire(budget, "acme", cost=0).remaining
    # 880 plus what 1000/d refilled meanwhile, on the Redis clock (0.01 per second: more
    # than approx's tolerance after 76 ms, which a loaded host can take)
    refilled = (redis_now_s(client) - started) * 1000 / 86400
    assert 880 - 1e-3 <= remaining <= 880 + refilled + 1e-3


def test_base_class_with_its_own_limits(app: Celery) -> None:
    class Shaped(ThrottledTask):  # type: ignore[misc]
        throttle = ("2/s burst 1",)

    @app.task(base=Shaped, shared=False)
    def shaped(x: int) -> int:
        return x

    started = time.monotonic()
    assert [shaped.delay(i).get() for i in range(3)] == [0, 1, 2]
    assert time.monotonic() - started >= 0.95  # 2/s burst 1: the third at +1 s


def test_outside_a_task_the_function_is_plain_and_report_cost_is_a_no_op() -> None:
    @throttled("10/s")
    def plain(x: int) -> int:
        report_cost(5)
        return x * 2

    assert plain(21) == 42
    assert slot_time() is None
    with pytest.raises(ValueError, match="finite number >= 0"):
        report_cost(-1)


def test_keys_and_costs_from_callables_and_argument_errors(app: Celery) -> None:
    seen: list[str] = []

    def tenant_of(order: dict[str, Any], **_: Any) -> str:
        seen.append(order["tenant"])
        return order["tenant"]

    @app.task(shared=False)
    @throttled("3/h burst 3", key=tenant_of, cost=lambda order, **_: len(order["items"]))
    def place(order: dict[str, Any]) -> int:
        return len(order["items"])

    assert place.delay({"tenant": "acme", "items": [1, 2]}).get() == 2
    assert place.delay({"tenant": "globex", "items": [1, 2, 3]}).get() == 3
    assert seen == ["acme", "globex"]
    limiter = Throttler.of(app).limiter
    rule = _rule_of(place)
    assert limiter.acquire(rule, "acme", cost=0).remaining == pytest.approx(1, abs=0.01)
    assert limiter.acquire(rule, "globex", cost=0).remaining == pytest.approx(0, abs=0.01)

    @app.task(shared=False)
    @throttled("budget")  # key "{tenant}": this task has no such argument
    def keyless(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match=r"limit 'budget': field 'key': the task has no "
                       r"argument 'tenant' for the key template"):  # fmt: skip
        keyless.delay(1).get()


def _rule_of(task: Any) -> Limit:
    spec = task.run.__throttle__
    return spec.rules[0].limit


def test_on_redis_down_allow_runs_and_defer_raises(prefix: str) -> None:
    from tests.support.servers import free_port  # noqa: PLC0415

    app = Celery("down", set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        task_always_eager=True,
        throttle_redis_url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {
                "open": {"rate": "5/s", "on_redis_down": "allow"},
                "closed": {"rate": "5/s"},
            },
        },
    )

    @app.task(shared=False)
    @throttled("open")
    def fail_open(x: int) -> int:
        return x

    @app.task(shared=False)
    @throttled("closed")
    def fail_closed(x: int) -> int:
        return x

    assert fail_open.delay(7).get() == 7
    with pytest.raises(BackendUnavailable, match="Redis is unreachable"):
        fail_closed.delay(7).get()
    close_throttler(app)


def test_waits_held_by_workers_must_stay_under_the_visibility_timeout(app: Celery) -> None:
    # The default settings hold a task up to park_after 1 s + park_lead 0.5 s + sleep_max 1 s
    app.conf.broker_transport_options = {"visibility_timeout": 4}
    with pytest.raises(ConfigError, match=r"held 2.5 s in a worker .* visibility_timeout \(4 s\)"):
        Throttler.from_app(app).check_visibility()
    app.conf.broker_transport_options = {"visibility_timeout": 3600}
    Throttler.from_app(app).check_visibility()


def test_shared_tasks_are_throttled_too(redis_url: str, prefix: str) -> None:
    from celery import shared_task  # noqa: PLC0415
    from celery._state import get_current_app  # noqa: PLC0415

    # A shared task runs on whichever app is current: make a fresh one current.
    previous = get_current_app()
    app = Celery("shared", task_cls=ThrottledTask)
    app.conf.update(throttle_redis_url=redis_url, throttle_config={"settings": {"prefix": prefix}})
    app.set_current()
    try:

        @shared_task(name="eager.shared")
        @throttled("5/s burst 1", algorithm="gcra")
        def shared(x: int) -> int:
            return x

        started = time.monotonic()
        assert [shared.apply((i,)).get() for i in range(3)] == [0, 1, 2]
        assert time.monotonic() - started >= 0.35  # 5/s burst 1: the third at +0.4 s
    finally:
        previous.set_current()
        close_throttler(app)
