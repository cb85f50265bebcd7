"""Coming back later: every way a task that may not run now goes back, in one place.

- A denial (:func:`come_back`): back when the limits say it could be admitted, plus a
  random jitter (none when only fair limits denied: their script spread the comebacks
  already); while a limit is paused, back every ``pause_recheck`` to look again; past the
  task's deadline (:mod:`throttle.celery.deadlines`), it times out.
- A slot reserved beyond ``sleep_max`` (:func:`come_back_to_slot`): back just before the
  slot (:mod:`throttle.celery.arrival`), once per slot (twice for a task that its pool
  child may not sleep the arrival's lead).
- A task with a plan that could not be admitted within a sleep (:func:`come_back_planned`):
  back at its place on the plans of its keyed limits (:mod:`throttle.celery.plan`).
- The body's own word (:func:`defer_task`; :func:`come_back_if_refused` after the upstream
  refused a call): back in the given time, past the deadline ``on_timeout``.

Each one ends the execution by raising (:mod:`throttle.celery.reschedule` re-publishes,
parks, or times the task out), except where said. A copy that came back is the same task:
it is shown the ETA its producer gave it (:func:`restore_eta`), and a parked copy released
twice runs once (:func:`drop_second_copy`).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from typing import NoReturn

from celery._state import get_current_task
from celery.exceptions import Ignore, Reject, Retry

from throttle.celery.arrival import earliest_arrival_s, eta_lead_s
from throttle.celery.deadlines import (
    MAX_RESERVE_S,
    capped_s,
    lease_s,
    left_s,
    overdue,
    set_deadlines,
)
from throttle.celery.execution import Execution, Refusal, Ticket, current_ticket
from throttle.celery.message import H_PARKED, H_PUBLISH, count_header, eta_header, id_header
from throttle.celery.plan import Plan, hand_back, reserve_plan
from throttle.celery.reschedule import defer, time_out
from throttle.celery.runtime import Throttler
from throttle.decision import Decision
from throttle.errors import RequestError, Throttled, throttled_in
from throttle.units import MAX_DURATION_S

logger = logging.getLogger("throttle")


UNIT_RECHECK_S = 1.0
"""The longest a concurrency limit's denial sends a task back for (or blocks the tasks of
a worker's line for it), in s: a unit comes back when a task ends (announced on
the capacity channel), not when the oldest lease would end, which is what the limit's
retry names (the task time limit and more)."""


def unit_names(execution: Execution) -> set[str]:
    """The names of the execution's concurrency limits."""
    return {limit.name for limit, _, _ in execution.targets if limit.algorithm.holds_units}


def denial_wait_s(decision: Decision, units: set[str], unit_wait_s: float) -> float:
    """How long a denial keeps the task back, in s: the longest wait among the limits that
    denied it, a concurrency limit's (one of ``units``, :func:`unit_names`) at most
    ``unit_wait_s``. A concurrency limit's own retry names when its oldest lease would
    end (the task time limit and more), while a unit comes back when a task ends; beside
    a rate limit that denied too, it would keep the task back as long. A pause (inf)
    stays one."""
    waits = [
        min(state.retry_after_s, unit_wait_s)
        if state.limit in units and not math.isinf(state.retry_after_s)
        else state.retry_after_s
        for state in decision.limits
        if not state.allowed
    ]
    return max(waits, default=decision.retry_after_s)


def known_wait_s(decision: Decision, units: set[str]) -> float:
    """The wait of a denial that the limits can name, in s: that of its rate limits; nan
    when it is a concurrency unit's or a pause's alone, whose end nothing tells (what a
    time-out says the task needed)."""
    known = denial_wait_s(decision, units, 0.0)
    return known if 0 < known < math.inf else math.nan


PAUSE_TO_LINE_S = 1.0
"""How soon a task that a pause stopped on its way to the pool comes back, in s: to a
worker's consumer, whose line holds it until the resume (a ``pause_recheck`` of 30 s
would hold it far longer than the pause may last)."""


def come_back(
    execution: Execution,
    decision: Decision,
    *,
    plan: Plan | None = None,
    planned: float | None = None,
    to_line: bool = False,
) -> NoReturn:
    """A denial: come back when the limits say, plus a jitter; or time out (the
    deadline is on the Redis clock). ``planned``: the task keeps its ``plan`` (for that
    time, epoch s). A concurrency limit's part of the wait is at most
    :data:`UNIT_RECHECK_S`, doubled with each deferral of the task (a worker's consumer
    then waits in its line for a unit to be released; without a line, a task whose units
    stay taken does not come back every second). Paused: back after ``pause_recheck``,
    or at its deadline; ``to_line`` (a task the consumer admitted before the pause
    began): within :data:`PAUSE_TO_LINE_S`, to wait in a worker's line, which a resume
    wakes."""
    settings = execution.settings
    deferrals = min(count_header(execution.message_headers), 6)
    units = unit_names(execution)
    retry = denial_wait_s(decision, units, UNIT_RECHECK_S * 2**deferrals)
    needed = known_wait_s(decision, units)  # what a time-out says the task needed
    if math.isinf(retry):
        # Paused (celery throttle pause): look again now and then; nothing is lost.
        recheck = settings.pause_recheck_s
        if to_line:
            recheck = min(recheck, PAUSE_TO_LINE_S)
        retry = recheck + random.uniform(0.0, recheck / 2)
        left = left_s(execution)
        if left is not None and left < retry:
            if left <= 0:
                time_out(
                    execution, execution.throttler.clock.now(), retry, decision, shown_s=needed
                )
            retry = left  # back at its deadline: to run, or to time out there
        defer(execution, retry, retry, decision, planned=planned)
    now = overdue(execution, retry)
    if now is not None:
        if planned is not None and plan is not None:
            # Its plan slot is handed back: the key's next tasks need not wait for it.
            hand_back(execution.throttler.limiter, plan.plan, execution.request.id,
                      [0.0] * len(plan.plan), lease_s(execution))  # fmt: skip
        time_out(execution, now, retry, decision, shown_s=needed)
    jitter = 0.0
    if not planned_by_fair(execution, decision):
        jitter = random.uniform(0.0, min(settings.jitter_s, max(retry, 0.05)))
    defer(execution, retry + jitter, retry, decision, planned=planned)


def come_back_to_slot(
    execution: Execution, decision: Decision, sleep_max_s: float | None = None
) -> NoReturn:
    """A slot is reserved further ahead than the task may sleep in its pool slot
    (``sleep_max_s``, at most ``sleep_max``): come back just before it, never more than
    ``sleep_max`` before it (:mod:`throttle.celery.arrival`): once per slot.

    A task already back for this slot (``held``: its own reservation), within the
    arrival's lead of it (:func:`~throttle.celery.arrival.earliest_arrival_s`) but further
    from it than ``sleep_max_s``, arrived that early as intended, but its
    pool child may sleep less than that (50 ms without ``acks_late``): a task the worker's
    consumer does not hold for its slot (under Celery's own ``rate_limit``, a ``Strategy``
    of its own). Sent back with the same lead, it came back as early again, and again (up
    to 14 re-publishes for one slot, each a few ms nearer). So it comes back once more, as
    an ETA message (never parked: the releaser's poll would make it early again) due
    within half of ``sleep_max_s`` before the slot, which Celery's consumer holds, its
    message unacknowledged, until then."""
    wait = decision.wait_s
    settings = execution.settings
    if decision.held and sleep_max_s is not None and wait <= earliest_arrival_s(settings):
        lead = min(eta_lead_s(settings), sleep_max_s / 2)
        defer(execution, wait - lead, wait, decision, slot=True, park=False)
    defer(execution, wait - eta_lead_s(settings), wait, decision, slot=True)


def come_back_planned(execution: Execution, decision: Decision, plan: Plan) -> None:
    """An arriving task with a plan could not be admitted within a sleep: reserve its
    place on the plans of its keyed limits (:func:`~throttle.celery.plan.reserve_plan`),
    and come back for it (raises); or, when the plans deny (a wait beyond the horizon),
    return: the task then comes back as :func:`come_back` says."""
    limiter = execution.throttler.limiter
    place = reserve_plan(
        limiter, plan, execution.request.id, decision, capped_s(execution, MAX_RESERVE_S),
        lease_s(execution),
    )  # fmt: skip
    if place is None:
        return
    now = overdue(execution, place.wait_s)
    if now is not None:
        assert place.acquisition is not None
        limiter.settle(place.acquisition, 0.0)  # handed back: it will not come
        time_out(execution, now, place.wait_s, decision)
    # Back half a sleep early: it then reserves its real slots (within sleep_max) and
    # sleeps to them, so that a late return (ETA precision, a busy pool) does not leave
    # its keyed limit's slot unused.
    planned = execution.throttler.clock.now() + place.slot_s
    back_in = place.wait_s - execution.settings.sleep_max_s / 2
    defer(execution, back_in, place.wait_s, decision, slot=True, planned=planned)


def planned_by_fair(execution: Execution, decision: Decision) -> bool:
    """Whether only fair limits denied: their script has already spread the comebacks (one
    share interval apart per key, a little before the key is due), so a jitter would only
    make them late and leave slots of the shared rate unused. The price: tasks a hold of a
    fair limit denied come back together at its end, and the script spreads them then."""
    fair = {limit.name for limit, _, _ in execution.targets if limit.fair}
    denied = decision.denied_by
    return bool(denied) and fair.issuperset(denied)


def defer_task(countdown_s: float, limits: Sequence[str] = ()) -> None:
    """Run the running throttled task again in ``countdown_s`` seconds, as the throttler
    re-runs a denied task: the same id, arguments, options, headers, links and chord, through
    its queue's lane (parked in Redis beyond ``park_after``), without spending
    ``max_retries``; past its deadline (``max_wait``, ``expires``), ``on_timeout`` applies.
    Raises celery's ``Retry``: let it propagate. For a task that its upstream told to come
    back later (:func:`throttle.upstream.report_upstream`); ``limits`` names the limits that
    wait (default: all the task's), as the reason shown. In eager mode and direct calls,
    where there is no queue, raises :class:`Throttled` instead."""
    task, ticket = get_current_task(), current_ticket()
    if task is None or ticket is None:
        raise RuntimeError("defer_task() is for the body of a running throttled task")
    try:
        seconds = float(countdown_s)
    except (TypeError, ValueError):
        seconds = math.nan
    if math.isnan(seconds) or seconds > MAX_DURATION_S:
        # Checked before anything is settled or sent: Celery's ETA arithmetic would fail
        # on it once the slot was given back.
        raise RequestError(
            f"defer_task: countdown_s must be a number of seconds, at most "
            f"{MAX_DURATION_S:.0f} (ten years); got {countdown_s!r}"
        )
    countdown_s = max(seconds, 0.0)
    names = (
        tuple(limits)
        or tuple(rule.name for rule in ticket.rules)
        or tuple(rule.name for rule, _ in ticket.shadow)
    )
    if task.request.is_eager or task.request.called_directly:
        raise Throttled(countdown_s, names)
    execution = Execution(task, Throttler.of(task.app), ticket.rules, task.run)
    set_deadlines(execution)
    # Before the copy is sent (or parked): the copy must take a slot of its own.
    ticket.settle_once(True)
    denied = Decision.denial(names, countdown_s)
    now = overdue(execution, countdown_s)
    if now is not None:
        time_out(execution, now, countdown_s, denied)
    defer(execution, countdown_s, countdown_s, denied)


def come_back_if_refused(ticket: Ticket, exc: Exception) -> None:
    """The body of ``ticket``'s task raised ``exc``: when the upstream refused its last call
    (``report_upstream(..., retry=True)`` recorded it), the task comes back now, once, with
    :func:`defer_task` (raises celery's ``Retry``, or :class:`Throttled` in eager mode).

    The refusal is answered here, after control has left the HTTP client and the SDK
    around it, and not in the hook that saw the 429: an SDK that wraps the hook's
    exception, retries the request itself, or meets a 429 again in its own retry loop
    cannot make the task come back twice, nor run on after its copy was published
    (``anthropic`` wraps any exception of its HTTP client as ``APIConnectionError`` and
    retries it). ``exc`` may be the hook's :class:`Throttled` or whatever the SDK made of
    it. A body that ended with celery's ``Retry``, ``Ignore`` or ``Reject`` has decided
    already (``self.retry()``, :func:`defer_task`): nothing more is published."""
    refusal = ticket.refusal
    if refusal is None:
        refusal = _unseen_refusal(exc)
    if refusal is None or isinstance(exc, (Retry, Ignore, Reject)):
        return
    ticket.refusal = None
    ticket.refused = True
    try:
        defer_task(refusal.countdown_s, refusal.limits)
    except Throttled as throttled:  # eager mode: no queue to come back through
        raise throttled from exc


def _unseen_refusal(exc: BaseException) -> Refusal | None:
    """A refusal the ticket's record does not show, carried by the body's exception: the
    hook's :class:`Throttled`, marked ``from_upstream``, in ``exc`` or what it was raised
    from or during. Either the hook saw it without the task's ticket (a call made from a
    thread that does not carry the body's context, such as a ``ThreadPoolExecutor``'s:
    nothing was held, no limits named), or another call of the body answered the record
    since (a fan-out whose other call was served after the refused one) while the body
    still exits by the refusal. The task comes back as the refusal said instead of
    failing with it."""
    throttled = throttled_in(exc)
    if throttled is not None and throttled.from_upstream:
        return Refusal(throttled.retry_after_s, throttled.denied_by)
    return None


def restore_eta(execution: Execution) -> None:
    """Show the task the ETA its producer gave it: a re-published copy carries the
    throttler's own ETA (or none, once parked), and the original in ``throttle_eta``, which
    is restored into ``request.eta`` (None: the producer gave none) unless a Celery
    ``retry`` came since (its ETA is the one to show)."""
    saved = eta_header(execution.message_headers)
    if saved is not None and saved[1] == execution.request.retries:
        execution.request.eta = saved[0]


def drop_second_copy(execution: Execution) -> None:
    """A task sent back runs once, as one copy (a second one is dropped: raises celery's
    ``Ignore``, which acknowledges it):

    - a parked task released twice (a releaser died between publishing and committing):
      the parking lot accepts one publish of each token;
    - a copy delivered again after it was sent back (its worker died between sending the
      next copy and acknowledging this one): the lot knows the number of the newest copy
      (:func:`throttle.celery.reschedule.defer`). Asked only of a message the broker
      delivered again, so that a first delivery pays no round trip."""
    headers = execution.message_headers
    token, publish = id_header(headers, H_PARKED), id_header(headers, H_PUBLISH)
    parking = execution.throttler.parking
    if token is not None and publish is not None and not parking.accept(token, publish):
        logger.info("throttle: dropping a second copy of parked task %s", execution.request.id)
        raise Ignore()
    delivery = execution.request.delivery_info or {}
    if delivery.get("redelivered") and parking.stale_copy(
        execution.request.id, count_header(headers)
    ):
        logger.info(
            "throttle: dropping task %s delivered again: a newer copy was sent back",
            execution.request.id,
        )
        raise Ignore()
