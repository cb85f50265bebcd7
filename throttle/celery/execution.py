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
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from celery import Task, signals

from throttle.celery.message import queue_of
from throttle.celery.runtime import Throttler
from throttle.celery.stock import Draw
from throttle.config import Settings
from throttle.decision import Acquisition, Decision
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
    estimates: dict[str, float] = field(default_factory=dict)
    """The whole estimates of the costs reserved at a learned share of them (rule name ->
    cost, :mod:`throttle.celery.estimates`): what the settle charges when the body
    reports no cost, and learns the share from when it does."""
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
    shadowing: Callable[[], tuple[tuple[Rule, Target], ...]] | None = None
    """The task's limits in shadow mode with their targets (:mod:`throttle.celery.shadow`),
    evaluated on first use (:attr:`shadow`)."""
    refusal: Refusal | None = None
    """The upstream refused the body's last call and the task is to come back
    (``report_upstream(..., retry=True)``): answered once, when the body exits by an
    exception (:func:`throttle.celery.task.run`); a later call that is served clears it."""
    refused: bool = False
    """The task comes back for an upstream's refusal: the refused call used none of its
    estimated costs, which are then settled at what the body reported, else 0
    (:func:`throttle.celery.settle.actual_costs`)."""
    task: Any = None
    """The running task (set by :func:`throttle.celery.task.run`): the body may call its
    upstream from another thread (``asyncio.to_thread``, which copies the context and so
    the ticket), where Celery's current task and request, kept per thread, are not set."""
    request: Any = None
    """The running task's request (its id, eager or not), for the same reason."""
    draw: Draw | None = None
    """The task's units, when drawn from its process's stock (:mod:`throttle.celery.stock`)
    instead of acquired: :attr:`acquisition` is then its share, not recorded in Redis (the
    stock is settled as a whole)."""
    settler: Callable[[bool], None] | None = None
    """Settles the ticket (failed or not): set by :func:`throttle.celery.task.run`, called
    once (:meth:`settle_once`)."""

    def settle_once(self, failed: bool) -> None:
        """Settle the ticket, once: after the body, or earlier, when a copy of the task is
        published from its body (a retry, a deferral: :func:`settle_before_copy`), so that
        the copy takes a slot of its own instead of finding this one's reservation under
        the same id."""
        settler, self.settler = self.settler, None
        if settler is not None:
            settler(failed)

    @property
    def shadow(self) -> tuple[tuple[Rule, Target], ...]:
        """The task's limits in shadow mode with their targets: nothing reserved; an
        upstream's refusal reported from the body holds their shadow twins and is
        recorded under their names, as it would be enforced."""
        return () if self.shadowing is None else self.shadowing()


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


def settle_before_copy(
    headers: Mapping[str, Any] | None = None, body: Any = None, **_: Any
) -> None:
    """Celery's ``before_task_publish``: a message with the running throttled task's own
    id (a copy of it sent from its body: ``self.retry()``, :func:`defer_task
    <throttle.celery.comeback.defer_task>`, an upstream's refusal) settles the task's
    ticket first. Settled only after the body, the copy could be consumed and acquire
    under the same id before that, find the reservation this run's call used, and call on
    it at once: two calls on one slot."""
    ticket = _ticket.get()
    if ticket is None or ticket.settler is None or ticket.request is None:
        return
    task_id = headers.get("id") if isinstance(headers, Mapping) else None
    if task_id is None and isinstance(body, Mapping):
        task_id = body.get("id")  # protocol 1
    if task_id is not None and task_id == ticket.request.id:
        ticket.settle_once(True)


signals.before_task_publish.connect(
    settle_before_copy, weak=False, dispatch_uid="throttle-settle-before-copy"
)


# -- the consumer's decision, carried to the pool child

ADMISSION_KEY = "throttle_admission"
"""The key of a request's dict (Celery's ``Request.request_dict``, which every pool hands
to its child: prefork pickles it) under which the worker's consumer leaves its decision
for the pool child (:mod:`throttle.celery.waiting`)."""

_SEAL = secrets.token_hex(16)
"""This worker's mark on the decisions its consumer hands to its pool. Drawn when the
module is first imported, in the worker's main process before the pool forks, so every
child of the worker (and every thread or greenlet of it) holds the same one, and no
producer can know it: a message whose headers carry a forged or stale
``throttle_admission`` (a copy that Celery's ``retry`` re-published with its headers)
is decided again, never admitted by it."""


@dataclass(frozen=True)
class Admission:
    """What the worker's consumer decided for one execution, before the pool: the first
    acquisition of the gate (:meth:`throttle.celery.gate.Gate.admit`), taken at
    ``decided_at`` (epoch s, this host's clock, read just before the call)."""

    task_id: str
    decision: Decision
    decided_at: float
    rates_changed: bool = False
    """Whether the consumer had heard of a rate set at run time lately (within the
    rates' ``refresh_s``): the pool child re-reads the rates before it runs the task."""
    targets: tuple[Target, ...] | None = None
    """The targets the consumer acquired (each rule's limit in force, key and cost), with
    the whole estimates of costs reserved at a learned share (:attr:`estimates`): the
    pool child takes them instead of evaluating the rules again (a task's arguments and
    rules are the same on both sides). None: the pool child evaluates them."""
    estimates: Mapping[str, float] = field(default_factory=dict)
    holds_clear: bool | None = None
    """What the consumer knew, when it handed the task to the pool, of holds placed on the
    task's limits since its decision (it listens to the holds' announcements). True:
    none; the pool child runs the task at its slot without looking at Redis again.
    False: one was; the pool child looks again before it calls, however near the slot.
    None (it was not listening): it looks again when the decision's slot was further than
    ``gate.RECHECK_LEAD_S`` from the decision, however near it is when the pool starts
    the task."""

    held_since: float | None = None
    """Since when the task's limits had held it in the worker's line before this decision
    (epoch s, this host's clock; None: it was not held there): the wait it is reported to
    have had counts from then, not from the decision."""
    sleep_max_s: float | None = None
    """The most the pool child may sleep to this decision's slot, in s (None: the
    setting's ``sleep_max``): set when the consumer had no room to hold the task (a
    fixed prefetch count), so that a slot further ahead sends it back through the
    broker for it and its prefetch slot frees."""

    def as_of(self, now: float) -> tuple[Decision, float]:
        """The decision as it stands at ``now`` (epoch s): its ``wait_s`` what is left of
        the wait, its ``late_s`` how long ago its slot passed (a pool that was busy, a held
        slot that had passed already); and when the slot is (epoch s)."""
        decision = self.decision
        if not decision.allowed:
            return decision, now
        slot_at = self.decided_at + decision.wait_s - decision.late_s
        left = slot_at - now
        return decision._replace(wait_s=max(left, 0.0), late_s=max(-left, 0.0)), slot_at


def carry(request_dict: dict[str, Any], admission: Admission) -> None:
    """Leave ``admission`` in a request's dict for the pool child (sealed)."""
    request_dict[ADMISSION_KEY] = (_SEAL, admission)


def mark_clear(request_dict: dict[str, Any], clear: bool | None) -> None:
    """Say, on the admission carried in ``request_dict`` (if any), whether no hold was
    announced on its limits since its decision (:attr:`Admission.holds_clear`)."""
    carried = request_dict.get(ADMISSION_KEY)
    if isinstance(carried, tuple) and len(carried) == 2 and isinstance(carried[1], Admission):
        request_dict[ADMISSION_KEY] = (carried[0], replace(carried[1], holds_clear=clear))


def take_admission(request: Any) -> Admission | None:
    """Take the consumer's decision out of a running task's request (Celery's
    ``Context``): it is removed from the request and its headers, so that no copy of the
    task re-published later carries it. None when there is none, or when it is not this
    worker's (unsealed, another task's)."""
    carried = request.__dict__.pop(ADMISSION_KEY, None)
    headers = request.headers
    if isinstance(headers, dict):
        headers.pop(ADMISSION_KEY, None)
    if not isinstance(carried, tuple) or len(carried) != 2 or carried[0] != _SEAL:
        return None
    admission = carried[1]
    if not isinstance(admission, Admission) or admission.task_id != request.id:
        return None
    return admission
