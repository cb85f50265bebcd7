"""The Celery app of tests/system/test_plans.py: one task under a keyed limit with plans,
run by a real ``celery worker``. Broker, result backend and limiter are the test's private
redis-server (``PLANS_BROKER_URL``). Each run of the task appends the Redis time at which
its body started to the list ``test:plans:TENANT``."""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery

from throttle.celery import install, throttled
from workers.harness import WORKER_SETTINGS

BROKER = os.environ.get("PLANS_BROKER_URL", "redis://127.0.0.1:6379/15")

app = Celery("plans_test", broker=BROKER, backend=BROKER)
app.conf.update(
    WORKER_SETTINGS,
    throttle_config={
        "settings": {"refresh": "0.5s"},
        "limits": {
            "api": {
                "algorithm": "gcra", "rate": "2/s burst 1", "key": "{tenant}",
                "plan": "{plan}", "plans": {"free": "5/s burst 1", "pro": "50/s burst 1"},
            },
        },
    },
)  # fmt: skip
install(app)


@app.task(bind=True, max_retries=0)
@throttled("api")
def call(self: Any, tenant: str, plan: str) -> None:
    client = redis.Redis.from_url(BROKER)
    try:
        seconds, micros = client.time()
        client.rpush(f"test:plans:{tenant}", f"{seconds}.{micros:06d}")
    finally:
        client.close()
