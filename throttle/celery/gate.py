"""The gate: decide for one execution whether it runs now, sleeps to its slot, or comes back.

1. The task's rules are evaluated (:func:`throttle.rules.targets`): key and cost from its
   arguments, the rate in force from Redis when an operator changed it at run time.
2. One :meth:`Limiter.acquire_many` with the task id as acquisition id: a redelivered task
   does not pay twice. Token bucket and GCRA limits *reserve* the next free slot.
3. A slot within ``sleep_max``: the task sleeps until it (looking once more just before
   it, for a hold placed meanwhile) and the body runs on a :class:`Ticket`. In a worker,
   the worker's consumer takes step 2 before the pool and holds the task until shortly
   before its slot (:mod:`throttle.celery.waiting`): the gate gets that decision
   (:class:`Admission`) and sleeps only the rest, at most ``waiting.LEAD_S``.
   Further ahead: the task is re-published for just before its slot
   (:mod:`throttle.celery.reschedule`). A task late for its slot (busy workers) gives it
   up and takes a new one. A denial that reserved nothing (windows, concurrency) comes
   back when the limit says it could admit, plus a random jitter.
4. Past the task's deadline: past its ``max_wait``, ``on_timeout``; past its ``expires``
   (Celery's: the task must not start after it), the task is revoked as expired, as
   Celery's worker does with a task received too late.

A re-published task is shown the ETA its producer gave it as ``request.eta`` (None when it
had none), not the throttler's own.

Eager mode (``task_always_eager``, ``Task.apply``) and direct calls block the caller until
the slot comes (one sleep per denial, never a busy loop), or raise ThrottleTimeout.
When the limiter's Redis fails, the rules' ``on_redis_down`` decide
(:mod:`throttle.celery.redis_down`).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore

from throttle.celery import shadow
from throttle.celery.arrival import eta_lead_s
from throttle.celery.execution import Admission, Execution, Ticket
from throttle.celery.message import (
    H_PARKED,
    H_PUBLISH,
    deadline_header,
    eta_header,
    id_header,
    planned_header,
)
from throttle.celery.plan import Plan, hand_back, plan_at, plan_id
from throttle.celery.redis_down import run_while_down
from throttle.celery.reschedule import defer, time_out
from throttle.celery.runtime import Throttler
from throttle.decision import Decision
from throttle.errors import BackendError, ThrottleTimeout
from throttle.limiter import DEFAULT_LEASE_S
from throttle.rules import Declared, Target, targets

logger = logging.getLogger("throttle")

MAX_RESERVE_S = 86400.0
"""The farthest ahead a slot is reserved, in s; a task that would wait longer is denied and
comes back when the limit says (a rate changed at run time applies to it then)."""
RECHECK_LEAD_S = 0.01
"""A task sleeping to its slot looks at Redis again this long before it (for holds placed
meanwhile), then sleeps the rest: the round trip must not make the call late."""


class Gate:
    """Decides for one execution of one task: run now (maybe after a short sleep), or
    come back later, or time out. :meth:`enter` returns the ticket to run on (None: run
    without one), or raises celery's Retry/Ignore, or ThrottleTimeout."""

    def __init__(
        self,
        task: Task,
        declared: Declared | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        request: Any = None,
    ) -> None:
        throttler = Throttler.of(task.app)
        self.execution = execution = Execution(task, throttler, (), fn, args, kwargs)
        if request is not None:
            # Decided in the worker's consumer, before the task runs: the request is the
            # one its pool child will see (:mod:`throttle.celery.waiting`).
            execution.request = request
        self.rule_set = throttler.rule_set(task, declared, execution.queue)
        execution.rules = self.rule_set.rules
        self.settings = throttler.settings
        self.limiter = throttler.limiter
        self.acquiring: list[Target] | None = None
        """What :meth:`_acquire` takes when not the task's targets (a task with a plan)."""
        self.plan: Plan | None = None
        self.planned: float | None = None
        """The planned time of a task back with a plan (epoch s, Redis clock), else None."""

    def enter(self, admission: Admission | None = None) -> Ticket | None:
        """Decide, and return the ticket to run on (see the class). ``admission``: what
        the worker's consumer decided already (:mod:`throttle.celery.waiting`), taken as
        the first acquisition instead of a round trip of this one's."""
        execution = self.execution
        restore_eta(execution)  # first: a copy re-published during an outage keeps it too
        if self.rule_set.shadow:  # limits in shadow mode: looked at, never waited for
            shadow.look(execution, self.rule_set.shadow)
        if not execution.rules:
            return None
        try:
            self._drop_second_copy()
            self.evaluate()
            now = time.time()
            if execution.eager:
                ticket = self._block()
            else:
                ticket = self._decide(now, admission)
                if admission is not None:
                    now = admission.decided_at  # the wait counted from the decision
            if self.rule_set.guarded:
                self._space()
        except BackendError as exc:
            run_while_down(execution, exc)
            return None
        if not execution.eager:
            execution.throttler.observer.allowed(execution, ticket.slot_at - now)
        return ticket

    def evaluate(self) -> None:
        """Evaluate the task's rules on its call (targets, deadlines) and, for a task with
        a plan, what it acquires: no Redis round trip (the rates in force are cached)."""
        execution, rule_set = self.execution, self.rule_set
        execution.targets = targets(
            execution.rules, execution.fn, execution.args, execution.kwargs,
            execution.throttler.rates.current, by_name=rule_set.by_name,
        )  # fmt: skip
        if rule_set.estimates:  # estimated costs reserved at the share the calls use
            execution.targets, execution.estimates = execution.throttler.estimates.scaled(
                execution.rules, execution.targets
            )
        if rule_set.adaptive:
            self._learn()
        set_deadlines(execution)
        shape = rule_set.plan
        if shape is not None and not execution.eager:
            self.plan = plan_at(execution.targets, shape)
            self.planned = planned_header(execution.message_headers)
            self.acquiring = self.plan.due if self.planned is not None else self.plan.admit

    def admit(self) -> Decision:
        """The first acquisition of an evaluated execution (one round trip): what the
        worker's consumer decides before the pool (:mod:`throttle.celery.waiting`)."""
        return self._acquire(*self._horizon())

    def plan_wait_s(self) -> float:
        """How long a task back with a plan waits before it acquires its real limits, in
        s (0 without a plan): until just before its planned time, at most ``sleep_max``
        (see :meth:`_wait_for_plan`)."""
        if self.planned is None:
            return 0.0
        lead = self.planned - self.execution.throttler.clock.now() - RECHECK_LEAD_S
        return min(max(lead, 0.0), self.settings.sleep_max_s)

    def _space(self) -> None:
        """The call-time spacing guard of the limits that have it (``Rule.guarded``): one
        round trip stamps the call on the Redis clock, then sleeps until the previous call
        of each such limit (and key) is at least its spacing ago. A task that started late
        for its slot then pushes the next call back instead of landing next to it."""
        targets = self.execution.targets
        wait = self.limiter.space([targets[i] for i in self.rule_set.guarded])
        if wait > 0:
            time.sleep(wait)

    def _learn(self) -> None:
        """Adaptive limits at their learned rate (:mod:`throttle.adaptive`): never above
        the rate in force, per key for a keyed limit."""
        execution = self.execution
        learned = execution.throttler.learned
        execution.targets = [
            (learned.current(limit, key, rule.adaptive) if rule.adaptive else limit, key, cost)
            for rule, (limit, key, cost) in zip(execution.rules, execution.targets, strict=True)
        ]

    def _drop_second_copy(self) -> None:
        """A parked task released twice (a releaser died between publishing and committing)
        runs once: the parking lot accepts one publish of each token."""
        headers = self.execution.message_headers
        token, publish = id_header(headers, H_PARKED), id_header(headers, H_PUBLISH)
        if (
            token is not None
            and publish is not None
            and not self.execution.throttler.parking.accept(token, publish)
        ):
            logger.info(
                "throttle: dropping a second copy of parked task %s", self.execution.request.id
            )
            raise Ignore()

    # -- horizons

    def _horizon(self) -> tuple[float, float | None]:
        """How far ahead a slot may be reserved: ``(max_wait_s, reserve_until)``, the
        second the task's deadline (epoch s, Redis clock) when it comes first, else None.
        The deadline goes to the script as a time, not as a wait measured here: the call's
        latency would carry the window past it. A concurrency unit must not be held while
        the task waits, so with one the wait is at most a sleep."""
        execution = self.execution
        horizon = self.settings.sleep_max_s if self.rule_set.concurrency else MAX_RESERVE_S
        if self.plan is not None:
            # A task with a plan reserves real slots within a sleep only (see plan.py).
            horizon = self.settings.sleep_max_s
        deadline = execution.deadline
        if deadline is not None and deadline - execution.throttler.clock.now() < horizon:
            return 0.0, deadline
        return horizon, None

    def _lease_s(self) -> float:
        """How long the acquisition's record and concurrency units live after its slot, in
        s: the task's hard time limit (or DEFAULT_LEASE_S) + 60 s. The script counts it from
        the slot, so a wait before the slot is in it already."""
        execution = self.execution
        limit = execution.request.timelimit or (None, None)
        hard = limit[0] or execution.task.time_limit or execution.throttler.task_time_limit
        return max(float(hard or DEFAULT_LEASE_S), 1.0) + 60.0

    def _acquire(self, max_wait_s: float, reserve_until: float | None = None) -> Decision:
        """Acquire (or look again at) the execution's slot, reserving up to ``max_wait_s``
        ahead or until ``reserve_until`` (:meth:`_horizon`); a reserved slot that a hold
        placed since has voided (an upstream 429, a pause) is given up, and the decision
        reads as a denial until the hold ends."""
        execution = self.execution
        decision = self.limiter.acquire_many(
            execution.targets if self.acquiring is None else self.acquiring,
            max_wait_s=max_wait_s,
            acquisition_id=execution.request.id,
            lease_s=self._lease_s(),
            reserve_until=reserve_until,
        )
        if decision.held and not decision.allowed and decision.acquisition is not None:
            self.limiter.settle(decision.acquisition, None)
        return decision

    def _give_up(self, decision: Decision) -> None:
        """Give up the slot of ``decision`` (the task is too late for it). Not a refund:
        the passed slot is lost capacity (a burst-1 API cannot bank it), and handing it
        back would book the same future slot twice."""
        assert decision.acquisition is not None
        self.limiter.settle(decision.acquisition, None)

    # -- the worker path

    def _decide(self, now: float, admission: Admission | None = None) -> Ticket:
        """A ticket for a slot within ``sleep_max`` (after sleeping to it); otherwise the
        task comes back later (raises). ``admission``: the first acquisition, taken by
        the worker's consumer, which held the task until shortly before its slot."""
        late_tolerance = self._late_tolerance()
        redelivered = bool((self.execution.request.delivery_info or {}).get("redelivered"))
        planned = self.planned
        first: Decision | None = None
        first_slot = now
        if admission is not None:
            # The consumer waited for the plan, and for the slot up to LEAD_S before it.
            first, first_slot = admission.as_of(now)
        elif planned is not None and self._wait_for_plan(planned):
            now = time.time()
        while True:
            decision = first if first is not None else self._acquire(*self._horizon())
            # The consumer's decision counts as held: its slot was reserved before the
            # pool took the task, which may have been late (a busy pool).
            on_first = first is not None
            reserved = decision.held or on_first
            first = None
            if (
                decision.allowed
                and reserved
                and decision.late_s > late_tolerance
                and not redelivered
            ):
                # The task reached its reserved slot late (busy workers): calling now could
                # land on the next task's slot: take a new one. Not for a redelivered
                # message (its worker or pool child died, most likely in the body, after
                # the slot): it is the same execution again, and keeps the slot it paid
                # for; a new one would charge the task twice. The trade-off: a copy that
                # died before its slot (prefetched) may now call up to its lateness
                # off-slot.
                self._give_up(decision)
                decision = self._acquire(*self._horizon())
                on_first = False
            self.execution.throttler.outage(None)
            if not decision.allowed:
                if self.plan is not None and planned is None:
                    self._make_plan(decision)
                self._come_back(decision, planned=planned)
            wait = decision.wait_s
            if wait > self.settings.sleep_max_s:
                # A slot is reserved, further ahead: come back just before it, never more
                # than sleep_max before it (throttle.celery.arrival): once per slot.
                defer(self.execution, wait - eta_lead_s(self.settings), wait, decision, slot=True)
            if wait > 0 and decision.acquisition:
                decision, on_time = self._sleep_to_slot(decision, late_tolerance)
                if not decision.allowed:
                    self._come_back(decision, planned=planned)
                if not on_time:
                    # Woke too late (a busy machine): the slot passed, take a new one.
                    self._give_up(decision)
                    now = time.time()
                    continue
            plan = self.plan.plan if planned is not None and self.plan is not None else None
            # The slot of the consumer's decision (its time, when it admitted at once).
            slot_at = first_slot if on_first else now + wait
            return Ticket(decision.acquisition, self.execution.rules, slot_at, plan=plan)

    def _late_tolerance(self) -> float:
        """How late a task may reach its reserved slot and still call on it, in s.

        ``late_tolerance``; but when every reserving limit of the task (token bucket,
        GCRA) has the spacing guard, up to one spacing of the tightest of them (at most
        half a ``sleep_max``). Giving a slot up keeps a late call from landing next to the
        following one; the guard already does that, by pushing the following calls back
        by the lateness. Kept, a slot late by d delays the busy period's later calls by at
        most d (the guard's push is the largest lateness since the limit was last idle,
        not a sum), so never by more than one spacing; given up, it is a whole spacing of
        the limit lost, and the task goes to the back of the queue."""
        execution, tolerance = self.execution, self.settings.late_tolerance_s
        if not self.rule_set.guarded:
            return tolerance
        spacing = math.inf
        for rule, (limit, _, cost) in zip(execution.rules, execution.targets, strict=True):
            if limit.algorithm.reserves:
                if not rule.guarded:
                    return tolerance
                spacing = min(spacing, limit.period_s / limit.count * cost)
        if math.isinf(spacing):
            return tolerance
        return max(tolerance, min(spacing, self.settings.sleep_max_s / 2))

    def _sleep_to_slot(self, decision: Decision, late_tolerance: float) -> tuple[Decision, bool]:
        """Sleep until the slot of ``decision`` (allowed, in the future); returns the
        decision as it stands then, and whether the wake-up came within ``late_tolerance``
        (s)."""
        wait = decision.wait_s
        left = wait
        if wait > RECHECK_LEAD_S:
            # A hold may begin while this task sleeps (the upstream answered another task
            # 429): look once more, with the id, shortly before the slot, so that the call
            # itself still lands on the slot.
            time.sleep(wait - RECHECK_LEAD_S)
            decision = self._acquire(0.0)
            if not decision.allowed:
                return decision, True
            if decision.late_s > late_tolerance:
                return decision, False
            left = decision.wait_s
        if left <= 0:
            return decision, True
        start = time.monotonic()
        time.sleep(left)
        return decision, time.monotonic() - start - left <= late_tolerance

    def _wait_for_plan(self, planned: float) -> bool:
        """A task back with a plan for ``planned`` (epoch s, Redis clock) sleeps until just
        before it (at most ``sleep_max``) and only then takes its real limits: reserved
        earlier, the shared limit's next slot would be set that far ahead, and a task of an
        idle key arriving meanwhile would wait behind it (a GCRA or a token bucket keeps
        one next slot; the time before it cannot be handed to another). It came back half
        a sleep early, so that a late delivery still makes its slot. Returns whether it
        slept."""
        lead = planned - self.execution.throttler.clock.now() - RECHECK_LEAD_S
        if lead <= 0:
            return False
        time.sleep(min(lead, self.settings.sleep_max_s))
        return True

    def _make_plan(self, decision: Decision) -> None:
        """An arriving task with a plan could not be admitted within a sleep: reserve its
        place on the plans of its keyed limits, and come back for it (raises); or, when
        the plans deny (a wait beyond the horizon), return to come back as they say."""
        assert self.plan is not None
        execution = self.execution
        # Recorded under the plan's id: a copy redelivered after this worker died before
        # re-publishing finds this plan (held, wait_s: until its slot) and takes no other.
        plan = self.limiter.acquire_many(
            self.plan.plan, max_wait_s=self._plan_horizon(),
            acquisition_id=plan_id(execution.request.id), lease_s=self._lease_s(),
        )  # fmt: skip
        if not plan.allowed:
            return
        # The plan says when the task's own limits let it run; the limits of the admit
        # step (the shared one too) when it could at the earliest.
        wait = max(plan.wait_s, decision.retry_after_s)
        if math.isinf(wait):
            return
        if execution.deadline is not None:
            now = execution.throttler.clock.now()
            if now + wait > execution.deadline:
                assert plan.acquisition is not None
                self.limiter.settle(plan.acquisition, 0.0)  # handed back: it will not come
                time_out(execution, now, wait, decision)
        # Back half a sleep early: it then reserves its real slots (within sleep_max) and
        # sleeps to them, so that a late return (ETA precision, a busy pool) does not leave
        # its keyed limit's slot unused.
        planned = execution.throttler.clock.now() + plan.wait_s
        defer(execution, wait - self.settings.sleep_max_s / 2, wait, decision, slot=True,
              planned=planned)  # fmt: skip

    def _plan_horizon(self) -> float:
        horizon = MAX_RESERVE_S
        if self.execution.deadline is not None:
            left = self.execution.deadline - self.execution.throttler.clock.now()
            horizon = min(horizon, max(left, 0.0))
        return horizon

    def _come_back(self, decision: Decision, *, planned: float | None = None) -> NoReturn:
        """A denial: come back when the limits say, plus a jitter; or time out (the
        deadline is on the Redis clock). ``planned``: the task keeps its plan (for that
        time, epoch s)."""
        execution, settings = self.execution, self.settings
        retry = decision.retry_after_s
        if math.isinf(retry):
            # Paused (celery throttle pause): look again now and then; nothing is lost.
            recheck = settings.pause_recheck_s
            retry = recheck + random.uniform(0.0, recheck / 2)
            defer(execution, retry, retry, decision, planned=planned)
        if execution.deadline is not None:
            now = execution.throttler.clock.now()
            if now + retry > execution.deadline:
                if planned is not None and self.plan is not None:
                    # Its plan slot is handed back: the key's next tasks need not wait for it.
                    hand_back(self.limiter, self.plan.plan, execution.request.id,
                              [0.0] * len(self.plan.plan), self._lease_s())  # fmt: skip
                time_out(execution, now, retry, decision)
        jitter = 0.0
        if not planned_by_fair(execution, decision):
            jitter = random.uniform(0.0, min(settings.jitter_s, max(retry, 0.05)))
        defer(execution, retry + jitter, retry, decision, planned=planned)

    # -- eager mode and direct calls

    def _block(self) -> Ticket:
        execution = self.execution
        while True:
            now = time.time()
            decision = self._acquire(*self._horizon())
            if decision.allowed:
                if decision.wait_s > 0:
                    time.sleep(decision.wait_s)
                return Ticket(decision.acquisition, execution.rules, now + decision.wait_s)
            retry = min(decision.retry_after_s, self.settings.pause_recheck_s)
            deadline = execution.deadline
            if deadline is not None:
                left = deadline - execution.throttler.clock.now()
                if retry > left:
                    raise ThrottleTimeout(decision.denied_by, retry, max(left, 0.0))
            time.sleep(retry + random.uniform(0.0, min(self.settings.jitter_s, retry) / 10))


def planned_by_fair(execution: Execution, decision: Decision) -> bool:
    """Whether only fair limits denied: their script has already spread the comebacks (one
    share interval apart per key, a little before the key is due), so a jitter would only
    make them late and leave slots of the shared rate unused. The price: tasks a hold of a
    fair limit denied come back together at its end, and the script spreads them then."""
    fair = {limit.name for limit, _, _ in execution.targets if limit.fair}
    denied = decision.denied_by
    return bool(denied) and fair.issuperset(denied)


def restore_eta(execution: Execution) -> None:
    """Show the task the ETA its producer gave it: a re-published copy carries the
    throttler's own ETA (or none, once parked), and the original in ``throttle_eta``, which
    is restored into ``request.eta`` (None: the producer gave none) unless a Celery
    ``retry`` came since (its ETA is the one to show)."""
    saved = eta_header(execution.message_headers)
    if saved is not None and saved[1] == execution.request.retries:
        execution.request.eta = saved[0]


def set_deadlines(execution: Execution) -> None:
    """Set the execution's ``timeout_at`` (:func:`timeout_of`), ``expires``
    (:func:`expires_of`) and ``deadline``, the earlier of the two."""
    execution.timeout_at = timeout_of(execution)
    execution.expires = expires_of(execution)
    execution.deadline = _earliest(execution.timeout_at, execution.expires)


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def timeout_of(execution: Execution) -> float | None:
    """The execution's ``max_wait`` deadline on the Redis clock (epoch s), which any worker
    reads the same whatever its own clock: its ``throttle_deadline`` header (set at its
    first deferral), else now + the shortest ``max_wait`` of its rules; None without one."""
    deadline = deadline_header(execution.message_headers)
    if deadline is None:
        waits = [rule.max_wait_s for rule in execution.rules if rule.max_wait_s is not None]
        deadline = execution.throttler.clock.now() + min(waits) if waits else None
    return deadline


def expires_of(execution: Execution) -> float | None:
    """The task's ``expires`` on the Redis clock (epoch s), or None. ``expires`` is
    Celery's: an absolute time on the producer's clock, which Celery compares with the
    receiving worker's clock; the throttler reads it as Celery does, on this worker's clock,
    converted to Redis time by its measured offset."""
    expires = execution.request.expires
    if not expires:
        return None
    try:
        stamp = (
            datetime.fromisoformat(expires).timestamp()
            if isinstance(expires, str)
            else float(expires.timestamp())
        )
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None
    return execution.throttler.clock.from_wall(stamp)
