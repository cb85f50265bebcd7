"""Celery's canvas under a binding limit: a selection of Celery 5.7.0's own integration
tests (t/integration/test_canvas.py and test_tasks.py: chains, groups, chords, countdowns,
ETAs, errors, expiry), ported to run against real ``celery worker`` subprocesses of
tests/apps/canvas_app.py, where every task is a ``ThrottledTask`` and the queue ``celery``
is limited to GCRA 20/s burst 1 with ``sleep_max`` 50 ms: the tasks of a canvas are really
re-published (ETA messages, parked), and the outcome must be Celery's.

As in Celery's own suite, ``task_create_missing_queues`` is off. Each ported test names the
Celery test it comes from; assertions are Celery's, plus, where the canvas is wide enough
to be throttled, that throttling did re-publish some of its tasks (else the test would not
test rescheduling).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import chain, chord, group
from celery.exceptions import ChordError, TaskRevokedError
from celery.result import AsyncResult

from tests.support.canvas import CanvasFleet, canvas_fleet
from throttle.errors import ThrottleTimeout
from throttle.redis.keys import KeySpace

pytestmark = pytest.mark.slow

CONFIG = """
settings:
  refresh: 0.5s
  sleep_max: 0.05s
  park_after: 0.5s
  line_max: 0s  # deferred tasks are re-published or parked (copies), as these tests check
  park_lead: 0.2s
  late_tolerance: 5s
limits:
  celery: {algorithm: gcra, rate: 20/s, burst: 1}
  eta: {algorithm: gcra, rate: 1/s, burst: 1, key: "{k}"}
  fast: {algorithm: gcra, rate: 5/s, burst: 1, key: "{k}"}
  hourly: {algorithm: gcra, rate: 1/h, burst: 1, key: "{k}"}
  waiting: {algorithm: gcra, rate: 1/h, burst: 1, key: "{k}", max_wait: 1s}
queues:
  celery: [celery]
"""
# late_tolerance 5 s: a task that reaches its slot late (a loaded host) keeps it, so that
# each task is re-published at most once here (a slot given up for lateness would be a
# second, legitimate, re-publication).
TIMEOUT = 60
KEYS = KeySpace()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CanvasFleet]:
    with canvas_fleet(tmp_path_factory.mktemp("canvas"), CONFIG) as fleet:
        yield fleet


def deferred(fleet: CanvasFleet, ids: list[str]) -> int:
    """How many of these tasks throttling re-published (their trail record)."""
    return sum(1 for task_id in ids if fleet.client.exists(KEYS.task_key(task_id)))


def revoked_signal(fleet: CanvasFleet, task_id: str) -> dict[str, Any] | None:
    """The ``task_revoked`` signal the worker sent for ``task_id`` (it follows the REVOKED
    state by a round trip, as in Celery), or None after 10 s."""
    from tests.apps.canvas_app import REVOKED  # noqa: PLC0415

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for raw in fleet.client.lrange(REVOKED, 0, -1):
            seen: dict[str, Any] = json.loads(raw)
            if seen["id"] == task_id:
                return seen
        time.sleep(0.05)
    return None


# -- chains (Celery: t/integration/test_canvas.py::test_chain)


def test_simple_chain(fleet: CanvasFleet) -> None:
    from tests.apps.canvas_app import add  # noqa: PLC0415

    c = add.s(4, 4) | add.s(8) | add.s(16)
    assert c().get(timeout=TIMEOUT) == 32


def test_chain_inside_group_receives_arguments(fleet: CanvasFleet) -> None:
    from tests.apps.canvas_app import add  # noqa: PLC0415

    c = add.s(5, 6) | group((add.s(1) | add.s(2), add.s(3)))
    assert c().get(timeout=TIMEOUT) == [14, 14]


def test_group_results_in_chain(fleet: CanvasFleet) -> None:
    from tests.apps.canvas_app import add  # noqa: PLC0415

    c = group(add.s(1, 2) | group(add.s(1), add.s(2)))
    assert c().get(timeout=TIMEOUT) == [4, 5]


def test_chain_on_error(fleet: CanvasFleet) -> None:
    from tests.apps.canvas_app import ExpectedError, add, fail  # noqa: PLC0415

    res = chain(add.s(1, 2), fail.s(), add.s(3, 4))()
    with pytest.raises(ExpectedError):
        res.get(propagate=True, timeout=TIMEOUT)
    with pytest.raises(ExpectedError):
        res.parent.get(propagate=True, timeout=TIMEOUT)


def test_chain_parent_ids(fleet: CanvasFleet) -> None:
    # test_chain::test_parent_ids (num=10): every link's root and parent, in order
    from tests.apps.canvas_app import ids  # noqa: PLC0415

    num = 10
    c = chain(ids.si(i=i) for i in range(num))
    c.freeze()
    res = c()
    res.get(timeout=TIMEOUT)
    root = res
    while root.parent:
        root = root.parent
    node, i = res, num - 1
    while node:
        root_id, parent_id, value = node.get(timeout=TIMEOUT)
        assert value == i
        if node.parent:
            assert parent_id == node.parent.id
        assert root_id == root.id
        node, i = node.parent, i - 1


@pytest.mark.filterwarnings("ignore::celery.exceptions.CPendingDeprecationWarning")  # Celery's
def test_chain_error_handler_with_eta(fleet: CanvasFleet) -> None:
    # test_chain::test_chain_error_handler_with_eta, with a 2 s ETA (Celery's: 10 s)
    from tests.apps.canvas_app import add, identity, tsum  # noqa: PLC0415

    eta = datetime.now(timezone.utc) + timedelta(seconds=2)
    c = chain(group(add.s(1, 2), add.s(3, 4)), tsum.s()).on_error(identity.si("err"))
    assert c.apply_async(eta=eta).get(timeout=TIMEOUT) == 10
    assert datetime.now(timezone.utc) >= eta


def test_chain_countdown_delays_the_first_task(fleet: CanvasFleet) -> None:
    from tests.apps.canvas_app import add, return_request_eta  # noqa: PLC0415

    started = time.monotonic()
    res = (add.si(1, 1) | return_request_eta.si()).apply_async(countdown=1)
    assert res.parent.get(timeout=TIMEOUT) == 2
    assert time.monotonic() - started >= 0.9
    # Celery gives the countdown to the first task only: the second has no ETA of its own
    assert res.get(timeout=TIMEOUT) is None


# -- groups (test_group)


def test_group_parent_ids(fleet: CanvasFleet) -> None:
    # test_group::test_parent_ids: 48 tasks in a group after two links, at 20/s
    from tests.apps.canvas_app import ids  # noqa: PLC0415

    g = ids.si(i=1) | ids.si(i=2) | group(ids.si(i=i) for i in range(2, 50))
    res = g()
    expected_root_id = res.parent.parent.id
    expected_parent_id = res.parent.id
    values = res.get(timeout=TIMEOUT)
    for i, (root_id, parent_id, value) in enumerate(values):
        assert root_id == expected_root_id
        assert parent_id == expected_parent_id
        assert value == i + 2
    assert deferred(fleet, [child.id for child in res.results]) > 0  # the limit bound


def test_group_countdown(fleet: CanvasFleet) -> None:
    # test_group::test_group_with_countdown-like: every member waits for the countdown,
    # and reads it as its request.eta
    from tests.apps.canvas_app import return_request_eta  # noqa: PLC0415

    eta = datetime.now(timezone.utc) + timedelta(seconds=1)
    res = group(return_request_eta.s() for _ in range(10)).apply_async(eta=eta)
    etas = res.get(timeout=TIMEOUT)
    assert etas == [eta.isoformat()] * 10
    assert deferred(fleet, [child.id for child in res.results]) > 0


# -- chords (test_chord)


def test_simple_chord(fleet: CanvasFleet) -> None:
    from tests.apps.canvas_app import add, tsum  # noqa: PLC0415

    res = chord(add.s(i, i) for i in range(20))(tsum.s())
    assert res.get(timeout=TIMEOUT) == 380


def chord_failed(res: AsyncResult) -> None:
    """The chord's body ends FAILURE with a ChordError (its header failed)."""
    deadline = time.monotonic() + TIMEOUT
    while not res.ready() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert res.state == "FAILURE"
    assert isinstance(res.result, ChordError)


def test_chord_header_failure_fails_the_chord(fleet: CanvasFleet) -> None:
    # test_chord::test_chord_on_error-like: a failing header task fails the body with a
    # ChordError; get() raises the header's error
    from tests.apps.canvas_app import ExpectedError, add, fail, tsum  # noqa: PLC0415

    res = chord([add.s(1, 2), fail.s(), add.s(3, 4)])(tsum.s())
    with pytest.raises(ExpectedError):
        res.get(timeout=TIMEOUT)
    chord_failed(res)


def test_group_or_task_countdown_delays_header(fleet: CanvasFleet) -> None:
    # test_chord::test_group_or_task_countdown_delays_header (#7851): the header tasks see
    # the countdown's ETA, throttled or not
    from tests.apps.canvas_app import identity, return_request_eta  # noqa: PLC0415

    countdown = 2
    started = time.monotonic()
    result = (group(return_request_eta.s(), return_request_eta.s()) | identity.s()).apply_async(
        countdown=countdown
    )
    header_etas = result.get(timeout=TIMEOUT)
    assert time.monotonic() - started >= countdown * 0.9
    assert all(eta is not None for eta in header_etas)


# -- retries (test_tasks)


def test_task_retried_once_under_the_limit(fleet: CanvasFleet) -> None:
    # test_tasks::test_task_retried_once-like: Celery's own retry of a task that the
    # throttler re-published (it comes back through the lane, a queue Celery looks up)
    from tests.apps.canvas_app import retry_once  # noqa: PLC0415

    handles = [retry_once.delay(n) for n in range(20)]
    done = [h.get(timeout=TIMEOUT) for h in handles]
    assert [d["x"] for d in done] == list(range(20))
    assert all(d["retries"] == 1 for d in done)
    assert deferred(fleet, [h.id for h in handles]) > 0


# -- the four semantics (issue 18)


def test_a_task_is_republished_at_most_once_per_slot(fleet: CanvasFleet) -> None:
    # Given sleep_max 50 ms and 10 tasks on one key at 5/s burst 1: slots 0.2 s apart,
    # beyond sleep_max (ETA messages up to park_after 0.5 s, parked beyond)
    from tests.apps.canvas_app import counted  # noqa: PLC0415

    handles = [counted.delay("once", n) for n in range(10)]
    done = [h.get(timeout=TIMEOUT) for h in handles]
    # Then each came back once for its slot, and slept the rest: never sent back again
    deferrals = [d["deferrals"] for d in done]
    assert max(deferrals) == 1, deferrals  # some waited beyond sleep_max; none came twice


def test_the_producers_eta_is_what_the_task_sees(fleet: CanvasFleet) -> None:
    # Given a key at 1/s burst 1, and three tasks without an ETA sent at once (they take
    # its slots now, in 1 s and in 2 s)
    from tests.apps.canvas_app import eta_seen  # noqa: PLC0415

    sent = datetime.now(timezone.utc)
    without = [eta_seen.apply_async(("eta", n)) for n in range(3)]
    # When a task with an ETA and one with a countdown come due after them (slots 3 s and
    # 4 s away: re-published with the throttler's own ETA, or parked)
    eta = sent + timedelta(seconds=0.3)
    with_eta = eta_seen.apply_async(("eta", 3), eta=eta)
    with_countdown = eta_seen.apply_async(("eta", 4), countdown=0.2)
    done = {h.id: h.get(timeout=TIMEOUT) for h in (*without, with_eta, with_countdown)}
    assert done[with_eta.id]["deferrals"] >= 1
    assert done[with_countdown.id]["deferrals"] >= 1
    assert any(done[h.id]["deferrals"] >= 1 for h in without), done
    # Then request.eta reads what the producer asked for: its ETA, or None
    assert done[with_eta.id]["eta"] == eta.isoformat()
    countdown_eta = datetime.fromisoformat(done[with_countdown.id]["eta"])
    assert sent + timedelta(seconds=0.2) <= countdown_eta <= sent + timedelta(seconds=5)
    assert [done[h.id]["eta"] for h in without] == [None, None, None]


def test_an_inline_errback_runs_in_the_failing_tasks_process(fleet: CanvasFleet) -> None:
    # An errback of three arguments (request, exc, traceback) is called by Celery inline,
    # not sent through the queue: it runs (the queue's limit does not apply to it)
    from tests.apps.canvas_app import ERRBACKS, ExpectedError, fail, inline_errback  # noqa: PLC0415

    res = fail.s().on_error(inline_errback.s()).delay()
    with pytest.raises(ExpectedError):
        res.get(timeout=TIMEOUT)
    deadline = time.monotonic() + 10
    while res.id.encode() not in fleet.client.lrange(ERRBACKS, 0, -1):
        assert time.monotonic() < deadline, "the inline errback did not run"
        time.sleep(0.05)


def test_a_task_expiring_before_its_slot_is_revoked_as_celery_does(fleet: CanvasFleet) -> None:
    # Given a key at 1/h whose slot is taken
    from tests.apps.canvas_app import hourly  # noqa: PLC0415

    first = hourly.delay("expiry")
    first.get(timeout=TIMEOUT)
    # When a task that expires in 2 s comes for the next slot, an hour away
    late = hourly.apply_async(("expiry",), expires=2)
    # Then it is revoked as expired, not failed: state REVOKED, the task_revoked signal
    # with expired=True, and its body never ran
    with pytest.raises(TaskRevokedError):
        late.get(timeout=TIMEOUT)
    assert late.state == "REVOKED"
    assert revoked_signal(fleet, late.id) == {"id": late.id, "expired": True, "terminated": False}
    assert not fleet.client.exists(KEYS.lease_key(late.id))


def test_a_task_past_max_wait_still_fails_with_throttle_timeout(fleet: CanvasFleet) -> None:
    # Given a key at 1/h whose slot is taken, and max_wait 1 s
    from tests.apps.canvas_app import waiting  # noqa: PLC0415

    waiting.delay("timeout").get(timeout=TIMEOUT)
    # When another task (no expires) would wait an hour
    late = waiting.delay("timeout")
    # Then it fails with ThrottleTimeout (max_wait is the throttler's, not Celery's expiry)
    with pytest.raises(ThrottleTimeout):
        late.get(timeout=TIMEOUT)
    assert late.state == "FAILURE"


def test_a_task_that_could_never_run_before_it_expires_is_revoked(fleet: CanvasFleet) -> None:
    # Given a key at 1/h whose slot is taken, max_wait 1 s, and a task that expires in 30 s
    from tests.apps.canvas_app import waiting  # noqa: PLC0415

    waiting.delay("both").get(timeout=TIMEOUT)
    late = waiting.apply_async(("both",), expires=30)
    # Then its slot, an hour away, is past its expires: revoked as expired (it could never
    # run), not a ThrottleTimeout, though max_wait is shorter
    with pytest.raises(TaskRevokedError):
        late.get(timeout=TIMEOUT)
    assert revoked_signal(fleet, late.id) == {"id": late.id, "expired": True, "terminated": False}


def test_expiry_fails_a_chord_as_with_celery(fleet: CanvasFleet) -> None:
    # A chord whose header task expires before its slot: the chord fails (ChordError), as
    # when Celery's worker revokes an expired header task
    from tests.apps.canvas_app import add, hourly, tsum  # noqa: PLC0415

    hourly.delay("chord").get(timeout=TIMEOUT)
    res = chord([add.s(1, 2), hourly.s("chord").set(expires=2)])(tsum.s())
    with pytest.raises(TaskRevokedError):
        res.get(timeout=TIMEOUT)
    chord_failed(res)
