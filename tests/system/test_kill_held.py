"""A worker killed (SIGKILL) while it holds throttled tasks that wait for their slots loses
none of them and runs none twice, with ``acks_late`` and without: here on the Redis broker
and a RabbitMQ quorum queue.

The scenario is tests/support/held.py (app: tests/apps/held_app.py): a victim worker takes
a backlog of 20 tasks at 4/s, holds some of them waiting, is killed between two bodies, and
a second worker takes over. Judged on the count of executions per task id once nothing is
left anywhere (broker, parking lot), never on timing. The full matrix (5 pools x 3 brokers
x 2) is ``python -m bench.kill_matrix``; here, for the time ``make test`` may take, the
two green pools, whose consumer has no event loop (``restore_when_idle``).

The gevent case on Redis fails without :func:`throttle.celery.waiting.restore_when_idle`:
the successor received none of the messages the victim held.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.held import (
    CONFIG,
    VISIBILITY_S,
    Case,
    CaseError,
    RedisBroker,
    _producer,
    rabbit_vhost,
    run_case,
)
from tests.support.servers import RedisServer
from tests.support.waits import wait_for
from throttle.limiter import Limiter
from throttle.parking import ParkingLot
from throttle.redis.keys import KeySpace
from throttle.spec import Limit
from workers.harness import Worker, wait_ready

pytestmark = pytest.mark.slow

CASES = [
    Case("gevent", "redis", acks_late=False),
    Case("eventlet", "quorum", acks_late=True),
]
"""Every pool once, every broker with and without ``acks_late``."""


@pytest.fixture(scope="module")
def vhost() -> Iterator[str]:
    """A private RabbitMQ vhost for this module's cases (each declares queues of its own
    name), deleted at the end. RabbitMQ unreachable is a failure, not a skip."""
    try:
        with rabbit_vhost() as url:
            yield url
    except CaseError as exc:
        pytest.fail(str(exc))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_killed_worker_s_waiting_tasks_run_once_each(
    case: Case, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = request.getfixturevalue("vhost") if case.broker != "redis" else None
    # Given a worker holding throttled tasks that wait; when it is killed and another
    # takes over (tests/support/held.py)
    outcome = run_case(case, tmp_path, url)
    # Then every task ran, and none twice
    said = f"{case.id}: {'; '.join(outcome.notes)}"
    assert outcome.lost == [], f"{len(outcome.lost)} never ran: {outcome.lost}; {said}"
    assert outcome.twice == {}, f"runs of the tasks run more than once: {outcome.twice}; {said}"
    assert sorted(outcome.runs) == sorted(outcome.ids)
    # (a body the victim completed may run again if the kill came before its
    # acknowledgement left: Celery's at-least-once, reported, not judged here)
    print(
        f"\n{case.id}: {outcome.ran_before_kill} ran before the kill, {outcome.held_at_kill} "
        f"held; all ran once {outcome.recovered_s:.1f} s after it; "
        f"{len(outcome.rerun_after_body)} ran again after a body on the victim; "
        f"{outcome.publishes_per_task:.2f} publishes per task; {'; '.join(outcome.notes)}"
    )


@pytest.mark.timeout(180)
def test_a_worker_killed_right_after_parking_a_task_runs_it_once(tmp_path: Path) -> None:
    """The parking lot took the task's copy; the worker dies before it acknowledges the
    message it ran (``acks_late``), which the broker delivers again. The copy's number
    must already be recorded then, or the message delivered again is not known to be
    stale and runs beside the parked copy (it did: the number was written by a second
    call, after the park)."""
    config = tmp_path / "limits.yaml"
    config.write_text(CONFIG)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        env = {
            "HELD_BROKER_URL": server.url, "HELD_REDIS_URL": server.url,
            "HELD_QUEUE": "parked-kill", "HELD_ACKS_LATE": "1",
            "HELD_VISIBILITY_S": str(VISIBILITY_S), "THROTTLE_CONFIG": str(config),
        }  # fmt: skip
        module = _producer(env)
        victim = Worker(
            "victim-park", {**env, "HELD_KILL_AFTER_PARK": "1"}, concurrency=1,
            queues="parked-kill", app="tests.apps.held_app", log=tmp_path / "victim.log",
        )  # fmt: skip
        survivor = Worker(
            "survivor-park", env, concurrency=1, queues="parked-kill",
            app="tests.apps.held_app", log=tmp_path / "survivor.log",
        )  # fmt: skip
        broker = RedisBroker(client, server.url, "parked-kill")
        lot = ParkingLot(client, KeySpace())
        try:
            victim.start()
            wait_ready(module.app, [victim])
            # Given a limit whose next free slot is 5 s ahead (20 slots of 4/s booked),
            # beyond the line's budget (1.5 s) and park_after: a task sent now is parked
            limiter = Limiter(client)
            held = Limit.parse("4/s burst 1", name="held", algorithm="gcra")
            for _ in range(20):
                assert limiter.acquire(held, max_wait_s=10).allowed
            task_id = module.call.delay(0).id
            # When its worker dies right after the parking lot took it
            killed = wait_for(lambda: client.lrange("held:killed_after_park", 0, -1), 60, 0.05)
            assert [k.decode() for k in killed] == [task_id]
            assert victim.proc is not None
            victim.proc.wait(30)
            # and another worker takes over (the message comes back after the visibility
            # timeout; the parked copy when it is due)
            survivor.start()
            wait_ready(module.app, [survivor])

            def settled() -> bool:
                ran = int(client.hlen("held:runs")) == 1
                return ran and broker.pending() == (0, 0) and lot.counts() == (0, 0)

            try:
                wait_for(settled, 90, 0.2)
            except TimeoutError:
                left = (client.hgetall("held:runs"), broker.pending(), lot.counts())
                raise AssertionError(f"(runs, broker, parking lot) still {left}") from None
            time.sleep(VISIBILITY_S / 2)  # a copy delivered again late would show now
            runs = {k.decode(): int(v) for k, v in client.hgetall("held:runs").items()}
        finally:
            victim.kill()
            survivor.stop()
            with contextlib.suppress(Exception):
                module.app.close()
            client.close()
    # Then it ran once: the message delivered again was known to be stale
    assert runs == {task_id: 1}
