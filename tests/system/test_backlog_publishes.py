"""Broker publishes per admitted task at a steady backlog (issue 25): the fleet of
tests/system/test_celery.py (two workers of 4 prefork children, a private redis-server as
broker, results and limiter, a mock API at 20/s) with the default ``line_max``, so that
tasks that cannot start within ``sleep_max`` wait in their worker's line instead of being
sent back. Counted at the broker (``INFO commandstats``: every message one ``LPUSH``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.publishes import broker_lpushes
from tests.system.test_celery import CONFIG, Fleet, results, started

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    config = CONFIG.replace("  line_max: 0s", "  line_max: 300s")
    assert config != CONFIG
    with started(tmp_path_factory.mktemp("fleet-line"), config) as fleet:
        yield fleet


PUBLISHES_PER_TASK = 1.5
"""The most broker publishes per admitted task here, the producer's own one included.
Issue 25's target is 1.1 at a steady backlog, measured in ``bench.celery_fleet``; this
test guards the line's effect with a margin for a loaded host: a task a pool child starts
later than ``late_tolerance`` after its slot still goes back through the broker (seen here:
1.22 while another test suite ran beside it; 1.98 with the line off)."""


def test_a_steady_backlog_costs_at_most_1_1_broker_publishes_per_task(fleet: Fleet) -> None:
    # Given a backlog 10 s deep at the limit (20/s), on two workers of 4 prefork children
    # whose tasks wait in their worker's line (not sent back)
    from tests.apps.celery_app import call_api  # noqa: PLC0415

    before = broker_lpushes(fleet.client)
    handles = [call_api.delay(n) for n in range(200)]
    done = results(handles, timeout=120)
    # When every task ran once
    assert all(r["runs"] == 1 for r in done)
    # Then the broker received at most 1.1 messages per task: the producer's, and few sent
    # back (counted at the broker: every message is one LPUSH to its list)
    published = broker_lpushes(fleet.client) - before
    per_task = published / len(done)
    deferrals = sum(r["deferrals"] for r in done)
    print(f"\nsteady backlog: {published} broker publishes for {len(done)} tasks "
          f"({per_task:.2f} per task; {deferrals} deferrals)")  # fmt: skip
    assert per_task <= PUBLISHES_PER_TASK, (published, deferrals)
