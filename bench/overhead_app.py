"""The Celery app of ``bench/overhead.py``: no-op tasks, plain and throttled.

Run by ``celery -A bench.overhead_app worker``; its broker and limiter are the Redis at
``OVERHEAD_BROKER_URL`` (the benchmark's private redis-server). The settings are those of
the demo app's workers (``workers.harness.WORKER_SETTINGS``: late acks, one prefetched
task per child), results ignored. The limits never bind: every task is admitted at once,
so what differs between the tasks is the throttler's own work.

``install(app)`` is not called: its releaser thread polls Redis with a script a few times
a second whether tasks run or not, which would blur the count of script calls per task;
no task here is ever parked, so the releaser would have nothing to do. Its consumer step,
where throttled tasks are decided before the pool (:mod:`throttle.celery.waiting`), is
added alone, when the code under test has it.
"""

from __future__ import annotations

import os

from celery import Celery

from throttle.celery import report_cost, throttled

try:
    from throttle.celery.waiting import WaitStep
except ImportError:  # a revision from before it (bench.overhead --before)
    WaitStep = None

BROKER = os.environ.get("OVERHEAD_BROKER_URL", "redis://127.0.0.1:6379/0")

app = Celery("overhead", broker=BROKER)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    # 1 (the demo's), or Celery's default 4 with `bench.overhead --prefetch 4`.
    worker_prefetch_multiplier=int(os.environ.get("OVERHEAD_PREFETCH", "1")),
    broker_connection_retry_on_startup=True,
    task_ignore_result=True,
    throttle_config={
        "limits": {
            "roomy": {"rate": "1000000/s"},
            "requests": {"algorithm": "gcra", "rate": "100000/s", "burst": 1000},
            "tokens": {"rate": "1000000000/d", "key": "{tenant}", "cost": "tokens"},
            "watched": {
                "algorithm": "gcra",
                "rate": "100000/s",
                "key": "{tenant}",
                "mode": "shadow",
            },
        },
    },
)

if WaitStep is not None:
    app.steps["consumer"].add(WaitStep)


@app.task
def plain() -> None:
    """Not throttled."""


@app.task
def plain_args(tenant: str, tokens: int) -> None:
    """Not throttled, with the arguments of ``two_limits`` and ``reported``: their
    baseline (the same task without ``@throttled``)."""


@app.task
@throttled("roomy")
def one_limit() -> None:
    """One token bucket, cost 1."""


@app.task
@throttled("requests", "tokens")
def two_limits(tenant: str, tokens: int) -> None:
    """A GCRA limit (cost 1) and a per-tenant token budget whose cost is an argument
    (an estimate, kept: nothing reported)."""


@app.task
@throttled("requests", "tokens")
def reported(tenant: str, tokens: int) -> None:
    """As ``two_limits``, and the body reports the actual cost (half the estimate): the
    acquisition is settled."""
    report_cost(tokens // 2)


@app.task
@throttled("watched")
def shadowed(tenant: str, tokens: int) -> None:
    """One per-tenant GCRA limit in shadow mode: looked at (gathered, sent in batches by
    a thread of the process), never waited for."""
