"""The outage of the limiter's Redis as one worker's processes see it
(:class:`throttle.celery.outage.OutageWatch`): a Redis that refuses writes (out of memory
under ``noeviction``) still answers the calls that write nothing, so failures and
answers alternate. The outage must last through them (its start kept, so that
``allow``'s bound comes; one warning, one "back"), and end once Redis has answered for
``RECOVERY_S`` with no failure in any process of the worker."""

from __future__ import annotations

import logging
import os
import time

import pytest

from throttle.celery import outage
from throttle.celery.outage import WORKER_ENV, Breaker, NotAsked, OutageWatch
from throttle.config import Settings
from throttle.errors import BackendUnavailable

RECOVERY_S = 0.2


class Clock:
    """The time outage.py reads (monotonic and wall, s) and writes on the outage file
    (its mtime, each failure's touch), moved by the test alone: what the assertions judge
    never depends on how fast the host ran the steps between them."""

    def __init__(self) -> None:
        self.now = 1_000.0
        self.wall = 1_800_000_000.0

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.wall += seconds

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.wall


class ClockedOs:
    """``os`` for outage.py, stamping the outage file with the test's clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def link(self, src: str, dst: str) -> None:
        os.link(src, dst)
        os.utime(dst, (self.clock.wall, self.clock.wall))

    def utime(self, path: str) -> None:
        os.utime(path, (self.clock.wall, self.clock.wall))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(outage, "time", clock)
    monkeypatch.setattr(outage, "os", ClockedOs(clock))
    return clock


@pytest.fixture
def watches(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory, clock: Clock
) -> tuple[OutageWatch, OutageWatch, list[str]]:
    """Two processes of one worker (sharing its outage file), and the on_recovery calls."""
    monkeypatch.setattr(outage, "RECOVERY_S", RECOVERY_S)
    monkeypatch.setattr(outage, "MARKER_LOOK_S", 0.0)
    monkeypatch.setenv(WORKER_ENV, f"test-{time.monotonic_ns()}")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path_factory.mktemp("outage")))
    checks: list[str] = []
    settings = Settings(prefix="test")

    def watch(name: str) -> OutageWatch:
        return OutageWatch(settings, on_recovery=lambda: checks.append(name), count_fleet=lambda: 1)

    return watch("a"), watch("b"), checks


def lines(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in record.getMessage() for record in caplog.records)


def test_answers_between_failures_do_not_end_the_outage(
    watches: tuple[OutageWatch, OutageWatch, list[str]],
    caplog: pytest.LogCaptureFixture,
    clock: Clock,
) -> None:
    a, b, checks = watches
    refused = BackendUnavailable("OOM command not allowed when used memory > 'maxmemory'")
    caplog.set_level(logging.WARNING, "throttle")
    a.note(refused)
    began = a.since()
    # a write taken now and then (memory freed for a moment), then one refused again, in
    # one process; another process's writes go through meanwhile, for 3 x RECOVERY_S
    for _ in range(12):
        a.note(None)
        b.note(None)
        clock.advance(RECOVERY_S / 4)
        a.note(refused)
    assert a.since() == began  # the same outage all along: allow's bound counts from it
    assert b._read_start(0.0) == began
    assert lines(caplog, "Redis is unreachable") == 1
    assert lines(caplog, "reachable again") == 0
    assert checks.count("a") == 1  # the cold-start check at the first answer, once
    # Answers alone for RECOVERY_S (in every process): the outage ends, said once.
    a.note(None)
    clock.advance(RECOVERY_S * 1.5)
    b.note(None)
    a.note(None)
    b.note(None)
    assert lines(caplog, "reachable again") == 1
    assert a.since() > began  # no outage: "now"
    assert a.file is not None and not a.file.exists()
    # A new outage is a new one: its own start, warned again.
    clock.advance(0.01)
    a.note(refused)
    assert a.since() > began
    assert lines(caplog, "Redis is unreachable") == 2


def test_a_sibling_s_stale_failure_after_the_outage_ended_is_not_a_new_one(
    watches: tuple[OutageWatch, OutageWatch, list[str]],
    caplog: pytest.LogCaptureFixture,
    clock: Clock,
) -> None:
    a, b, _ = watches
    gone = BackendUnavailable("Connection refused")
    caplog.set_level(logging.WARNING, "throttle")
    # Both processes meet the outage; Redis comes back and `a` ends it
    a.note(gone)
    b.note(gone)
    a.note(None)
    clock.advance(RECOVERY_S * 1.5)
    a.note(None)
    assert lines(caplog, "reachable again") == 1
    # When `b`, which had no answer since, fails once on a connection to the old server,
    # that is the outage's tail: no second warning, nothing to end again
    b.note(BackendUnavailable("Connection reset by peer"))
    b.note(None)
    clock.advance(RECOVERY_S * 1.5)
    b.note(None)
    assert a.file is not None and not a.file.exists()
    assert lines(caplog, "Redis is unreachable") == 1
    assert lines(caplog, "reachable again") == 1
    # A failure after that is a new outage, warned
    b.note(gone)
    assert lines(caplog, "Redis is unreachable") == 2


def test_the_breaker_stops_asking_after_two_failures_or_one_slow_one(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    monkeypatch.setattr(outage, "PROBE_S", 3600.0)
    breaker = outage.Breaker()
    breaker.failed(breaker.check())  # one fast failure (a blip): still asked
    breaker.answered()
    breaker.failed(breaker.check())
    breaker.failed(breaker.check())  # two in a row: not asked
    with pytest.raises(outage.NotAsked, match="Redis is unreachable: 2 calls in a row failed"):
        breaker.check()
    # One call that took SLOW_FAILURE_S to fail (a timeout: Redis hangs) is enough
    slow = outage.Breaker()
    asked_at = slow.check()
    clock.advance(outage.SLOW_FAILURE_S)
    slow.failed(asked_at)
    with pytest.raises(outage.NotAsked):
        slow.check()


def test_the_breaker_lets_one_probe_ask_while_it_runs(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    """Once PROBE_S has passed, one call asks; the calls of the process's other threads
    meanwhile are not asked (a hung Redis holds the probe for the socket timeout: each of
    them would have hung as long)."""
    monkeypatch.setattr(outage, "PROBE_S", 0.05)
    breaker = Breaker()
    breaker.failed(breaker.check())
    breaker.failed(breaker.check())
    with pytest.raises(NotAsked):
        breaker.check()
    clock.advance(0.06)
    breaker.check()  # the probe
    with pytest.raises(NotAsked):
        breaker.check()  # another thread, while the probe hangs
    clock.advance(0.06)
    breaker.check()  # the probe hung past PROBE_S: one more asks
    breaker.answered()
    breaker.check()
    breaker.check()


def test_a_probe_that_needed_no_call_leaves_the_breaker_closed(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    # The probe may fall to a task that asks Redis nothing (the worker's consumer decided
    # it, or a stock held its units): its gate's block ends without an error, and the
    # breaker must close then; left open, every task after it went by on_redis_down
    # (a pool child deferred tasks "by local" for seconds after Redis was back)
    monkeypatch.setattr(outage, "PROBE_S", 0.05)
    breaker = Breaker()
    breaker.failed(breaker.check())
    breaker.failed(breaker.check())
    clock.advance(0.06)
    with breaker.asking():
        pass  # the probe: no call needed
    breaker.check()
    breaker.check()
    # and one whose task comes back (Celery's Retry out of the gate) was answered too
    breaker.failed(breaker.check())
    breaker.failed(breaker.check())
    clock.advance(0.06)
    with pytest.raises(RuntimeError), breaker.asking():
        raise RuntimeError("the task comes back")
    breaker.check()
    # while a failure inside counts as one
    with pytest.raises(BackendUnavailable), breaker.asking():
        raise BackendUnavailable("Connection refused")
    with pytest.raises(BackendUnavailable), breaker.asking():
        raise BackendUnavailable("Connection refused")
    with pytest.raises(NotAsked):
        breaker.check()


def test_a_read_from_the_cache_does_not_take_the_probe(
    monkeypatch: pytest.MonkeyPatch, clock: Clock
) -> None:
    # The run-time modes are read before each task's gate, mostly from a cache: they look
    # with is_open(), which must leave the probe to a call that asks Redis (else no
    # acquisition would ever probe, and the breaker never close).
    monkeypatch.setattr(outage, "PROBE_S", 0.05)
    breaker = Breaker()
    breaker.failed(breaker.check())
    breaker.failed(breaker.check())
    assert breaker.is_open()
    clock.advance(0.06)
    assert not breaker.is_open()
    assert not breaker.is_open()  # looking twice takes nothing
    breaker.check()  # the probe, still there for the gate
    assert breaker.is_open()  # taken: the others wait while it runs
    breaker.answered()
    assert not breaker.is_open()
