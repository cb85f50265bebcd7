"""After the body: settle the acquisition with what the call really cost.

A cost the body reported (:func:`throttle.celery.report_cost`) replaces its estimate; a
body that raised refunds the limits whose rule says ``on_error: refund``; concurrency units
come back. One round trip (``Limiter.settle``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from throttle.celery.execution import Ticket
from throttle.errors import BackendError

if TYPE_CHECKING:
    from throttle.celery.runtime import Throttler


def settle(throttler: Throttler, ticket: Ticket, failed: bool) -> None:
    """Settle ``ticket`` once its body returned (``failed``: it raised). A Redis error is
    noted, not raised: the lease expires by itself (concurrency units come back then, a
    refund is lost)."""
    acquisition = ticket.acquisition
    if acquisition is None:
        return
    by_name = {rule.name: rule for rule in ticket.rules}
    actuals: list[float | None] = []
    for limit, _ in acquisition.targets:
        rule = by_name.get(limit.name)
        actual = ticket.reported.get(limit.name)
        if actual is None and rule is not None and rule.estimated:
            actual = ticket.reported.get(None)
        if actual is None and failed and rule is not None and rule.on_error == "refund":
            actual = 0.0
        actuals.append(actual)
    names = [limit.name for limit, _ in acquisition.targets]
    try:
        settlement = throttler.limiter.settle(acquisition, actuals)
    except BackendError as exc:
        throttler.outage(exc)
        throttler.observer.redis_error(names)
        return
    throttler.observer.settled(names, settlement.deltas)
