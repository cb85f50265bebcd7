"""Plans: shared capacity is taken when a task can run, not while it waits for its own key.

A task throttled by a keyed limit (per tenant, say) and a shared one (unkeyed: the whole
API) would otherwise reserve a slot on both as soon as it arrives. A flood of one tenant
then reserves the shared limit far ahead (its slots there are set by the tenant's limit),
and another tenant's task, which its own limit would let run now, waits behind them while
the shared rate goes unused. In a worker such a task waits in the consumer's line
(:mod:`throttle.celery.waiting`), which takes the shared limit only when the task's key
can run, reserving at most the near horizon (``reserve_ahead``) ahead; a task that may not
wait there (a wait longer than the line's) plans instead:

- **Admit** (a task arriving): one acquisition of every limit, and of the *plan* of its
  keyed limits, within ``sleep_max``. Admitted: it runs as any task (one round trip).
- **Plan** (denied): the task reserves only on the plan of its keyed limits, as far ahead
  as needed (one more round trip, :func:`reserve_plan`), and comes back for that time
  (:mod:`throttle.celery.comeback`). A plan is a twin limit
  (the same numbers under the name ``NAME.plan``, its own state per key): it orders the
  key's tasks and says when each should come back; it never takes real capacity.
- **Due** (a task back with a plan, header ``throttle_planned`` = the planned time): it
  sleeps to that time (it came back half a sleep early; :func:`due_wait_s`), then one
  acquisition of every real limit within ``sleep_max`` (one round trip, as the look-again
  of a reserved task costs); denied, it comes back when that acquisition says, without
  reserving.

Only the near future is reserved on the real limits, so every limit keeps its own shape
(the slot of several limits is the earliest at which all conform) and the shared limit is
free for any key whose own limit lets it run. Applies when a task has at least one keyed
token bucket or GCRA limit and one shared limit (unkeyed, a fair limit, or keyed by fewer
of the task's arguments than another: ``{org}`` beside ``{org}:{user}``), and no
concurrency limit (a
concurrency unit is never held while waiting, so nothing is reserved far ahead there).
Nothing is planned twice: a plan is recorded under the task id + ``.plan``, so a copy of
the task redelivered after its worker died between planning and re-publishing finds its
plan instead of taking another. A plan slot the task no longer needs is handed back as a
real reservation is (a token bucket refunded up to its capacity, a GCRA's next slot pulled
back, never before now): when the task times out (``max_wait``), and when its call settles
for less (an actual cost reported lower, ``on_error: refund``). A revoked task never reaches
a worker's gate (Celery drops it), so its plan slot stays: harmless to the API (a plan
never admits a call, it only says when the key's tasks come back), and bounded: the key's
later tasks come back at most that task's cost x the limit's spacing later than they could,
once, and then acquire the real limits as usual (which the plan does not hold). The tasks
of one key are taken in plan order only approximately (one that comes back later than
planned may be overtaken).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from throttle.decision import Acquisition, Decision, Settlement
from throttle.limiter import Limiter
from throttle.rules import Rule, Target
from throttle.spec import PLAN_SUFFIX, Limit


@dataclass(frozen=True)
class Plan:
    """The targets of a task whose acquisition goes through a plan."""

    admit: list[Target]
    """Every limit, and the plan of its keyed ones: the acquisition of an arriving task."""
    plan: list[Target]
    """The plans of the keyed limits alone: reserved as far ahead as needed."""
    due: list[Target]
    """Every real limit: the acquisition of a task back with a plan."""


@dataclass(frozen=True)
class Place:
    """A task's place on the plans of its keyed limits (:func:`reserve_plan`)."""

    acquisition: Acquisition | None
    """The plans' acquisition, recorded under the task's plan id."""
    slot_s: float
    """Until the plan's slot, in s: when the task's own keyed limits let it run."""
    wait_s: float
    """Until the task comes back, in s: its plan slot, or later when the limits of the
    admit step (the shared one too) could admit it only later."""


def plan_id(task_id: str) -> str:
    """The acquisition id of a task's plan: its own id is its real acquisition's."""
    return task_id + PLAN_SUFFIX


def rule_name(limit_name: str) -> str:
    """The name of the rule a target's limit comes from (a plan's: its limit's)."""
    return limit_name.removesuffix(PLAN_SUFFIX)


@functools.lru_cache(maxsize=1024)
def plan_limit(limit: Limit) -> Limit:
    """The plan twin of ``limit``: the same algorithm and numbers, its own state."""
    return dataclasses.replace(limit, name=limit.name + PLAN_SUFFIX)


def plan_of(targets: list[Target], rules: Sequence[Rule] = ()) -> Plan | None:
    """The plan of a task's targets (``rules``: the rules they were evaluated from, in the
    same order), or None when it acquires in one step: no concurrency limit, and at least
    one narrow keyed token bucket or GCRA limit and one shared limit.

    Shared: unkeyed, fair (its rate is every key's), or keyed by a template that reads a
    strict subset of the arguments another limit's template reads (``{org}`` beside
    ``{org}:{user}``). A key from a
    callable is compared with nothing: narrow."""
    fields: list[frozenset[str] | None] = [None] * len(targets)
    if len(rules) == len(targets):
        fields = [
            frozenset(rule.key_fields) if rule.key_template is not None else None for rule in rules
        ]
    keyed = [key is not None for _, key, _ in targets]
    narrow = _narrow([limit for limit, _, _ in targets], keyed, fields)
    return None if narrow is None else plan_at(targets, narrow)


def plan_shape(rules: Sequence[Rule]) -> tuple[int, ...] | None:
    """What :func:`plan_of` decides from the rules alone, for the gate to work out once per
    task rather than per message: the indices of the narrow limits whose plans the task
    takes, or None when it acquires in one step. (A rule's key is None exactly when its
    target's is, and a rate changed at run time keeps its limit's algorithm and
    fairness.)"""
    fields = [
        frozenset(rule.key_fields) if rule.key_template is not None else None for rule in rules
    ]
    keyed = [rule.key is not None for rule in rules]
    return _narrow([rule.limit for rule in rules], keyed, fields)


def plan_at(targets: list[Target], narrow: Sequence[int]) -> Plan:
    """The plan of ``targets`` whose narrow limits are at the indices ``narrow``."""
    plans = [(plan_limit(targets[i][0]), targets[i][1], targets[i][2]) for i in narrow]
    return Plan(admit=[*targets, *plans], plan=plans, due=list(targets))


def _narrow(
    limits: Sequence[Limit], keyed: Sequence[bool], fields: Sequence[frozenset[str] | None]
) -> tuple[int, ...] | None:
    """The indices of the narrow limits (keyed, reserving, not shared), or None when there
    is no plan: a concurrency limit, no narrow limit or no shared one."""
    if any(limit.algorithm.holds_units for limit in limits):
        return None
    templated = [f for f in fields if f is not None]

    def shared(i: int) -> bool:
        mine = fields[i]
        if limits[i].fair:
            return True  # its rate is every key's: taken when due, as an unkeyed limit
        return not keyed[i] or (mine is not None and any(mine < f for f in templated))

    narrow = tuple(i for i in range(len(limits)) if not shared(i) and limits[i].algorithm.reserves)
    if not narrow or not any(shared(i) for i in range(len(limits))):
        return None
    return narrow


def hand_back(
    limiter: Limiter, targets: list[Target], task_id: str, actuals: list[float | None],
    lease_s: float,
) -> Settlement | None:  # fmt: skip
    """Settle the plan of ``task_id`` on ``targets`` at ``actuals`` (0: all of it handed
    back; None: as planned). One round trip to find the plan (acquiring with its id finds
    the recorded one and takes nothing), one to settle it; None when nothing changes. A plan
    whose record expired is not found: what this finds admitted now (a plan with room) is
    taken and settled back at once, so nothing is taken either way."""
    if all(a is None for a in actuals):
        return None
    found = limiter.acquire_many(
        targets, max_wait_s=0.0, acquisition_id=plan_id(task_id), lease_s=lease_s
    )
    if found.acquisition is None:
        return None
    if not found.held:
        actuals = [0.0] * len(targets)
    return limiter.settle(found.acquisition, actuals)


def due_wait_s(planned: float, now: float, lead_s: float, sleep_max_s: float) -> float:
    """How long a task back with a plan for ``planned`` (epoch s, Redis clock, as ``now``)
    sleeps before it takes its real limits, in s: until ``lead_s`` before it, at most
    ``sleep_max_s``, 0 when that time has come.

    Reserved earlier, the shared limit's next slot would be set that far ahead, and a task
    of an idle key arriving meanwhile would wait behind it (a GCRA or a token bucket keeps
    one next slot; the time before it cannot be handed to another). It came back half a
    sleep early, so that a late delivery still makes its slot."""
    return min(max(planned - now - lead_s, 0.0), sleep_max_s)


def reserve_plan(
    limiter: Limiter, plan: Plan, task_id: str, denied: Decision, horizon_s: float,
    lease_s: float,
) -> Place | None:  # fmt: skip
    """An arriving task with a plan was ``denied`` within a sleep: reserve its place on the
    plans of its keyed limits, up to ``horizon_s`` ahead (one round trip). None when the
    plans deny (a wait beyond the horizon) or no limit says when it could run.

    Recorded under the plan's id (:func:`plan_id`): a copy redelivered after its worker
    died before re-publishing finds this plan (held, ``wait_s``: until its slot) and takes
    no other."""
    found = limiter.acquire_many(
        plan.plan, max_wait_s=horizon_s, acquisition_id=plan_id(task_id), lease_s=lease_s
    )
    if not found.allowed:
        return None
    # The plan says when the task's own limits let it run; the limits of the admit
    # step (the shared one too) when it could at the earliest.
    wait = max(found.wait_s, denied.retry_after_s)
    if math.isinf(wait):
        return None
    return Place(found.acquisition, found.wait_s, wait)
