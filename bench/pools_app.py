"""The Celery app of ``bench/pools.py``: a plain, unthrottled task that calls an API with
``requests``, as a user's task would. Broker: ``POOLS_BROKER_URL`` (the benchmark's private
redis-server); the API: ``MOCK_API_URL``."""

from __future__ import annotations

import os
from typing import Any

import requests
from celery import Celery

BROKER = os.environ.get("POOLS_BROKER_URL", "redis://127.0.0.1:6379/0")
API_URL = os.environ.get("MOCK_API_URL", "")

app = Celery("pools", broker=BROKER)
app.conf.update(
    task_default_queue="upstream",
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    # kombu's Redis transport keeps 10 connections per worker by default: fewer than a
    # large gevent or threads pool acks with (MaxConnectionsError, then redeliveries).
    broker_transport_options={"max_connections": int(os.environ.get("POOLS_CONNECTIONS", "20"))},
)
if os.environ.get("POOLS_WORKER_POOL"):
    # The pool chosen in the settings, not by -P (bench.pools: nothing monkey-patches).
    app.conf.worker_pool = os.environ["POOLS_WORKER_POOL"]


@app.task(bind=True)
def fetch(self: Any, n: int) -> int:
    """One call of the API: a new connection each time (``requests.post``, no session)."""
    response = requests.post(f"{API_URL}/call", headers={"X-Task-Id": self.request.id}, timeout=30)
    return response.status_code
