"""What the throttler reads from and writes to a task's message: its queue, its headers, and
the payload a parked task waits in Redis as.

The ``throttle_*`` headers come with the message, and whoever can publish a task can write
them. Each is read defensively: a value of the wrong type or out of range is absent (never
an exception), and none of them can make a task skip the limiter or pay less: a deadline
only shortens the wait a task accepts (it times out sooner, it never runs sooner), the
parking ids only let a second copy of a parked task be dropped, the dead-letter mark
only keeps a timed-out task from being dead-lettered again, and the saved ETA and
delivery are only shown to the task (``request.eta``, ``request.delivery_info``).

A deferred copy keeps what its message carried besides its headers: its properties
(:func:`carried_properties`) and how it was delivered (:data:`H_DELIVERY`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kombu.serialization import dumps, loads

from throttle.units import real

H_DEADLINE = "throttle_deadline"
"""``[deadline, retries]``: the task's ``max_wait`` deadline (epoch s on the Redis clock;
past it, ``on_timeout`` applies; its ``expires`` is read from the message itself), set
when a worker first looked at its limits, and the task's ``retries`` then: a Celery
``retry`` since (which copies the headers) is a new attempt, with a ``max_wait`` of its
own. A bare number (older messages) is the deadline whatever the retries."""
H_DEFERRALS = "throttle_deferrals"
"""How many times throttling re-published the task."""
H_PARKED = "throttle_parked"
"""The parking token of a task released from the lot."""
H_PUBLISH = "throttle_publish"
"""The publish id of that release."""
H_DEAD = "throttle_dead_letter"
"""The dead-letter queue a timed-out task was sent to."""
H_ETA = "throttle_eta"
"""``[eta, retries]``: the ``eta`` the task had before throttling first re-published it (the
producer's ISO 8601 string, or None) and its ``retries`` then. The re-published message has
the throttler's own ETA (or none); the gate restores this one into ``request.eta`` while
``retries`` is unchanged (a Celery ``retry`` since has an ETA of its own)."""
H_DELIVERY = "throttle_delivery"
"""``[exchange, routing_key, redelivered]``: how the message the producer sent was
delivered (``request.delivery_info``), before throttling first re-published it. A copy goes
to its queue (or lane) through the default exchange, so its own delivery names the queue,
not the producer's exchange and routing key (a topic's key may mean something to the task),
and it is a new message, never ``redelivered``; the task is shown these instead
(:func:`restore_delivery`). ``redelivered`` is true once any delivery of the task was (a
task that checks it for work done before must still see it after a deferral)."""
H_PLANNED = "throttle_planned"
"""Set when the task holds a plan on its keyed limits (see :mod:`throttle.celery.plan`): the
planned slot (epoch s, Redis clock; 1 when unknown). Back, the task waits for that time
before it acquires its limits for real. Forged, it only skips the plan (or delays a task by
at most ``sleep_max``), which is advisory: the real acquisition still takes every limit."""

H_NOT_BEFORE = "throttle_not_before"
"""When a task sent back may run again: epoch s on the Redis clock (the time its limits or
its upstream gave, less the throttler's own lead). A task with no limit in force (all in
shadow mode) has no slot to wait for: a worker's consumer holds it until then (at most
``sleep_max``: a copy released from the parking lot arrives up to a poll early).
Forged, it delays a task by at most ``sleep_max``."""

H_SENT = "throttle_sent"
"""When the producer published the task: epoch s on the Redis clock, as the producer's
throttler reads it (:mod:`throttle.celery.sent`). Kept by re-publishing; shadow mode counts
a would-be wait from it. Forged, it only changes what shadow mode reports."""

LANE_SUFFIX = ".throttled"
"""A queue's lane: where deferred tasks of QUEUE come back (see ``Settings.lanes``)."""

QUEUE_KEY = "queue"
"""The ``delivery_info`` key where the worker writes the queue a task was consumed from
(:mod:`throttle.celery.routing`; "" when it could not be told)."""

MAX_EPOCH_S = 253402300800.0
"""Year 10000 in epoch s: later than any real deadline (and than ``datetime`` can show)."""


def queue_of(delivery_info: object) -> str | None:
    """The queue a task was consumed from (its lane counts as the queue itself), as the
    worker resolved it into ``delivery_info`` (see :mod:`throttle.celery.routing`). Where
    nothing resolved it (a consumer outside a worker), the routing key, which is the
    queue's name in Celery's default routing."""
    if not isinstance(delivery_info, Mapping):
        return None
    if QUEUE_KEY in delivery_info:
        queue = delivery_info.get(QUEUE_KEY) or None
    else:
        queue = delivery_info.get("routing_key") or None
    if not isinstance(queue, str):
        return None
    if queue.endswith(LANE_SUFFIX):
        queue = queue[: -len(LANE_SUFFIX)]
    return queue


def deadline_header(headers: Mapping[str, Any], retries: int = 0) -> float | None:
    """The ``throttle_deadline`` header in epoch s, or None when absent, corrupt (not a
    number, a bool, NaN, infinite, <= 0, past year 10000, an int too large for a float)
    or set for other ``retries`` than the task's now."""
    value = headers.get(H_DEADLINE)
    if isinstance(value, list | tuple) and len(value) == 2:
        value, stamped = value
        if stamped != retries or isinstance(stamped, bool):
            return None
    deadline = real(value)
    if deadline is not None and 0 < deadline < MAX_EPOCH_S:
        return deadline
    return None


def deadline_value(deadline: float, retries: object) -> list[float | int]:
    """The ``throttle_deadline`` header for ``deadline`` (epoch s) set at ``retries``."""
    return [deadline, retries if isinstance(retries, int) else 0]


def planned_header(headers: Mapping[str, Any]) -> float | None:
    """The planned slot of a task that holds a plan (epoch s; 1.0: unknown), else None."""
    value = real(headers.get(H_PLANNED))
    if value is not None and 0 < value < MAX_EPOCH_S:
        return value
    return None


def not_before_header(headers: Mapping[str, Any]) -> float | None:
    """The ``throttle_not_before`` header in epoch s, or None when absent or corrupt."""
    value = real(headers.get(H_NOT_BEFORE))
    if value is not None and 0 < value < MAX_EPOCH_S:
        return value
    return None


def sent_header(headers: Mapping[str, Any]) -> float | None:
    """The ``throttle_sent`` header in epoch s, or None when absent or corrupt (as
    :func:`deadline_header`)."""
    value = real(headers.get(H_SENT))
    if value is not None and 0 < value < MAX_EPOCH_S:
        return value
    return None


def count_header(headers: Mapping[str, Any]) -> int:
    """The ``throttle_deferrals`` header, or 0 when absent or corrupt."""
    value = headers.get(H_DEFERRALS)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31:
        return value
    return 0


def id_header(headers: Mapping[str, Any], name: str) -> str | None:
    """A parking token or publish id (hex, ``:``), or None when absent or corrupt."""
    value = headers.get(name)
    if isinstance(value, str) and 0 < len(value) <= 100 and value.isascii() and value.isprintable():
        return value
    return None


MAX_ETA_CHARS = 64
"""The longest ``eta`` string kept in the ``throttle_eta`` header (ISO 8601 needs 32)."""


def eta_header(headers: Mapping[str, Any]) -> tuple[str | None, int] | None:
    """The ``throttle_eta`` header as (eta, retries), or None when absent or corrupt."""
    value = headers.get(H_ETA)
    if not isinstance(value, list | tuple) or len(value) != 2:
        return None
    eta, retries = value
    if eta is not None and not (isinstance(eta, str) and 0 < len(eta) <= MAX_ETA_CHARS):
        return None
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries < 2**31:
        return None
    return eta, retries


def eta_value(eta: object) -> str | None:
    """A request's ``eta`` as the ``throttle_eta`` header keeps it: Celery's ISO 8601
    string (a ``datetime`` in older protocols: formatted), or None."""
    if eta is None or eta == "":
        return None
    if isinstance(eta, str):
        return eta[:MAX_ETA_CHARS]
    isoformat = getattr(eta, "isoformat", None)
    return str(isoformat()) if callable(isoformat) else None


MAX_ROUTE_CHARS = 255
"""The longest exchange or routing key kept in the ``throttle_delivery`` header (AMQP's
limit for both)."""


def delivery_header(headers: Mapping[str, Any]) -> tuple[str, str, bool] | None:
    """The ``throttle_delivery`` header as (exchange, routing_key, redelivered), or None
    when absent or corrupt."""
    value = headers.get(H_DELIVERY)
    if not isinstance(value, list | tuple) or len(value) != 3:
        return None
    exchange, routing_key, redelivered = value
    for name in (exchange, routing_key):
        if not isinstance(name, str) or len(name) > MAX_ROUTE_CHARS:
            return None
    if not isinstance(redelivered, bool):
        return None
    return exchange, routing_key, redelivered


def delivery_value(headers: Mapping[str, Any], delivery_info: object) -> list[Any]:
    """The ``throttle_delivery`` header of a copy about to be re-published: the one the
    message carried (its producer's delivery), else this delivery's; ``redelivered`` if
    either says so."""
    info = delivery_info if isinstance(delivery_info, Mapping) else {}
    redelivered = bool(info.get("redelivered"))
    saved = delivery_header(headers)
    if saved is not None:
        return [saved[0], saved[1], saved[2] or redelivered]
    exchange, routing_key = info.get("exchange"), info.get("routing_key")
    return [
        exchange[:MAX_ROUTE_CHARS] if isinstance(exchange, str) else "",
        routing_key[:MAX_ROUTE_CHARS] if isinstance(routing_key, str) else "",
        redelivered,
    ]


def restore_delivery(request: Any) -> None:
    """Show a re-published copy the delivery of the message its producer sent
    (``exchange``, ``routing_key``, ``redelivered``, from ``throttle_delivery``) in
    ``request.delivery_info``. Done just before the body runs: the gate decides on the
    copy's own delivery (the queue it came from, whether the broker redelivered it)."""
    headers = request.headers
    saved = delivery_header(headers) if isinstance(headers, Mapping) else None
    if saved is None:
        return
    info = request.delivery_info
    info = dict(info) if isinstance(info, Mapping) else {}
    info["exchange"], info["routing_key"] = saved[0], saved[1]
    info["redelivered"] = saved[2] or bool(info.get("redelivered"))
    request.delivery_info = info


TRANSPORT_PROPERTIES = frozenset(
    {
        # The transport's own bookkeeping of this delivery (Redis, the AMQP frame).
        "delivery_info",
        "delivery_tag",
        "body_encoding",
        "application_headers",
        "redelivered",  # (Redis) shown to the task from ``throttle_delivery`` instead
        # Set by the copy's own publish: its body's serializer, and the time it was sent.
        "content_type",
        "content_encoding",
        "timestamp",
        # Checked by RabbitMQ against the publishing connection's user: the producer's,
        # re-published by a worker connected as another user, is refused.
        "user_id",
        # Celery derives it from the task's ``expires`` at each publish (the time left
        # then); the message's own would restart the broker's TTL.
        "expiration",
    }
)
"""Message properties a deferred copy does not take from the message (see
:func:`carried_properties`)."""


def carried_properties(request: Any) -> dict[str, Any]:
    """The message properties a deferred copy is published with: every property the
    message came with (``request.properties``: ``app_id``, ``correlation_id``,
    ``reply_to``, ``priority``, ``delivery_mode``, ``type``, ``message_id``, and on the
    Redis transport any other property a producer passed to ``apply_async``), but those
    of :data:`TRANSPORT_PROPERTIES`. Celery's ``signature_from_request`` keeps only
    ``reply_to`` and ``priority`` of them; the rest reach the copy's publish as options
    (``send_task`` passes unknown options on as properties)."""
    properties = getattr(request, "properties", None)
    if not isinstance(properties, Mapping):
        return {}
    return {
        name: value
        for name, value in properties.items()
        if isinstance(name, str) and name not in TRANSPORT_PROPERTIES and value is not None
    }


def parked_payload(signature: Mapping[str, Any], serializer: str | None) -> bytes:
    """A task's signature as the parking lot keeps it: ``content type\\nencoding\\nbody``,
    the body serialized by kombu with ``serializer`` (the task's own), so that a releaser
    or ``celery throttle parked`` reads it back without knowing the task."""
    content_type, encoding, body = dumps(  # type: ignore[no-untyped-call]
        dict(signature), serializer=serializer
    )
    head = f"{content_type}\n{encoding}\n".encode()
    return head + (body if isinstance(body, bytes) else body.encode())


def parked_signature(payload: bytes) -> dict[str, Any]:
    """The signature in a parked payload (:func:`parked_payload`), as ``app.signature``
    takes it.

    Unlike the headers, it raises on a payload it cannot read: ``ValueError`` when the
    payload is not of that shape (no two lines of head, a head that is not UTF-8, a body
    that is not a mapping), kombu's ``DecodeError`` or ``ContentDisallowed`` when the body
    does not decode as its content type says (or this process refuses that serializer).
    The releaser logs it and keeps the task parked; the command shows it as unreadable."""
    parts = payload.split(b"\n", 2)
    if len(parts) != 3:
        raise ValueError("a parked payload has the lines: content type, encoding, body")
    content_type, encoding, body = parts
    signature = loads(  # type: ignore[no-untyped-call]
        body, content_type.decode(), encoding.decode()
    )
    if not isinstance(signature, dict):
        raise ValueError(f"a parked payload holds a task signature, not {type(signature).__name__}")
    return signature
