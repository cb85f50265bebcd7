"""The gate: admit one execution, let it wait to its slot, and run it.

1. **Admit.** The task's rules are evaluated (:func:`throttle.rules.targets`): key and
   cost from its arguments, the rate in force from Redis when an operator changed it at
   run time, its deadlines (:mod:`throttle.celery.deadlines`), its plan
   (:mod:`throttle.celery.plan`). Then one :meth:`Limiter.acquire_many` with the task id
   as acquisition id: a redelivered task does not pay twice. Token bucket and GCRA limits
   *reserve* the next free slot, never past the task's deadline. In a worker, the
   worker's consumer takes this step before the pool (:mod:`throttle.celery.waiting`):
   the gate gets that decision (:class:`Admission`).
2. **Wait.** A slot within ``sleep_max``: the task sleeps until it, looking once more
   :data:`RECHECK_LEAD_S` before it (for a hold placed meanwhile); after the consumer
   held it, only the rest, at most ``waiting.LEAD_S``, looking once more only when the
   consumer had heard of a hold placed since its decision. A task late for its slot (busy
   workers) gives it up and takes a new one (:mod:`throttle.celery.lateness`). Anything
   else comes back later (:mod:`throttle.celery.comeback`: a slot further ahead, a
   denial, a plan, a deadline passed).
3. **Run.** The body runs on a :class:`Ticket` (after the spacing guard, for limits that
   have it), settled afterwards (:mod:`throttle.celery.settle`).

Eager mode (``task_always_eager``, ``Task.apply``) and direct calls block the caller until
the slot comes (one sleep per denial, never a busy loop), or raise ThrottleTimeout.
When the limiter's Redis fails, the rules' ``on_redis_down`` decide
(:mod:`throttle.celery.redis_down`).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import Task

from throttle.adaptive import Adaptive
from throttle.celery import shadow
from throttle.celery.comeback import (
    UNIT_RECHECK_S,
    come_back,
    come_back_planned,
    come_back_to_slot,
    denial_wait_s,
    drop_second_copy,
    known_wait_s,
    restore_eta,
    unit_names,
)
from throttle.celery.deadlines import (
    MAX_RESERVE_S,
    lease_s,
    left_s,
    reserve_within,
    set_deadlines,
    time_limit_s,
)
from throttle.celery.execution import Admission, Execution, Ticket
from throttle.celery.lateness import tolerance_s, too_late
from throttle.celery.message import planned_header
from throttle.celery.plan import Plan, due_wait_s, plan_at
from throttle.celery.redis_down import run_while_down
from throttle.celery.runtime import Throttler
from throttle.decision import Decision
from throttle.errors import BackendError, ThrottleTimeout
from throttle.rules import Declared, Target, kept_in_hand, targets
from throttle.spec import Limit

RECHECK_LEAD_S = 0.01
"""A task sleeping to its slot looks at Redis again this long before it (for holds placed
meanwhile), then sleeps the rest: the round trip must not make the call late."""
UNIT_POLL_S = 0.05
"""How soon an eager or direct call denied a concurrency unit looks again, in s (doubling
up to ``comeback.UNIT_RECHECK_S``): nothing announces a unit's return to a caller."""
EARLY_ACK_SLEEP_MAX_S = 0.05
"""The longest a task without ``acks_late`` sleeps to its slot in its pool slot, in s. Its
message is acknowledged when the pool starts it: a worker killed during the sleep would
lose it. A slot further ahead (a task handed over undecided, or one that reached the
consumer's slot late and took another) sends it back, to arrive shortly before the slot
it reserved, and wait for it in a worker's consumer."""


TIME_LIMIT_SHARE = 0.1
"""The most of a task's time limit (its shortest, soft or hard) that its pool child
spends sleeping to its slot, at least :data:`EARLY_ACK_SLEEP_MAX_S`: a slot further ahead
sends the task back, to arrive shortly before it. Celery counts the limit from when the
pool child starts the task, so a longer sleep took the body's time (a task whose slot
was 1 s ahead, with ``soft_time_limit=0.5``, failed with ``SoftTimeLimitExceeded``
before its body began)."""


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
        self.declared = declared
        self.rule_set = throttler.rule_set(task, declared, execution.queue)
        execution.rules = self.rule_set.rules
        self.settings = throttler.settings
        self.limiter = throttler.limiter
        self.acquiring: list[Target] | None = None
        """What :meth:`_acquire` takes when not the task's targets (a task with a plan)."""
        self.plan: Plan | None = None
        self.planned: float | None = None
        """The planned time of a task back with a plan (epoch s, Redis clock), else None."""
        self.direct_id: str | None = None
        """The acquisition id of a direct call (no task id), made on its first acquire."""
        self.learning: list[tuple[Limit, str | None, Adaptive, float]] = []
        """The adaptive limits of the last evaluation: (the limit in force, key, how it
        learns, the learned rate used, per s)."""

    def enter(self, admission: Admission | None = None) -> Ticket | None:
        """Decide, and return the ticket to run on (see the class). ``admission``: what
        the worker's consumer decided already (:mod:`throttle.celery.waiting`), taken as
        the first acquisition instead of a round trip of this one's."""
        execution = self.execution
        restore_eta(execution)  # first: a copy re-published during an outage keeps it too
        shadowing = None
        if self.rule_set.shadow:  # limits in shadow mode: looked at, never waited for
            shadowing = shadow.look(execution, self.rule_set.shadow)
        pairs = None if shadowing is None else shadowing.pairs
        if not execution.rules:
            # Only limits in shadow mode: a ticket without acquisition, for the upstream's
            # refusals reported from the body (their twins held, the task back as enforced).
            return None if pairs is None else Ticket(None, (), time.time(), shadowing=pairs)
        try:
            # Not while Redis fails call after call (outage.Breaker: NotAsked at once, and
            # on_redis_down applies); the rates in force are read in here too.
            with execution.throttler.breaker.asking():
                drop_second_copy(execution)
                if not self._take_evaluation(admission):
                    self.evaluate()
                now = time.time()
                if execution.eager:
                    ticket = self._block()
                else:
                    ticket = self._decide(now, admission)
                    if admission is not None:
                        # The wait counted from the decision, or from when the limits
                        # first held the task back in the worker's line.
                        now = admission.held_since or admission.decided_at
                if self.rule_set.guarded:
                    self._space()
        except BackendError as exc:
            run_while_down(execution, exc)
            # Run while Redis is away: nothing to settle, but a ticket all the same, so
            # that an upstream's refusal seen by the body brings the task back through
            # the broker (come_back_if_refused) instead of failing it.
            return Ticket(None, execution.rules, time.time(), shadowing=pairs)
        if not execution.eager:
            execution.throttler.observer.allowed(execution, ticket.slot_at - now)
        ticket.shadowing = pairs
        return ticket

    def modes_changed(self) -> bool:
        """Whether a limit of the task was switched between shadow and enforce since this
        gate took its rules (the modes are cached for ``settings.refresh``): a task that
        waited since then must take the rules in force now."""
        execution = self.execution
        now = execution.throttler.rule_set(execution.task, self.declared, execution.queue)
        return now is not self.rule_set

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
        margin = self.settings.burst_margin_s
        if margin > 0 and not execution.eager:
            execution.targets = kept_in_hand(execution.targets, margin)
        self._derive()

    def _derive(self) -> None:
        """What follows from the evaluated targets: the deadlines, and the plan."""
        execution = self.execution
        set_deadlines(execution)
        shape = self.rule_set.plan
        if shape is not None and not execution.eager:
            self.plan = plan_at(execution.targets, shape)
            self.planned = planned_header(execution.message_headers)
            self.acquiring = self.plan.due if self.planned is not None else self.plan.admit

    def evaluated(self) -> tuple[tuple[Target, ...], dict[str, float]]:
        """What :meth:`evaluate` found, for the pool child to take with the consumer's
        decision (:meth:`_take_evaluation`): the targets and the whole estimates."""
        return tuple(self.execution.targets), self.execution.estimates

    def _take_evaluation(self, admission: Admission | None) -> bool:
        """Take the consumer's evaluation carried with ``admission`` (:meth:`evaluated`)
        instead of evaluating the rules again: the same message, rules and rates (not
        when a rate was set at run time since, or the rules differ: a mode switched
        between the two). Spares the pool child the rules' evaluation (templates, costs,
        the rates in force: some 15 µs of its CPU a task with two limits and a cost); the
        deadlines, which count from now, and the plan are derived again."""
        if admission is None or admission.targets is None or admission.rates_changed:
            return False
        execution = self.execution
        found = admission.targets
        if len(found) != len(execution.rules) or any(
            target[0].name != rule.name for target, rule in zip(found, execution.rules, strict=True)
        ):
            return False
        execution.targets = list(found)
        execution.estimates = dict(admission.estimates)
        self._derive()
        return True

    def admit(self, near_s: float | None = None) -> Decision:
        """The first acquisition of an evaluated execution (one round trip): what the
        worker's consumer decides before the pool (:mod:`throttle.celery.waiting`).
        ``near_s``: reserve a slot only within it (s; not past the deadline either): a
        task further from its slot reserves nothing and waits in the consumer's line
        (:mod:`throttle.celery.capacity`). A task back with a plan keeps its own horizon."""
        if near_s is None or self.planned is not None:
            return self._acquire(*self._horizon())
        return self._acquire(*reserve_within(self.execution, near_s))

    def plan_wait_s(self, sleep_max_s: float | None = None) -> float:
        """How long a task back with a plan waits before it acquires its real limits, in
        s (0 without a plan): until just before its planned time, at most ``sleep_max_s``
        (default ``sleep_max``; :func:`~throttle.celery.plan.due_wait_s`)."""
        if self.planned is None:
            return 0.0
        now = self.execution.throttler.clock.now()
        cap = self.settings.sleep_max_s if sleep_max_s is None else sleep_max_s
        return due_wait_s(self.planned, now, RECHECK_LEAD_S, cap)

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
        learning, targets = [], []
        for rule, (limit, key, cost) in zip(execution.rules, execution.targets, strict=True):
            if not rule.adaptive:
                targets.append((limit, key, cost))
                continue
            at = learned.current(limit, key, rule.adaptive)
            learning.append((limit, key, rule.adaptive, at.rate_per_s))
            targets.append((at, key, cost))
        execution.targets, self.learning = targets, learning

    # -- horizons

    def _horizon(self) -> tuple[float, float | None]:
        """How far ahead a slot may be reserved: ``(max_wait_s, reserve_until)``
        (:func:`~throttle.celery.deadlines.reserve_within`: not past the task's deadline).
        A concurrency unit must not be held while the task waits, so with one the wait is
        at most a sleep."""
        horizon = self.settings.sleep_max_s if self.rule_set.concurrency else MAX_RESERVE_S
        if self.plan is not None:
            # A task with a plan reserves real slots within a sleep only (see plan.py).
            horizon = self.settings.sleep_max_s
        return reserve_within(self.execution, horizon)

    def _acquire(self, max_wait_s: float, reserve_until: float | None = None) -> Decision:
        """Acquire (or look again at) the execution's slot, reserving up to ``max_wait_s``
        ahead or until ``reserve_until`` (:meth:`_horizon`); a reserved slot that a hold
        placed since has voided (an upstream 429, a pause) is given up, and the decision
        reads as a denial until the hold ends."""
        execution = self.execution
        acquisition_id = execution.request.id
        if acquisition_id is None:  # a direct call: an id of its own, for report_cost
            acquisition_id = self.direct_id = self.direct_id or uuid.uuid4().hex
        decision = self.limiter.acquire_many(
            execution.targets if self.acquiring is None else self.acquiring,
            max_wait_s=max_wait_s,
            acquisition_id=acquisition_id,
            lease_s=lease_s(execution),
            reserve_until=reserve_until,
        )
        execution.throttler.breaker.answered()
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
        redelivered = bool((self.execution.request.delivery_info or {}).get("redelivered"))
        planned = self.planned
        # Decided here, while the limits have plenty of room: from the process's stock
        # (of the task's limits and their plans, as its first acquisition would take).
        # Not a redelivered copy (it may find its own reservation), nor one back with a plan.
        stocks = self.execution.throttler.stocks
        taking = self.execution.targets if self.acquiring is None else self.acquiring
        stocked = (
            admission is None and planned is None and self.rule_set.stockable and not redelivered
        )
        if stocked:
            draw = stocks.draw(taking)
            if draw is not None:
                return Ticket(draw.share(), self.execution.rules, now, draw=draw)
        first: Decision | None = None
        first_slot = now
        # Admitted by the worker's consumer, a task that a pause then stops goes back to
        # wait in a line, not for pause_recheck (sent on from the line, it was denied).
        to_line = admission is not None and admission.decision.allowed
        if admission is not None:
            # The consumer waited for the plan, and for the slot up to LEAD_S before it.
            first, first_slot = admission.as_of(now)
        elif planned is not None:
            # Back with a plan: its real limits are taken just before the planned time,
            # within what this pool slot may sleep (an early ack, a time limit).
            plan_wait = self.plan_wait_s(self._sleep_max_s())
            if plan_wait > 0:
                time.sleep(plan_wait)
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
                and self._too_late(decision.late_s)
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
            if not on_first and decision.allowed:
                # This process's acquisition was written (not only the consumer's word):
                # Redis takes writes. A denial writes nothing, which a Redis out of
                # memory still answers.
                self.execution.throttler.outage(None)
            if not decision.allowed:
                if self.plan is not None and planned is None:
                    come_back_planned(self.execution, decision, self.plan)
                come_back(
                    self.execution, decision, plan=self.plan, planned=planned, to_line=to_line
                )
            wait = decision.wait_s
            sleep_max = self._sleep_max_s()
            if on_first and admission is not None and admission.sleep_max_s is not None:
                sleep_max = min(sleep_max, admission.sleep_max_s)  # no room in the consumer
            if wait > sleep_max:
                come_back_to_slot(self.execution, decision, sleep_max)  # a slot further ahead
            # What the consumer knew of holds placed since its decision (None: nothing).
            heard = admission.holds_clear if on_first and admission is not None else None
            if heard is None and admission is not None and on_first:
                # A hold may come at any time from the decision to the slot: one the
                # consumer cannot rule out over a wait of more than RECHECK_LEAD_S is
                # looked for as one it heard of, however near the slot is by now (the
                # hand-over to the pool may have taken the rest of the lead).
                heard = None if admission.decision.wait_s <= RECHECK_LEAD_S else False
            if (wait > 0 or heard is False) and decision.acquisition:
                look = None if heard is None else not heard
                decision, on_time = self._sleep_to_slot(decision, look)
                if not decision.allowed:
                    come_back(
                        self.execution, decision, plan=self.plan, planned=planned,
                        to_line=to_line,
                    )  # fmt: skip
                if not on_time:
                    # Woke too late (a busy machine): the slot passed, take a new one.
                    self._give_up(decision)
                    now = time.time()
                    continue
            if stocked:
                stocks.saw(taking, decision)
            plan = self.plan.plan if planned is not None and self.plan is not None else None
            # The slot of the consumer's decision (its time, when it admitted at once).
            slot_at = first_slot if on_first else now + wait
            return Ticket(decision.acquisition, self.execution.rules, slot_at, plan=plan)

    def _sleep_max_s(self) -> float:
        """The longest this execution sleeps to a slot in its pool slot, in s:
        ``sleep_max``; :data:`EARLY_ACK_SLEEP_MAX_S` at most for a task whose message was
        acknowledged when it started (no ``acks_late``); :data:`TIME_LIMIT_SHARE` of the
        task's time limit at most, when it has one."""
        sleep_max = self.settings.sleep_max_s
        if not self.execution.task.acks_late:
            return min(sleep_max, EARLY_ACK_SLEEP_MAX_S)
        limit = time_limit_s(self.execution)
        if limit is not None:
            sleep_max = min(sleep_max, max(TIME_LIMIT_SHARE * limit, EARLY_ACK_SLEEP_MAX_S))
        return sleep_max

    def late_tolerance(self) -> float:
        """How late this execution may reach its reserved slot and still call on it, in s
        (:func:`throttle.celery.lateness.tolerance_s`)."""
        return tolerance_s(self.execution, bool(self.rule_set.guarded))

    def _too_late(self, late_s: float) -> bool:
        return too_late(self.execution, bool(self.rule_set.guarded), late_s)

    def _sleep_to_slot(self, decision: Decision, look: bool | None = None) -> tuple[Decision, bool]:
        """Sleep until the slot of ``decision`` (allowed, not past); returns the decision
        as it stands then, and whether the wake-up came within :meth:`late_tolerance`.
        ``look``: look at Redis once more shortly before the slot (True: in any case, a
        hold was placed since the decision; False: not; None: when the slot is further
        than :data:`RECHECK_LEAD_S`)."""
        wait = decision.wait_s
        left = wait
        if look or (look is None and wait > RECHECK_LEAD_S):
            # A hold may begin while this task sleeps (the upstream answered another task
            # 429): look once more, with the id, shortly before the slot, so that the call
            # itself still lands on the slot.
            time.sleep(max(wait - RECHECK_LEAD_S, 0.0))
            decision = self._acquire(0.0)
            if not decision.allowed:
                return decision, True
            if self._too_late(decision.late_s):
                return decision, False
            left = decision.wait_s
        if left <= 0:
            return decision, True
        start = time.monotonic()
        time.sleep(left)
        return decision, not self._too_late(time.monotonic() - start - left)

    # -- eager mode and direct calls

    def _block(self) -> Ticket:
        """Sleep until the limits admit the task, in steps: the limits' wait; for a
        concurrency unit (whose limit names only when its oldest lease would end) from
        :data:`UNIT_POLL_S`, doubling up to ``UNIT_RECHECK_S``; while paused,
        ``pause_recheck``. Past the deadline, or when the rate limits' own wait alone
        passes it, :class:`ThrottleTimeout`."""
        execution = self.execution
        units = unit_names(execution)
        unit_poll = UNIT_POLL_S
        while True:
            now = time.time()
            decision = self._acquire(*self._horizon())
            if decision.allowed:
                if decision.wait_s > 0:
                    time.sleep(decision.wait_s)
                return Ticket(decision.acquisition, execution.rules, now + decision.wait_s)
            # A unit may come back at any time, and a pause end: only the rate limits'
            # wait is known (nan: none).
            known = known_wait_s(decision, units)
            retry = min(denial_wait_s(decision, units, unit_poll), self.settings.pause_recheck_s)
            unit_poll = min(2 * unit_poll, UNIT_RECHECK_S)
            left = left_s(execution)
            if left is not None and (known > left or left <= 0):
                # The limits' own wait, not the recheck it is slept in steps of.
                raise ThrottleTimeout(decision.denied_by, known, max(left, 0.0))
            if left is not None:
                retry = min(retry, left)  # one more look at the deadline
            time.sleep(retry + random.uniform(0.0, min(self.settings.jitter_s, retry) / 10))
