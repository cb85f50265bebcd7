"""Which queue a task was consumed from, and the lane its deferred copies come back through.

A message's ``delivery_info`` carries the exchange and routing key it was *published* with,
not the queue it was consumed from: with topic, fanout or headers routing (or any binding
key other than the queue's name) the routing key names no queue. So the worker's main
process, which holds the consumer, resolves the queue when a task is received
(Celery's ``task_received`` signal, before the task goes to a pool child) and writes it
into the request's ``delivery_info`` under ``"queue"``, which the pool child reads
(:func:`throttle.celery.message.queue_of`):

1. **The consumer tag** (py-amqp / RabbitMQ): every delivery names the consumer it was
   delivered to, and the worker's task consumer knows which queue each of its consumer
   tags consumes. Exact, whatever the routing.
2. Transports without consumer tags (Redis, SQS...): the one queue the worker consumes
   whose bindings match the delivery's exchange and routing key (direct: equality; topic:
   ``*`` and ``#`` patterns; fanout and headers: any key; the default exchange ``""``:
   the queue's name). A worker whose consumed queues could both receive one message is
   refused at start (:func:`check_routing`), so at most one matches.
3. Otherwise (a queue added at run time by ``add_consumer``): the routing key when it
   names a queue the worker consumes (Celery's default routing), else no queue (the task
   takes no ``queues:`` limits and no lane); the worker logs one warning per exchange and
   routing key.

Lanes: the lane of queue Q is ``Q.throttled``, bound to a direct exchange of the same name
(as Celery creates a missing queue) and declared with Q's arguments (``x-queue-type``,
``x-max-priority``, TTLs, ...), durability and auto-delete, so that a quorum queue's lane
is a quorum queue. :func:`declare_lanes` registers the lanes of the queues a worker
consumes in ``app.amqp.queues`` of its main process before the pool forks, so that every
process of the worker knows them (a pool child re-publishing, Celery's own ``retry`` of a
task that came through a lane, the releaser, the consumer), under either setting of
``task_create_missing_queues``: Celery looks a queue up by name when it publishes there,
and declares it as registered.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from celery import Celery, signals
from kombu.entity import Exchange, Queue

from throttle.celery.message import LANE_SUFFIX, QUEUE_KEY
from throttle.errors import ConfigError

logger = logging.getLogger("throttle")

Binding = tuple[str, str, str]
"""(exchange name, exchange type, binding key) of one of a queue's bindings."""

_warned: set[tuple[str, str]] = set()


def bindings_of(queue: Queue) -> list[Binding]:
    """A queue's bindings: its ``bindings``, else its exchange and routing key; and the
    default exchange ``""``, to which every queue is bound under its name."""
    found: list[Binding] = [("", "direct", queue.name)]
    for bound in queue.bindings or ():
        exchange = bound.exchange
        name = exchange if isinstance(exchange, str) else getattr(exchange, "name", "")
        kind = getattr(exchange, "type", "direct") or "direct"
        if name:
            found.append((name, kind, bound.routing_key or ""))
    exchange = queue.exchange
    if not queue.bindings and exchange is not None and exchange.name:
        found.append((exchange.name, exchange.type or "direct", queue.routing_key or ""))
    return found


def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching: ``*`` is one word, ``#`` zero or more (words split on ``.``)."""
    return _overlap(tuple(pattern.split(".")), tuple(key.split(".")), literal_right=True)


def topics_overlap(a: str, b: str) -> bool:
    """Whether some routing key matches both topic patterns."""
    return _overlap(tuple(a.split(".")), tuple(b.split(".")), literal_right=False)


def _overlap(p: tuple[str, ...], q: tuple[str, ...], *, literal_right: bool) -> bool:
    """Whether a word sequence matches both ``p`` and ``q`` (``q`` is a plain key when
    ``literal_right``: its ``*`` and ``#`` are words)."""
    memo: dict[tuple[int, int], bool] = {}

    def wild(tokens: tuple[str, ...], i: int, literal: bool) -> str | None:
        return None if literal or tokens[i] not in ("*", "#") else tokens[i]

    def go(i: int, j: int) -> bool:
        if (i, j) in memo:
            return memo[(i, j)]
        if i == len(p) and j == len(q):
            result = True
        elif i < len(p) and p[i] == "#":
            result = go(i + 1, j) or (j < len(q) and go(i, j + 1))
        elif j < len(q) and wild(q, j, literal_right) == "#":
            result = go(i, j + 1) or (i < len(p) and go(i + 1, j))
        elif i == len(p) or j == len(q):
            result = False
        else:
            star = p[i] == "*" or wild(q, j, literal_right) == "*"
            result = (star or p[i] == q[j]) and go(i + 1, j + 1)
        memo[(i, j)] = result
        return result

    return go(0, 0)


def binding_matches(binding: Binding, exchange: str, routing_key: str) -> bool:
    """Whether a message published to ``exchange`` with ``routing_key`` reaches ``binding``."""
    name, kind, key = binding
    if name != exchange:
        return False
    if kind == "topic":
        return topic_matches(key, routing_key)
    if kind in ("fanout", "headers"):  # headers: decided by the message's headers
        return True
    return key == routing_key


def bindings_overlap(a: Binding, b: Binding) -> bool:
    """Whether one message can reach both bindings."""
    if a[0] != b[0]:
        return False
    kinds = {a[1], b[1]}
    if kinds & {"fanout", "headers"}:
        return True
    if "topic" in kinds:
        return topics_overlap(a[2], b[2])
    return a[2] == b[2]


def resolve(
    queues: Iterable[Queue], tags: Mapping[str, str], delivery_info: Mapping[str, Any]
) -> str | None:
    """The queue (of ``queues``, consumed under ``tags``: queue name -> consumer tag) that a
    delivery came from (see the module's rules), or None."""
    queues = list(queues)
    tag = delivery_info.get("consumer_tag")
    if tag:
        for name, consumer_tag in tags.items():
            if consumer_tag == tag:
                return name
    exchange = delivery_info.get("exchange") or ""
    routing_key = delivery_info.get("routing_key") or ""
    if not isinstance(exchange, str) or not isinstance(routing_key, str):
        return None
    matching = [
        q.name
        for q in queues
        if any(binding_matches(b, exchange, routing_key) for b in bindings_of(q))
    ]
    if len(matching) == 1:
        return matching[0]
    if routing_key in {q.name for q in queues}:
        return routing_key
    if (exchange, routing_key) not in _warned:
        _warned.add((exchange, routing_key))
        logger.warning(
            "throttle: cannot tell which queue a task sent to exchange %r with routing key %r "
            "came from (%s): it takes no queue limits and no lane",
            exchange, routing_key,
            f"queues {', '.join(matching)} all match" if matching else "no consumed queue matches",
        )  # fmt: skip
    return None


def _on_task_received(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    """Write the queue a received task came from into its ``delivery_info`` (the dict the
    pool child gets as ``task.request.delivery_info``); "" when it cannot be told."""
    info = getattr(request, "delivery_info", None)
    message = getattr(request, "message", None)
    consumer = getattr(sender, "task_consumer", None)
    if not isinstance(info, dict) or message is None or consumer is None:
        return
    raw = getattr(message, "delivery_info", None)
    if not isinstance(raw, Mapping):
        return
    tags = getattr(consumer, "_active_tags", None)  # kombu: queue name -> consumer tag
    queue = resolve(consumer.queues, tags if isinstance(tags, Mapping) else {}, raw)
    info[QUEUE_KEY] = queue or ""


signals.task_received.connect(_on_task_received, weak=False, dispatch_uid="throttle-queue-of")


def has_consumer_tags(app: Celery) -> bool:
    """Whether the app's broker transport names the consumer of each delivery (py-amqp)."""
    try:
        return app.connection_for_write().transport.driver_type == "amqp"  # type: ignore[no-any-return]
    except Exception:  # an unknown transport: assume the worst
        return False


def check_routing(app: Celery, source: str | None = None) -> None:
    """At worker start: on a transport without consumer tags, refuse consumed queues that
    one message can reach two of (its queue could not be told: the wrong limits or none
    would apply, a deferred copy would go to the wrong lane)."""
    if has_consumer_tags(app):
        return
    queues = [q for q in app.amqp.queues.consume_from.values() if isinstance(q, Queue)]
    for a, b in itertools.combinations(queues, 2):
        for x in bindings_of(a):
            for y in bindings_of(b):
                if bindings_overlap(x, y):
                    raise ConfigError(
                        f"queues {a.name!r} and {b.name!r} can both receive a message sent to "
                        f"exchange {x[0]!r} ({x[1]} {x[2]!r} / {y[1]} {y[2]!r}), and this "
                        f"broker's transport does not say which queue a message came from: "
                        f"consume them from separate workers, give them disjoint bindings, "
                        f"or use RabbitMQ (py-amqp), where the consumer tag tells",
                        field="queues", source=source,
                    )  # fmt: skip


def lane_name(queue: str) -> str:
    return queue + LANE_SUFFIX


def lane_queue(app: Celery, queue: Queue | str) -> Queue:
    """The lane of ``queue``, registered in ``app.amqp.queues`` (see the module)."""
    queues = app.amqp.queues
    source_name = queue if isinstance(queue, str) else queue.name
    name = lane_name(source_name)
    known: Queue | None = dict.get(queues, name)  # an operator's own definition wins
    if known is not None:
        return known
    source: Any  # kombu.Queue (its declaration attributes are untyped)
    if isinstance(queue, Queue):
        source = queue
    else:
        try:
            source = queues[source_name]  # Celery creates it as it would to consume it
        except KeyError:
            source = None
    exchange = Exchange(name, "direct")  # type: ignore[no-untyped-call]
    if source is None:
        lane = Queue(name, exchange, routing_key=name)  # type: ignore[no-untyped-call]
    else:
        lane = Queue(  # type: ignore[no-untyped-call]
            name,
            exchange,
            routing_key=name,
            durable=source.durable,
            auto_delete=source.auto_delete,
            queue_arguments=dict(source.queue_arguments or {}),
            max_priority=source.max_priority,
            expires=source.expires,
            message_ttl=source.message_ttl,
            max_length=source.max_length,
            max_length_bytes=source.max_length_bytes,
            no_declare=source.no_declare,
        )
    added: Queue = queues.add(lane)
    return added


def declare_lanes(app: Celery) -> list[Queue]:
    """Register the lane of every queue the worker consumes (``-Q``, else every queue of
    ``task_queues``) in ``app.amqp.queues``. Called in the worker's main process before the
    pool forks: a lane registered later (when the consumer starts) would be unknown to the
    pool children, whose publishes to it then fail with ``QueueNotFound`` when
    ``task_create_missing_queues`` is off, or declare it without the queue's arguments when
    it is on. Returns the lanes."""
    consumed = app.amqp.queues.consume_from
    sources = [q for q in list(consumed.values()) if not q.name.endswith(LANE_SUFFIX)]
    return [lane_queue(app, queue) for queue in sources]
