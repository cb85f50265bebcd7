"""The Celery app of tests/integration/test_tls.py, run by a real ``celery worker``, Flower and the
``celery throttle`` command: one throttled task. Its broker and result backend are
``TLS_BROKER_URL``; its limits file is ``THROTTLE_CONFIG``; the limiter's Redis (TLS, an ACL
user with a password) is ``THROTTLE_REDIS_URL``. An app of its own, so that the limits file
names only what its tasks use."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from throttle.celery import ThrottledTask, install, throttled

BROKER = os.environ.get("TLS_BROKER_URL")

app = Celery("tls_tests", broker=BROKER, backend=BROKER, task_cls=ThrottledTask)
app.conf.update(
    throttle_config=os.environ.get("THROTTLE_CONFIG"),
    task_default_queue="tls",
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
install(app)


@app.task(bind=True)
@throttled("slow")
def slow(self: Any, x: int) -> dict[str, Any]:
    headers = self.request.headers or {}
    return {"x": x, "deferrals": headers.get("throttle_deferrals", 0)}
