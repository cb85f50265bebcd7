"""A task's rules for one queue, with what the gate reads from the rules alone worked out
once (per task name, declaration and queue, by :meth:`Throttler.rule_set`), not on every
message: the gate's own Python runs on every throttled task, beside one Redis round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from throttle.celery.estimates import learns
from throttle.celery.plan import plan_shape
from throttle.rules import Rule, names_arguments


@dataclass(frozen=True)
class RuleSet:
    """The rules of a task on one queue, and what follows from them."""

    rules: tuple[Rule, ...]
    by_name: bool
    """Some key template, plan template or cost names an argument: the call's arguments
    are bound to the function's parameters (:func:`throttle.rules.named_arguments`)."""
    adaptive: bool
    """Some limit learns its rate (:mod:`throttle.adaptive`)."""
    guarded: tuple[int, ...]
    """The indices of the rules under the call-time spacing guard (``Rule.guarded``)."""
    concurrency: bool
    """Some limit is a concurrency limit (its unit is never held while a task waits)."""
    plan: tuple[int, ...] | None
    """The indices of the narrow limits an arriving task plans on, or None when it
    acquires in one step (:func:`throttle.celery.plan.plan_shape`)."""
    estimates: bool = False
    """Some limit reserves the learned share of its estimated cost
    (:mod:`throttle.celery.estimates`)."""
    shadow: tuple[Rule, ...] = ()
    """The task's limits in shadow mode (:mod:`throttle.celery.shadow`): left out of
    :attr:`rules`, which the task waits for; looked at on a twin state, never waited for."""
    shadow_declared: bool = False
    """Some rule says ``mode: shadow`` itself (the settings' mode and the modes set at run
    time aside)."""
    stockable: bool = False
    """Every limit is a plain token bucket or GCRA rate (not fair, no spacing guard,
    adaptive rate or learned estimate) and none is a concurrency limit: a worker
    process may take their units ahead while they have plenty of room
    (:mod:`throttle.celery.stock`)."""

    @classmethod
    def of(cls, rules: Sequence[Rule], shadow: Sequence[Rule] = ()) -> RuleSet:
        rules = tuple(rules)
        return cls(
            shadow=tuple(shadow),
            rules=rules,
            by_name=any(names_arguments(rule) for rule in rules),
            adaptive=any(rule.adaptive for rule in rules),
            guarded=tuple(i for i, rule in enumerate(rules) if rule.guarded),
            concurrency=any(rule.limit.algorithm.holds_units for rule in rules),
            plan=plan_shape(rules),
            estimates=any(learns(rule) for rule in rules),
            shadow_declared=any(rule.mode == "shadow" for rule in (*rules, *shadow)),
            stockable=bool(rules) and all(stockable(rule) for rule in rules),
        )


def stockable(rule: Rule) -> bool:
    """Whether a worker process may take the units of ``rule`` ahead of its tasks
    (:attr:`RuleSet.stockable`)."""
    limit = rule.limit
    return (
        limit.algorithm.reserves
        and not limit.fair
        and not rule.guarded
        and not rule.adaptive
        and not learns(rule)
    )
