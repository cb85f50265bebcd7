"""The share of its estimate a limit's calls use (throttle/celery/estimates.py): learned
from the reported costs, applied only to limits that follow a dimension of their upstream
and whose cost is an estimate, rising at once and falling slowly, within its bounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from throttle import Limit
from throttle.celery.estimates import FLOOR, MIN_SAMPLES, Estimates, learns
from throttle.rules import Rule

TOKENS = Limit.parse("120000/m burst 2000", name="tokens")


def rule(**fields: object) -> Rule:
    return Rule(TOKENS, **fields)  # type: ignore[arg-type]


def test_only_estimated_costs_of_limits_that_follow_their_upstream_learn() -> None:
    assert learns(rule(cost="estimate", upstream="tokens"))
    assert not learns(rule(cost="estimate"))  # no upstream: the whole estimate, as before
    assert not learns(rule(cost=250.0, upstream="tokens"))  # a fixed cost is no estimate


def test_the_share_applies_after_a_few_reports_and_scales_the_reservation() -> None:
    estimates = Estimates()
    learning = rule(cost="estimate", upstream="tokens")
    fixed = Rule(Limit.parse("10/s", name="requests"))
    targets = [(TOKENS, None, 250.0), (fixed.limit, None, 1.0)]
    for _ in range(MIN_SAMPLES - 1):
        estimates.observe("tokens", 250.0, 200.0)
    # Given fewer reports than MIN_SAMPLES: the whole estimate
    assert estimates.scaled([learning, fixed], targets) == (targets, {"tokens": 250.0})
    estimates.observe("tokens", 250.0, 200.0)
    # Then 80 % of it, and the whole estimate kept for the settle
    scaled, whole = estimates.scaled([learning, fixed], targets)
    assert scaled == [(TOKENS, None, pytest.approx(200.0)), (fixed.limit, None, 1.0)]
    assert whole == {"tokens": 250.0}


def test_a_larger_share_is_taken_at_once_a_smaller_one_slowly() -> None:
    estimates = Estimates()
    for _ in range(MIN_SAMPLES):
        estimates.observe("tokens", 100.0, 50.0)
    assert estimates.share("tokens") == pytest.approx(0.5)
    estimates.observe("tokens", 100.0, 90.0)  # a call that used more: at once
    assert estimates.share("tokens") == pytest.approx(0.9)
    estimates.observe("tokens", 100.0, 50.0)  # a smaller one: a fifth of the way
    assert estimates.share("tokens") == pytest.approx(0.82)
    estimates.observe("tokens", 100.0, 500.0)  # more than the estimate: the whole of it
    assert estimates.share("tokens") == 1.0
    estimates.observe("tokens", 0.0, 10.0)  # an estimate of 0 says nothing
    assert estimates.share("tokens") == 1.0


@given(st.lists(st.tuples(st.floats(0, 1e9), st.floats(0, 1e9)), max_size=30))
def test_the_share_stays_within_its_bounds(reports: list[tuple[float, float]]) -> None:
    estimates = Estimates()
    for estimate, actual in reports:
        estimates.observe("tokens", estimate, actual)
        assert FLOOR <= estimates.share("tokens") <= 1.0
