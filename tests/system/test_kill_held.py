"""A worker killed (SIGKILL) while it holds throttled tasks that wait for their slots loses
none of them and runs none twice, with ``acks_late`` and without: here on the Redis broker
and a RabbitMQ quorum queue.

The scenario is tests/support/held.py (app: tests/apps/held_app.py): a victim worker takes
a backlog of 20 tasks at 4/s, holds some of them waiting, is killed between two bodies, and
a second worker takes over. Judged on the count of executions per task id once nothing is
left anywhere (broker, parking lot), never on timing. The full matrix (5 pools x 3 brokers
x 2) is ``python -m bench.kill_matrix``; here, for the time ``make test`` may take, the
two green pools, whose consumer has no event loop (``restore_when_idle``).

The gevent case on Redis fails without :func:`throttle.celery.waiting.restore_when_idle`:
the successor received none of the messages the victim held.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.held import Case, CaseError, rabbit_vhost, run_case

pytestmark = pytest.mark.slow

CASES = [
    Case("gevent", "redis", acks_late=False),
    Case("eventlet", "quorum", acks_late=True),
]
"""Every pool once, every broker with and without ``acks_late``."""


@pytest.fixture(scope="module")
def vhost() -> Iterator[str]:
    """A private RabbitMQ vhost for this module's cases (each declares queues of its own
    name), deleted at the end. RabbitMQ unreachable is a failure, not a skip."""
    try:
        with rabbit_vhost() as url:
            yield url
    except CaseError as exc:
        pytest.fail(str(exc))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_killed_worker_s_waiting_tasks_run_once_each(
    case: Case, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = request.getfixturevalue("vhost") if case.broker != "redis" else None
    # Given a worker holding throttled tasks that wait; when it is killed and another
    # takes over (tests/support/held.py)
    outcome = run_case(case, tmp_path, url)
    # Then every task ran, and none twice
    said = f"{case.id}: {'; '.join(outcome.notes)}"
    assert outcome.lost == [], f"{len(outcome.lost)} never ran: {outcome.lost}; {said}"
    assert outcome.twice == {}, f"runs of the tasks run more than once: {outcome.twice}; {said}"
    assert sorted(outcome.runs) == sorted(outcome.ids)
    # (a body the victim completed may run again if the kill came before its
    # acknowledgement left: Celery's at-least-once, reported, not judged here)
    print(
        f"\n{case.id}: {outcome.ran_before_kill} ran before the kill, {outcome.held_at_kill} "
        f"held; all ran once {outcome.recovered_s:.1f} s after it; "
        f"{len(outcome.rerun_after_body)} ran again after a body on the victim; "
        f"{outcome.publishes_per_task:.2f} publishes per task; {'; '.join(outcome.notes)}"
    )
