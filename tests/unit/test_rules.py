"""The step "rules -> (limit, key, cost)" of one execution, without Celery or Redis."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace
from typing import Any

import pytest

from throttle.adaptive import Adaptive
from throttle.errors import ConfigError
from throttle.rules import RedisDown, Rule, declare, key_problem, named_arguments, targets
from throttle.spec import Algorithm, Limit
from throttle.units import MAX_DURATION_S

TOKENS = Limit.parse("90000/m", name="tokens")
REQUESTS = Limit.parse("10/s", name="requests")


def complete(tenant_id: str, prompt: str, max_tokens: int = 100, **extra: Any) -> None:
    """A task function: the rules read its arguments by name."""


def test_targets_give_each_rule_its_limit_key_and_cost() -> None:
    rules = [
        Rule(REQUESTS, key="{tenant_id}"),
        Rule(TOKENS, key="{tenant_id}:{region}", cost="max_tokens"),
    ]
    got = targets(rules, complete, ("acme", "hi"), {"max_tokens": 2000, "region": "eu"})
    assert got == [(REQUESTS, "acme", 1.0), (TOKENS, "acme:eu", 2000.0)]


def test_positional_arguments_are_bound_by_name_and_defaults_are_read() -> None:
    rule = Rule(TOKENS, cost="max_tokens")
    assert targets([rule], complete, ("acme", "hi", 7), {}) == [(TOKENS, None, 7.0)]
    default = inspect.signature(complete).parameters["max_tokens"].default
    # left out: the default, which the body sees
    assert targets([rule], complete, ("acme", "hi"), {}) == [(TOKENS, None, float(default))]
    with pytest.raises(ConfigError, match="no argument of this name") as caught:
        targets([Rule(TOKENS, cost="tokens_used")], complete, ("acme", "hi"), {})
    assert (caught.value.limit, caught.value.field) == ("tokens", "cost")


def send(tenant_id: str, body: str, tokens: int = 10) -> None:
    """A task function of plain parameters (bound without inspect: the same answer)."""


class Bound:
    def run(self, tenant_id: str, tokens: int) -> None:
        """A method: ``self`` is a parameter of the function, not of the bound method."""


@pytest.mark.parametrize(
    ("fn", "args", "kwargs"),
    [
        (send, ("acme", "hi"), {}),
        (send, ("acme",), {"tokens": 3}),
        (send, (), {"tenant_id": "acme", "body": "hi"}),
        (send, ("acme", "hi", 3, 4), {}),  # too many: refused, the keywords alone
        (send, ("acme",), {"tenant_id": "other"}),  # given twice: refused
        (send, ("acme",), {"region": "eu"}),  # unknown: refused
        (complete, ("acme", "hi"), {"region": "eu"}),  # **extra: through inspect
        (Bound().run, ("acme",), {"tokens": 2}),
        (Bound.run, (Bound(), "acme"), {"tokens": 2}),
    ],
)
def test_arguments_are_named_as_signature_binds_them(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    try:
        signature = inspect.signature(fn)
        bound = signature.bind_partial(*args, **kwargs)
        bound.apply_defaults()  # what the body sees of the arguments left out
        expected = dict(bound.arguments)
        expected.update(expected.pop("extra", {}))
    except TypeError:
        expected = dict(kwargs)
    assert named_arguments(fn, args, kwargs) == expected


def test_a_key_and_a_cost_read_an_argument_left_at_its_default() -> None:
    # send(tenant_id, body, tokens=10) called without tokens: the body sees 10
    rule = Rule(REQUESTS, key="{tenant_id}", cost="tokens")
    assert targets([rule], send, ("acme", "hi"), {}) == [(REQUESTS, "acme", 10.0)]
    assert targets([rule], send, ("acme", "hi", 3), {}) == [(REQUESTS, "acme", 3.0)]


def test_key_templates_read_whole_arguments_attributes_and_indexes() -> None:
    user = SimpleNamespace(org="acme", ids=[7, 8])
    rule = Rule(REQUESTS, key="{tenant_id}/{user.org}/{user.ids[1]}")
    got = targets([rule], complete, ("t1", "hi"), {"user": user, "user.org": "not read"})
    assert got == [(REQUESTS, "t1/acme/8", 1.0)]
    with pytest.raises(ConfigError, match="cannot read"):
        targets([rule], complete, ("t1", "hi"), {"user": SimpleNamespace(org="acme")})


def test_callables_get_the_task_arguments_as_given() -> None:
    rule = Rule(TOKENS, key=lambda tenant_id, *a, **k: tenant_id.upper(), cost=lambda *a, **k: 3)
    assert targets([rule], complete, ("acme", "hi"), {}) == [(TOKENS, "ACME", 3.0)]


def test_the_limit_in_force_comes_from_current() -> None:
    lowered = Limit.parse("5/s", name="requests")
    got = targets([Rule(REQUESTS)], complete, ("a", "b"), {}, current=lambda limit, key: lowered)
    assert got == [(lowered, None, 1.0)]


@pytest.mark.parametrize("cost", [-1, float("nan"), float("inf"), True, "x", None, 10**400])
def test_a_cost_from_the_arguments_must_be_a_finite_number_at_least_zero(cost: object) -> None:
    rule = Rule(TOKENS, cost="max_tokens")
    with pytest.raises(ConfigError, match="finite number") as caught:
        targets([rule], complete, ("a", "b"), {"max_tokens": cost})
    assert "(got " in str(caught.value)  # the value shown, None included


def test_policy_strings_are_parsed_once_into_typed_values() -> None:
    assert Rule(REQUESTS).redis_down is RedisDown.DEFER
    allow = Rule(REQUESTS, on_redis_down="allow:30s")
    assert (allow.redis_down, allow.fail_open_s) == (RedisDown.ALLOW, 30.0)
    assert (Rule(REQUESTS, on_redis_down="allow").fail_open_s) is None
    assert Rule(REQUESTS, on_redis_down="local").redis_down is RedisDown.LOCAL
    assert Rule(REQUESTS, on_timeout="dead_letter:late").dead_letter_queue == "late"
    assert Rule(REQUESTS).dead_letter_queue is None
    with pytest.raises(ConfigError, match="'defer'") as caught:
        Rule(REQUESTS, on_redis_down="allow:soon")
    assert (caught.value.limit, caught.value.field) == ("requests", "on_redis_down")


def test_a_concurrency_limit_counts_whole_tasks_in_the_python_api_as_in_a_file() -> None:
    whole = "the count of a concurrency limit must be a whole number"
    with pytest.raises(ConfigError, match=whole) as caught:
        Limit("slots", Algorithm.CONCURRENCY, 2.5)
    assert (caught.value.limit, caught.value.field, caught.value.value) == ("slots", "count", 2.5)
    with pytest.raises(ConfigError, match=whole) as caught:
        declare(["2.5 concurrent"], "proj.tasks.stream", {})  # @throttled("2.5 concurrent")
    assert str(caught.value).startswith("proj.tasks.stream: limit 'proj.tasks.stream': field ")
    assert (caught.value.field, caught.value.value) == ("rate", "2.5 concurrent")
    assert Limit.parse("3 concurrent").count == 3
    assert Limit.parse("2.5/s").count == 2.5  # a rate's count may be a fraction


@pytest.mark.parametrize(
    ("options", "field"),
    [
        pytest.param({"max_wait_s": -1}, "max_wait", id="negative-wait"),
        pytest.param({"max_wait_s": float("nan")}, "max_wait", id="nan-wait"),
        pytest.param({"max_wait_s": float("inf")}, "max_wait", id="inf-wait"),
        pytest.param({"max_wait_s": 1e12}, "max_wait", id="wait-beyond-ten-years"),
        pytest.param({"max_wait_s": "3651d"}, "max_wait", id="wait-string-beyond-ten-years"),
        pytest.param({"on_redis_down": "allow:5000d"}, "on_redis_down", id="fail-open-too-long"),
    ],
)
def test_a_duration_is_finite_at_least_zero_and_at_most_ten_years_in_python_as_in_a_file(
    options: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError, match="must be a duration") as caught:
        Rule(REQUESTS, **options)
    assert caught.value.field == field
    # @throttled("10/s", max_wait=...) builds the same Rule: the same error, named after the task
    if field == "max_wait":
        with pytest.raises(ConfigError, match="must be a duration"):
            declare(["10/s"], "proj.tasks.fetch", options)
    assert Rule(REQUESTS, max_wait_s=MAX_DURATION_S).max_wait_s == MAX_DURATION_S


def test_an_adaptive_limit_recovers_within_ten_years_in_python_as_in_a_file() -> None:
    with pytest.raises(ConfigError, match="at most 3650d") as caught:
        Adaptive(recover_s=3651 * 86400.0)
    assert caught.value.field == "recover"
    assert Adaptive(recover_s=MAX_DURATION_S).recover_s == MAX_DURATION_S


def test_declare_splits_inline_rates_from_names_and_keeps_the_overrides() -> None:
    declared = declare(
        ["20/s burst 1", "github", REQUESTS],
        "proj.tasks.fetch",
        {"key": "{owner}", "algorithm": "gcra", "cost": "n"},
    )
    assert declared.names == ("github",)
    inline, given = declared.rules
    assert (inline.name, inline.limit.algorithm, inline.key) == (
        "proj.tasks.fetch#1",
        Algorithm.GCRA,
        "{owner}",
    )
    assert given.limit is REQUESTS
    assert set(declared.overrides) == {"key", "cost"}


def test_an_override_of_a_named_limit_is_checked_when_declared_not_when_run() -> None:
    with pytest.raises(ConfigError) as caught:
        declare(["github"], "proj.tasks.fetch", {"max_wait_s": "soon"})
    assert str(caught.value).startswith(
        "proj.tasks.fetch: limit 'github': field 'max_wait': must be a duration"
    )
    with pytest.raises(ConfigError, match="field 'on_timeout'"):
        declare(["github"], "proj.tasks.fetch", {"on_timeout": "explode"})
    # fine ones pass, whatever the named limit's own numbers turn out to be
    declared = declare(["github"], "proj.tasks.fetch", {"max_wait_s": "5s", "cost": 500})
    assert declared.overrides == {"max_wait_s": "5s", "cost": 500}


def test_a_key_an_operator_types_is_checked_against_the_limit_s_template() -> None:
    composite = Rule(REQUESTS, key="{tenant_id}:{region}")
    # the key as the worker writes it: each value percent-encoded
    ((_, name, _),) = targets([composite], complete, ("acme corp", "hi"), {"region": "eu"})
    assert name == "acme%20corp:eu" and key_problem(composite, name) is None
    problem = key_problem(composite, "acme corp:eu")
    assert problem is not None and "did you mean 'acme%20corp:eu'?" in problem
    assert key_problem(composite, "acme") is not None  # not the template's shape
    assert key_problem(Rule(REQUESTS, key="{tenant_id}"), "acme corp") is None  # one value
    assert "has no key" in (key_problem(Rule(REQUESTS), "acme") or "")


@pytest.mark.parametrize(
    ("key", "hint"),
    [("tenant_id", "write '{tenant_id}' for the argument"), ("acme-eu", "share one key")],
)
def test_a_key_template_without_a_field_is_refused(key: str, hint: str) -> None:
    # A key with no {field} would be one constant: every tenant in one bucket
    with pytest.raises(ConfigError, match=re.escape(hint)) as caught:
        Rule(REQUESTS, key=key)
    assert (caught.value.field, caught.value.value) == ("key", key)


def test_a_call_the_task_would_refuse_is_named_as_such_not_as_a_missing_argument() -> None:
    def fetch(tenant: str, n: int) -> None: ...

    rule = Rule(Limit.parse("10/s", name="api"), key="{tenant}", cost="n")
    with pytest.raises(ConfigError) as caught:
        targets([rule], fetch, ("acme", 1), {"zzz": 1})
    assert "the call does not fit the task's parameters (an unexpected keyword argument " \
        "'zzz'): no argument 'tenant' for the key template" in str(caught.value)  # fmt: skip
    with pytest.raises(ConfigError, match=r"\(3 positional arguments for 2\)"):
        targets([rule], fetch, ("acme", 1, 2), {})
    assert targets([rule], fetch, (), {"tenant": "a", "n": 2})[0][1:] == ("a", 2.0)


def test_what_a_key_cost_or_plan_function_raises_names_its_limit_and_field() -> None:
    def fetch(tenant: str) -> None: ...

    def broken(*args: object, **kwargs: object) -> str:
        raise KeyError("nope")

    for field in ("key", "cost"):
        rule = Rule(Limit.parse("10/s", name="api"), **{field: broken})
        with pytest.raises(ConfigError) as caught:
            targets([rule], fetch, ("acme",), {})
        assert str(caught.value) == (
            f"limit 'api': field '{field}': the {field} function raised KeyError: 'nope'"
        )
        assert isinstance(caught.value.__cause__, KeyError)


def test_a_limit_name_holding_a_slash_or_concurrent_is_a_name_not_a_rate() -> None:
    # A limits file accepts `github/core` or `max-concurrent` as names; @throttled named
    # them and got "malformed rate": a rate starts with its count
    declared = declare(["github/core", "max-concurrent", "llm concurrent"], "proj.t", {})
    assert declared.names == ("github/core", "max-concurrent", "llm concurrent")
    assert not declared.rules
    (rate, streams) = declare(["20/s burst 1", " 8 Concurrent"], "proj.t", {}).rules
    assert rate.limit.rate_per_s == 20
    assert (streams.limit.algorithm, streams.limit.count) == (Algorithm.CONCURRENCY, 8)
    # mistakes in a rate are still named as such
    for bad in ("20/x", "-5/s", ".5/s"):
        with pytest.raises(ConfigError, match="field 'rate'"):
            declare([bad], "proj.t", {})


@pytest.mark.parametrize(
    ("rate", "algorithm", "cost", "advice"),
    [
        ("10/s", "token_bucket", 20, "give the limit a burst of at least 20 (got 20)"),
        ("0.5/s", "gcra", 1, "burst of at least 1 (a rate of 0.5/s holds 0.5 at once, 1/2s"),
        ("10/s", "fixed_window", 20, "give the rate a count of at least 20 (got 20)"),
        ("10/s", "sliding_window", 20, "give the rate a count of at least 20 (got 20)"),
        ("5 concurrent", None, 10, "allow at least 10 concurrent (got 10)"),
    ],
)
def test_a_fixed_cost_above_the_capacity_is_told_how_to_fit_in_its_algorithm_s_words(
    rate: str, algorithm: str | None, cost: float, advice: str
) -> None:
    # It advised a burst whatever the algorithm (which windows and concurrency refuse), with
    # an example of fractional rates even for a cost of 20 on 10/s
    with pytest.raises(ConfigError, match="field 'cost'") as caught:
        Rule(Limit.parse(rate, name="x", algorithm=algorithm), cost=cost)
    assert advice in str(caught.value)
    if "0.5/s" not in rate:
        assert "0.5/s" not in str(caught.value)
