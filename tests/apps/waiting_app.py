"""The Celery app of tests/system/test_waiting.py: throttled tasks wait in the worker's
consumer, not in a pool slot. Run by real ``celery worker`` subprocesses (``-c 1``, every
pool).

Settings come from the environment, so that the producer (the test process) and the
workers build the same app: ``WAITING_BROKER_URL`` (broker, results and limiter: a private
redis-server), ``THROTTLE_CONFIG`` (the limits file the test writes) and
``WAITING_VISIBILITY_S`` (the Redis transport's visibility timeout, s).

Each body appends ``"<tag> <Redis time in s>"`` to the list ``waiting:log``, and counts
itself in ``waiting:done`` (HASH tag -> count), so that the tests read the order of the
calls on the Redis clock and see a body that ran twice.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery, signals

from throttle.celery import report_cost, slot_time, throttled
from throttle.celery.steps import LaneStep, ThrottleStep
from throttle.celery.waiting import WaitStep

BROKER = os.environ.get("WAITING_BROKER_URL", "redis://127.0.0.1:6379/15")
VISIBILITY_S = float(os.environ.get("WAITING_VISIBILITY_S", "8"))

app = Celery("waiting", broker=BROKER, backend=BROKER)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    task_default_queue="waiting",
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": VISIBILITY_S,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    result_expires=600,
)
# The step under test alone: install(app) would also run the releaser of parked tasks,
# whose polls (a script call every 0.25 s) would blur the tests' count of script calls per
# task; a test whose tasks are parked asks for it (WAITING_RELEASE).
app.steps["consumer"].add(WaitStep)
if os.environ.get("WAITING_RELEASE"):  # and the lanes, where released tasks come back
    app.steps["worker"].add(ThrottleStep)
    app.steps["consumer"].add(LaneStep)

_clients: dict[str, redis.Redis] = {}


def _redis() -> redis.Redis:
    """One connection pool per process (made after the fork, never at import)."""
    client = _clients.get(BROKER)
    if client is None:
        client = _clients[BROKER] = redis.Redis.from_url(BROKER)
    return client


_started: dict[str, float] = {}


@signals.task_prerun.connect
def _on_prerun(task_id: str = "", **kwargs: Any) -> None:
    """When the pool child starts the task (before the throttler's gate), this host's
    clock: the gate's sleep to the slot is ``slot_time()`` minus this."""
    _started[task_id] = time.time()


def _log(tag: str, task_id: str | None = None) -> None:
    """Log the body's start; with ``task_id``, also how long the pool child slept before
    the slot (s, this host's clock)."""
    client = _redis()
    seconds, micros = client.time()
    slept = ""
    slot, started = slot_time(), _started.pop(task_id or "", None)
    if slot is not None and started is not None:
        slept = f" {slot - started:.6f}"
    pipe = client.pipeline()
    pipe.rpush("waiting:log", f"{tag} {seconds + micros / 1e6:.6f}{slept}")
    pipe.hincrby("waiting:done", tag, 1)
    pipe.execute()


# shared=False: these tasks must not join the other test apps of the same pytest process.
@app.task(bind=True, shared=False)
@throttled("spaced")
def spaced(self: Any, tag: str) -> None:
    """Under ``spaced`` (GCRA, one call per spacing): the second of two waits."""
    _log(tag, self.request.id)


@app.task(bind=True, shared=False, acks_late=True)
@throttled("spaced")
def spaced_late(self: Any, tag: str) -> None:
    """As ``spaced``, acknowledged when it returns: a pool child may sleep up to
    ``sleep_max`` for a slot it decided itself."""
    _log(tag, self.request.id)


@app.task(bind=True, shared=False, rate_limit="1000/s")
@throttled("spaced")
def spaced_limited(self: Any, tag: str) -> None:
    """As ``spaced``, under a ``rate_limit`` of Celery's own too (which never binds): the
    consumer does not decide it, its pool child does, and sleeps to its slot there at most
    50 ms (no ``acks_late``). Notes how many times throttling had sent it back
    (``waiting:deferrals``, HASH tag -> count)."""
    deferrals = (self.request.headers or {}).get("throttle_deferrals", 0)
    _redis().hset("waiting:deferrals", tag, deferrals)
    _log(tag)


@app.task(bind=True, shared=False, rate_limit="1000/s", acks_late=True)
@throttled("spaced")
def spaced_limited_late(self: Any, tag: str) -> None:
    """As ``spaced_limited``, acknowledged when it returns: its pool child may sleep to its
    slot up to ``sleep_max``, less when the task has a time limit."""
    _log(tag)


@app.task(shared=False)
@throttled("slow")
def slow(tag: str) -> None:
    """Under ``slow`` (GCRA, one call per 2.5 s): held long enough to kill its worker."""
    _log(tag)


@app.task(bind=True, shared=False)
@throttled("bulk")
def bulk(self: Any, tag: str) -> None:
    """Under ``bulk`` (a token bucket of burst 10 refilled at 1000/s): never waits, and
    never has room for 20 more (the consumer decides every task of it)."""
    _log(tag)


@app.task(shared=False)
@throttled("roomy", "budget")
def stocked(tag: str, tenant: str, tokens: int, used: int) -> None:
    """Under two limits that never bind (``roomy``, ``budget`` per tenant, whose cost is
    ``tokens``), reporting ``used``: drawn from its pool child's stock."""
    report_cost(used, limit="budget")
    _log(tag)


def _span(tag: str, seconds: float) -> None:
    """Hold the pool slot ``seconds``; log ``"<tag> <start> <end>"`` (Redis time, s) in
    ``waiting:spans``, so that a test sees how many bodies ran at once."""
    client = _redis()
    start, micros = client.time()
    time.sleep(seconds)
    end, end_micros = client.time()
    client.rpush("waiting:spans", f"{tag} {start + micros / 1e6:.6f} {end + end_micros / 1e6:.6f}")


@app.task(shared=False)
@throttled("bulk")
def bulk_busy(tag: str, seconds: float) -> None:
    """Under ``bulk`` (decided in the consumer, handed to the pool at once): a span."""
    _span(tag, seconds)


@app.task(shared=False)
@throttled("spaced")
def spaced_busy(tag: str, seconds: float) -> None:
    """Under ``spaced`` (1/s: handed to the pool a second apart, long after its message
    came): a span."""
    _span(tag, seconds)


@app.task(shared=False)
def plain(tag: str) -> None:
    """Not throttled."""
    _log(tag)


@app.task(shared=False)
def busy(tag: str, seconds: float) -> None:
    """Not throttled: holds its pool slot ``seconds``, then logs its end and the limiter's
    script calls so far (``waiting:fcalls:<tag>``)."""
    time.sleep(seconds)
    stats = _redis().info("commandstats")
    _redis().set(f"waiting:fcalls:{tag}", int(stats.get("cmdstat_fcall", {}).get("calls", 0)))
    _log(tag)
