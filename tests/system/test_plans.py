"""Plans with a real ``celery worker``: each tenant's tasks run at its plan's rate, and a
rate set for one key at run time reaches the worker (started on the Redis clock)."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from tests.support.servers import RedisServer
from throttle import KeySpace, Limit
from throttle.rates import RateBook
from workers.harness import Worker, running

TASKS = 10


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, redis.Redis]]:
    tmp = tmp_path_factory.mktemp("plans")
    with RedisServer() as server:
        env = {"PLANS_BROKER_URL": server.url}
        os.environ.update(env)
        from tests.apps.plans_app import app  # noqa: PLC0415

        app.conf.broker_url = app.conf.result_backend = server.url
        worker = Worker("p1", env, app="tests.apps.plans_app", log=tmp / "p1.log")
        client = redis.Redis.from_url(server.url)
        try:
            with running(app, [worker]):
                yield app, client
        finally:
            client.close()
            os.environ.pop("PLANS_BROKER_URL", None)


def starts(client: redis.Redis, tenant: str) -> list[float]:
    return sorted(float(x) for x in client.lrange(f"test:plans:{tenant}", 0, -1))


def run(app: Any, client: redis.Redis, sends: list[tuple[str, str]]) -> None:
    results = [app.tasks["tests.apps.plans_app.call"].delay(t, p) for t, p in sends]
    for result in results:
        result.get(timeout=60)


def test_each_tenant_runs_at_its_plan_s_rate_and_a_key_s_own_rate_reaches_the_worker(
    fleet: tuple[Any, redis.Redis],
) -> None:
    app, client = fleet
    # Given two tenants on plans 5/s and 50/s (burst 1), each sending 10 tasks at once
    # (one after the other: on 4 prefork children, a's tasks sleeping to their slots would
    # hold the pool slots b's need, a matter of where tasks wait, not of plans)
    run(app, client, [("b", "pro")] * TASKS)
    run(app, client, [("a", "free")] * TASKS)
    free, pro = starts(client, "a"), starts(client, "b")
    assert len(free) == len(pro) == TASKS
    # Then a's tasks start 0.2 s apart (its plan's spacing, less the 20 ms a task may
    # start late or early on the Redis clock), b's ten times closer
    assert min(y - x for x, y in itertools.pairwise(free)) >= 0.2 - 0.03
    assert free[-1] - free[0] >= 9 * 0.2 - 0.05
    assert pro[-1] - pro[0] < 9 * 0.2 / 3
    # When a is given 25/s of its own at run time (what `set api 25/s --key a` does)
    RateBook(client, KeySpace()).set_key(Limit.parse("2/s", name="api"), "a", "25/s")
    time.sleep(0.5 + 0.5)  # settings.refresh, and a margin for the worker's cache
    client.delete("test:plans:a")
    run(app, client, [("a", "free")] * TASKS)
    # Then its next tasks run at 25/s (burst 1: no burstier than its plan), not 5/s
    again = starts(client, "a")
    assert len(again) == TASKS
    assert again[-1] - again[0] < 9 * 0.2 / 2
    assert min(y - x for x, y in itertools.pairwise(again)) >= 0.04 - 0.03
