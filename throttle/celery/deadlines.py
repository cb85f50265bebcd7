"""The deadlines of one execution, all on the Redis clock (epoch s), which every worker
reads the same whatever its own clock:

- ``timeout_at``: its ``max_wait`` (:func:`timeout_of`). Past it, ``on_timeout`` applies.
- ``expires``: Celery's (:func:`expires_of`). Past it, the task must not start: it is
  revoked as expired, as Celery's worker does with a task received too late.
- ``deadline``: the earlier of the two. No slot is reserved past it (:func:`reserve_within`
  sends it to the script as a time), and a wait that would pass it times out
  (:func:`overdue`; :func:`throttle.celery.reschedule.time_out` tells the two apart).
- the lease (:func:`lease_s`): how long an acquisition's record, and its concurrency
  units, live after its slot.
"""

from __future__ import annotations

from datetime import datetime, timezone

from throttle.celery.execution import Execution
from throttle.celery.message import deadline_header
from throttle.limiter import DEFAULT_LEASE_S

MAX_RESERVE_S = 86400.0
"""The farthest ahead a slot is reserved, in s; a task that would wait longer is denied and
comes back when the limit says (a rate changed at run time applies to it then)."""


def set_deadlines(execution: Execution) -> None:
    """Set the execution's ``timeout_at`` (:func:`timeout_of`; once: an execution
    evaluated again, as the consumer's line does for a waiting task, keeps the one it
    first had), ``expires`` (:func:`expires_of`) and ``deadline``, the earlier of the
    two."""
    if execution.timeout_at is None:
        execution.timeout_at = timeout_of(execution)
    execution.expires = expires_of(execution)
    execution.deadline = _earliest(execution.timeout_at, execution.expires)


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def timeout_of(execution: Execution) -> float | None:
    """The execution's ``max_wait`` deadline on the Redis clock (epoch s), which any worker
    reads the same whatever its own clock: its ``throttle_deadline`` header (set at its
    first deferral), else now + the shortest ``max_wait`` of its rules; None without one."""
    deadline = deadline_header(execution.message_headers, execution.request.retries or 0)
    if deadline is None:
        waits = [rule.max_wait_s for rule in execution.rules if rule.max_wait_s is not None]
        deadline = execution.throttler.clock.now() + min(waits) if waits else None
    return deadline


def expires_of(execution: Execution) -> float | None:
    """The task's ``expires`` on the Redis clock (epoch s), or None. ``expires`` is
    Celery's: an absolute time on the producer's clock, which Celery compares with the
    receiving worker's clock; the throttler reads it as Celery does, on this worker's clock,
    converted to Redis time by its measured offset. A naive one is UTC, as Celery's worker
    reads it (``maybe_make_aware``), not this host's local time."""
    expires = execution.request.expires
    if not expires:
        return None
    try:
        if isinstance(expires, str):
            # Python 3.10's fromisoformat refuses a trailing Z (UTC), which producers in
            # other languages write; Celery's own reader takes it.
            text = expires[:-1] + "+00:00" if expires.endswith(("Z", "z")) else expires
            moment = datetime.fromisoformat(text)
        else:
            moment = expires
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        stamp = float(moment.timestamp())
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None
    return execution.throttler.clock.from_wall(stamp)


def left_s(execution: Execution) -> float | None:
    """How long until the execution's deadline, in s (negative: past it); None without
    one."""
    deadline = execution.deadline
    return None if deadline is None else deadline - execution.throttler.clock.now()


def reserve_within(execution: Execution, horizon_s: float) -> tuple[float, float | None]:
    """How far ahead a slot may be reserved when the gate would reserve up to ``horizon_s``
    (s): ``(max_wait_s, reserve_until)``, ``(0.0, deadline)`` when the deadline comes first,
    else ``(horizon_s, None)``. The deadline goes to the script as a time (epoch s, Redis
    clock), not as a wait measured here: the call's latency would carry the window past
    it."""
    left = left_s(execution)
    if left is not None and left < horizon_s:
        return 0.0, execution.deadline
    return horizon_s, None


def capped_s(execution: Execution, horizon_s: float) -> float:
    """``horizon_s`` (s), or the time left before the deadline when that is shorter (never
    below 0)."""
    left = left_s(execution)
    return horizon_s if left is None else min(horizon_s, max(left, 0.0))


def overdue(execution: Execution, wait_s: float) -> float | None:
    """Now on the Redis clock (epoch s) when waiting ``wait_s`` from now would pass the
    execution's deadline (the task times out), else None."""
    if execution.deadline is None:
        return None
    now = execution.throttler.clock.now()
    return now if now + wait_s > execution.deadline else None


def time_limit_s(execution: Execution) -> float | None:
    """The shortest time limit (soft or hard) the execution runs under in its pool child,
    in s, as Celery's worker sets them: the message's (``soft_time_limit``,
    ``time_limit``), else the task's, else the app's; None without one. It counts from
    when the pool child starts the task, so a sleep to the slot there spends it."""
    hard, soft = execution.request.timelimit or (None, None)
    task, throttler = execution.task, execution.throttler
    hard = hard or task.time_limit or throttler.task_time_limit
    soft = soft or task.soft_time_limit or throttler.task_soft_time_limit
    limits = [float(limit) for limit in (hard, soft) if limit]
    return min(limits) if limits else None


def lease_s(execution: Execution) -> float:
    """How long the acquisition's record and concurrency units live after its slot, in
    s: the task's hard time limit (or DEFAULT_LEASE_S) + 60 s. The script counts it from
    the slot, so a wait before the slot is in it already."""
    limit = execution.request.timelimit or (None, None)
    hard = limit[0] or execution.task.time_limit or execution.throttler.task_time_limit
    return max(float(hard or DEFAULT_LEASE_S), 1.0) + 60.0
