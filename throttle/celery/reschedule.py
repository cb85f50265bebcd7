"""Coming back later: re-publish, park, time out, or dead-letter a task.

A deferred task is the same task (same id, arguments, options, headers, links, chord),
re-published with Celery's ``signature_from_request`` and ``Retry`` as ``Task.retry``
does, but without spending ``max_retries``:

- through its queue's lane ``QUEUE.throttled`` (served in turn with QUEUE, so that it does
  not wait behind QUEUE's backlog);
- parked in Redis (:mod:`throttle.parking`) until it is due, on the Redis clock, then sent
  back at once by a worker's releaser: a task with a reserved slot arrives shortly before
  it (``park_lead``, at most half of ``sleep_max``) and sleeps the rest, measured by the
  limiter on the Redis clock. No time of any worker's clock travels in the message, so
  workers whose clocks disagree keep the schedule. Waits up to ``park_after`` (and every
  wait while no releaser runs, without ``install()``, or while the limiter's Redis is
  away) are re-published as Celery ETA messages instead: those are due on the publishing
  worker's clock and held until then on the receiving worker's;
- past the task's deadline: past its ``max_wait``, it fails with :class:`ThrottleTimeout`
  or goes to the dead-letter queue of ``on_timeout``; past its ``expires``, it is revoked
  as expired, as Celery does (:func:`expire`).

A re-published copy keeps the ETA the producer gave the task in the ``throttle_eta``
header; the gate shows it to the task as ``request.eta``. It keeps the message's
properties (``app_id``, ``correlation_id``, ...) and, in ``throttle_delivery``, the
producer's exchange, routing key and ``redelivered``, shown to the body as
``request.delivery_info`` (:func:`copy_of`). A deferral writes nothing to the result
backend (:func:`end_as_retry`): the task's state is what the task stored.

Every function here ends the execution by raising (celery's ``Retry`` or ``Ignore``, or
ThrottleTimeout): none returns.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn

from celery import _state, signals
from celery.exceptions import Ignore, Retry

from throttle.celery.arrival import park_lead_s
from throttle.celery.execution import Execution
from throttle.celery.message import (
    H_DEAD,
    H_DEADLINE,
    H_DEFERRALS,
    H_DELIVERY,
    H_ETA,
    H_NOT_BEFORE,
    H_PARKED,
    H_PLANNED,
    H_PUBLISH,
    carried_properties,
    count_header,
    deadline_value,
    delivery_value,
    eta_value,
    parked_payload,
)
from throttle.celery.plan import rule_name
from throttle.celery.routing import lane_queue
from throttle.decision import Decision
from throttle.errors import BackendError, Throttled, ThrottleTimeout

logger = logging.getLogger("throttle")

PUBLISH_WAIT_S = 60.0
"""How long a re-publish waits for a broker that went away, in s (retries 1 s apart)."""
PUBLISH_RETRY = {
    "max_retries": int(PUBLISH_WAIT_S),
    "interval_start": 0.2,
    "interval_step": 0.2,
    "interval_max": 1.0,
}


def defer(
    execution: Execution,
    countdown_s: float,
    wait_s: float,
    decision: Decision,
    *,
    slot: bool = False,
    planned: float | None = None,
    park: bool = True,
) -> NoReturn:
    """Send the task back to arrive in ``countdown_s`` (parked beyond ``park_after``, unless
    not ``park``: re-published, an ETA message, whatever the wait);
    ``wait_s`` is how long the limits said it must wait (shown and counted). ``slot``: a
    slot (or a plan) is due in ``wait_s``, so a parked task is released ``park_lead``
    before it (at most half of ``sleep_max``: the task then sleeps to it). ``planned``: the
    task holds a plan for this time (``throttle_planned``, epoch s on the Redis clock) and
    takes its limits when it comes back."""
    task, request, settings = execution.task, execution.request, execution.settings
    countdown_s = max(countdown_s, 0.0)
    headers = {k: v for k, v in execution.headers.items() if k not in (H_PARKED, H_PUBLISH)}
    headers[H_ETA] = saved_eta(execution)
    if execution.timeout_at is not None:
        headers[H_DEADLINE] = deadline_value(execution.timeout_at, execution.request.retries)
    else:
        headers.pop(H_DEADLINE, None)  # a corrupt one, read as absent: not passed on
    count = headers[H_DEFERRALS] = count_header(headers) + 1
    headers[H_NOT_BEFORE] = execution.throttler.clock.now() + countdown_s
    if planned is not None:
        headers[H_PLANNED] = planned
    limits = denied_limits(execution, decision)
    route = route_of(execution)
    if park and countdown_s > settings.park_after_s and execution.throttler.releasing:
        sig = copy_of(execution, headers, **route)
        lead_s = park_lead_s(settings) if slot else 0.0
        # The copy's number is recorded with it, atomically (see ParkingLot.park).
        execution.throttler.parking.park(
            parked_payload(sig, task.serializer),
            (wait_s if slot else countdown_s) - lead_s,
            task_id=request.id,
            copy=count,
        )
        how = "park"
    else:
        sig = copy_of(execution, headers, countdown=countdown_s, **route)
        publish(sig)
        how = "republish"
        sent_copy(execution, count)
    execution.throttler.observer.deferred(execution, limits, how, wait_s, count)
    end_as_retry(execution, Throttled(wait_s, limits), countdown_s, sig)


def copy_of(execution: Execution, headers: dict[str, Any], **options: Any) -> Any:
    """The signature of the task's deferred copy: Celery's ``signature_from_request``
    (the same id, arguments, options, links, chord, reply_to, priority) with ``headers``
    and ``options`` (the throttler's: routing, countdown), plus what that leaves out of the
    message: its other properties (``app_id``, ``correlation_id``, ...:
    :func:`throttle.celery.message.carried_properties`; one named as a Celery option is
    that option's) and, in ``throttle_delivery``, how the producer's message was
    delivered (shown to the task again, :func:`throttle.celery.message.restore_delivery`).
    Only scalar properties travel (a parked copy is serialized with the task's serializer).
    """
    request = execution.request
    mapping_headers(request)
    headers[H_DELIVERY] = delivery_value(execution.message_headers, request.delivery_info)
    sig = execution.task.signature_from_request(request, headers=headers, **options)
    for name, value in carried_properties(request).items():
        if isinstance(value, str | int | float | bool):
            sig.options.setdefault(name, value)
    return sig


class DeferralRetry(Retry):  # type: ignore[misc]
    """Celery's ``Retry``, whose repr is its reason's: ``Throttled(limit='api', wait=1.9s)``.

    The worker's ``task-retried`` event (Flower's exception column) carries the repr of
    ``exc_info.exception.exc``. Under the prefork pool the result was pickled on its way
    from the child, which unwraps billiard's ``ExceptionWithTraceback``: that is the reason.
    Under the threads, gevent, eventlet and solo pools nothing is pickled, it is the
    ``Retry`` itself, whose repr Celery builds as ``Retry(Retry(...), Throttled(...), 1.8)``.
    Pickled as ``Retry`` is (``__reduce__``: this class, importable here)."""

    def __repr__(self) -> str:
        return repr(self.exc)


def end_as_retry(execution: Execution, exc: Exception, countdown_s: float, sig: Any) -> NoReturn:
    """End this execution as Celery's ``Task.retry`` does once its copy is published
    (raises ``Retry``: the worker acknowledges the message, sends ``task-retried``, fires
    ``task_retry``), but without writing the result backend: Celery would store RETRY
    with ``exc``, over whatever the task itself stored there (its own ``retry(exc=...)``,
    its PENDING), and the task's result must say what the task did, not that it waits.
    The request's ``ignore_result`` (read by Celery when it handles the ``Retry``) says
    so; it is set after the copy's signature took the task's own. A task with
    ``store_errors_even_if_ignored`` still gets RETRY stored: Celery stores it then."""
    execution.request.ignore_result = True
    raise DeferralRetry(exc=exc, when=countdown_s, sig=sig)


def sent_copy(execution: Execution, count: int) -> None:
    """Record copy ``count`` of the task as sent, before the message being run is
    acknowledged (see :func:`throttle.celery.comeback.drop_second_copy`). A failure to
    record loses only that protection: the copy is out, and this message must still be
    acknowledged."""
    try:
        execution.throttler.parking.sent_copy(execution.request.id, count)
    except BackendError as exc:  # the copy runs in any case
        logger.warning("throttle: task %s: recording its copy %d failed: %r",
                       execution.request.id, count, exc)  # fmt: skip


def mapping_headers(request: Any) -> None:
    """Make a request's headers a mapping (empty when a producer sent something else as
    ``headers``): Celery's ``signature_from_request`` copies them with ``dict.pop`` and
    fails on anything else, and the copy gets the headers the throttler read (none)."""
    if not isinstance(request.headers, Mapping):
        request.headers = {}


def route_of(execution: Execution) -> dict[str, Any]:
    """Where a deferred task is published: its queue's lane, else the queue it was consumed
    from, each through the default exchange, so that exactly that queue receives it (the
    queue's own exchange may be fanout or topic: a copy in every bound queue); a task whose
    queue is unknown goes back as it came (its exchange and routing key)."""
    target = lane_of(execution) or execution.queue
    if target is None:
        return {}
    return {"queue": target, "exchange": "", "exchange_type": "direct"}


def lane_of(execution: Execution) -> str | None:
    """The lane of the task's queue, when lanes are on and consumed (install()); registered
    with the queue's arguments, which Celery declares when it publishes there."""
    queue = execution.queue
    if queue is None or not execution.settings.lanes or not execution.throttler.releasing:
        return None
    return lane_queue(execution.task.app, queue).name


def saved_eta(execution: Execution) -> list[Any]:
    """The ``throttle_eta`` header of a re-published copy: the ETA the task had before it
    was first re-published (the gate restored it into ``request.eta``), and its retries."""
    request = execution.request
    retries = request.retries if isinstance(request.retries, int) else 0
    return [eta_value(request.eta), retries]


def time_out(
    execution: Execution,
    now: float,
    needed_s: float,
    decision: Decision,
    *,
    shown_s: float | None = None,
) -> NoReturn:
    """The task would wait ``needed_s`` from ``now``, past its deadline. If that is past its
    ``expires``, the task expires (:func:`expire`: it could never run); else (past
    ``max_wait``) fail it with ThrottleTimeout, or send it to the dead-letter queue of its
    rule's ``on_timeout`` (once: never from that queue). ``shown_s``: the wait the error
    names, when not ``needed_s`` (nan: none is known, a concurrency unit's or a pause's)."""
    limits = denied_limits(execution, decision)
    if execution.expires is not None and now + needed_s > execution.expires:
        expire(execution, limits)
    left = max((execution.deadline or now) - now, 0.0)
    rules = [r for r in execution.rules if r.name in decision.denied_by] or list(execution.rules)
    queue = next((rule.dead_letter_queue for rule in rules if rule.dead_letter_queue), None)
    headers = execution.headers
    # Consumed from the dead-letter queue it was sent to: throttled as any task (it still
    # calls the API), but never dead-lettered again (no loop). A forged mark can do no
    # more than make a timed-out task fail instead of being dead-lettered.
    dead_lettered = execution.queue is not None and headers.get(H_DEAD) == execution.queue
    if queue is None or dead_lettered:
        execution.throttler.observer.timed_out(execution, limits, "fail")
        raise ThrottleTimeout(decision.denied_by, needed_s if shown_s is None else shown_s, left)
    headers = {k: v for k, v in headers.items() if k not in (H_PARKED, H_PUBLISH, H_DEADLINE)}
    headers[H_DEAD] = queue
    sig = copy_of(execution, headers, queue=queue)
    with outside_the_task():
        sig.apply_async(queue=queue)
    execution.throttler.observer.timed_out(execution, limits, "dead_letter")
    logger.warning(
        "throttle: task %s timed out; sent to dead-letter queue %s", execution.request.id, queue
    )
    raise Ignore()


def expire(execution: Execution, limits: Sequence[str]) -> NoReturn:
    """The task cannot run before its ``expires``: it expires now, as Celery's worker expires
    a task received too late (``celery/worker/request.py``, ``Request.revoked``): its state
    becomes REVOKED (reason ``"expired"``; a chord it belongs to fails, as with Celery), the
    ``task-revoked`` event is sent (when the worker sends task events, ``-E``) and the
    ``task_revoked`` signal with ``expired=True``; its body never runs, its message is
    acknowledged. Unlike Celery's, this happens in the pool child (``task_prerun`` and
    ``task_postrun`` have fired, with state IGNORED), not in the worker's main process."""
    task, request = execution.task, execution.request
    logger.info("throttle: task %s[%s] expires before its slot: revoked", task.name, request.id)
    if task.app.conf.worker_send_task_events and task.send_events:
        task.send_event(
            "task-revoked", retry=False, terminated=False, signum=None, expired=True
        )  # fmt: skip
    task.backend.mark_as_revoked(
        request.id,
        "expired",
        request=request,
        store_result=not task.ignore_result or task.store_errors_even_if_ignored,
    )
    signals.task_revoked.send(
        sender=task, request=request, terminated=False, signum=None, expired=True
    )
    execution.throttler.observer.timed_out(execution, limits, "expired")
    raise Ignore()


def defer_down(execution: Execution, exc: BackendError, countdown_s: float) -> NoReturn:
    """Re-publish the task during an outage of the limiter's Redis (not parked: parking
    lives in Redis). Eager calls, which have no queue, get the error."""
    if execution.eager:
        raise exc
    # Jittered, so that the tasks deferred during an outage do not all come back at once.
    countdown_s += random.uniform(0.0, min(execution.settings.jitter_s, countdown_s))
    headers = {**execution.headers, H_ETA: saved_eta(execution)}
    sig = copy_of(execution, headers, countdown=countdown_s, **route_of(execution))
    publish(sig)
    end_as_retry(execution, exc, countdown_s, sig)


@contextlib.contextmanager
def outside_the_task() -> Iterator[None]:
    """Publish a copy of the running task as its producer did: from outside any task.
    Celery's ``send_task`` takes the task a worker runs for the parent of what it sends
    (its ``parent_id``, and ``root_id`` when the message has none; the result added to the
    task's children): a task's copy sent from the task itself would read its own id as its
    parent (Celery's test_chord::test_parent_ids, its first task deferred). So the
    thread's task stack is set aside while the copy is sent, and restored."""
    stack = _state._task_stack
    saved = []
    while stack.top is not None:
        saved.append(stack.pop())
    try:
        yield
    finally:
        for task in reversed(saved):
            stack.push(task)


def publish(sig: Any) -> None:
    """Re-publish the task, waiting for a broker that went away (up to about
    :data:`PUBLISH_WAIT_S`).

    Until the copy is published, the message this worker holds is the task's only copy,
    and acknowledging it would lose the task: a failed publish must not end the execution
    normally. So the pool slot waits for the broker (it could run nothing else without
    one), then publishes, and the original is acknowledged as usual. After that wait the
    task fails with the broker's error (``OperationalError``), as it would without the
    throttler; the message, unacknowledgeable while the broker is away, comes back after
    the visibility timeout."""
    with outside_the_task():
        sig.apply_async(retry=True, retry_policy=PUBLISH_RETRY)


def denied_limits(execution: Execution, decision: Decision) -> tuple[str, ...]:
    """The limits that denied the task, as users name them: a limit's plan
    (``LIMIT.plan``, :mod:`throttle.celery.plan`) is its limit, each once; all the task's
    limits when the decision names none."""
    names = decision.denied_by or tuple(rule.name for rule in execution.rules)
    return tuple(dict.fromkeys(rule_name(name) for name in names))
