"""Where a throttled task waits: in the worker's consumer, not in a pool slot.

Celery holds a task with an ETA, or one over its own ``rate_limit``, in the worker's
consumer (the main process, thread or greenlet that receives messages): a timer entry
hands it to the pool when it may run, and the prefetch count is raised meanwhile so the
consumer keeps receiving (``celery/worker/strategy.py``, ``Consumer.apply_eta_task``).
A throttled task waits there too. The consumer step :class:`WaitStep` (added by
:func:`throttle.celery.install`) gives every throttled task (``@throttled``,
``ThrottledTask``) Celery's default strategy built over a view of the consumer in which
the hand-over to the pool (``on_task_request``, and ``apply_eta_task`` when an ETA comes)
goes through :meth:`Waiting.admit` first:

1. The gate's rules are evaluated on the message (name, arguments, headers, the queue it
   came from) and the gate's first acquisition is taken: one ``acquire_many``, the task id
   as acquisition id (:meth:`throttle.celery.gate.Gate.admit`). A task back with a plan
   (:mod:`throttle.celery.plan`) is first held until just before its planned time.
   The acquisition reserves a slot only within the near horizon (``reserve_ahead``,
   0.25 s by default, at most ``sleep_max``).
2. Allowed now: the task goes to the pool at once, where the gate runs it.
3. A slot within the near horizon: held in the consumer's timer (the prefetch count raised by
   one, as for an ETA task) until :data:`LEAD_S` before the slot, then handed to the pool.
4. Denied (no slot within the near horizon): the task reserves nothing and waits in the
   consumer's line (:class:`WaitingLine`, the prefetch count raised by one for at most
   :data:`LINE_MAX_TASKS` of them), and asks again when capacity should be there or is
   announced (:mod:`throttle.celery.capacity`: how capacity is handed out). A task that
   may not wait so long in a worker (:func:`line_budget_s`, its deadline) goes to the
   pool with its denial: the gate there sends it back (re-published or parked) for when
   its limits said, reserving nothing; that costs the pool slot no wait.

While a task's limits have room (the consumer's last look, at most :data:`FRESH_S` ago,
admitted at once and left room for :data:`ROOM_TASKS` more: :class:`Look`), its tasks go
to the pool undecided and the pool child decides, as before this step: the consumer's loop
serves the whole worker one message at a time, and a round trip there for a task that
would run at once anyway costs the worker's throughput. Once a look finds them busy (a
wait, a denial, little room), the consumer decides every task of it for :data:`BUSY_S`.

The consumer decides when the pool can start the task: a task received while every pool
slot is busy (running a body, or waiting for a free child: the prefetched messages) waits
undecided in the consumer, first come first decided, until a slot frees (looked at every
:data:`POLL_S`). Decided earlier, its slot would pass while it waits for a child, and it
would have to give the slot up (capacity lost) and take another.

The decision travels to the pool child in the request's dict (sealed:
:func:`throttle.celery.execution.carry`) with the targets it was taken on, so the gate
there pays no second round trip for it and does not evaluate the rules again: it sleeps
what is left to the slot (at most :data:`LEAD_S`, plus the time the pool took to start the
task), then runs the body. A hold placed meanwhile (another worker's 429, a pause) is
announced on the capacity channel (``!held NAME``): when the consumer hands a task over
after hearing of a hold on one of its limits since its decision, or while it was not
listening, the pool child looks once more shortly before the slot
(:data:`throttle.celery.gate.RECHECK_LEAD_S`; :attr:`Admission.holds_clear` says which).
A hold placed after the hand-over, in the last :data:`LEAD_S` before the slot, is not
seen: as for a call already made, the upstream's next answer places it again. A task
that the pool starts later than ``late_tolerance`` after its slot (a busy pool) gives the
slot up and takes a new one, as a late task always has.

A held task is Celery's scheduled task in every respect: its message is unacknowledged
(a worker killed meanwhile loses nothing: the broker delivers the message again, and the
copy finds its reservation under the same id), ``celery inspect scheduled`` lists it, a
revoke or its ``expires`` stops it when its timer fires (its reservation is given up), and
a lost broker connection drops it for the broker to deliver again.

Not covered (the gate in the pool decides, as before): a task class with a ``Strategy``
of its own, a task under Celery's own ``rate_limit`` (its bucket hands the task to the
pool), eager mode and direct calls (they block their caller). When the limiter's Redis
fails in the consumer, the task goes to the pool, whose gate applies ``on_redis_down``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from celery import Celery, Task, bootsteps
from celery.app.task import Context
from celery.worker import state
from celery.worker.control import inspect_command
from celery.worker.strategy import default

from throttle.celery.capacity import Announcements, Line, Pair, Waiter, blocks_of
from throttle.celery.comeback import UNIT_RECHECK_S, unit_names
from throttle.celery.deadlines import MAX_RESERVE_S
from throttle.celery.execution import ADMISSION_KEY, Admission, carry, mark_clear
from throttle.celery.gate import Gate
from throttle.celery.message import (
    H_DEADLINE,
    count_header,
    deadline_value,
    not_before_header,
    queue_of,
)
from throttle.celery.outage import NotAsked
from throttle.celery.runtime import (
    RABBITMQ_CONSUMER_TIMEOUT_S,
    Throttler,
    declared_by,
    throttling_enabled,
)
from throttle.celery.task import gated_call
from throttle.decision import Decision
from throttle.errors import BackendError, ThrottleError
from throttle.limiter import HOLD_PLACED
from throttle.rates import RATES_CHANGED

logger = logging.getLogger("throttle")

LEAD_S = 0.02
"""A task held for its slot goes to the pool this long before the slot, in s: the pool
child sleeps what is left (the most a pool slot waits, when the pool is free), so that the
time the pool takes to start a task does not make the call late."""

DEFAULT_STRATEGY = "celery.worker.strategy:default"

FRESH_S = 0.05
"""How long the consumer trusts a look at a task's limits that found room, in s
(:class:`Look`): about one decision in the consumer per this time and queue while the
limits have room, every task's while they are busy."""
BUSY_S = 1.0
"""How long after a decision that found a task's limits busy every task of it is decided
in the consumer, in s."""
ROOM_TASKS = 20
"""The room a look must find in every limit, in tasks of the same cost."""

POLL_S = (0.0005, 0.005)
"""How often the consumer looks for a free pool slot while throttled tasks wait for one,
in s: first after the shortest, then twice as long each time up to the longest, while the
pool stays full (only then: an idle or unsaturated worker does not poll). A pool of short
tasks frees a slot within a millisecond: waiting 5 ms for it cost a worker of no-op tasks
a tenth of its throughput."""

LINE_MAX_TASKS = 1000
"""How many waiting tasks (:class:`WaitingLine`) a worker raises its prefetch count for:
beyond, a task that joins the line takes one of the worker's ordinary prefetch slots, so
that once they are all taken the consumer receives no more and the rest of a backlog stays
in the broker (nothing published, nothing held)."""
PROBE_MAX_PAIRS = 100
"""The most (adaptive limit, key) pairs whose learned rate a line reads per probe."""
PROBE_RISE = 1.01
"""How much a learned rate must have risen (a factor) to wake the tasks waiting on it."""
MIN_HOLD_S = 0.001
"""A task with no limit in force due back sooner than this (s) goes to the pool at once."""

_TIMER_PRIORITY = 6
"""The priority Celery gives its ETA entries (``strategy.default``)."""


def governed(task: Task) -> bool:
    """Whether ``task`` waits in the consumer: a throttled task with Celery's default
    strategy and no ``rate_limit`` of Celery's own."""
    return (
        task.Strategy == DEFAULT_STRATEGY
        and not task.rate_limit
        and gated_call(task, (), {}) is not None
    )


_task_scheduled: Any = getattr(state, "task_scheduled", None)
"""Celery's registration of a request held for its ETA (``inspect scheduled``,
``query_task``), since 5.7; older releases keep their own ETA requests in the timer only,
and so are the throttler's held there."""


class Waiting:
    """The consumer side of one throttled task: admits its requests before the pool, and
    holds those whose slot is near in the consumer's timer."""

    def __init__(
        self, task: Task, consumer: Any, queue: Undecided, line: WaitingLine | None = None
    ) -> None:
        self.task = task
        self.consumer = consumer
        self.throttler = Throttler.of(task.app)
        self.undecided = queue
        self.line = line
        self.looks: dict[str | None, Look] = {}
        """What the last decisions said of the task's limits, per queue it came from."""
        self.declared = declared_by(task)

    def strategy(self) -> Any:
        """Celery's default strategy for the task, over a view of the consumer whose
        hand-over to the pool goes through :meth:`admit` (once a pool slot is free)."""
        view = _ConsumerView(self.consumer, self.on_request, self.on_eta)
        return default(self.task, self.task.app, view, task_reserved=_not_yet)

    # -- the hand-overs of the default strategy

    def on_request(self, request: Any) -> None:
        """A task may run (no ETA, or its ETA came): admit it when a pool slot is free; or,
        while its limits have room (:class:`Look`), or when it has no limit in force on
        its queue, hand it to the pool undecided. A task with no limit in force that was
        sent back (an upstream's refusal under a limit in shadow mode) and arrives before
        its ``throttle_not_before`` is held in the timer until then: it has no slot that
        would keep it from calling the upstream early."""
        queue = queue_of(request.delivery_info)
        look = self.looks.get(queue)
        if look is not None and look.roomy(time.monotonic()):
            self._to_pool(request)
            return
        if not self._enforced(queue):
            wait = self._not_before_s(request)
            if wait > 0:
                self._hold(request, wait, self._release_held)
            else:
                self._to_pool(request)
            return
        self.undecided.submit(self, request)

    def _not_before_s(self, request: Any) -> float:
        """How long a task sent back must still wait before it runs (its
        ``throttle_not_before``, on the Redis clock), at most ``sleep_max``; 0 for a task
        never sent back (no header: no clock read)."""
        not_before = not_before_header(request.request_dict)
        if not_before is None:
            return 0.0
        wait = not_before - self.throttler.clock.now()
        return min(wait, self.throttler.settings.sleep_max_s) if wait > MIN_HOLD_S else 0.0

    def _release_held(self, request: Any) -> None:
        """The time of a task held for its ``throttle_not_before`` came: to the pool."""
        try:
            if not request.revoked():
                self._to_pool(request)
        finally:
            self.consumer.qos.decrement_eventually()

    def _enforced(self, queue: str | None) -> bool:
        """Whether the task has a limit in force on ``queue`` now; not when it has none
        there, or only limits in shadow mode, which never delay it: then nothing waits
        for a free pool slot in the consumer (where the default strategy would not keep
        it), and the pool child's gate makes its shadow look (the rule set is resolved
        once per queue, the modes cached for ``settings.refresh``). True when this
        cannot be told: :meth:`admit` then decides, and reports what went wrong."""
        try:
            return bool(self.throttler.rule_set(self.task, self.declared, queue).rules)
        except Exception:
            return True

    def on_eta(self, request: Any) -> None:
        """The ETA of a task came (Celery's ``apply_eta_task``, which had raised the
        prefetch count)."""
        self.on_request(request)
        self.consumer.qos.decrement_eventually()

    def admit(self, request: Any) -> None:
        """Decide for ``request`` before the pool (see the module): hand it to the pool now,
        or hold it in the timer until shortly before its slot."""
        gate: Gate | None = None
        wait = 0.0
        try:
            gate = self._gate(request)
            wait = 0.0 if gate is None else gate.plan_wait_s()
        except Exception as exc:
            self._undecided(request, exc)
            gate = None
        if gate is None:
            self._to_pool(request)
        elif wait > LEAD_S:
            self._hold(request, wait, self._admit_planned, gate)
        else:
            self._decide(request, gate)

    def _admit_planned(self, request: Any, gate: Gate) -> None:
        """The planned time of a task held for its plan came."""
        try:
            if not request.revoked():
                self._decide(request, gate, stale=True)
        finally:
            self.consumer.qos.decrement_eventually()

    def _decide(self, request: Any, gate: Gate, stale: bool = False) -> None:
        """Take the gate's first acquisition within the near horizon: hold the task to a
        near slot, or hand it to the pool; denied, it joins the consumer's line
        (:class:`WaitingLine`), behind the tasks already waiting for the same limits
        (then without asking: they would be served first). ``stale``: the gate was
        evaluated a while ago (before a wait for the plan), and is evaluated again."""
        line = self.line
        if line is not None and line.full():
            self.decide_in_pool(Pending(self, request, gate, None, stale=stale))
            return
        pairs = pairs_of(gate)
        if (
            line is not None
            and self._may_line(gate)
            and line.line.needs(pairs)
            and not count_header(gate.execution.message_headers)
        ):
            # Behind the tasks waiting for the same limits, without asking: they would be
            # served first. Not a task back through the broker: it may hold a reserved
            # slot, which joining the line would miss, and it came before them.
            line.join(Pending(self, request, gate, None, stale=True), pairs, priority_of(request))
            return
        pending = Pending(self, request, gate, None, stale=stale)
        blocks = self.ask(pending)
        if blocks is not None and line is not None:
            line.join(pending, pairs, priority_of(request), blocks)

    def ask(self, pending: Pending) -> dict[Pair, float] | None:
        """Ask the limiter for ``pending`` (its slot within the near horizon): held to a near
        slot or handed to the pool (None), or, denied, how long each of its limits stays
        blocked (s) when it may wait in the line; a task that may not (no line, back with
        a plan, a deadline before its limits could admit it, a wait longer than the
        line's) goes to the pool with the denial, whose gate sends it back for when the
        limits said, reserving nothing."""
        request, gate = pending.request, pending.gate
        if request.revoked():
            return None
        try:
            # Not while Redis fails call after call (outage.Breaker): a hung Redis would
            # hold the consumer, and its unacknowledged backlog, for each task.
            with self.throttler.breaker.asking():
                if pending.stale and gate.modes_changed():
                    # A limit switched to shadow or enforce while the task waited: its
                    # rules as they are now; with none enforced, it runs at once.
                    renewed = self._gate(request)
                    if renewed is None:
                        self._to_pool(request)
                        return None
                    pending.gate = gate = renewed
                elif pending.stale:
                    # The rates in force now (one set at run time and announced, or
                    # followed from the upstream's word): the pool child runs on these
                    # targets too.
                    gate.evaluate()
                pending.stale = True
                since = time.monotonic()  # a hold announced after this may postdate it
                now = time.time()
                horizon = self.near_s(gate)
                # Without a line (a broker whose visibility timeout leaves it no time, the
                # in-memory throttler) a far slot is reserved, as the pool's gate would.
                decision = gate.admit(near_s=horizon if self.line is not None else None)
        except Exception as exc:
            if isinstance(exc, BackendError) and not isinstance(exc, NotAsked):
                self.throttler.outage(exc)  # the outage's warning names what Redis said
            self._undecided(request, exc)
            self._to_pool(request)
            return None
        queue = queue_of(request.delivery_info)
        look = self.looks.get(queue)
        if look is None:
            look = self.looks[queue] = Look()
        look.saw(decision, time.monotonic())
        if decision.allowed:
            self.throttler.outage(None)  # an acquisition written: Redis takes writes
            fresh = self.line is not None and self.line.rates_changed_lately()
            targets, estimates = gate.evaluated()
            admission = Admission(
                request.id, decision, now, fresh, targets=targets, estimates=estimates,
                held_since=pending.held_since,
            )  # fmt: skip
            carry(request.request_dict, admission)
            wait = decision.wait_s
            if decision.acquisition is not None and LEAD_S < wait <= self.settings_sleep_max:
                self._hold(
                    request, wait - LEAD_S, self._release, decision, pending, now + wait, since
                )
            else:
                self._to_pool(request, pairs_of(gate), since)
            return None
        pending.decision = decision
        line = self.line
        # A concurrency limit's retry is when its oldest lease ends (up to the task time
        # limit and more): a unit comes back when a task ends, which is announced. Its
        # task waits in the line, which asks again at least every UNIT_RECHECK_S.
        units = unit_names(gate.execution)
        states = [
            (state.limit, state.allowed,
             min(state.retry_after_s, UNIT_RECHECK_S)
             if state.limit in units and not math.isinf(state.retry_after_s)
             else state.retry_after_s)  # a pause (inf) stays one: resume wakes the line
            for state in decision.limits
        ]  # fmt: skip
        retry = max(
            (wait for _, allowed, wait in states if not allowed), default=decision.retry_after_s
        )
        deadline = gate.execution.deadline
        if (
            line is None
            or not self._may_line(gate)
            or (not math.isinf(retry) and retry - horizon > line.line.max_wait_s)
            # (a pause has no end to compare: the task waits, and leaves the line at its
            # deadline if the pause lasts)
            or (
                deadline is not None
                and not math.isinf(retry)
                and self.throttler.clock.now() + retry > deadline
            )
        ):
            self.send_on(pending, None)
            return None
        fair = {limit.name for limit, _, _ in gate.execution.targets if limit.fair}
        return blocks_of(pairs_of(gate), states, retry, horizon, exact=fair)

    @property
    def settings_sleep_max(self) -> float:
        return self.throttler.settings.sleep_max_s

    def near_s(self, gate: Gate | None = None) -> float:
        """How far ahead a task in the consumer reserves its slot, in s: the near horizon,
        ``reserve_ahead`` (at most ``sleep_max``). Further, it waits in the line.

        Under a fair limit (of ``gate``), at least one of its turns on that limit (cost /
        rate, at most ``MAX_RESERVE_S``): the fair script admits a key on its schedule
        only within the asker's horizon, and each denial moves the key's turn on by one
        share interval (lua/fair.lua's plan), so a horizon shorter than one turn was
        denied every other look (half the limit's rate for two tenants). And up to the
        fair limit's own near horizon (:attr:`~throttle.spec.Limit.fair_horizon_s`, at
        most ``sleep_max``): the keys that come due together each take one of the total's
        next slots, N keys N turns of the limit apart, and a key whose slot fell beyond a
        shorter horizon was denied, its turn moved on by a share interval (three tenants
        on a 6/s limit got 4/s between them, one of them a third of its share). A slot
        beyond ``sleep_max`` is then reached through the broker, as the pool's far slots
        are."""
        settings = self.throttler.settings
        near = min(settings.sleep_max_s, settings.reserve_ahead_s)
        if gate is not None:
            for limit, _, cost in gate.execution.targets:
                if limit.fair:
                    near = max(
                        near,
                        min(cost / limit.rate_per_s, MAX_RESERVE_S),
                        min(limit.fair_horizon_s, settings.sleep_max_s),
                    )
        return near

    @staticmethod
    def _may_line(gate: Gate) -> bool:
        """Whether the task may wait in the line: not a task back with a plan (it keeps its
        planned time, :mod:`throttle.celery.plan`). A task that would plan on arrival (a
        keyed limit beside a shared one) waits in the line instead: the line already
        takes the shared capacity only when the task can run, and skips a key whose own
        limit is blocked, which is what a plan is for; and it does so without the
        re-publish a plan costs. Sent on from the line (a wait longer than the line's),
        it plans in the pool as before."""
        return gate.planned is None

    def send_on(self, pending: Pending, retry_s: float | None) -> None:
        """Hand a task that may not wait (any longer) to the pool with its last denial
        (``retry_s``: what is left of its wait, s; None: as the denial said): the gate
        there sends it back for then, reserving nothing. A task that joined the line
        behind others and never asked goes with a denial of ``retry_s`` on its limits:
        decided in the pool instead, it would sleep there up to ``sleep_max`` for a slot,
        and the tasks sent on with it would wait for a free pool slot, unacknowledged,
        past the line's budget (and a broker's visibility timeout)."""
        request, decision = pending.request, pending.decision
        if request.revoked():
            return
        if decision is None and retry_s is not None:
            names = dict.fromkeys(name for name, _ in pairs_of(pending.gate))
            decision = Decision.denial(tuple(names), retry_s)
        if decision is not None:
            if retry_s is not None:
                # The pool's gate comes back for its denying limits' own waits
                # (comeback.denial_wait_s): each says the line's, not the one its limit
                # named at the task's last ask.
                limits = tuple(
                    state if state.allowed else state._replace(retry_after_s=retry_s)
                    for state in decision.limits
                )
                decision = decision._replace(retry_after_s=retry_s, limits=limits)
            carry(request.request_dict, Admission(request.id, decision, time.time()))
        self._to_pool(request)

    def decide_in_pool(self, pending: Pending) -> None:
        """A task that comes while the consumer holds all the waiting tasks it may
        (:func:`line_room`): its slot is reserved now, as far ahead as the pool's gate
        would (up to ``MAX_RESERVE_S``), and the pool sends it back through the broker
        for it (one publish) instead of sleeping to it, so that its prefetch slot frees
        for the tasks behind it. A slot within ``LEAD_S`` runs now; a task back on its
        own reservation (``held``) is held to it here even so (it is due within the
        arrival's lead, and sent back again it would only come back again). The price:
        a far reservation, which a refund or a rate raised meanwhile does not bring
        earlier."""
        request, gate = pending.request, pending.gate
        if request.revoked():
            return
        try:
            if pending.stale:
                gate.evaluate()
            since = time.monotonic()  # a hold announced after this may postdate the look
            now = time.time()
            decision = gate.admit(near_s=None)
        except Exception as exc:
            self._undecided(request, exc)
            self._to_pool(request)
            return
        if not decision.allowed:
            pending.decision = decision
            self.send_on(pending, None)
            return
        targets, estimates = gate.evaluated()
        wait = decision.wait_s
        held = decision.held and decision.acquisition is not None
        admission = Admission(
            request.id, decision, now, targets=targets, estimates=estimates,
            sleep_max_s=None if held else LEAD_S,
        )  # fmt: skip
        carry(request.request_dict, admission)
        if held and LEAD_S < wait <= self.settings_sleep_max:
            self._hold(request, wait - LEAD_S, self._release, decision, pending, now + wait, since)
        else:
            self._to_pool(request, pairs_of(gate), since)

    def _undecided(self, request: Any, exc: Exception) -> None:
        """The consumer could not decide (the limiter's Redis is away, an argument the
        rules read is missing): the pool's gate decides, as without this step, and fails
        there as it would have."""
        if isinstance(exc, BackendError | ThrottleError):
            logger.debug("throttle: task %s decided in the pool: %s", request.id, exc)
        else:
            logger.exception("throttle: task %s decided in the pool", request.id)

    def _gate(self, request: Any) -> Gate | None:
        """The gate of ``request``, its rules evaluated on the message; None when no rule
        applies (the task runs unthrottled)."""
        call = gated_call(self.task, request.args, request.kwargs)
        if call is None:
            return None
        declared, fn, args, kwargs = call
        # What the pool child's task.request will be (celery/app/trace.py builds it so).
        context = Context(request.request_dict, called_directly=False, is_eager=False)
        gate = Gate(self.task, declared, fn, args, kwargs, request=context)
        if not gate.execution.rules:
            return None
        gate.evaluate()
        timeout_at = gate.execution.timeout_at
        if timeout_at is not None and H_DEADLINE not in request.request_dict:
            # max_wait counts from here, for the line's later looks and for the pool
            # child, which sends the task back with it (as a first deferral would).
            retries = request.request_dict.get("retries")
            request.request_dict[H_DEADLINE] = deadline_value(timeout_at, retries)
        return gate

    def _release(
        self,
        request: Any,
        decision: Any,
        pending: Pending | None = None,
        slot_at: float = 0.0,
        since: float = math.inf,
    ) -> None:
        """The slot of a held task is near: to the pool (a revoked or expired one gives
        its reservation up instead: a concurrency unit it took comes back). A timer that
        fired after the slot had passed (a busy consumer) gives the slot up here and asks
        again, rather than have the pool child find it late and send the task back
        through the broker (``slot_at``: epoch s, this host's clock). Whatever fails
        here (the limiter's Redis away), the task goes to the pool, whose gate decides
        (``on_redis_down``): a task left here would wait for the broker's redelivery."""
        handed = False
        try:
            if request.revoked():
                if decision.acquisition is not None:
                    self._give_up(decision)
                return
            if (
                pending is not None
                and decision.acquisition is not None
                and time.time() - slot_at > pending.gate.late_tolerance()
            ):
                self._give_up(decision)  # passed: lost
                request.request_dict.pop(ADMISSION_KEY, None)
                handed = True  # ask() hands it on, or it joins the line
                blocks = self.ask(pending)
                if blocks is not None and self.line is not None:
                    self.line.join(pending, pairs_of(pending.gate), priority_of(request), blocks)
                return
            handed = True
            self._to_pool(request, pairs_of(pending.gate) if pending is not None else (), since)
        except Exception:
            logger.exception("throttle: releasing held task %s", request.id)
            if not handed:
                with contextlib.suppress(Exception):
                    self._to_pool(request)
        finally:
            self.consumer.qos.decrement_eventually()

    def _give_up(self, decision: Any) -> None:
        """Give the reservation of ``decision`` up, if Redis answers: otherwise it ends
        with its lease (the outage is noted, the task goes on)."""
        try:
            self.throttler.limiter.settle(decision.acquisition, None)
        except BackendError as exc:
            self.throttler.outage(exc)

    # -- Celery's bookkeeping, as for its own ETA tasks

    def _hold(self, request: Any, delay_s: float, then: Any, *args: Any) -> None:
        """Hold ``request`` in the consumer's timer for ``delay_s`` (s), then call
        ``then(request, *args)``; as Celery holds an ETA task (prefetch raised by one; a
        scheduled request, which a revoke, ``inspect scheduled`` and a lost connection
        find)."""
        consumer = self.consumer
        consumer.qos.increment_eventually()
        state.reserved_requests.discard(request)
        line = self.line
        if line is not None:
            line.held += 1

        def due(*given: Any) -> None:
            try:
                then(*given)
            finally:
                if line is not None:
                    line.held -= 1

        request._eta_timer_entry = consumer.timer.call_at(
            time.monotonic() + delay_s, due, (request, *args), priority=_TIMER_PRIORITY
        )
        if _task_scheduled is not None:
            _task_scheduled(request)

    def _to_pool(self, request: Any, pairs: tuple[Pair, ...] = (), since: float = math.inf) -> None:
        """Hand ``request`` to the pool. With the ``pairs`` of a decision taken at
        ``since`` (monotonic s), the admission it carries says whether a hold was announced
        on any of them since (:attr:`Admission.holds_clear`)."""
        if pairs and self.line is not None:
            mark_clear(request.request_dict, self.line.holds_clear(pairs, since))
        state.task_reserved(request)
        self.consumer.on_task_request(request)
        scale_for_reserved(self.consumer)


def autoscaler_of(consumer: Any) -> Any:
    """The worker's ``--autoscale`` autoscaler, or None."""
    return getattr(getattr(consumer, "controller", None), "autoscaler", None)


def scale_for_reserved(consumer: Any) -> None:
    """Let ``--autoscale`` see a task handed to the pool. An event loop's autoscaler
    looks when a message arrives and every keepalive (30 s); a throttled task reaches the
    pool from the consumer's timer or line, long after its message arrived, so without
    this a backlog received at once grew the pool only every 30 s (a worker without an
    event loop runs the autoscaler's own thread, which looks every second)."""
    if getattr(consumer, "hub", None) is None:
        return
    scaler = autoscaler_of(consumer)
    if scaler is None:
        return
    try:
        scaler.maybe_scale()
    except Exception:  # never fail the hand-over; the keepalive looks again
        logger.debug("throttle: autoscaling after a hand-over failed", exc_info=True)


class Look:
    """What the consumer's last decisions said of one task's limits (on one queue): whether
    they had room. While they have, the pool child decides, as it did before this step,
    and the consumer's loop is spared the round trip (it serves every pool slot of the
    worker one message at a time: a round trip there costs the whole worker's throughput,
    where the pool children's overlap). They have room when the consumer's last decision,
    at most :data:`FRESH_S` ago, admitted the task at once with room left for
    :data:`ROOM_TASKS` more tasks in every limit, and no decision for :data:`BUSY_S`
    said otherwise (a wait, a denial, less room: then the consumer decides every task).

    The price: in the :data:`FRESH_S` after a last look that had room, a flood can take the
    room, and the tasks handed over undecided then wait for their slot in their pool slot,
    up to ``sleep_max``, as before this step, until the next look (the first task after
    :data:`FRESH_S`) finds the limits busy."""

    __slots__ = ("at", "busy_until", "room")

    def __init__(self) -> None:
        self.at = -math.inf
        self.busy_until = -math.inf
        self.room = False

    def roomy(self, now: float) -> bool:
        """Whether the limits had room at the last look (``now``: monotonic s)."""
        return self.room and now - self.at < FRESH_S and now >= self.busy_until

    def saw(self, decision: Decision, now: float) -> None:
        """Note a decision of the consumer's, taken at ``now`` (monotonic s)."""
        self.at = now
        self.room = has_room(decision)
        if not self.room:
            self.busy_until = now + BUSY_S


def has_room(decision: Decision) -> bool:
    """Whether ``decision`` admitted at once and leaves room for :data:`ROOM_TASKS` more
    tasks of the same cost in each of its limits."""
    acquisition = decision.acquisition
    if not decision.allowed or decision.wait_s > 0 or decision.held or acquisition is None:
        return False
    costs = acquisition.costs
    limits = decision.limits
    if len(costs) != len(limits):
        return decision.remaining >= ROOM_TASKS * max(costs, default=1.0)
    return all(
        state.remaining >= ROOM_TASKS * cost for state, cost in zip(limits, costs, strict=True)
    )


class Pending:
    """A task in the line: its consumer side, request and gate, and its last denial
    (None until it asked)."""

    __slots__ = ("decision", "gate", "held_since", "request", "stale", "waiting")

    def __init__(
        self,
        waiting: Waiting,
        request: Any,
        gate: Gate,
        decision: Decision | None,
        *,
        stale: bool = False,
    ) -> None:
        self.waiting = waiting
        self.request = request
        self.gate = gate
        self.decision = decision
        self.held_since: float | None = None
        """When it first joined the line (epoch s, this host's clock; None: not yet)."""
        self.stale = stale
        """Whether the gate's evaluation may be out of date (the task waited since it was
        evaluated: in the line, for its plan, or it asked before): evaluated again before
        it asks."""


def spacing_s(gate: Gate) -> float:
    """How long the task's slowest rate limit takes to admit one more such task, in s:
    cost x period / count (0 with concurrency limits alone: a unit has no pace)."""
    spacing = 0.0
    for limit, _, cost in gate.execution.targets:
        if not limit.algorithm.holds_units:
            spacing = max(spacing, cost * limit.period_s / limit.count)
    return spacing


def pairs_of(gate: Gate) -> tuple[Pair, ...]:
    """The (limit name, key) pairs the task of ``gate`` acquires."""
    targets = gate.acquiring if gate.acquiring is not None else gate.execution.targets
    return tuple((limit.name, key) for limit, key, _ in targets)


def priority_of(request: Any) -> int:
    """The task's priority in the line: its message's (Celery's ``priority``, as sent:
    higher first; 0 without one)."""
    info = getattr(request, "delivery_info", None) or {}
    priority = info.get("priority")
    try:
        return int(priority) if priority is not None else 0
    except (TypeError, ValueError):
        return 0


def line_budget_s(app: Celery, throttler: Throttler) -> float:
    """How long a task may wait in a worker's line, in s: the ``line_max`` setting, but at most
    half the broker's visibility timeout (Redis, SQS: counted from delivery, kombu#337)
    or RabbitMQ's ``consumer_timeout``, less what a task may be held after it
    (``sleep_max``, ``park_lead``); 0 (no line) when nothing is left."""
    settings = throttler.settings
    options: dict[str, Any] = app.conf.broker_transport_options or {}
    budget = settings.line_max_s
    timeouts = [options.get("visibility_timeout"), options.get("consumer_timeout")]
    if options.get("consumer_timeout") is None and str(app.conf.broker_url or "").startswith(
        ("amqp", "pyamqp")
    ):
        timeouts.append(RABBITMQ_CONSUMER_TIMEOUT_S)
    for timeout in timeouts:
        if isinstance(timeout, int | float) and not isinstance(timeout, bool):
            budget = min(budget, timeout / 2 - settings.sleep_max_s - settings.park_lead_s)
    return max(budget, 0.0)


def line_room(consumer: Any) -> int | None:
    """How many tasks a worker's line may hold: no bound of its own (None) where the
    consumer can raise its prefetch count for each, as it does for Celery's ETA tasks.
    With per-consumer QoS (RabbitMQ quorum queues: Celery turns global QoS off), a raised
    prefetch count reaches only consumers started after it, so every waiting task keeps
    one of the fixed prefetch slots (``worker_prefetch_multiplier`` x concurrency): the
    line then holds at most those beyond the pool's size, and the pool's share stays for
    tasks that can run (other tenants, unthrottled tasks, higher priorities). A task that
    comes while the line is full is decided in the pool, as before the line existed
    (:meth:`Waiting.decide_in_pool`). ``worker_prefetch_multiplier`` sets how many wait
    in the line."""
    if getattr(consumer, "qos_global", True) is not False:
        return None
    try:  # Redis and the other virtual transports raise a per-channel count at once
        if consumer.connection.transport.driver_type != "amqp":
            return None
    except AttributeError:
        return None
    prefetch = int(getattr(consumer, "initial_prefetch_count", 0) or 0)
    if prefetch <= 0:  # no prefetch limit: nothing to keep free
        return None
    size = getattr(consumer.pool, "num_processes", None) or 1
    return max(prefetch - size, 0)


class WaitingLine:
    """Where the consumer keeps the tasks that wait for capacity (reserving nothing): a
    :class:`throttle.celery.capacity.Line`, served from the consumer's timer when its
    limits should have room again, and at once when capacity is announced
    (:class:`throttle.celery.capacity.Announcements`).

    As for Celery's ETA tasks, a waiting task's message is unacknowledged and the prefetch
    count is raised by one for it, so that the consumer keeps receiving (the tasks of other
    limits or tenants, behind a flood on the same queue, are seen and served); for at most
    :data:`LINE_MAX_TASKS` tasks: beyond, a task takes one of the ordinary prefetch slots,
    and once those are taken the rest of the backlog stays in the broker. A task waits at
    most :func:`line_budget_s` (well within the visibility timeout), then goes back through
    the broker as any long wait does (re-published or parked by the pool's gate)."""

    def __init__(self, consumer: Any, max_wait_s: float) -> None:
        self.consumer = consumer
        self.line = Line(self._ask, max_wait_s)
        self.room = line_room(consumer)
        """How many tasks the line may hold, with those held for a near slot; None: as
        many as the prefetch count can be raised for (see :func:`line_room`)."""
        self.held = 0
        """How many tasks the consumer's timer holds (a near slot, a plan, a not-before)."""
        self.entry: Any = None
        self.armed_at = math.inf
        self.announcements: Announcements | None = None
        self.throttler: Throttler | None = None
        self.rates_changed_at = -math.inf
        """When a rate set at run time was last announced (monotonic s)."""
        self.serving = False
        self.again = False
        self.probing: Any = None
        self.held_at: dict[str, float] = {}
        """When a hold on each limit was last announced (monotonic s, by name)."""
        self.sent_until: dict[Pair, float] = {}
        """For each (limit, key) pair, when the last task sent on from the line on it
        comes back (monotonic s): the next one comes a spacing after it."""
        self.beyond: deque[Waiter] = deque()
        """The tasks that joined beyond :data:`LINE_MAX_TASKS` (the prefetch count not
        raised for them: each keeps an ordinary prefetch slot), in arrival order; some
        may have left since (``gone``)."""

    def listen(self, throttler: Throttler) -> None:
        """Listen to the capacity announcements of ``throttler``'s namespace, and follow
        its adaptive limits' learned rates (:meth:`_probe`)."""
        self.throttler = throttler
        limiter = throttler.limiter
        self.announcements = Announcements(
            limiter.client, limiter.keyspace.capacity_channel(), self._announced
        )
        self.announcements.start()
        self.probing = self.consumer.timer.call_repeatedly(
            throttler.learned.refresh_s, self._probe, priority=_TIMER_PRIORITY
        )

    def _probe(self) -> None:
        """An adaptive limit probing up (:mod:`throttle.adaptive`: its learned rate climbs
        with the upstream's successes) is announced by nobody: every ``refresh_s`` while
        tasks wait on one, its learned rate is read again (one round trip per limit and
        key, at most :data:`PROBE_MAX_PAIRS`), and a rate above every one its waiting tasks
        were denied at wakes them, as an announcement would: they were blocked until
        the time the lower rate named."""
        throttler = self.throttler
        if throttler is None or not self.line.waiters:
            return
        known: dict[Pair, tuple[Any, str | None, Any, float]] = {}
        for waiter in self.line.waiters:
            for limit, key, adaptive, used in waiter.item.gate.learning:
                seen = known.get((limit.name, key))
                if seen is None and len(known) >= PROBE_MAX_PAIRS:
                    continue
                if seen is None or used > seen[3]:
                    known[(limit.name, key)] = (limit, key, adaptive, used)
        risen = set()
        try:
            for limit, key, adaptive, used in known.values():
                if throttler.learned.current(limit, key, adaptive).rate_per_s > used * PROBE_RISE:
                    risen.add(limit.name)
        except Exception:  # Redis away: the next ask finds out, and the next probe retries
            logger.debug("throttle: reading learned rates failed", exc_info=True)
        if risen:
            self.wake(risen)

    def join(
        self,
        pending: Pending,
        pairs: tuple[Pair, ...],
        priority: int,
        blocks: dict[Pair, float] | None = None,
    ) -> None:
        request = pending.request
        if self.full():
            pending.waiting.decide_in_pool(pending)
            return
        raised = self.room is None and len(self.line) < LINE_MAX_TASKS
        if raised:
            self.consumer.qos.increment_eventually()
        state.reserved_requests.discard(request)
        if pending.held_since is None:
            pending.held_since = time.time()
        now = time.monotonic()
        leave_by = math.inf
        deadline = pending.gate.execution.deadline  # max_wait, expires: Redis clock
        if deadline is not None and self.throttler is not None:
            # It leaves at its deadline, wherever it is in the line: the pool's gate then
            # applies on_timeout, or revokes it as expired.
            leave_by = now + deadline - self.throttler.clock.now()
        waiter = self.line.join(
            pending, pairs, priority=priority, blocks=blocks, now=now, raised=raised,
            leave_by=leave_by,
        )  # fmt: skip
        if self.room is None and not raised:
            if len(self.beyond) >= LINE_MAX_TASKS:  # mostly tasks that left since
                self.beyond = deque(w for w in self.beyond if not w.gone)
            self.beyond.append(waiter)
        # Only this task's own time can be earlier than the timer's: no pass over the line
        # per arrival (a backlog of a thousand would cost the consumer a million looks).
        self._arm_at(self.line.free_at(waiter))

    def full(self) -> bool:
        """Whether the consumer holds all the waiting tasks it may, in the line and in its
        timer (only with a fixed prefetch count: each keeps a prefetch slot)."""
        return self.room is not None and len(self.line) + self.held >= self.room

    def _ask(self, waiter: Waiter) -> dict[Pair, float] | None:
        pending: Pending = waiter.item
        blocks = pending.waiting.ask(pending)
        if blocks is None:
            self._left(waiter)
        return blocks

    def _left(self, waiter: Waiter) -> None:
        """``waiter`` leaves the line. Its raise of the prefetch count passes to a task
        that joined beyond the bound and still waits, if any: lowered instead, the count
        would leave those tasks in the ordinary prefetch slots, and the consumer would
        receive nothing more (other tenants' tasks, unthrottled ones) until the line had
        nearly run dry."""
        if not waiter.raised:
            return
        beyond = self.beyond
        while beyond:
            other = beyond.popleft()
            if not other.gone and other is not waiter:
                other.raised = True
                return
        self.consumer.qos.decrement_eventually()

    def _due(self) -> None:
        """The timer: send on the tasks that waited too long, serve the others."""
        self.entry, self.armed_at = None, math.inf
        self._run()

    def _run(self) -> None:
        """Send on the tasks that waited too long and serve the others, once at a time:
        under gevent and eventlet the timer, an announcement and the consumer are
        greenlets, and a pass yields at every round trip; a second pass asked for
        meanwhile runs after the first (one pass asking for a task while another hands
        it to the pool would run it twice)."""
        if self.serving:
            self.again = True
            return
        self.serving = True
        try:
            self.again = True
            while self.again:
                self.again = False
                now = time.monotonic()
                for waiter in self.line.expired(now):  # the oldest first
                    self._send_on(waiter, now)
                self.line.serve(time.monotonic())
        finally:
            self.serving = False
            self._arm()

    def _send_on(self, waiter: Waiter, now: float) -> None:
        """Send on a task that waited as long as it may: back for about when its turn
        comes, its limits' next slot, or one spacing after the task sent on before it on
        one of its (limit, key) pairs if that is later (:attr:`sent_until`). Tasks that
        came at once leave at once: sent back for the limits' next slot, they would all
        come back at once, and leave again; so they come back at the limits' pace."""
        pending: Pending = waiter.item
        due = now + self.line.blocked_for(waiter, now) + pending.waiting.near_s(pending.gate)
        spacing = spacing_s(pending.gate)
        sent_until = self.sent_until
        for pair in waiter.pairs:
            due = max(due, sent_until.get(pair, -math.inf) + spacing)
        if not math.isinf(due):
            # A pause has no end: a task sent on during one comes back for the pause's
            # recheck, and the tasks sent on after the resume must not queue behind it.
            for pair in waiter.pairs:
                sent_until[pair] = due
        if len(sent_until) > LINE_MAX_TASKS:  # keys of long ago: forget them
            for pair in [pair for pair, until in sent_until.items() if until < now]:
                del sent_until[pair]
        left = due - now
        if self.throttler is not None and not self.throttler.releasing:
            # Not parked but re-published, its ETA message is held unacknowledged: no
            # longer than the line may hold a task (the broker would deliver it again).
            left = min(left, self.line.max_wait_s)
        try:
            pending.waiting.send_on(pending, left)
        except Exception:
            logger.exception("throttle: sending on waiting task %s", pending.request.id)
        finally:
            self._left(waiter)

    def _arm(self) -> None:
        due = self.line.due()
        if due is None:
            self._cancel()
            return
        self._arm_at(due)

    def _arm_at(self, due: float) -> None:
        """Have the timer serve the line at ``due`` (monotonic s) unless it will sooner."""
        if self.serving:
            return  # the pass under way arms the timer when it ends
        due = max(due, time.monotonic())
        if self.entry is not None and self.armed_at <= due + 0.0005:
            return
        self._cancel()
        self.armed_at = due
        self.entry = self.consumer.timer.call_at(due, self._due, priority=_TIMER_PRIORITY)

    def _cancel(self) -> None:
        entry, self.entry, self.armed_at = self.entry, None, math.inf
        if entry is not None:
            with contextlib.suppress(Exception):
                self.consumer.timer.cancel(entry)

    def _announced(self, names: set[str] | None) -> None:
        """An announcement (in the listening thread): hand it to the consumer's loop. A
        hold placed is noted here at once (a task about to go to the pool must see it),
        and wakes nobody."""
        if names is not None and HOLD_PLACED in names:
            now = time.monotonic()
            for name in names - {HOLD_PLACED}:
                self.held_at[name] = now
            return
        hub = getattr(self.consumer, "hub", None)
        if hub is not None:
            hub.call_soon(self.wake, names)  # thread-safe: it wakes the hub's poll
        else:  # gevent, eventlet: the timer's own greenlet (a thread-safe schedule)
            self.consumer.timer.call_after(0.0, self.wake, (names,), priority=_TIMER_PRIORITY)

    def wake(self, names: set[str] | None) -> None:
        """Capacity appeared on the limits ``names`` (None: any): serve their tasks now."""
        if names is not None and RATES_CHANGED in names:
            names = names - {RATES_CHANGED}
            self.rates_changed_at = time.monotonic()
            if self.throttler is not None:
                self.throttler.rates.refresh_soon()
        if self.line.wake(names or None):
            self._cancel()
            self._run()

    def holds_clear(self, pairs: Iterable[Pair], since: float) -> bool | None:
        """Whether no hold was placed on the limits of ``pairs`` since ``since`` (monotonic
        s): True when none was announced, False when one was; None when this worker does
        not know (it has not listened to the announcements without a break since then).
        A hold on one key is announced as one on its limit (a look that finds none costs
        a round trip, not a call)."""
        announcements = self.announcements
        listening = None if announcements is None else announcements.listening_since
        if listening is None or listening > since:
            return None
        held_at = self.held_at
        return all(held_at.get(name, -math.inf) < since for name, _ in pairs)

    def rates_changed_lately(self) -> bool:
        """Whether a rate set was announced within the rates' ``refresh_s`` (the pool
        children's caches may not have it yet)."""
        if self.throttler is None:
            return False
        return time.monotonic() - self.rates_changed_at < self.throttler.rates.refresh_s

    def clear(self) -> None:
        """Forget every waiting task (the consumer stops: their messages, unacknowledged,
        come back from the broker) and stop listening."""
        self.line.clear()
        self.beyond.clear()
        self._cancel()
        probing, self.probing = self.probing, None
        if probing is not None:
            with contextlib.suppress(Exception):
                self.consumer.timer.cancel(probing)
        if self.announcements is not None:
            self.announcements.stop()
            self.announcements = None


class Undecided:
    """The throttled tasks of one consumer that wait for a free pool slot to be decided,
    in arrival order. Dropped when the consumer stops (a lost broker connection, a
    shutdown): their messages are unacknowledged, and the broker delivers them again.

    A green pool's worker (gevent, eventlet) has no event loop, and kombu's Redis
    transport asks for messages only between its polls: a poll that begins with the
    prefetch count reached waits out its whole timeout (1-2 s, ``drain_events``), whatever
    acknowledgements come meanwhile. Queued here, the tasks received while the pool is
    busy filled the prefetch count, and such a worker ran a prefetch count of tasks per
    1-2 s (60 tasks of one pool slot: 16-22 s instead of 0.3 s). There the consumer waits
    for a free slot before it takes the next message, as Celery's own green pools do
    (their ``spawn`` blocks while the pool is full): :attr:`green_sleep`."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.waiting: deque[tuple[Waiting, Any]] = deque()
        self.entry: Any = None
        self.poll_s = POLL_S[0]
        self.claimed = 0
        """Tasks being admitted for a slot found free (:meth:`_admit`): under a green pool
        another greenlet may look for a slot while an admission waits for Redis."""
        self.green_sleep = green_sleep(consumer)
        """The green pool's cooperative sleep, when the consumer has no event loop (see
        the class); None otherwise."""

    def pool_free(self) -> bool:
        """Whether the pool has a slot that no task holds (running, or handed over and
        waiting for a child: Celery's reserved requests; held tasks are not in them)."""
        return len(state.reserved_requests) + self.claimed < pool_size(self.consumer)

    def submit(self, waiting: Waiting, request: Any) -> None:
        if not self.waiting:
            if self.green_sleep is not None:
                self._wait_for_slot(self.green_sleep)
            if self.pool_free():
                self._admit(waiting, request)
                return
            self.poll_s = POLL_S[0]
        self.waiting.append((waiting, request))
        self._arm()

    def _wait_for_slot(self, sleep: Any) -> None:
        """Wait, cooperatively, until a pool slot is free or the consumer stops (then the
        task is queued, and dropped with the queue: the broker delivers it again)."""
        poll_s = POLL_S[0]
        blueprint = getattr(self.consumer, "blueprint", None)
        while not self.pool_free():
            if blueprint is not None and blueprint.state != bootsteps.RUN:
                return
            sleep(poll_s)
            poll_s = min(2 * poll_s, POLL_S[1])

    def _admit(self, waiting: Waiting, request: Any) -> None:
        self.claimed += 1
        try:
            waiting.admit(request)
        finally:
            self.claimed -= 1

    def _arm(self) -> None:
        if self.entry is None:
            self.entry = self.consumer.timer.call_after(
                self.poll_s, self._drain, priority=_TIMER_PRIORITY
            )

    def _drain(self) -> None:
        self.entry = None
        free = self.pool_free()
        self.poll_s = POLL_S[0] if free else min(2 * self.poll_s, POLL_S[1])
        while self.waiting and self.pool_free():
            waiting, request = self.waiting.popleft()
            try:
                if not request.revoked():
                    self._admit(waiting, request)
            except Exception:
                logger.exception("throttle: admitting task %s", request.id)
        if self.waiting:
            self._arm()

    def clear(self) -> None:
        """Forget every waiting task (the consumer stops)."""
        self.waiting.clear()
        entry, self.entry = self.entry, None
        if entry is not None:
            with contextlib.suppress(Exception):
                self.consumer.timer.cancel(entry)


def green_sleep(consumer: Any) -> Any:
    """The cooperative sleep of ``consumer``'s pool when it is a green one (gevent,
    eventlet) and the consumer has no event loop; else None. The pool's own library's
    sleep, not ``time.sleep``: one that was not monkey-patched would stop the greenlets
    that free the slot."""
    pool = getattr(consumer, "pool", None)
    if getattr(consumer, "hub", None) is not None or not getattr(pool, "is_green", False):
        return None
    module = type(pool).__module__
    for library in ("gevent", "eventlet"):
        if module.endswith(library):
            return getattr(importlib.import_module(library), "sleep", None)
    return None


def pool_size(consumer: Any) -> int:
    """How many tasks the consumer hands to the pool before it waits for one to end: the
    pool's processes, or under ``--autoscale`` its maximum. Celery's autoscaler grows the
    pool only while more tasks are reserved than it has processes
    (``celery/worker/autoscale.py``: ``qty`` is ``len(state.reserved_requests)``); held to
    the current size, the reserved tasks never outnumbered it, and a worker started with
    ``--autoscale 30,2`` ran throttled tasks on 2 processes for good."""
    maximum = getattr(autoscaler_of(consumer), "max_concurrency", None)
    if isinstance(maximum, int) and maximum > 0:
        return maximum
    return getattr(consumer.pool, "num_processes", None) or 1


def _not_yet(request: Any) -> None:
    """The default strategy marks a request reserved before it hands it over: here that
    waits until :meth:`Waiting.admit` hands it to the pool (a held request is scheduled)."""


class _ConsumerView:
    """The consumer as the default strategy sees it: the same, but for the hand-overs."""

    def __init__(self, consumer: Any, on_task_request: Any, apply_eta_task: Any) -> None:
        self._consumer = consumer
        self.on_task_request = on_task_request
        self.apply_eta_task = apply_eta_task

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def install_strategies(
    app: Celery, consumer: Any, undecided: Undecided, line: WaitingLine | None = None
) -> list[str]:
    """Give every governed task of ``app`` its waiting strategy in ``consumer``; returns
    their names."""
    names = []
    for name, task in list(app.tasks.items()):
        if governed(task):
            consumer.strategies[name] = Waiting(task, consumer, undecided, line).strategy()
            names.append(name)
    return names


class WaitStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: throttled tasks wait in the consumer (see the module). Starts
    after Celery's ``Tasks`` step, which builds every task's strategy (again after a lost
    connection), and replaces those of the throttled tasks."""

    label = "throttle-waiting"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        super().__init__(consumer, **kwargs)
        self.undecided: Undecided | None = None
        self.line: WaitingLine | None = None
        self.restoring: Any = None

    def start(self, consumer: Any) -> None:
        app = consumer.app
        if not throttling_enabled(app):
            return
        consumer.throttle_wait_step = self  # what `inspect throttle_waiting` lists
        self.undecided = undecided = Undecided(consumer)
        throttler = Throttler.of(app)
        budget = line_budget_s(app, throttler)
        line = None
        if budget > 0 and not throttler.in_memory:
            self.line = line = WaitingLine(consumer, budget)
            line.listen(throttler)
            if line.room is not None:
                logger.info(
                    "throttle: the broker's prefetch count is per consumer (a quorum queue): "
                    "at most %d tasks wait in this worker's line (worker_prefetch_multiplier x "
                    "concurrency, less the pool's size); more are decided in the pool, which "
                    "reserves their slots and sends them back through the broker", line.room,
                )  # fmt: skip
        names = install_strategies(app, consumer, undecided, line)
        survive_broker_loss(consumer)
        self.restoring = restore_when_idle(consumer)
        logger.debug("throttle: %d throttled tasks wait in the consumer", len(names))

    def stop(self, consumer: Any) -> None:
        if self.undecided is not None:
            self.undecided.clear()
        if self.line is not None:
            self.line.clear()
            self.line = None
        entry, self.restoring = self.restoring, None
        if entry is not None:
            with contextlib.suppress(Exception):
                consumer.timer.cancel(entry)

    def shutdown(self, consumer: Any) -> None:
        self.stop(consumer)


@inspect_command()  # type: ignore[untyped-decorator]
def throttle_waiting(state: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """The throttled tasks a worker holds unreserved: in its line, waiting for capacity
    (``"where": "line"``), and waiting for a free pool slot to be decided (``"pool"``).
    ``celery inspect throttle_waiting`` (with the app's ``-A``); ``inspect scheduled``
    lists the tasks held for a near slot, as Celery's own ETA tasks. Each entry as
    ``scheduled`` gives one, plus where, how long it has waited (s), the queue it came
    from and (in the line) the limits it waits for."""
    step = getattr(state.consumer, "throttle_wait_step", None)
    if step is None:
        return []
    now = time.monotonic()
    entries: list[dict[str, Any]] = []
    if step.line is not None:
        for waiter in list(step.line.line.waiters):
            pending = waiter.item
            request = pending.request
            entries.append({
                "eta": None, "priority": waiter.priority, "request": request.info(),
                "where": "line", "waited_s": round(now - waiter.since, 3),
                "queue": queue_of(request.delivery_info),
                "limits": [rule.name for rule in pending.gate.execution.rules],
            })  # fmt: skip
    if step.undecided is not None:
        for _, request in list(step.undecided.waiting):
            entries.append({
                "eta": None, "priority": priority_of(request), "request": request.info(),
                "where": "pool", "waited_s": None, "queue": queue_of(request.delivery_info),
            })  # fmt: skip
    return entries


RESTORE_EVERY_S = 1.0
"""How often a worker without an event loop asks kombu's Redis transport to deliver again
the messages of dead workers, in s (kombu scans on one call of ten: about every 10 s, as
an event loop's worker does)."""


def restore_when_idle(consumer: Any) -> Any:
    """Have a worker without an event loop (``-P gevent``, ``-P eventlet``) on the Redis
    broker deliver again the unacknowledged messages of dead workers; returns the timer
    entry (None: not needed).

    kombu's Redis transport restores them (past the visibility timeout) from its event
    loop's timer; a worker without one only restores after a poll that saw nothing at
    all, and an idle one never sees nothing: every ``BRPOP`` times out with a reply
    first. A fleet of such workers then never ran the tasks a killed one held, waiting
    tasks and Celery's own ETA tasks alike (unacknowledged, in the ``unacked`` hash)."""
    if consumer.hub is not None:
        return None
    transport = getattr(consumer.connection, "transport", None)
    cycle = getattr(transport, "cycle", None)
    if getattr(transport, "driver_type", None) != "redis" or cycle is None:
        return None

    def restore() -> None:
        try:
            cycle.maybe_restore_messages()
        except Exception:  # the broker away: the consumer reconnects, this runs again
            logger.debug("throttle: restoring unacknowledged messages failed", exc_info=True)

    return consumer.timer.call_repeatedly(RESTORE_EVERY_S, restore, priority=_TIMER_PRIORITY)


def survive_broker_loss(consumer: Any) -> None:
    """Keep the worker alive when its Redis broker goes away while it holds tasks.

    A consumer that holds unacknowledged messages (waiting tasks, as Celery's own ETA
    tasks) keeps polling the broker, so a lost broker usually finds it inside a ``BRPOP``.
    Celery then collects the connection (kombu's close of the channel fails on that
    ``BRPOP`` and the transport drops its client) and closes it again; this second close
    restores the held messages through the dropped client and raises ``AttributeError``,
    which Celery treats as unrecoverable: the worker stops. The messages are not lost
    (they stay in the broker's ``unacked`` hash, restored after the visibility timeout),
    but the worker should reconnect as it does after any other connection loss: this
    wraps the consumer's handler so that this one error is logged and the restart goes on.
    Installed once per consumer."""
    handler = consumer.on_connection_error_after_connected
    if getattr(handler, "__throttle_guard__", False):
        return

    def guarded(exc: BaseException) -> None:
        try:
            handler(exc)
        except AttributeError as error:  # the dropped transport client, as above
            logger.warning(
                "throttle: closing the lost broker connection failed (%r); the held "
                "messages come back after the visibility timeout",
                error,
            )

    guarded.__throttle_guard__ = True  # type: ignore[attr-defined]
    consumer.on_connection_error_after_connected = guarded
