"""Plans: a keyed limit's rate and burst from the task's own arguments (``plan``/``plans``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from throttle.config import ThrottleConfig
from throttle.errors import ConfigError
from throttle.rules import Rule, declare, targets
from throttle.spec import Algorithm, Limit

API = Limit.parse("10/s", name="api", algorithm="gcra")
PLANS = {"free": "10/s burst 5", "pro": "100/s burst 50", "enterprise": "1000/s"}


def call(tenant_id: str, plan: Any = None, tokens: int = 1) -> None:
    """A task function: the rule reads its tenant and plan by name."""


def test_each_plan_gives_its_rate_and_burst_and_keeps_algorithm_key_and_cost() -> None:
    rule = Rule(API, key="{tenant_id}", cost="tokens", plan="{plan}", plans=PLANS)
    got = targets([rule], call, ("acme", "pro"), {"tokens": 3})
    ((limit, key, cost),) = got
    assert (limit.name, limit.algorithm, limit.count, limit.period_s, limit.capacity) == (
        "api", Algorithm.GCRA, 100.0, 1.0, 50.0,
    )  # fmt: skip
    assert (key, cost) == ("acme", 3.0)
    ((limit, _, _),) = targets([rule], call, ("bigco",), {"plan": "enterprise", "tokens": 1})
    assert (limit.count, limit.capacity) == (1000.0, 1000.0)


@pytest.mark.parametrize("plan", ["platinum", None, 3.5, ["pro"]], ids=repr)
def test_a_plan_outside_the_table_or_not_text_gets_the_limit_s_own_rate(plan: object) -> None:
    rule = Rule(API, key="{tenant_id}", plan="{plan}", plans=PLANS)
    assert targets([rule], call, ("acme", plan), {})[0][0] is API


def test_a_missing_plan_argument_gets_the_limit_s_own_rate() -> None:
    def untyped(tenant_id: str) -> None: ...

    rule = Rule(API, key="{tenant_id}", plan="{plan}", plans=PLANS)
    assert targets([rule], untyped, ("acme",), {})[0][0] is API


def test_an_integer_plan_is_its_decimal_text_and_a_callable_may_choose() -> None:
    rule = Rule(API, key="{tenant_id}", plan="{plan}", plans={2: "2/s", "3": "3/s"})
    assert targets([rule], call, ("a", 2), {})[0][0].count == 2.0
    assert targets([rule], call, ("a", "2"), {})[0][0].count == 2.0
    assert targets([rule], call, ("a", 3), {})[0][0].count == 3.0
    chosen = Rule(API, key="{tenant_id}", plan=lambda tenant_id, **_: "pro", plans=PLANS)
    assert targets([chosen], call, ("a",), {})[0][0].count == 100.0


def test_the_limit_in_force_is_asked_with_the_plan_s_limit_and_the_key() -> None:
    rule = Rule(API, key="{tenant_id}", plan="{plan}", plans=PLANS)
    asked: list[tuple[float, str | None]] = []

    def current(limit: Limit, key: str | None) -> Limit:
        asked.append((limit.count, key))
        return limit

    targets([rule], call, ("acme", "free"), {}, current)
    assert asked == [(10.0, "acme")]


def test_a_fair_limit_s_plan_gives_the_key_s_weight_unless_weights_list_it() -> None:
    fair = Limit.parse("10/s", name="llm", fair=True, weights={"vip": 8})
    rule = Rule(fair, key="{tenant_id}", plan="{plan}", plans={"free": 1, "pro": 4})
    ((limit, key, _),) = targets([rule], call, ("acme", "pro"), {})
    assert (limit.weight(key), limit.count, limit.fair) == (4.0, 10.0, True)
    ((limit, key, _),) = targets([rule], call, ("vip", "pro"), {})
    assert limit.weight(key) == 8.0  # listed in weights: the file's word for that key


def test_inline_plans_through_declare() -> None:
    declared = declare(
        ["10/s"],
        "proj.call",
        {"key": "{tenant_id}", "plan": "{plan}", "plans": PLANS, "algorithm": "gcra"},
    )
    (rule,) = declared.rules
    assert rule.plan_limits["pro"].count == 100.0
    assert rule.plan_limits["pro"].algorithm is Algorithm.GCRA


@pytest.mark.parametrize(
    ("fields", "field", "problem"),
    [
        ({"plan": "{plan}"}, "plan", "needs a plan table"),
        ({"plans": {"free": "1/s"}}, "plans", "needs a plan template"),
        ({"plan": "{plan}", "plans": {"free": "1 per s"}}, "plans.free", "malformed rate"),
        ({"plan": "{plan}", "plans": {}}, "plans", "non-empty mapping"),
        ({"plan": "{plan}", "plans": {None: "1/s"}}, "plans", "not null"),
        ({"plan": "{plan}", "plans": {"free": "1/s"}, "key": None}, "plans",
         "give the limit a key"),
        ({"plan": "{0}", "plans": {"free": "1/s"}}, "plan", "must name arguments"),
        ({"plan": "plan", "plans": {"free": "1/s"}}, "plan", "every task would be on the same"),
        ({"plan": "{plan}", "plans": {2: "3/s", "2": "5/s"}}, "plans.2", "named twice"),
        ({"plan": "{plan}", "plans": {"free": "1/s burst 1"}, "cost": 2}, "plans.free",
         "below the limit's cost"),
    ],
)  # fmt: skip
def test_bad_plans_name_the_field(fields: dict[str, Any], field: str, problem: str) -> None:
    fields = {"key": "{tenant_id}", **fields}
    with pytest.raises(ConfigError, match=problem) as caught:
        Rule(API, **fields)
    assert (caught.value.limit, caught.value.field) == ("api", field)


def test_plans_on_an_adaptive_limit_are_refused() -> None:
    from throttle.adaptive import Adaptive  # noqa: PLC0415

    with pytest.raises(ConfigError, match="adaptive") as caught:
        Rule(API, key="{t}", plan="{p}", plans={"a": "1/s"}, adaptive=Adaptive())
    assert caught.value.field == "plans"


def test_plans_on_a_concurrency_limit_are_refused() -> None:
    with pytest.raises(ConfigError, match="concurrency limit") as caught:
        Rule(Limit.parse("5 concurrent", name="c"), key="{t}", plan="{p}", plans={"a": "1/s"})
    assert caught.value.field == "plans"


def test_a_limits_file_names_file_limit_field_and_value(tmp_path: Path) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "limits": {
                    "api": {
                        "algorithm": "gcra", "key": "{tenant_id}", "plan": "{plan}",
                        "plans": PLANS, "rate": "10/s",
                    },
                    "orphan": {"rate": "10/s", "key": "{t}", "plan": "{plan}"},
                    "typo": {"rate": "10/s", "key": "{t}", "plan": "{plan}",
                             "plans": {"pro": "100/sec burst x"}},
                    "fair": {"rate": "10/s", "key": "{t}", "fair": True, "plan": "{plan}",
                             "plans": {"pro": "4/s"}},
                }
            },
            sort_keys=False,
        )
    )  # fmt: skip
    errors = [str(error) for error in ThrottleConfig.check(path)]
    assert errors == [
        f"{path}: limit 'orphan': field 'plan': a plan template needs a plan table: add "
        "plans, such as {free: 10/s burst 5, pro: 100/s} (got '{plan}')",
        f"{path}: limit 'typo': field 'plans.pro': malformed rate; expected COUNT/[N]UNIT "
        "[burst B], e.g. '50/s', '3500/m burst 100', '1/3h', or 'N concurrent' (got "
        "'100/sec burst x')",
        f"{path}: limit 'fair': field 'plans.pro': a plan of a fair limit gives its keys' "
        "weight in the shared rate: a number > 0, such as 4 (got '4/s')",
    ]
    path.write_text(yaml.safe_dump({"limits": {"api": {
        "algorithm": "gcra", "key": "{tenant_id}", "plan": "{plan}", "plans": PLANS,
        "rate": "10/s"}}}))  # fmt: skip
    rule = ThrottleConfig.load(path).rule("api")
    assert sorted(rule.plan_limits) == ["enterprise", "free", "pro"]
    assert rule.plan_limits["free"].capacity == 5.0


def test_the_spacing_guard_by_default_only_when_every_plan_is_burst_1() -> None:
    # A burst-1 rate beside plans of larger bursts: their calls are not spaced one by one
    burst_1 = Limit.parse("1/s", name="api", algorithm="gcra")
    assert Rule(burst_1).guarded
    mixed = {"free": "1/s burst 1", "pro": "100/s burst 50"}
    assert not Rule(burst_1, key="{t}", plan="{p}", plans=mixed).guarded
    strict = {"free": "1/s burst 1", "pro": "100/s burst 1"}
    assert Rule(burst_1, key="{t}", plan="{p}", plans=strict).guarded
    # ... unless the rule says so
    assert Rule(burst_1, key="{t}", plan="{p}", plans=mixed, spacing_guard=True).guarded
