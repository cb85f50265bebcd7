"""Bad input gets a clear error that names what is wrong; driver errors never leak raw."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import redis
import redis.asyncio

from tests.support.servers import free_port
from throttle import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    CostExceedsCapacity,
    Limit,
    Limiter,
    RequestError,
    ThrottleError,
)

BAD_SPECS = [
    pytest.param("", "malformed rate", id="empty"),
    pytest.param("fast", "malformed rate", id="words"),
    pytest.param("10/", "malformed rate", id="no-unit"),
    pytest.param("/s", "malformed rate", id="no-count"),
    pytest.param("10//s", "malformed rate", id="double-slash"),
    pytest.param("-5/s", "malformed rate", id="negative-count"),
    pytest.param("nan/s", "malformed rate", id="nan-count"),
    pytest.param("10/s burst", "malformed rate", id="burst-without-value"),
    pytest.param("10/s burst -1", "malformed rate", id="negative-burst"),
    pytest.param("10/fortnight", "unknown time unit 'fortnight'", id="unknown-unit"),
    pytest.param("0/s", "must be a finite number > 0", id="zero-rate"),
    pytest.param("10/0s", "must be a finite number > 0", id="zero-period"),
    pytest.param("10/s burst 0", "must be a finite number > 0", id="zero-burst"),
    pytest.param("0 concurrent", "must be a finite number > 0", id="zero-concurrency"),
]


@pytest.mark.parametrize(("spec", "problem"), BAD_SPECS)
def test_malformed_specs_name_the_field_and_value(spec: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Limit.parse(spec, name="upstream")
    message = str(caught.value)
    assert problem in message
    assert "limit 'upstream'" in message
    assert "field 'rate'" in message
    assert repr(spec) in message
    assert caught.value.field == "rate"


BAD_MAPPINGS = [
    pytest.param(
        {"rate": "10/s", "algorithm": "magic"}, "algorithm", "unknown algorithm", id="algo"
    ),
    pytest.param({"rate": "10/x"}, "rate", "unknown time unit", id="unit"),
    pytest.param({"rate": 10}, "rate", "must be a string", id="rate-type"),
    pytest.param({"algorithm": "gcra"}, "rate", "missing field", id="missing-rate"),
    pytest.param({"rate": "10/s", "burst": -2}, "burst", "finite number > 0", id="neg-burst"),
    pytest.param({"rate": "10/s", "burst": "lots"}, "burst", "must be a number", id="burst-type"),
    pytest.param({"rate": "10/s", "burts": 2}, "burts", "unknown field", id="typo"),
    pytest.param(
        {"rate": "10/m", "algorithm": "fixed_window", "burst": 5},
        "burst",
        "token_bucket and gcra only",
        id="burst-on-window",
    ),
]


@pytest.mark.parametrize(("mapping", "field", "problem"), BAD_MAPPINGS)
def test_bad_config_mappings_name_file_limit_and_field(
    mapping: dict[str, Any], field: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        Limit.from_mapping(mapping, name="github", source="configs/limits.yaml")
    message = str(caught.value)
    assert message.startswith("configs/limits.yaml: limit 'github': field ")
    assert f"field {field!r}" in message
    assert problem in message


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"count": 0}, "count"),
        ({"count": -1}, "count"),
        ({"count": math.nan}, "count"),
        ({"count": math.inf}, "count"),
        ({"period_s": 0}, "period_s"),
        ({"period_s": -3}, "period_s"),
        ({"burst": 0}, "burst"),
        ({"algorithm": "bogus"}, "algorithm"),
        ({"name": ""}, "name"),
    ],
)
def test_invalid_limit_fields(kwargs: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"name": "api", "algorithm": "token_bucket", "count": 10}
    args.update(kwargs)
    with pytest.raises(ConfigError) as caught:
        Limit(**args)
    assert caught.value.field == field


BAD_CALLS = [
    pytest.param({"cost": -1}, "cost must be a finite number >= 0 (got -1)", id="negative-cost"),
    pytest.param({"cost": math.nan}, "cost must be a finite number >= 0 (got nan)", id="nan-cost"),
    pytest.param({"cost": math.inf}, "cost must be a finite number >= 0", id="inf-cost"),
    pytest.param({"cost": "1"}, "cost must be a number (got '1')", id="str-cost"),
    pytest.param({"cost": True}, "cost must be a number", id="bool-cost"),
    pytest.param({"key": ""}, "key must be a non-empty string or None (got '')", id="empty-key"),
    pytest.param({"key": 42}, "key must be a non-empty string or None (got 42)", id="int-key"),
    pytest.param({"max_wait_s": -1}, "max_wait_s must be a finite number >= 0", id="neg-wait"),
    pytest.param({"lease_s": 0}, "lease_s must be a finite number > 0", id="zero-lease"),
    pytest.param({"acquisition_id": ""}, "acquisition_id must be a non-empty", id="empty-id"),
    pytest.param({"cost": 10**400}, "cost must be a finite number >= 0", id="huge-int-cost"),
    pytest.param({"max_wait_s": None}, "max_wait_s must be a number (got None)", id="none-wait"),
    pytest.param(
        {"max_wait_s": 1e12},
        "max_wait_s must be a finite number >= 0 and <= 3.1536e+08",
        id="absurd-wait",
    ),
    pytest.param(
        {"lease_s": 1e15}, "lease_s must be a finite number > 0 and <= ", id="absurd-lease"
    ),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_CALLS)
def test_bad_acquire_arguments(limiter: Limiter, kwargs: dict[str, Any], message: str) -> None:
    limit = Limit.parse("10/s", name="api")
    with pytest.raises(RequestError) as caught:
        limiter.acquire(limit, **kwargs)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "spec",
    [
        ("10/s burst 3", "token_bucket"),
        ("10/s burst 3", "gcra"),
        ("3/s", "sliding_window"),
        ("3/d", "fixed_window"),
        ("3 concurrent", "concurrency"),
    ],
    ids=lambda spec: spec[1],
)
def test_a_cost_above_capacity_fails_at_once(limiter: Limiter, spec: tuple[str, str]) -> None:
    limit = Limit.parse(spec[0], name="api", algorithm=spec[1])
    with pytest.raises(CostExceedsCapacity) as caught:
        limiter.acquire(limit, cost=3.5, max_wait_s=3600)
    assert str(caught.value) == (
        "cost 3.5 exceeds the capacity 3 of limit 'api': it can never be admitted"
    )
    assert limiter.acquire(limit, cost=3).allowed  # nothing was taken by the refusal


def test_a_spec_string_is_not_a_limit(limiter: Limiter) -> None:
    with pytest.raises(
        RequestError, match=r"expected a Limit, e.g. Limit.parse\('50/s'\) \(got '50/s'\)"
    ):
        limiter.acquire("50/s")  # type: ignore[arg-type]


def test_the_same_target_twice_is_refused(limiter: Limiter) -> None:
    limit = Limit.parse("10/s", name="api")
    with pytest.raises(RequestError, match="appear twice"):
        limiter.acquire_many([(limit, "a"), (limit, "a")])
    with pytest.raises(RequestError, match="at least one limit"):
        limiter.acquire_many([])


def test_number_subclasses_are_numbers(limiter: Limiter) -> None:
    class Units(float):
        pass

    assert limiter.acquire(Limit.parse("10/s", name="api"), cost=Units(2.0)).remaining == 8


def test_settle_needs_an_acquisition(limiter: Limiter) -> None:
    denied = limiter.acquire(Limit.parse("1/h", name="api"), cost=0)
    with pytest.raises(RequestError, match="settle needs the Acquisition"):
        limiter.settle(denied.acquisition, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "algorithm", "problem"),
    [
        ("8 concurrent", "gcra", "'N concurrent' is a concurrency limit, not gcra"),
        ("10/s", "concurrency", "a concurrency limit is written 'N concurrent'"),
    ],
)
def test_a_spec_and_an_algorithm_that_disagree(spec: str, algorithm: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        Limit.parse(spec, name="x", algorithm=algorithm)
    with pytest.raises(ConfigError, match=problem):
        Limit.from_mapping({"rate": spec, "algorithm": algorithm}, name="x")


def test_huge_numbers_in_a_limit() -> None:
    with pytest.raises(ConfigError, match="finite number > 0"):
        Limit("x", "token_bucket", 10**400)  # type: ignore[arg-type]


def test_settle_rejects_a_bad_actual_cost(limiter: Limiter) -> None:
    decision = limiter.acquire(Limit.parse("10/s", name="api"), acquisition_id="t")
    assert decision.acquisition is not None
    with pytest.raises(RequestError, match=r"actual_cost of limit 'api' must be a finite"):
        limiter.settle(decision.acquisition, -3)


def test_unreachable_redis_is_wrapped() -> None:
    client = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    limiter = Limiter(client)
    with pytest.raises(BackendUnavailable) as caught:
        limiter.acquire(Limit.parse("10/s", name="api"))
    assert isinstance(caught.value.__cause__, redis.ConnectionError)
    assert isinstance(caught.value, ThrottleError)


def test_redis_errors_are_wrapped(limiter: Limiter, client: redis.Redis) -> None:
    limit = Limit.parse("10/s", name="api")
    client.rpush(limiter.keyspace.state_keys(limit, None)[0], "not a bucket")
    with pytest.raises(BackendError, match="WRONGTYPE") as caught:
        limiter.acquire(limit)
    assert not isinstance(caught.value, BackendUnavailable)
    assert isinstance(caught.value.__cause__, redis.ResponseError)


def test_malformed_targets_are_request_errors_before_anything_is_sent(limiter: Limiter) -> None:
    limit = Limit.parse("10/s", name="api")
    shapes = "(limit, key) or (limit, key, cost) tuple"
    cases: list[tuple[Any, str]] = [
        ([(limit,)], f"each target is a {shapes}"),
        ([(limit, "k", 1.0, 2.0)], f"each target is a {shapes}"),
        (limit, "expected a list of"),
        ("api", "expected a list of"),
    ]
    for targets, message in cases:
        with pytest.raises(RequestError, match=re.escape(message)):
            limiter.acquire_many(targets)
    with pytest.raises(RequestError, match=re.escape("each target is a (limit, key, cost) tuple")):
        limiter.acquire_each([(limit, "k")])
    assert limiter.peek(limit).remaining == 10.0  # nothing taken


def test_a_client_that_decodes_replies_is_refused_by_name(redis_url: str) -> None:
    # The scripts answer in bytes that are not text: a decoding client would fail every
    # call with redis-py's UnicodeDecodeError
    from throttle.aio import Limiter as AsyncLimiter  # noqa: PLC0415

    for make in (
        lambda: Limiter(redis.Redis.from_url(redis_url, decode_responses=True)),
        lambda: Limiter.from_url(redis_url + "?decode_responses=true"),
        lambda: AsyncLimiter(redis.asyncio.Redis.from_url(redis_url, decode_responses=True)),
    ):
        with pytest.raises(ConfigError, match="decode_responses") as caught:
            make()
        assert caught.value.field in ("decode_responses", "redis_url")
    # and a client of its own, without the option, works
    assert Limiter.from_url(redis_url).acquire(Limit.parse("10/s", name="d")).allowed
