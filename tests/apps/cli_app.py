"""The Celery app of the ``celery throttle`` tests (tests/integration/test_cli.py).

Run by ``celery -A tests.apps.cli_app throttle ...`` and ``celery -A tests.apps.cli_app worker``
subprocesses, and imported by the tests themselves. Its broker and result backend are the
test's private redis-server (``CLI_BROKER_URL``; no result backend: tasks record their runs
in the limiter's Redis); its limits file is ``THROTTLE_CONFIG``,
and the limiter's Redis ``THROTTLE_REDIS_URL``. In-process tests point ``app.conf`` at their
own file and Redis instead.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from throttle.celery import ThrottledTask, Throttler, install, throttled

BROKER = os.environ.get("CLI_BROKER_URL")

app = Celery("cli_tests", broker=BROKER, task_cls=ThrottledTask)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    task_default_queue="cli",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
install(app)


def _count_run(task: Any) -> int:
    """Count this execution, and note when it started (epoch s), in the limiter's Redis
    under the limits file's prefix (the test's cleanup removes them): a task run twice
    shows as 2."""
    at = time.time()
    throttler = Throttler.of(app)
    runs_key = f"{throttler.settings.prefix}:runs:{task.request.id}"
    at_key = f"{throttler.settings.prefix}:at:{task.request.id}"
    with throttler.limiter.client.pipeline() as pipe:
        pipe.incr(runs_key).expire(runs_key, 600).set(at_key, repr(at), ex=600)
        runs, _, _ = pipe.execute()
    return int(runs)


@app.task(bind=True)
@throttled("gate")
def gated(self: Any, n: int) -> int:
    return _count_run(self)


@app.task(bind=True)
@throttled("busy")
def busy(self: Any, seconds: float) -> int:
    """Occupies a pool child for ``seconds`` under limit ``busy`` (counted in flight)."""
    time.sleep(seconds)
    return _count_run(self)


@app.task
@throttled("30/m burst 3", algorithm="gcra")
def inline(x: int) -> int:
    """An inline limit, named after the task: tests.apps.cli_app.inline."""
    return x


@app.task
@throttled("nowhere")
def orphan(x: int) -> int:
    """Names a limit that only some limits files define (``check`` reports the others)."""
    return x
