"""The Celery app of tests/system/test_capacity.py: capacity goes to the tasks that wait in
the worker's consumer as it appears (:mod:`throttle.celery.capacity`). Run by real
``celery worker`` subprocesses.

Settings come from the environment, so that the producer (the test process) and the
workers build the same app: ``CAPACITY_BROKER_URL`` (broker, results and limiter: a
private redis-server) and ``THROTTLE_CONFIG`` (the limits file the test writes). The
visibility timeout is 120 s, so that a task may wait in the line for up to 58.5 s
(:func:`throttle.celery.waiting.line_budget_s`).

Each body appends ``"<tag> <event> <Redis time in s>"`` to the list ``capacity:log`` and
counts itself in ``capacity:done`` (HASH tag -> count): the tests read the order and the
times on the Redis clock, and see a body that ran twice.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from throttle.celery import report_cost, throttled
from throttle.celery.waiting import WaitStep

BROKER = os.environ.get("CAPACITY_BROKER_URL", "redis://127.0.0.1:6379/15")

app = Celery("capacity", broker=BROKER, backend=BROKER)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    task_default_queue="capacity",
    broker_connection_retry_on_startup=True,
    broker_transport_options={"visibility_timeout": 120},
    result_expires=600,
)
app.steps["consumer"].add(WaitStep)

_clients: dict[str, redis.Redis] = {}


def _redis() -> redis.Redis:
    """One connection pool per process (made after the fork, never at import)."""
    client = _clients.get(BROKER)
    if client is None:
        client = _clients[BROKER] = redis.Redis.from_url(BROKER)
    return client


def log(tag: str, event: str) -> None:
    client = _redis()
    seconds, micros = client.time()
    pipe = client.pipeline()
    pipe.rpush("capacity:log", f"{tag} {event} {seconds + micros / 1e6:.6f}")
    if event == "start":
        pipe.hincrby("capacity:done", tag, 1)
    pipe.execute()


# shared=False: these tasks must not join the other test apps of the same pytest process.
@app.task(shared=False)
@throttled("tokens")
def spend(tag: str, cost: float, used: float, hold_s: float) -> None:
    """Under ``tokens`` (a token bucket, ``cost`` tokens reserved): holds ``hold_s``, then
    reports ``used`` tokens; the gap is refunded when the task settles, after the body."""
    log(tag, "start")
    time.sleep(hold_s)
    report_cost(used)
    log(tag, "end")


@app.task(shared=False)
@throttled("rated")
def rated(tag: str) -> None:
    """Under ``rated`` (a token bucket of 2/m, burst 1: raised at run time by the test)."""
    log(tag, "start")


@app.task(shared=False)
@throttled("learner")
def learner(tag: str) -> None:
    """Under ``learner`` (an adaptive token bucket: its learned rate set by the test)."""
    log(tag, "start")


@app.task(shared=False)
@throttled("ordered")
def ordered(tag: str) -> None:
    """Under ``ordered`` (GCRA, one call per 5 s: longer than ``sleep_max``, so that a
    second task waits in the line, reserving nothing)."""
    log(tag, "start")


@app.task(shared=False)
@throttled("units")
def held(tag: str, hold_s: float) -> None:
    """Under ``units`` (2 concurrent, no task time limit: a unit's lease is 360 s):
    holds its unit ``hold_s``."""
    log(tag, "start")
    time.sleep(hold_s)
    log(tag, "end")


@app.task(shared=False)
@throttled("paced", "units")
def paced_units(tag: str, hold_s: float) -> None:
    """Under ``paced`` (GCRA 5/s, burst 1) and ``units`` (2 concurrent): holds its unit
    ``hold_s``."""
    log(tag, "start")
    time.sleep(hold_s)
    log(tag, "end")


@app.task(shared=False)
@throttled("shared")
def shared_fairly(tenant: str, tag: str) -> None:
    """Under ``shared`` (2/s, fair among its tenants): logs its start under its tenant."""
    log(tenant, "start")
    log(tenant, "end")
