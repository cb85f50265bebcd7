"""Limit specs parse from the strings users write and from config mappings."""

from __future__ import annotations

import dataclasses

import pytest

from throttle import Algorithm, ConfigError, Limit


@pytest.mark.parametrize(
    ("spec", "count", "period_s", "burst"),
    [
        ("50/s", 50, 1, 50),
        ("3500/m burst 100", 3500, 60, 100),
        ("10000/d", 10000, 86400, 10000),
        ("1/3h", 1, 10800, 1),
        ("10/5s", 10, 5, 10),
        ("2.5/s", 2.5, 1, 2.5),
        ("100/1.5m", 100, 90, 100),
        ("100 / minute", 100, 60, 100),
        ("20/S BURST 1", 20, 1, 1),
        ("5/250ms", 5, 0.25, 5),
        ("  7/hours  ", 7, 3600, 7),
    ],
)
def test_rate_strings(spec: str, count: float, period_s: float, burst: float) -> None:
    limit = Limit.parse(spec, name="x")
    assert (limit.count, limit.period_s, limit.burst) == (count, period_s, burst)
    assert limit.algorithm is Algorithm.TOKEN_BUCKET


def test_algorithm_and_name() -> None:
    limit = Limit.parse("20/s burst 1", name="github", algorithm="gcra")
    assert (limit.name, limit.algorithm, limit.rate_per_s, limit.capacity) == (
        "github",
        Algorithm.GCRA,
        20.0,
        1.0,
    )
    assert Limit.parse("10/s").name == "10/s"
    assert Limit.parse("10/s", algorithm="leaky_bucket").algorithm is Algorithm.GCRA


def test_concurrency_spec() -> None:
    limit = Limit.parse("8 concurrent", name="streams")
    assert (limit.algorithm, limit.count, limit.capacity) == (Algorithm.CONCURRENCY, 8, 8)
    assert Limit.parse("8 concurrent", algorithm="concurrency").algorithm is Algorithm.CONCURRENCY


@pytest.mark.parametrize(
    ("algorithm", "reserves", "holds_units"),
    [
        (Algorithm.TOKEN_BUCKET, True, False),
        (Algorithm.GCRA, True, False),
        (Algorithm.SLIDING_WINDOW, False, False),
        (Algorithm.FIXED_WINDOW, False, False),
        (Algorithm.CONCURRENCY, False, True),
    ],
    ids=lambda value: value.value if isinstance(value, Algorithm) else None,
)
def test_what_each_algorithm_does(algorithm: Algorithm, reserves: bool, holds_units: bool) -> None:
    """Only the reserving algorithms take a burst apart from their rate; only a concurrency
    limit is written 'N concurrent'."""
    assert (algorithm.reserves, algorithm.holds_units) == (reserves, holds_units)
    spec = "2 concurrent" if holds_units else "2/s"
    assert Limit.parse(spec, name="x", algorithm=algorithm).algorithm is algorithm
    if reserves:
        assert Limit.parse("2/s burst 5", name="x", algorithm=algorithm).capacity == 5
    elif not holds_units:
        with pytest.raises(ConfigError, match="burst applies"):
            Limit.parse("2/s burst 5", name="x", algorithm=algorithm)


def test_from_mapping() -> None:
    limit = Limit.from_mapping(
        {"algorithm": "gcra", "rate": "20/s", "burst": 2}, name="github", source="f.yaml"
    )
    assert limit == Limit("github", Algorithm.GCRA, 20, 1, 2)
    assert Limit.from_mapping({"rate": "10/s burst 4"}, name="a").burst == 4
    assert Limit.from_mapping({"rate": "5 concurrent"}, name="c").algorithm is Algorithm.CONCURRENCY


def test_limits_are_immutable_and_hashable() -> None:
    limit = Limit.parse("10/s", name="api")
    with pytest.raises(AttributeError):
        limit.count = 5  # type: ignore[misc]
    assert {limit: 1}[Limit.parse("10/s", name="api")] == 1


def test_a_fair_limit_and_its_weights() -> None:
    limit = Limit.parse("20/s burst 1", name="llm", algorithm="gcra", fair=True,
                        weights={"enterprise": 4, "free": 0.5})  # fmt: skip
    assert (limit.fair, limit.code, limit.codes) == (True, "fair", frozenset({"fair"}))
    assert limit.weights == (("enterprise", 4.0), ("free", 0.5))
    assert (limit.weight("enterprise"), limit.weight("free"), limit.weight("x")) == (4, 0.5, 1)
    assert {limit: 1}[dataclasses.replace(limit)] == 1  # hashable, and replace keeps weights
    assert (
        Limit.from_mapping({"rate": "20/s", "fair": True, "weights": {"a": 2}}, name="llm").weight(
            "a"
        )
        == 2
    )
    assert Limit.parse("20/s", name="plain").code == "tb"


@pytest.mark.parametrize(
    ("options", "field", "value"),
    [
        ({"fair": "yes"}, "fair", "yes"),
        ({"fair": True, "weights": {"a": 0}}, "weights.a", 0),
        ({"fair": True, "weights": {"a": -2}}, "weights.a", -2),
        ({"fair": True, "weights": {"a": "many"}}, "weights.a", "many"),
        ({"fair": True, "weights": {"a": float("nan")}}, "weights.a", None),
        ({"fair": True, "weights": [1]}, "weights", [1]),
        ({"fair": True, "weights": {"": 2}}, "weights", ""),
        ({"weights": {"a": 2}}, "weights", {"a": 2}),
    ],
)
def test_fair_errors_name_the_field_and_value(
    options: dict[str, object], field: str, value: object
) -> None:
    with pytest.raises(ConfigError) as caught:
        Limit.parse("20/s", name="llm", **options)  # type: ignore[arg-type]
    assert (caught.value.field, caught.value.limit) == (field, "llm")
    if value is not None:
        assert caught.value.value == value


def test_fair_is_for_token_bucket_and_gcra() -> None:
    with pytest.raises(ConfigError, match="token_bucket and gcra") as caught:
        Limit.parse("20/s", name="llm", algorithm="sliding_window", fair=True)
    assert caught.value.field == "fair"


def test_a_learned_rate_keeps_a_limit_fair() -> None:
    from throttle.adaptive import learned_limit  # noqa: PLC0415

    limit = Limit.parse("20/s burst 1", name="llm", algorithm="gcra", fair=True,
                        weights={"a": 3})  # fmt: skip
    learned = learned_limit(limit, 10.0)
    assert (learned.fair, learned.weights, learned.rate_per_s) == (True, limit.weights, 10.0)
