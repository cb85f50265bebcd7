"""After the body: settle the acquisition with what the call really cost, when there is
something to settle.

A cost the body reported (:func:`throttle.celery.report_cost`) replaces its estimate; a
body that raised refunds the limits whose rule says ``on_error: refund``; concurrency units
come back. One round trip (``Limiter.settle``), and none at all when the body returned and
nothing changes: every cost stays as reserved (fixed costs, estimates not corrected) and no
concurrency unit is held. The lease record is then left to expire on its own (the lease
after the slot, :func:`throttle.celery.deadlines.lease_s`): until then a redelivered copy
of the task still finds its reservation instead of paying twice.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from throttle.celery.execution import Ticket
from throttle.celery.plan import hand_back, rule_name
from throttle.celery.runtime import Throttler
from throttle.decision import Acquisition
from throttle.errors import BackendError, RequestError, ThrottleError
from throttle.limiter import checked_actual
from throttle.spec import PLAN_SUFFIX, Limit

logger = logging.getLogger("throttle")


def settle(
    throttler: Throttler,
    ticket: Ticket,
    failed: bool,
    estimates: Mapping[str, float] | None = None,
) -> None:
    """Settle ``ticket`` once its body returned (``failed``: it raised). ``estimates``:
    the whole estimates of the costs reserved at a learned share of them (rule name ->
    cost, :mod:`throttle.celery.estimates`): charged when the body reports no cost, and
    the share is learned from what it reports. A Redis error is noted, not raised: the
    lease expires by itself (concurrency units come back then, a refund is lost)."""
    acquisition = ticket.acquisition
    if acquisition is None:
        return
    if ticket.draw is not None:
        settle_draw(throttler, ticket, acquisition, failed)
        return
    estimates = estimates or {}
    if not failed and not ticket.reported and not holds_units(acquisition) and not estimates:
        return  # the common case, below without building the costs: nothing to settle
    actuals = actual_costs(ticket, acquisition, failed, estimates)
    if estimates and ticket.reported:
        throttler.estimates.settled(estimates, reported_costs(ticket))
    if not failed and not holds_units(acquisition) and all(a is None for a in actuals):
        # Nothing to settle. A body that raised is settled even then: it may come back
        # under the same id (self.retry, autoretry, defer_task), and that run must pay for
        # its own call, not find this one's reservation.
        return
    names = [limit.name for limit, _ in acquisition.targets]
    # What the observers count is the task's own limits, not their plan twins (plan.py).
    own = [i for i, name in enumerate(names) if not name.endswith(PLAN_SUFFIX)]
    try:
        try:
            settlement = throttler.limiter.settle(acquisition, actuals)
        except RequestError as exc:
            # A cost the limiter refuses: that limit settled as reserved, the others at
            # what was reported, so that the concurrency units come back now, not when the
            # lease ends; the body's outcome stands.
            logger.error("throttle: task %s settled as reserved: %s", acquisition.id, exc)
            actuals = [
                _kept(limit, actual)
                for (limit, _), actual in zip(acquisition.targets, actuals, strict=True)
            ]
            settlement = throttler.limiter.settle(acquisition, actuals)
        if ticket.plan is not None:
            # Ran on a plan: what the call did not use goes back to the plan too.
            by_name = dict(zip((rule_name(n) for n in names), actuals, strict=True))
            plan_actuals = [by_name.get(rule_name(limit.name)) for limit, _, _ in ticket.plan]
            try:
                hand_back(throttler.limiter, ticket.plan, acquisition.id, plan_actuals, 60.0)
            except BackendError:
                raise
            except ThrottleError as exc:
                # A plan that refuses the hand-back (a burst set since below the task's
                # cost): its slot stays taken, as an unsettled one does. Raised, it would
                # replace the body's result or error (the settle runs in a finally).
                logger.warning("throttle: task %s kept its plan's slot: %s", acquisition.id, exc)
    except BackendError as exc:
        throttler.outage(exc)
        throttler.observer.redis_error([names[i] for i in own])
        return
    deltas = settlement.deltas  # empty when the lease was gone: nothing settled
    throttler.observer.settled([names[i] for i in own], [deltas[i] for i in own if deltas])


def settle_draw(throttler: Throttler, ticket: Ticket, share: Acquisition, failed: bool) -> None:
    """Settle a task drawn from a stock (:mod:`throttle.celery.stock`): its actual costs
    go to the stock, settled as a whole when it ends (no round trip here); the observers
    count what the task's own limits were refunded or charged, as for any settle."""
    assert ticket.draw is not None
    if not failed and not ticket.reported:
        ticket.draw.done(())
        return
    actuals = actual_costs(ticket, share, failed)
    ticket.draw.done(actuals)
    own = [
        (limit.name, actual - cost)
        for (limit, _), cost, actual in zip(share.targets, share.costs, actuals, strict=True)
        if actual is not None and not limit.name.endswith(PLAN_SUFFIX)
    ]
    if own:
        throttler.observer.settled([name for name, _ in own], [delta for _, delta in own])


def actual_costs(
    ticket: Ticket,
    acquisition: Acquisition,
    failed: bool,
    estimates: Mapping[str, float] | None = None,
) -> list[float | None]:
    """Each target's actual cost, in order (None: as reserved): the one the body reported
    for the limit by name; else, for an estimated cost, the one it reported for all; else
    0 when the body raised and the rule refunds on error, or when the task comes back for
    an upstream's refusal and the cost is an estimate (a refused call uses no tokens; a
    fixed cost, such as 1 request, stays: an API may count refused requests); else, for a
    cost reserved at a share of its estimate (``estimates``), the whole estimate."""
    reported = ticket.reported
    by_name = {rule.name: rule for rule in ticket.rules}
    actuals: list[float | None] = []
    for (limit, _), reserved in zip(acquisition.targets, acquisition.costs, strict=True):
        name = rule_name(limit.name)  # a plan's cost follows its limit's
        rule = by_name.get(name)
        actual = reported.get(name) if reported else None
        if actual is None and rule is not None and rule.estimated:
            actual = reported.get(None)
        if (
            actual is None
            and failed
            and rule is not None
            and (rule.on_error == "refund" or (ticket.refused and rule.estimated))
        ):
            actual = 0.0
        if actual is None and estimates:
            whole = estimates.get(name)
            actual = None if whole is None or whole == reserved else whole
        actuals.append(actual)
    return actuals


def reported_costs(ticket: Ticket) -> dict[str, float]:
    """The cost the body reported for each limit whose cost is an estimate (rule name ->
    cost): by name, else the one reported for all."""
    reported = ticket.reported
    found: dict[str, float] = {}
    for rule in ticket.rules:
        if rule.estimated:
            actual = reported.get(rule.name, reported.get(None))
            if actual is not None:
                found[rule.name] = actual
    return found


def holds_units(acquisition: Acquisition) -> bool:
    """Whether the acquisition holds concurrency units (given back only by a settle, or by
    the lease's end)."""
    return any(limit.algorithm.holds_units for limit, _ in acquisition.targets)


def _kept(limit: Limit, actual: float | None) -> float | None:
    """``actual`` if a settle of ``limit`` takes it, else None (as reserved)."""
    if actual is None:
        return None
    try:
        return checked_actual(limit, actual)
    except RequestError:
        return None
