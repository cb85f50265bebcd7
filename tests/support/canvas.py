"""The fleet of tests/apps/canvas_app.py: real ``celery worker`` subprocesses, a private
redis-server (result backend, limiter, ledger) and a broker (that server, or a RabbitMQ
vhost of the test's), and the app imported in the test process as the producer."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from tests.support.servers import RedisServer
from workers.harness import Worker, running

ENV = ("CANVAS_BROKER_URL", "CANVAS_REDIS_URL", "THROTTLE_CONFIG", "CANVAS_MISSING")


class CanvasFleet:
    """What a test sees: the producer app, the ledger, the workers' logs."""

    def __init__(self, app: Any, server: RedisServer, workers: list[Worker]) -> None:
        self.app, self.server, self.workers = app, server, workers
        self.client = redis.Redis.from_url(server.url)

    def logs(self) -> str:
        return "\n".join(w.log.read_text() for w in self.workers if w.log and w.log.exists())


@contextlib.contextmanager
def canvas_fleet(
    tmp: Path,
    config: str,
    *,
    broker: str | None = None,
    missing_queues: bool = False,
    concurrency: int = 4,
) -> Iterator[CanvasFleet]:
    """A private redis-server and one worker of ``concurrency`` prefork children consuming
    ``celery``, with the limits file ``config``; ``broker`` (default: the redis-server);
    ``missing_queues``: ``task_create_missing_queues`` on."""
    path = tmp / "limits.yaml"
    path.write_text(config)
    with RedisServer() as server:
        env = {
            "CANVAS_BROKER_URL": broker or server.url,
            "CANVAS_REDIS_URL": server.url,
            "THROTTLE_CONFIG": str(path),
            "CANVAS_MISSING": "1" if missing_queues else "0",
        }
        os.environ.update(env)
        from tests.apps.canvas_app import app  # noqa: PLC0415

        # The module is imported once per test session: each fleet sets its own servers.
        app.conf.broker_url = env["CANVAS_BROKER_URL"]
        app.conf.result_backend = app.conf.throttle_redis_url = server.url
        app.conf.task_create_missing_queues = missing_queues
        app.conf.throttle_config = str(path)
        workers = [
            Worker("canvas", env, app="tests.apps.canvas_app", queues="celery",
                   concurrency=concurrency, log=tmp / "worker.log")
        ]  # fmt: skip
        fleet = CanvasFleet(app, server, workers)
        try:
            with running(app, workers):
                yield fleet
        finally:
            # Results still referenced (a failed test's traceback) unsubscribe when collected:
            # from a closed pub/sub, not from the server about to stop.
            backend = app._backend_cache or getattr(app._local, "backend", None)
            consumer = getattr(backend, "result_consumer", None)
            pubsub = getattr(consumer, "_pubsub", None)
            if pubsub is not None:
                consumer._pubsub = None
                pubsub.close()
            fleet.client.close()
            cached = getattr(app, "_throttler", None)
            if cached is not None:
                cached[1].limiter.client.close()
                app._throttler = None
            # The app module is imported once per session: the next fleet gets its own
            # broker connections (kombu's pools are per URL) and result backend.
            app._pool = None
            app.amqp._producer_pool = None
            app._backend_cache = None
            vars(app._local).pop("backend", None)
            for name in ENV:
                os.environ.pop(name, None)
