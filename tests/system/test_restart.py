"""The limiter's Redis loses its data mid-run, with tasks sleeping to their slots (issue 17).

A fleet (2 ``celery worker`` x 2 children of ``workers/demo_app.py``, GCRA 15/s burst 1)
calls the mock API at 20/s **burst 1**, judged on each call's arrival; its limiter Redis is
flushed three times (a failover to an empty replica) and SIGKILLed and started again empty
once, while tasks sleep to slots it granted. Without the restart fence the fresh state
admits calls at once, next to the calls and slots of the lost one, and the API refuses
them; with it, nothing is refused and every task calls once. ``make bench-restart`` runs
the same 20 times (bench/restart.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.restart import LOSSES, RestartFleet, restart_fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestartFleet]:
    with restart_fleet(tmp_path_factory.mktemp("restart")) as fleet:
        yield fleet


def test_a_limiter_redis_that_loses_its_data_refuses_nothing(fleet: RestartFleet) -> None:
    """Given 120 tasks shaped at 15/s, when the limiter's Redis is flushed at 1, 5 and 7 s
    and killed and restarted empty at 3 s, then the strict API refused no call
    whose slot was too close to the last allowed one (refusals of calls a loaded host made
    late are not the schedule's: see unexplained_refusals), and every task completed, its
    id reaching the API exactly once."""
    outcome = fleet.run(tasks=120, losses=LOSSES, down_s=0.0)
    print(outcome.line())
    assert outcome.unexplained == [], outcome.line()
    assert outcome.once == outcome.tasks == outcome.completed, outcome.line()
    # The fence marker is back (written by the first script after the last loss).
    assert fleet.limiter.client().exists("throttle:{default}:fence")
