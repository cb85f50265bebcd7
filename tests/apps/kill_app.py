"""The Celery app of the crash tests (tests/system/test_kill.py) and the soak run (bench/soak.py),
run by real ``celery worker`` subprocesses that the tests kill with SIGKILL.

Settings come from the environment, so that the producer (the test process) and the
workers build the same app:

* ``KILL_BROKER_URL``: broker, result backend and limiter (a private redis-server);
* ``THROTTLE_CONFIG``: the limits file, written by the test or the benchmark;
* ``KILL_VISIBILITY_S``: the Redis transport's visibility timeout, in s (default 8).

Crash recovery rests on three settings: ``task_acks_late`` (the message is acked when the
task ends, not when it starts), ``task_reject_on_worker_lost`` (a killed pool child's
message is requeued, not acked), and a short ``visibility_timeout``: after a whole worker is
killed, its unacked messages go back to the queue only once they are that old, and only when
a live worker sweeps for them (``unacked_restore_interval`` x ``unacked_restore_throttle``
seconds apart: 100 s by kombu's defaults, 1 s here).

Each body counts itself in Redis (``kill:starts`` and ``kill:done``: HASH task id -> count)
so the tests see a body that started twice or completed twice.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import redis
from celery import Celery

from throttle.celery import ThrottledTask, install, report_cost, throttled

BROKER = os.environ.get("KILL_BROKER_URL", "redis://127.0.0.1:6379/15")
# The soak counts its 100,000 executions in a Redis of its own, so that the broker's key
# count and memory show the fleet's footprint only.
COUNT_URL = os.environ.get("KILL_COUNT_URL", BROKER)
VISIBILITY_S = float(os.environ.get("KILL_VISIBILITY_S", "8"))

app = Celery("kill", broker=BROKER, backend=BROKER, task_cls=ThrottledTask)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    task_default_queue="kill",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    # The lease of a task's acquisition is its hard time limit + wait + 60 s
    # (throttle.celery.deadlines.lease_s): a short limit keeps the tests' leases short.
    task_time_limit=20,
    broker_transport_options={
        "visibility_timeout": VISIBILITY_S,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    result_expires=600,
)
install(app)

_clients: dict[str, redis.Redis] = {}


def _redis(url: str = BROKER) -> redis.Redis:
    """One connection pool per pool child (made after the fork, never at import)."""
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url)
    return client


# shared=False: these tasks must not join the other test apps of the same pytest process.
@app.task(bind=True, shared=False)
@throttled("slots", "tokens")
def work(self: Any, run: str, n: int, estimate: int, actual: int, seconds: float) -> dict[str, Any]:
    """Holds a concurrency unit of ``slots`` and ``estimate`` tokens of ``tokens`` (key
    ``run``) while it sleeps ``seconds``, then reports ``actual`` tokens (the rest is
    refunded)."""
    client, task_id = _redis(), self.request.id
    pipe = client.pipeline()
    pipe.hincrby("kill:starts", task_id, 1)
    # Where the body runs: the test kills this pool child, or this worker.
    pipe.hset("kill:where", task_id, f"{os.getpid()} {self.request.hostname}")
    pipe.rpush(f"kill:at:{task_id}", time.time())
    pipe.execute()
    time.sleep(seconds)
    report_cost(actual, limit="tokens")
    client.hincrby("kill:done", task_id, 1)
    return {"n": n, "pid": os.getpid(), "host": socket.gethostname()}


@app.task(bind=True, ignore_result=True, shared=False)
@throttled("soak")
def tick(self: Any, n: int) -> None:
    """The soak's task: almost no work, so the limiter and the fleet are what is measured.
    Counts each completed body per task id (HINCRBY: a count of 2 is a double execution);
    no result is stored, so that the broker's keys go back to their baseline."""
    _redis(COUNT_URL).hincrby("soak:done", self.request.id, 1)
