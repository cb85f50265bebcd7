"""Limit specs parse from the strings users write and from config mappings."""

from __future__ import annotations

import pytest

from throttle import Algorithm, Limit


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
