"""The outage of the limiter's Redis as one worker's processes see it
(:class:`throttle.celery.outage.OutageWatch`): a Redis that refuses writes (out of memory
under ``noeviction``) still answers the calls that write nothing, so failures and
answers alternate. The outage must last through them (its start kept, so that
``allow``'s bound comes; one warning, one "back"), and end once Redis has answered for
``RECOVERY_S`` with no failure in any process of the worker."""

from __future__ import annotations

import logging
import time

import pytest

from throttle.celery import outage
from throttle.celery.outage import WORKER_ENV, Breaker, NotAsked, OutageWatch
from throttle.config import Settings
from throttle.errors import BackendUnavailable

RECOVERY_S = 0.2


@pytest.fixture
def watches(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
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
    watches: tuple[OutageWatch, OutageWatch, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    a, b, checks = watches
    refused = BackendUnavailable("OOM command not allowed when used memory > 'maxmemory'")
    caplog.set_level(logging.WARNING, "throttle")
    a.note(refused)
    began = a.since()
    # a denial that wrote nothing, then a write refused again, for longer than RECOVERY_S
    deadline = time.monotonic() + 3 * RECOVERY_S
    while time.monotonic() < deadline:
        a.note(None)
        b.note(None)  # a process that only reads (the releaser's empty poll)
        time.sleep(RECOVERY_S / 4)
        a.note(refused)
    assert a.since() == began  # the same outage all along: allow's bound counts from it
    assert b._read_start(0.0) == began
    assert lines(caplog, "Redis is unreachable") == 1
    assert lines(caplog, "reachable again") == 0
    assert checks.count("a") == 1  # the cold-start check at the first answer, once
    # Answers alone for RECOVERY_S (in every process): the outage ends, said once.
    a.note(None)
    time.sleep(RECOVERY_S * 1.5)
    b.note(None)
    a.note(None)
    b.note(None)
    assert lines(caplog, "reachable again") == 1
    assert a.since() > began  # no outage: "now"
    assert a.file is not None and not a.file.exists()
    # A new outage is a new one: its own start, warned again.
    time.sleep(0.01)
    a.note(refused)
    assert a.since() > began
    assert lines(caplog, "Redis is unreachable") == 2


def test_the_breaker_stops_asking_after_two_failures_or_one_slow_one(
    monkeypatch: pytest.MonkeyPatch,
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
    monkeypatch.setattr(outage, "SLOW_FAILURE_S", 0.0)
    slow.failed(slow.check())
    with pytest.raises(outage.NotAsked):
        slow.check()


def test_the_breaker_lets_one_probe_ask_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once PROBE_S has passed, one call asks; the calls of the process's other threads
    meanwhile are not asked (a hung Redis holds the probe for the socket timeout: each of
    them would have hung as long)."""
    monkeypatch.setattr(outage, "PROBE_S", 0.05)
    breaker = Breaker()
    breaker.failed(breaker.check())
    breaker.failed(breaker.check())
    with pytest.raises(NotAsked):
        breaker.check()
    time.sleep(0.06)
    breaker.check()  # the probe
    with pytest.raises(NotAsked):
        breaker.check()  # another thread, while the probe hangs
    time.sleep(0.06)
    breaker.check()  # the probe hung past PROBE_S: one more asks
    breaker.answered()
    breaker.check()
    breaker.check()


def test_a_read_from_the_cache_does_not_take_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # The run-time modes are read before each task's gate, mostly from a cache: they look
    # with is_open(), which must leave the probe to a call that asks Redis (else no
    # acquisition would ever probe, and the breaker never close).
    monkeypatch.setattr(outage, "PROBE_S", 0.05)
    breaker = Breaker()
    breaker.failed(breaker.check())
    breaker.failed(breaker.check())
    assert breaker.is_open()
    time.sleep(0.06)
    assert not breaker.is_open()
    assert not breaker.is_open()  # looking twice takes nothing
    breaker.check()  # the probe, still there for the gate
    assert breaker.is_open()  # taken: the others wait while it runs
    breaker.answered()
    assert not breaker.is_open()
