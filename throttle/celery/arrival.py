"""How early a rescheduled task arrives before its reserved slot, and why it never comes
back twice for one slot.

A task whose slot is further ahead than ``sleep_max`` is sent back to arrive shortly
*before* the slot, then waits the rest in the worker's consumer
(:mod:`throttle.celery.waiting`), measured by the limiter on the Redis clock: the slot is
kept to the millisecond, whatever the precision of the broker's delivery. For that, the
task must arrive no earlier than ``sleep_max`` before its slot; arriving earlier, the gate
would find the slot beyond ``sleep_max`` once more and send the task back again, and
again, until the slot (a loop that burns broker round trips). So every lead is derived
from ``sleep_max``:

- an ETA message (waits up to ``park_after``) is due :func:`eta_lead_s` before the slot:
  :data:`EARLY_S`, at most half of ``sleep_max``; Celery's worker holds an ETA message until
  it is due on its clock, never before;
- a task coming back for its plan (:mod:`throttle.celery.plan`) is due half of
  ``sleep_max`` before the time its plan gave;
- a parked task is due :func:`park_lead_s` before its slot (``park_lead``, at most half of
  ``sleep_max``) and the releaser publishes it up to one poll, :func:`release_poll_s` (at
  most a quarter of ``sleep_max``), earlier.

So a task arrives at most three quarters of ``sleep_max`` before its slot and sleeps to it:
one re-publication per slot. A task whose pool child may sleep less than that (no
``acks_late``: 50 ms) and that the worker's consumer does not hold for its slot (under
Celery's own ``rate_limit``) comes back once more, within that sleep
(:func:`throttle.celery.comeback.come_back_to_slot`): two. ``sleep_max`` has a floor
(:data:`throttle.config.MIN_SLEEP_MAX_S`)
so that the quarter left over covers the Redis round trips, and the release poll is not
clamped to :data:`MIN_POLL_S`. What this does not cover: an ETA message received by a worker
whose clock is ahead of the publisher's arrives early by that difference (parking, on the
Redis clock, does not depend on the workers' clocks).
"""

from __future__ import annotations

from throttle.config import Settings

EARLY_S = 0.1
"""The most an ETA message of a rescheduled task is due before its slot, in s."""
POLL_S = 0.25
"""How often the releaser looks for due tasks, in s (shorter when ``sleep_max`` is short)."""
MIN_POLL_S = 0.01
"""The shortest release poll, in s (the releaser must not spin)."""


def eta_lead_s(settings: Settings) -> float:
    """How long before its slot an ETA message of a rescheduled task is due, in s."""
    return min(EARLY_S, settings.sleep_max_s / 2)


def park_lead_s(settings: Settings) -> float:
    """How long before its slot a parked task is due to be released, in s."""
    return min(settings.park_lead_s, settings.sleep_max_s / 2)


def release_poll_s(settings: Settings, poll_s: float = POLL_S) -> float:
    """The releaser's poll, in s: it releases tasks due by its next poll, so up to this
    much before they are due."""
    return max(min(poll_s, settings.sleep_max_s / 4), MIN_POLL_S)


def earliest_arrival_s(settings: Settings) -> float:
    """The most a rescheduled task arrives before its slot, in s (see the module): less
    than ``sleep_max`` for every valid setting, so the task sleeps to its slot."""
    return max(eta_lead_s(settings), park_lead_s(settings) + release_poll_s(settings))
