"""``on_redis_down: local`` in a pool of threads: the threads of one process share its
buckets, so a thread may wake to find the tokens it slept for taken by another. It must
not sleep again past ``sleep_max`` (and so past the outage's end, calling on a local token
next to what Redis admits again): beyond it, the task is deferred."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from throttle.celery import redis_down
from throttle.celery.outage import OutageWatch
from throttle.config import ThrottleConfig
from throttle.errors import BackendUnavailable

SLEEP_MAX_S = 0.3


class Deferred(Exception):
    pass


def _execution(config: ThrottleConfig) -> Any:
    settings = config.settings
    watch = OutageWatch(settings, on_recovery=lambda: None, count_fleet=lambda: 1)
    throttler = SimpleNamespace(
        watch=watch,
        settings=settings,
        observer=SimpleNamespace(redis_error=list),
    )

    def fn() -> None:
        return None

    return SimpleNamespace(
        throttler=throttler, settings=settings, rules=(config.rules["api"],), fn=fn,
        args=(), kwargs={}, eager=False,
    )  # fmt: skip


def test_threads_sharing_local_buckets_never_sleep_past_sleep_max(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given a local limit of 1 call per 0.25 s (burst 1) shared by one process's threads,
    when four threads meet the outage together, then one runs at once, one after a
    quarter second, and the others, whose tokens another thread took while they slept, are
    deferred by sleep_max (0.3 s) rather than sleeping on."""
    monkeypatch.delenv("THROTTLE_POOL_SIZE", raising=False)
    monkeypatch.delenv("THROTTLE_WORKER_ID", raising=False)
    config = ThrottleConfig.from_mapping(
        {
            "settings": {"fleet_workers": 1, "sleep_max": SLEEP_MAX_S},
            "limits": {"api": {"rate": "4/s", "burst": 1, "on_redis_down": "local"}},
        }
    )

    def defer(execution: Any, exc: Exception, countdown_s: float) -> None:
        raise Deferred(countdown_s)

    monkeypatch.setattr(redis_down, "defer_down", defer)
    execution = _execution(config)
    exc = BackendUnavailable("Redis is unreachable: test")
    outcomes: list[tuple[str, float]] = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def one() -> None:
        start.wait()
        began = time.monotonic()
        try:
            redis_down.run_while_down(execution, exc)
            outcome = "ran"
        except Deferred:
            outcome = "deferred"
        with lock:
            outcomes.append((outcome, time.monotonic() - began))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(o for o, _ in outcomes) == ["deferred", "deferred", "ran", "ran"]
    # Nobody waited in the gate longer than sleep_max (plus scheduling noise).
    assert max(s for _, s in outcomes) < SLEEP_MAX_S + 0.1
