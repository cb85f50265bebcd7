"""How large a stock may be (throttle/celery/stock.py): within the burst margin."""

from __future__ import annotations

import pytest

from throttle import Limit
from throttle.celery.stock import kept_units, within_margin


def margined(spec: str, margin_s: float) -> Limit:
    return Limit.parse(spec, name="api").with_margin(margin_s)


def test_the_refill_missed_while_a_stock_is_drawn_fits_in_half_the_margin() -> None:
    limit = margined("1000/s burst 1000", 0.1)  # keeps 100 tokens in hand
    assert kept_units(limit, 0.1) == pytest.approx(100)
    # 50 ms of refill (50 tokens) is half of it, whatever the stock's size
    assert within_margin(limit, 500, 0.1, 0.05)
    assert not within_margin(limit, 500, 0.1, 0.06)


def test_a_capped_margin_bounds_the_stock_itself() -> None:
    # 0.1 s of 100,000/s would be 10,000 tokens: kept is half the burst beyond 1 instead
    limit = margined("100000/s burst 1000", 0.1)
    assert kept_units(limit, 0.1) == pytest.approx(499.5)
    assert within_margin(limit, 62, 0.1, 0.05)  # an eighth of it
    assert not within_margin(limit, 63, 0.1, 0.05)


def test_no_margin_no_stock() -> None:
    assert not within_margin(Limit.parse("1000/s", name="api"), 1, 0.0, 0.0)
    assert not within_margin(margined("10/s burst 1", 0.1), 1, 0.1, 0.05)
