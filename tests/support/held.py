"""A worker killed while it holds throttled tasks that wait for their slots: the scenario of
tests/system/test_kill_held.py (one case per pool) and bench/kill_matrix.py (every pool x
broker x ``acks_late``), with the app tests/apps/held_app.py.

The scenario, judged on the messages' outcome only (where and how a task waits is not
looked at, so that it holds however the waiting is built):

1. One worker (the victim) consumes a backlog of :data:`TASKS` tasks under a limit of
   :data:`RATE` per second (GCRA, burst 1): seconds of waiting, far more than its pool.
2. Once :data:`RUN_BEFORE_KILL` of them have run and the victim holds at least
   :data:`HELD_AT_KILL` waiting tasks (``celery inspect scheduled``: unacknowledged
   messages, held as Celery holds its ETA tasks), the victim is killed with SIGKILL, main
   process and pool children, half a slot after a body ended. Each body is one
   ``HINCRBY``, and the consumer's loop sends its acknowledgement within milliseconds, so
   the kill lands between bodies and their acknowledgements: what Celery itself does with
   a task killed mid-body (run again with ``acks_late``, lost without) or between its
   body and its acknowledgement (run again) is not what is measured.
3. A second worker (same pool) starts and takes over: RabbitMQ gives the dropped
   connection's messages back at once; the Redis transport once they are
   ``visibility_timeout`` old.
4. Judged once every task ran and the broker and the parking lot are empty (nothing left
   that could run a task again), after a grace: each task id ran exactly once. A task
   whose body the victim had completed and that ran again is counted apart
   (:attr:`Outcome.rerun_after_body`): its acknowledgement had not left when the victim
   died, which is Celery's at-least-once, not a waiting task run twice.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from kombu import Connection

from tests.support.publishes import publishes_of
from tests.support.servers import RedisServer
from tests.support.waits import wait_for
from throttle.parking import ParkingLot
from throttle.redis.keys import KeySpace
from workers.harness import Worker, wait_ready

AMQP = "amqp://guest:guest@127.0.0.1:5672"
RATE = 4.0
"""The limit ``held``: calls per second (GCRA, burst 1)."""
TASKS = 20
"""The backlog: 5 s at :data:`RATE`."""
RUN_BEFORE_KILL = 3
HELD_AT_KILL = 2
"""How many waiting tasks the victim must hold (Celery's ``inspect scheduled``) shortly
before it is killed."""
VISIBILITY_S = 6.0
"""The Redis transport's visibility timeout, in s. A task waits in a worker at most
``park_after`` + ``park_lead`` + ``sleep_max`` = 3 s below, within half of it (the
worker's start-up check)."""
CONFIG = """
settings:
  refresh: 0.5s
  sleep_max: 1s
  park_after: 1.5s
  park_lead: 0.5s
limits:
  held: {algorithm: gcra, rate: 4/s, burst: 1}
"""
CONCURRENCY = {"prefork": 2, "threads": 4, "gevent": 8, "eventlet": 8, "solo": 1}
"""Pool slots per pool: fewer than the backlog in every case, so that tasks wait."""
GRACE_S = 1.5
"""How long the counts must stay put once nothing is left anywhere, in s."""
TIMEOUT_S = float(os.environ.get("HELD_TIMEOUT_S", "60"))
"""How long every task may take to run after the kill, in s."""


class CaseError(AssertionError):
    """The scenario could not be set up as described (not a verdict on the throttler)."""


def rabbitmqctl(*args: str) -> str:
    """Run ``rabbitmqctl`` (RabbitMQ's own CLI: the vhosts here are ours alone)."""
    if shutil.which("rabbitmqctl") is None:
        raise CaseError("rabbitmqctl is not installed: the RabbitMQ cases need the service")
    done = subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise CaseError(
            f"rabbitmqctl {' '.join(args)} failed ({done.returncode}): is RabbitMQ running at "
            f"127.0.0.1:5672? {done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout


@contextlib.contextmanager
def rabbit_vhost(prefix: str = "throttle-held") -> Iterator[str]:
    """A private vhost on the RabbitMQ service (guest may do anything there), deleted at
    the end; yields its broker URL."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", name)
    try:
        rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
        url = f"{AMQP}/{name}"
        with Connection(url, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=2)
        yield url
    finally:
        rabbitmqctl("delete_vhost", name)


@dataclass(frozen=True)
class Case:
    """One cell of the matrix: an execution pool, a broker, late acknowledgement or not."""

    pool: str
    broker: str  # "redis", "classic" or "quorum" (RabbitMQ queue types)
    acks_late: bool

    @property
    def id(self) -> str:
        return f"{self.pool}-{self.broker}-{'acks_late' if self.acks_late else 'early_ack'}"


@dataclass
class Outcome:
    """What a case did: runs and publishes per task id, and how long the phases took (s)."""

    case: Case
    runs: dict[str, int]
    publishes: dict[str, int]
    """Messages published per task id: the producer's one plus the workers' (re-publishes,
    releases from parking)."""
    ids: list[str]
    held_at_kill: int
    """Tasks the victim held, waiting, shortly before it died (``inspect scheduled``)."""
    ran_before_kill: int
    took_s: float
    recovered_s: float
    """From the kill until every task had run."""
    notes: list[str] = field(default_factory=list)

    @property
    def lost(self) -> list[str]:
        return [i for i in self.ids if self.runs.get(i, 0) == 0]

    ran_on_victim: set[str] = field(default_factory=set)
    """Tasks whose body the victim completed (before it was killed)."""

    @property
    def twice(self) -> dict[str, int]:
        """Tasks run more than once whose body the victim had not completed: a copy made
        while the task waited (a re-publish or a park whose original came back too)."""
        return {i: n for i, n in self.runs.items() if n != 1 and i not in self.ran_on_victim}

    @property
    def rerun_after_body(self) -> dict[str, int]:
        """Tasks run again after the victim completed their body: killed after the body and
        before the consumer's loop sent the acknowledgement (Celery's at-least-once with
        ``acks_late``; the solo pool sends an early one only when the task returns, too)."""
        return {i: n for i, n in self.runs.items() if n != 1 and i in self.ran_on_victim}

    @property
    def publishes_per_task(self) -> float:
        return sum(self.publishes.get(i, 0) for i in self.ids) / len(self.ids)


class Broker:
    """The broker of a case, as seen from outside the workers."""

    url: str

    def pending(self) -> tuple[int, int]:
        """(ready, delivered but unacknowledged) messages, over every queue of the case."""
        raise NotImplementedError


class RedisBroker(Broker):
    """kombu's Redis transport: each queue a list (a key per priority step), and the
    delivered, unacknowledged messages in the ``unacked`` hash."""

    def __init__(self, client: redis.Redis, url: str, queue: str) -> None:
        self.client, self.url, self.queue = client, url, queue

    def pending(self) -> tuple[int, int]:
        ready = sum(
            int(self.client.llen(key))
            for key in self.client.scan_iter(match=f"{self.queue}*", _type="list")
        )
        return ready, int(self.client.hlen("unacked"))


class RabbitBroker(Broker):
    """A private vhost: the case's queue and its lane, and the delayed-delivery queues
    Celery uses for countdowns when it knows a quorum queue (``celery_delayed_*``); not
    Celery's control queues (a dead worker's broadcast queue keeps what was broadcast)."""

    def __init__(self, url: str, queue: str) -> None:
        self.url, self.vhost, self.queue = url, url.rsplit("/", 1)[1], queue

    def pending(self) -> tuple[int, int]:
        out = rabbitmqctl(
            "list_queues", "-p", self.vhost, "-q", "--no-table-headers",
            "name", "messages_ready", "messages_unacknowledged",
        )  # fmt: skip
        ready = unacked = 0
        for line in out.splitlines():
            parts = line.split("\t")
            if len(parts) == 3 and parts[0].startswith((self.queue, "celery_delayed_")):
                ready += int(parts[1])
                unacked += int(parts[2])
        return ready, unacked


def run_case(case: Case, tmp: Path, rabbit_url: str | None = None) -> Outcome:
    """Run one case (see the module) in ``tmp`` (logs, limits file); ``rabbit_url``: a
    private vhost (:func:`rabbit_vhost`) for the RabbitMQ cases, whose queues get names
    of their own."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "limits.yaml"
    config.write_text(CONFIG)
    queue = f"held-{uuid.uuid4().hex[:8]}"
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        try:
            broker: Broker
            if case.broker == "redis":
                broker = RedisBroker(client, server.url, queue)
            else:
                if rabbit_url is None:
                    raise CaseError(f"case {case.id} needs a RabbitMQ vhost")
                broker = RabbitBroker(rabbit_url, queue)
            env = {
                "HELD_BROKER_URL": broker.url,
                "HELD_REDIS_URL": server.url,
                "HELD_QUEUE": queue,
                "HELD_QUORUM": "1" if case.broker == "quorum" else "0",
                "HELD_ACKS_LATE": "1" if case.acks_late else "0",
                "HELD_VISIBILITY_S": str(VISIBILITY_S),
                "THROTTLE_CONFIG": str(config),
            }
            return _run(case, tmp, env, broker, client)
        finally:
            client.close()


def _producer(env: dict[str, str]) -> Any:
    """The app as the workers build it (tests/apps/held_app.py reads its environment at
    import: imported afresh for each case)."""
    import importlib  # noqa: PLC0415
    import sys  # noqa: PLC0415

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        sys.modules.pop("tests.apps.held_app", None)
        return importlib.import_module("tests.apps.held_app")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run(
    case: Case, tmp: Path, env: dict[str, str], broker: Broker, client: redis.Redis
) -> Outcome:
    module = _producer(env)
    app = module.app
    worker_env = {**env, "HELD_COUNT_PUBLISHES": "1"}

    def worker(name: str) -> Worker:
        return Worker(
            f"{name}-{case.id}", worker_env, concurrency=CONCURRENCY[case.pool],
            queues=env["HELD_QUEUE"], app="tests.apps.held_app",
            log=tmp / f"{name}.log", pool=case.pool,
        )  # fmt: skip

    victim, survivor = worker("victim"), worker("survivor")
    lot = ParkingLot(client, KeySpace())
    notes: list[str] = []
    started = time.monotonic()
    try:
        victim.start()
        wait_ready(app, [victim])
        handles = [module.call.delay(n) for n in range(TASKS)]
        ids = [h.id for h in handles]

        def ran() -> int:
            return int(client.hlen("held:runs"))

        # Given a victim that has run a few tasks and holds some of the rest, waiting
        wait_for(lambda: ran() >= RUN_BEFORE_KILL, 60, 0.01)
        held = wait_for(lambda: _holding(app, victim.hostname, ran), 30, 0.0)
        # When it is killed between two bodies: half a slot after one ended (its
        # acknowledgement, sent by the consumer's loop within milliseconds, is out; the
        # next task is handed to the pool just before its slot, half a slot later)
        before = ran()
        wait_for(lambda: ran() > before, 30, 0.002)
        time.sleep(0.5 / RATE)
        victim.kill()
        killed_at = time.monotonic()
        ran_before_kill = ran()
        after_kill = broker.pending()
        notes.append(f"broker (ready, unacked) just after the kill: {after_kill}; logs in {tmp}")
        if ran_before_kill >= TASKS:
            raise CaseError(f"{case.id}: every task ran before the kill; nothing was held")
        # Then a second worker takes over and every task runs
        survivor.start()
        wait_ready(app, [survivor])
        try:
            wait_for(lambda: ran() >= TASKS, TIMEOUT_S, 0.05)
        except TimeoutError:  # judged below: the tasks that never ran are lost
            notes.append(
                f"not every task ran {TIMEOUT_S:g} s after the kill: broker (ready, unacked) "
                f"{broker.pending()}, parking lot (parked, claimed) {lot.counts()}; logs in {tmp}"
            )
        recovered_s = time.monotonic() - killed_at
        # and once nothing is left anywhere (broker, parking lot), the counts stay put
        wait_for(lambda: broker.pending() == (0, 0) and lot.counts() == (0, 0), 60, 0.2)
        time.sleep(GRACE_S)
        left = broker.pending(), lot.counts()
        assert left == ((0, 0), (0, 0)), f"{case.id}: messages came back in the grace: {left}"
        runs = {k.decode(): int(v) for k, v in client.hgetall("held:runs").items()}
        publishes = publishes_of(client, ids)
        on_victim = {
            i for i in ids
            if victim.hostname.encode() in client.lrange(f"held:by:{i}", 0, -1)
        }  # fmt: skip
        return Outcome(
            case, runs, publishes, ids, held, ran_before_kill,
            time.monotonic() - started, recovered_s, notes, on_victim,
        )  # fmt: skip
    finally:
        victim.kill()
        survivor.stop()
        cached = getattr(app, "_throttler", None)
        if cached is not None:  # the producer's (its publishes are stamped on Redis time)
            cached[1].limiter.client.close()
        with contextlib.suppress(Exception):
            app.close()


def _holding(app: Any, hostname: str, ran: Callable[[], int]) -> int:
    """How many tasks the victim holds, waiting (Celery's ``inspect scheduled``: held for a
    time, as its own ETA tasks are) once at least :data:`HELD_AT_KILL`, else 0."""
    if ran() >= TASKS:
        raise CaseError("every task ran before the victim was seen holding any")
    replies = app.control.inspect(destination=[hostname], timeout=1.0, limit=1).scheduled()
    held = len((replies or {}).get(hostname) or [])
    return held if held >= HELD_AT_KILL else 0
