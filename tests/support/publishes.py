"""Broker publishes per task: how many messages a fleet sent for the tasks it ran.

A task the throttler sends back (re-published for a later slot, parked in Redis then
released to the broker) costs the broker one more message each time; the target of issue
25 is at most 1.1 publishes per admitted task (the producer's one included) at a steady
backlog. Two ways to count, both outside the throttler, so that the figure holds however
tasks wait:

* at a Redis broker, :func:`broker_lpushes`: kombu's Redis transport publishes every
  message with one ``LPUSH`` (a consumer takes from the other end; a restored unacked
  message goes back with ``RPUSH``, a requeued reject with ``LPUSH``), so the server's
  ``LPUSH`` calls before and after a run count its publishes, whoever sent them;
* on any broker, :func:`count_publishes` in the workers' app (RabbitMQ 3.10 counts
  publishes only through its management plugin, which is not ours to enable): Celery's
  ``after_task_publish`` signal, per task id, for every message Celery sends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from celery import signals

PUBLISHES_KEY = "test:publishes"
"""HASH task id -> messages published by the workers (:func:`count_publishes`)."""


def broker_lpushes(client: redis.Redis) -> int:
    """The ``LPUSH`` calls the Redis server has served (``INFO commandstats``): the
    messages published to it as a broker, for a server that is nothing else's list store.
    Commands that Lua scripts run count too; no script of the throttler pushes to a list."""
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_lpush", {}).get("calls", 0))


def script_calls(client: redis.Redis) -> int:
    """The script calls (FCALL of the limiter's functions; EVALSHA, EVAL) the Redis server
    has served so far (``INFO commandstats``)."""
    stats = client.info("commandstats")
    names = ("fcall", "evalsha", "eval")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names)


def count_publishes(
    client: Callable[[], redis.Redis], task_names: Callable[[], set[str]]
) -> Callable[..., None]:
    """Count every message Celery publishes for a task of ``task_names()`` in
    :data:`PUBLISHES_KEY` of ``client()`` (made lazily: after a pool's fork). For the
    worker processes of a test app (a global signal receiver: not in the test process,
    which sends other apps' tasks too). Returns the receiver, connected."""

    def counted(sender: Any = None, headers: Any = None, **_: Any) -> None:
        task_id = (headers or {}).get("id")
        if task_id and sender in task_names():
            client().hincrby(PUBLISHES_KEY, task_id, 1)

    signals.after_task_publish.connect(counted, weak=False)
    return counted


def publishes_of(client: redis.Redis, task_ids: list[str]) -> dict[str, int]:
    """Messages published per task id: the producer's one, and the workers' counted by
    :func:`count_publishes`."""
    raw = client.hgetall(PUBLISHES_KEY)
    counted = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
    return {task_id: 1 + counted.get(task_id, 0) for task_id in task_ids}
