"""Which tasks acquire through a plan (throttle/celery/plan.py), and what each step takes."""

from __future__ import annotations

from throttle import Limit
from throttle.celery.message import H_PLANNED, planned_header
from throttle.celery.plan import plan_at, plan_limit, plan_of, plan_shape
from throttle.rules import Rule

TENANT = Limit.parse("15/s burst 1", name="tenant", algorithm="gcra")
SHARED = Limit.parse("19.8/s burst 1", name="shared", algorithm="gcra")
WINDOW = Limit.parse("100/h", name="quota", algorithm="fixed_window")
SLOTS = Limit("slots", "concurrency", 4)  # type: ignore[arg-type]


def test_a_keyed_limit_and_a_shared_one_go_through_a_plan() -> None:
    plan = plan_of([(TENANT, "a", 1.0), (SHARED, None, 1.0)])
    assert plan is not None
    twin = plan_limit(TENANT)
    assert (twin.name, twin.algorithm, twin.count, twin.period_s, twin.burst) == (
        "tenant.plan", TENANT.algorithm, TENANT.count, TENANT.period_s, TENANT.burst,
    )  # fmt: skip
    assert plan.admit == [(TENANT, "a", 1.0), (SHARED, None, 1.0), (twin, "a", 1.0)]
    assert plan.plan == [(twin, "a", 1.0)]
    assert plan.due == [(TENANT, "a", 1.0), (SHARED, None, 1.0)]


def test_a_shared_window_is_taken_when_due_a_keyed_window_has_no_plan() -> None:
    plan = plan_of([(TENANT, "a", 2.0), (WINDOW, None, 1.0)])
    assert plan is not None and plan.plan == [(plan_limit(TENANT), "a", 2.0)]
    assert plan_of([(WINDOW, "a", 1.0), (SHARED, None, 1.0)]) is None


def test_one_step_without_a_keyed_and_a_shared_limit_or_with_concurrency() -> None:
    assert plan_of([(TENANT, "a", 1.0)]) is None
    assert plan_of([(SHARED, None, 1.0), (WINDOW, None, 1.0)]) is None
    assert plan_of([(TENANT, "a", 1.0), (TENANT, "b", 1.0)]) is None
    assert plan_of([(TENANT, "a", 1.0), (SHARED, None, 1.0), (SLOTS, None, 1.0)]) is None


def test_a_limit_keyed_by_fewer_arguments_is_shared() -> None:
    org = Limit.parse("50/s burst 1", name="org", algorithm="gcra")
    rules = [Rule(TENANT, key="{org}:{user}"), Rule(org, key="{org}")]
    targets = [(TENANT, "acme:ann", 1.0), (org, "acme", 1.0)]
    plan = plan_of(targets, rules)
    assert plan is not None
    assert plan.plan == [(plan_limit(TENANT), "acme:ann", 1.0)]
    assert plan.due == targets
    # The same arguments, or a key from a callable: neither is coarser, one step.
    same = [Rule(TENANT, key="{org}:{user}"), Rule(org, key="{user}:{org}")]
    assert plan_of(targets, same) is None
    called = [Rule(TENANT, key=lambda org, user: f"{org}:{user}"), Rule(org, key="{org}")]
    assert plan_of(targets, called) is None


def test_a_fair_limit_is_shared() -> None:
    # Its rate is every key's: a tenant's own limit is planned, the fair one taken when due.
    fair = Limit.parse("20/s burst 1", name="llm", algorithm="gcra", fair=True)
    rules = [Rule(TENANT, key="{tenant}"), Rule(fair, key="{tenant}")]
    targets = [(TENANT, "a", 1.0), (fair, "a", 1.0)]
    plan = plan_of(targets, rules)
    assert plan is not None
    assert plan.plan == [(plan_limit(TENANT), "a", 1.0)]
    assert plan.due == targets
    # A fair limit alone (or two) has nothing narrow to plan on: one step.
    assert plan_of([(fair, "a", 1.0)], [rules[1]]) is None


def test_the_planned_header_carries_the_plan_slot() -> None:
    # The planned slot (epoch s, Redis clock); 1 from an older worker: a plan, time unknown
    assert planned_header({H_PLANNED: 1_790_000_000.25}) == 1_790_000_000.25
    assert planned_header({H_PLANNED: 1}) == 1.0
    # Absent, or not a time: no plan (the task is taken as arriving)
    for headers in ({}, {H_PLANNED: 0}, {H_PLANNED: "soon"}, {H_PLANNED: float("nan")}):
        assert planned_header(headers) is None


def test_the_shape_worked_out_from_the_rules_is_the_plan_of_their_targets() -> None:
    # The gate works out once per task (plan_shape) what plan_of decides per message.
    org = Limit.parse("50/s burst 1", name="org", algorithm="gcra")
    fair = Limit.parse("20/s burst 1", name="llm", algorithm="gcra", fair=True)
    rule_sets = [
        [Rule(TENANT, key="{tenant}"), Rule(SHARED)],
        [Rule(TENANT, key="{tenant}"), Rule(WINDOW)],
        [Rule(WINDOW, key="{tenant}"), Rule(SHARED)],
        [Rule(TENANT, key="{tenant}"), Rule(SHARED), Rule(SLOTS)],
        [Rule(TENANT, key="{org}:{user}"), Rule(org, key="{org}")],
        [Rule(TENANT, key="{org}:{user}"), Rule(org, key="{user}:{org}")],
        [Rule(TENANT, key=lambda **kw: kw["tenant"]), Rule(org, key="{org}")],
        [Rule(TENANT, key="{tenant}"), Rule(fair, key="{tenant}")],
        [Rule(fair, key="{tenant}")],
        [Rule(TENANT, key="{tenant}"), Rule(SHARED), Rule(org, key="{org}")],
        [Rule(SHARED)],
    ]
    for rules in rule_sets:
        targets = [
            (rule.limit, None if rule.key is None else f"k{i}", 1.0 + i)
            for i, rule in enumerate(rules)
        ]
        shape = plan_shape(rules)
        expected = plan_of(targets, rules)
        assert (shape is None) == (expected is None), rules
        if shape is not None:
            assert plan_at(targets, shape) == expected
