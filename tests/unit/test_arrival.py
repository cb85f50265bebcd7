"""A rescheduled task comes back once per slot, for every valid setting: it arrives no
earlier than ``sleep_max`` before its slot, so the gate sleeps to the slot instead of
sending the task back again (throttle/celery/arrival.py). A property over the settings a
limits file accepts, and the waits a limit can impose."""

from __future__ import annotations

from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st

from throttle import ConfigError
from throttle.celery.arrival import (
    earliest_arrival_s,
    eta_lead_s,
    park_lead_s,
    release_poll_s,
)
from throttle.config import MIN_SLEEP_MAX_S, Settings

durations = st.one_of(
    st.floats(min_value=0.0, max_value=0.2, allow_nan=False),  # near the floor
    st.floats(min_value=0.0, max_value=3600.0, allow_nan=False),
)


def settings_of(**values: float) -> Settings | None:
    """The settings a limits file with these durations (s) loads to, or None if refused."""
    try:
        return Settings.from_mapping(values, source="limits.yaml")
    except ConfigError:
        return None


def comes_back(settings: Settings, wait_s: float) -> tuple[str, float]:
    """Where a task that must wait ``wait_s`` (beyond sleep_max) for its reserved slot
    comes back, and the latest it can find its slot still ahead then (the earliest
    arrival): an ETA message is due ``eta_lead`` before the slot and Celery never runs it
    before it is due; a parked one (beyond park_after) is due ``park_lead`` before the
    slot and released up to one poll before it is due. Mirrors Gate._decide and defer."""
    countdown_s = wait_s - eta_lead_s(settings)
    if countdown_s > settings.park_after_s:
        return "park", park_lead_s(settings) + release_poll_s(settings)
    return "republish", eta_lead_s(settings)


@given(
    sleep_max=durations,
    park_after=durations,
    park_lead=durations,
    wait=st.floats(min_value=0.0, max_value=86400.0, allow_nan=False),
)
def test_a_task_is_republished_at_most_once_per_slot(
    sleep_max: float, park_after: float, park_lead: float, wait: float
) -> None:
    settings = settings_of(sleep_max=sleep_max, park_after=park_after, park_lead=park_lead)
    assume(settings is not None)
    assert settings is not None
    assume(wait > settings.sleep_max_s)  # the gate sends the task back
    _, left_s = comes_back(settings, wait)
    # When it comes back, its slot is at most left_s ahead: within sleep_max, the gate
    # sleeps to it; it is not sent back a second time
    assert 0 <= left_s < settings.sleep_max_s
    assert left_s <= earliest_arrival_s(settings)
    assert earliest_arrival_s(settings) <= 0.75 * settings.sleep_max_s


@given(sleep_max=st.floats(min_value=0.0, max_value=MIN_SLEEP_MAX_S, exclude_max=True))
def test_a_sleep_max_that_would_loop_is_refused(sleep_max: float) -> None:
    assert settings_of(sleep_max=sleep_max) is None


def test_the_leads_of_the_defaults() -> None:
    defaults: dict[str, Any] = {}
    settings = Settings.from_mapping(defaults, source=None)
    # sleep_max 1 s: ETA messages 0.1 s early, parked tasks 0.5 s + one 0.25 s poll
    assert (eta_lead_s(settings), park_lead_s(settings), release_poll_s(settings)) == (
        0.1,
        0.5,
        0.25,
    )
    assert earliest_arrival_s(settings) == 0.75
