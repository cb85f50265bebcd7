"""``kill -9`` in the middle of throttled tasks, with real ``celery worker`` subprocesses and
a private redis-server as broker, result backend and limiter (app: tests/apps/kill_app.py).

What must hold after a crash: the message comes back (``acks_late`` and
``task_reject_on_worker_lost``; after a whole worker dies, only once the visibility timeout
has passed), the body completes once, the task pays its cost reservation once (the
redelivered task finds its lease by task id), and the concurrency unit comes back.

"Twice" means a body that *completed* twice. A body killed mid-way has run partially: it
started, did not finish, and runs again from the start on redelivery (at-least-once): its
start count is 2, its completion count 1.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.servers import RedisServer
from tests.support.waits import wait_for
from throttle import Limit, Limiter
from throttle.redis.keys import KeySpace
from workers.harness import Worker, running

VISIBILITY_S = 10.0
# Held in a worker at most park_after + park_lead + sleep_max = 2.5 s: within half the
# visibility timeout, as the worker requires.
CONFIG = """
settings:
  refresh: 0.5s
  sleep_max: 0.5s
  park_after: 1.5s
  park_lead: 0.5s
limits:
  slots: {rate: 4 concurrent}
  tokens: {rate: 1000/d, key: "{run}", cost: estimate}
  soak: {algorithm: gcra, rate: 100/s}
"""
SLOTS = Limit.parse("4 concurrent", name="slots")
TOKENS = Limit.parse("1000/d", name="tokens")
# The lease of an acquisition after its slot: task_time_limit (20 s) + 60 s; the slot is at
# most sleep_max (0.5 s) ahead for these tasks.
LEASE_S = 20 + 60 + 0.5


class Fleet:
    def __init__(self, server: RedisServer, tmp: Path) -> None:
        config = tmp / "limits.yaml"
        config.write_text(CONFIG)
        self.env = {
            "KILL_BROKER_URL": server.url,
            "THROTTLE_CONFIG": str(config),
            "KILL_VISIBILITY_S": str(VISIBILITY_S),
        }
        self.workers = [
            Worker(name, self.env, concurrency=2, queues="kill", app="tests.apps.kill_app",
                   log=tmp / f"{name}.log")
            for name in ("wa", "wb")
        ]  # fmt: skip
        self.client = redis.Redis.from_url(server.url, decode_responses=True)
        self.limiter = Limiter(redis.Redis.from_url(server.url))
        self.conc_keys = KeySpace().state_keys(SLOTS, None)

    def count(self, what: str, task_id: str) -> int:
        return int(self.client.hget(f"kill:{what}", task_id) or 0)

    def starts_at(self, task_id: str) -> list[float]:
        return [float(x) for x in self.client.lrange(f"kill:at:{task_id}", 0, -1)]

    def where(self, task_id: str) -> tuple[int, str] | None:
        value = self.client.hget("kill:where", task_id)
        if value is None:
            return None
        pid, host = value.split(" ", 1)
        return int(pid), host

    def holders(self) -> list[str]:
        """The holders of ``slots`` units that are alive by the Redis clock."""
        seconds, micros = self.client.time()
        now_us = seconds * 1_000_000 + micros
        return list(self.client.zrangebyscore(self.conc_keys[0], now_us, "+inf"))

    def units(self) -> float:
        return float(self.client.hget(self.conc_keys[1], "t") or 0)

    def tokens_left(self, run: str) -> float:
        return self.limiter.peek(TOKENS, run).remaining

    def lease_ttl_s(self, task_id: str) -> float:
        return self.client.pttl(KeySpace().lease_key(task_id)) / 1000


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("kill")
    with RedisServer() as server:
        fleet = Fleet(server, tmp)
        # The test process is the producer: it imports the same app with the same settings.
        os.environ.update(fleet.env)
        from tests.apps.kill_app import app  # noqa: PLC0415

        app.conf.broker_url = app.conf.result_backend = server.url
        try:
            with running(app, fleet.workers, kill=True):
                yield fleet
        finally:
            fleet.client.close()
            fleet.limiter.client.close()
            for name in fleet.env:
                os.environ.pop(name, None)


def test_a_killed_pool_child_runs_again_once_and_pays_once(fleet: Fleet) -> None:
    from tests.apps.kill_app import work  # noqa: PLC0415

    # Given a task that holds a slot and 100 reserved tokens, in the middle of its body
    handle = work.delay("child", 0, estimate=100, actual=40, seconds=2.0)
    pid, _ = wait_for(lambda: fleet.where(handle.id), 20)
    assert fleet.holders() == [handle.id]
    assert fleet.tokens_left("child") == pytest.approx(900, abs=1)
    # When its pool child is killed (SIGKILL: no settle, no ack)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    # Then the message is requeued at once (reject_on_worker_lost) and the body runs again
    result = handle.get(timeout=30)
    starts = fleet.starts_at(handle.id)
    assert len(starts) == 2 and result["pid"] != pid
    redelivered_after_s = starts[1] - killed_at
    assert redelivered_after_s < VISIBILITY_S, redelivered_after_s
    # and completes once
    assert fleet.count("done", handle.id) == 1
    # and pays once: the estimate was reserved once and settled at the reported 40 (a second
    # acquisition would have taken another 100, kept as the given-up slot's cost)
    assert fleet.tokens_left("child") == pytest.approx(960, abs=1)
    # and the unit came back when the redelivered task settled, not by the lease's TTL
    assert fleet.holders() == [] and fleet.units() == 0
    back_after_s = time.time() - killed_at
    assert back_after_s < LEASE_S / 2
    # while the settled lease record stays until its TTL (so a late copy finds it)
    assert 0 < fleet.lease_ttl_s(handle.id) <= LEASE_S
    print(
        f"\nkilled child: redelivered after {redelivered_after_s:.2f} s, "
        f"unit back after {back_after_s:.2f} s (lease TTL {LEASE_S:g} s)"
    )


def test_a_rate_limited_task_s_lease_ends_with_its_time_limit(fleet: Fleet) -> None:
    # Given a task throttled only by a rate (GCRA), which may reserve a slot up to a day ahead
    from tests.apps.kill_app import tick  # noqa: PLC0415

    handle = tick.delay(0)
    wait_for(lambda: fleet.client.hget("soak:done", handle.id), 20)
    # Then its lease record lives for its time limit + 60 s after its slot, not a day: a
    # record per task for a day would hold millions of keys at a few hundred tasks a second
    assert 0 < fleet.lease_ttl_s(handle.id) <= LEASE_S


def test_a_killed_worker_s_tasks_return_after_the_visibility_timeout(fleet: Fleet) -> None:
    from tests.apps.kill_app import work  # noqa: PLC0415

    victim, survivor = fleet.workers
    # Given six tasks on two workers of two children each, two of them running on the victim
    handles = [work.delay("worker", n, estimate=100, actual=40, seconds=2.5) for n in range(6)]

    def on_victim() -> list[str]:
        found = [h.id for h in handles if (fleet.where(h.id) or (0, ""))[1] == victim.hostname]
        return found if len(found) == 2 else []

    killed = wait_for(on_victim, 30)
    assert set(killed) <= set(fleet.holders())
    # When the whole worker is killed (main process and pool children, SIGKILL)
    victim.kill()
    killed_at = time.time()
    # Then every task completes, on the survivor, each body once
    results = [h.get(timeout=45) for h in handles]
    assert sorted(r["n"] for r in results) == list(range(6))
    assert [fleet.count("done", h.id) for h in handles] == [1] * 6
    # the killed ones ran partially once, then again after the visibility timeout
    for task_id in killed:
        first, second = fleet.starts_at(task_id)
        assert second - first >= VISIBILITY_S - 0.5, (first, second)
        where = fleet.where(task_id)
        assert where is not None and where[1] == survivor.hostname, where
    assert sum(len(fleet.starts_at(h.id)) for h in handles) == 6 + 2
    # each paid once (6 x 40 of 1000), and the units are all back
    assert fleet.tokens_left("worker") == pytest.approx(1000 - 6 * 40, abs=1)
    assert fleet.holders() == [] and fleet.units() == 0
    # and every lease record expires on its own
    ttls = [fleet.lease_ttl_s(h.id) for h in handles]
    assert all(0 < ttl <= LEASE_S for ttl in ttls), ttls
    waited = max(fleet.starts_at(t)[1] for t in killed) - killed_at
    print(f"\nkilled worker: its tasks restarted {waited:.2f} s after the kill "
          f"(visibility_timeout {VISIBILITY_S:g} s)")  # fmt: skip
