"""Lateness: how late a task may reach its reserved slot and still call on it.

A task that reaches its slot late (a busy pool, a slow start) and calls at once could land
on the next task's slot: past a tolerance it gives the slot up and takes a new one
(:class:`throttle.celery.gate.Gate`). How much lateness is tolerated depends on what
absorbs it: the spacing guard, which pushes the calls after it back; or the burst's slack,
which an upstream enforcing the same limits has in hand; or, with neither,
``settings.late_tolerance`` alone. A task under concurrency limits only is never late: a
unit has no slot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from throttle.celery.execution import Execution
from throttle.rules import Target


def tolerance_s(execution: Execution, guarded: bool) -> float:
    """How late ``execution`` (its targets evaluated) may reach its reserved slot and
    still call on it, in s; ``guarded``: some of its limits have the spacing guard.

    ``late_tolerance``; but when every reserving limit of the task (token bucket, GCRA)
    has the spacing guard, up to one spacing of the tightest of them (at most half a
    ``sleep_max``). Giving a slot up keeps a late call from landing next to the following
    one; the guard already does that, by pushing the following calls back by the
    lateness. Kept, a slot late by d delays the busy period's later calls by at most d
    (the guard's push is the largest lateness since the limit was last idle, not a sum),
    so never by more than one spacing; given up, it is a whole spacing of the limit lost,
    and the task goes to the back of the queue.

    Without the guard, up to the burst's slack (:func:`slack_s`, at most half a
    ``sleep_max``): a late call within it is one an upstream that enforces the same limits
    admits, and giving the slot up would charge its cost again."""
    settings = execution.settings
    tolerance = settings.late_tolerance_s
    if not guarded:
        return max(tolerance, min(slack_s(execution.targets), settings.sleep_max_s / 2))
    spacing = math.inf
    for rule, (limit, _, cost) in zip(execution.rules, execution.targets, strict=True):
        if limit.algorithm.reserves:
            if not rule.guarded:
                return tolerance
            spacing = min(spacing, limit.period_s / limit.count * cost)
    if math.isinf(spacing):
        return tolerance
    return max(tolerance, min(spacing, settings.sleep_max_s / 2))


def slack_s(targets: Sequence[Target]) -> float:
    """How late a call may come after its reserved slot, in s, without an upstream that
    enforces the same limits refusing it or the next call: for each reserving limit
    (token bucket, GCRA), the time its burst beyond this call's cost takes to refill,
    ``(burst - cost) x period / count`` (a call late by d brings the next one d closer,
    which that much burst absorbs); the smallest over them, 0 without any (a burst-1
    limit has none)."""
    slack = math.inf
    for limit, _, cost in targets:
        if limit.algorithm.reserves:
            spare = max(limit.capacity - cost, 0.0)
            slack = min(slack, spare * limit.period_s / limit.count)
    return 0.0 if math.isinf(slack) else slack


def too_late(execution: Execution, guarded: bool, late_s: float) -> bool:
    """Whether a task ``late_s`` behind its slot is later than :func:`tolerance_s`
    (worked out only past ``settings.late_tolerance``, below which it never is). Never
    for a task whose limits are all concurrency limits: a unit has no slot to be late
    for, and giving it up would hand it to a task waiting for one, and send this one
    back."""
    if late_s <= execution.settings.late_tolerance_s:
        return False
    if all(limit.algorithm.holds_units for limit, _, _ in execution.targets):
        return False
    return late_s > tolerance_s(execution, guarded)
