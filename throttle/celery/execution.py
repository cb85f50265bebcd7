"""One execution of one throttled task: what the gate knows, and the ticket the body runs on.

An :class:`Execution` is built when the task is about to run (its request, headers, queue
and rules); the gate fills in its targets and deadline, and hands it to the rescheduling
and reporting code. A :class:`Ticket` is what an admitted execution holds while its body
runs (the acquisition to settle, the costs the body reported); :func:`current_ticket`
finds it from inside the body (``report_cost``, ``report_upstream``).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery import Task

from throttle.celery.message import queue_of
from throttle.celery.runtime import Throttler
from throttle.config import Settings
from throttle.decision import Acquisition
from throttle.rules import Rule, Target


@dataclass
class Execution:
    """One execution of ``task``: its request and the throttler's view of it."""

    task: Task
    throttler: Throttler
    rules: tuple[Rule, ...]
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    """Each rule's (limit in force, key, cost); empty until the gate evaluates them."""
    deadline: float | None = None
    """Epoch s on the Redis clock, the earlier of ``timeout_at`` and ``expires``: no slot
    is reserved past it."""
    timeout_at: float | None = None
    """The ``max_wait`` deadline (epoch s, Redis clock): past it, ``on_timeout`` applies."""
    expires: float | None = None
    """The task's ``expires`` (epoch s, Redis clock): a task that cannot run before it
    expires (revoked, as Celery does)."""

    @functools.cached_property
    def request(self) -> Any:
        """The task's request (read once: it is the top of a stack, on every lookup)."""
        return self.task.request

    @property
    def settings(self) -> Settings:
        return self.throttler.settings

    @property
    def headers(self) -> dict[str, Any]:
        """A copy of the message's headers (an empty dict when they are not a mapping)."""
        return dict(self.message_headers)

    @functools.cached_property
    def message_headers(self) -> Mapping[str, Any]:
        """The message's headers as they came, for lookups (not a copy: never change it;
        empty when they are not a mapping)."""
        headers = self.request.headers
        return headers if isinstance(headers, Mapping) else {}

    @property
    def queue(self) -> str | None:
        """The queue the task was consumed from (its lane counts as the queue)."""
        return queue_of(self.request.delivery_info)

    @property
    def eager(self) -> bool:
        """Eager mode or a direct call: no message, no queue to come back through."""
        return bool(self.request.is_eager or self.request.called_directly)


@dataclass
class Ticket:
    """What an admitted execution holds: the acquisition to settle, the costs reported."""

    acquisition: Acquisition | None
    rules: tuple[Rule, ...]
    slot_at: float
    """When the slot came, in epoch s of this worker's clock."""
    reported: dict[str | None, float] = field(default_factory=dict)
    plan: list[Target] | None = None
    """The plan targets of a task that ran on a plan (:mod:`throttle.celery.plan`): what a
    cost settled lower hands back to the plan too (its record is ``id`` + ``.plan``)."""
    refusal: Refusal | None = None
    """The upstream refused the body's last call and the task is to come back
    (``report_upstream(..., retry=True)``): answered once, when the body exits by an
    exception (:func:`throttle.celery.task.run`); a later call that is served clears it."""


@dataclass(frozen=True)
class Refusal:
    """An upstream refusal recorded on a ticket: come back in ``countdown_s`` seconds,
    waiting for ``limits`` (their names)."""

    countdown_s: float
    limits: tuple[str, ...]


_ticket: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar(
    "throttle_ticket", default=None
)


def current_ticket() -> Ticket | None:
    """The ticket of the throttled task running in this context, or None."""
    return _ticket.get()


def enter_ticket(ticket: Ticket) -> contextvars.Token[Ticket | None]:
    """Make ``ticket`` the current one; pass the token to :func:`leave_ticket`."""
    return _ticket.set(ticket)


def leave_ticket(token: contextvars.Token[Ticket | None]) -> None:
    _ticket.reset(token)
