"""When a task was sent: the producer stamps its messages with the Redis clock.

A worker learns of a task when it takes it from the queue, which for a backlog can be many
seconds after the send. What a limit in shadow mode would have imposed is counted from the
send (:mod:`throttle.celery.shadow`), as a user sees a delay: the enforced fleet would have
run the task at its slot, and the task was waiting since it was sent, whether in the queue
or for the limit. Celery's messages carry no send time, so :func:`install_stamp` connects
a ``before_task_publish`` receiver that writes one (:data:`~throttle.celery.message.H_SENT`)
into the headers of every task of the app.

The time is on the Redis clock, from the producer's own throttler
(:class:`throttle.redis.clock.RedisClock`): every worker compares it with its own reading
of that clock, so neither host's wall clock matters. The cost in the producer: its
throttler is built on its first publish (the limits file read, no connection), and it
measures its offset to Redis then and once a minute after (three ``TIME`` round trips);
every other publish reads the monotonic clock. While Redis is away, the producer's wall
clock stands in. Nothing here can fail a publish: any error leaves the message unstamped
(a shadow look then counts from when the worker took the task).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import MutableMapping
from typing import Any

from celery import Celery, signals

from throttle.celery.message import H_SENT
from throttle.celery.runtime import Throttler, throttling_enabled

logger = logging.getLogger("throttle")


def stamp(headers: MutableMapping[str, Any], throttler: Throttler) -> None:
    """Write the send time (Redis clock, epoch s) into ``headers``, unless they carry
    one: a task re-published by the throttler keeps the time of its first send."""
    if H_SENT not in headers:
        headers[H_SENT] = round(throttler.clock.now(), 6)


def install_stamp(app: Celery) -> None:
    """Stamp the messages of ``app``'s tasks with their send time (see the module), once
    per app. The receiver is on Celery's global ``before_task_publish`` signal, which
    names only the task: it stamps the tasks registered on ``app``, and holds the app
    weakly (an app dropped by a test leaves a receiver that does nothing)."""
    if getattr(app, "_throttle_stamps", False):
        return
    app._throttle_stamps = True
    ref = weakref.ref(app)

    def on_publish(
        sender: str | None = None, headers: MutableMapping[str, Any] | None = None, **_: Any
    ) -> None:
        owner = ref()
        if owner is None or headers is None or sender is None or sender not in owner.tasks:
            return
        if getattr(owner, "_throttle_stamps", None) == "off":
            return
        try:
            if throttling_enabled(owner):
                stamp(headers, Throttler.of(owner))
        except Exception as exc:  # no limits file in this process, anything: never fail
            # the publish, and do not try again on every publish (building the throttler
            # reads the limits file)
            owner._throttle_stamps = "off"
            logger.info(
                "throttle: %s's tasks are sent without their send time (shadow mode counts "
                "from when a worker takes them): %s", owner.main, exc,
            )  # fmt: skip

    signals.before_task_publish.connect(on_publish, weak=False)
