"""Eight processes hammer one key: the limiter never admits more than capacity + rate x
elapsed in any window, nor fewer than the calls it was asked for allowed.

Both sides are judged on the times Redis itself decided at, not on when a client process
happened to run: ``redis-cli monitor`` records every script with the time of the ``TIME``
call inside it (the script's "now", to the microsecond) and whether it wrote the limit's
state (a denial writes nothing). A starved client (a loaded host) then only means fewer
calls, which the lower bound accounts for, instead of a shortfall against wall-clock time.
"""

from __future__ import annotations

import itertools
import multiprocessing
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from throttle import Limit, Limiter

PROCESSES = 8
RUN_S = 3.0
RATE, BURST = 300.0, 30.0
"""The binding limit of every case: "300/s burst 30"."""
SLACK = 1.0
"""Tokens of tolerance on each bound for the timestamps: the monitor stamps the script's
``TIME`` call with its own clock read right after it, so the two differ by microseconds,
unless the host preempts Redis between them (a few ms: one call misplaced by at most
1/RATE = 3.3 ms moves a bound by at most one token)."""


def _redis_now_s(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def _hammer(
    url: str, prefix: str, specs: list[tuple[str, str]], ready: object, go: object, out: object
) -> None:
    client = redis.Redis.from_url(url)
    limiter = Limiter(client, prefix=prefix)
    targets = [
        (Limit.parse(spec, name=f"l{i}", algorithm=algo), None)
        for i, (spec, algo) in enumerate(specs)
    ]
    ready.put(True)  # type: ignore[attr-defined]
    go.wait(120)  # type: ignore[attr-defined]
    end_at = _redis_now_s(client) + RUN_S
    admitted = calls = denied_by_others = 0
    while True:
        decision = limiter.acquire_many(targets)
        admitted += decision.allowed
        denied_by_others += not decision.allowed and decision.denied_by != ("l0",)
        calls += 1
        if calls % 16 == 0 and _redis_now_s(client) >= end_at:
            break
    out.put((admitted, calls, denied_by_others))  # type: ignore[attr-defined]
    client.close()


@dataclass
class Call:
    at_s: float
    """The script's Redis time (its TIME call, as the monitor stamped it)."""
    admitted: bool


@contextmanager
def monitor(client: redis.Redis, url: str, log: Path) -> Iterator[Path]:
    """``redis-cli monitor`` writing to ``log`` from entry until every command sent before
    the exit is in the file (a marker command is waited for, with deadlines, not sleeps)."""
    cli = shutil.which("redis-cli")
    assert cli, "redis-cli is missing: it comes with redis-server (apt-get install redis-tools)"
    with open(log, "wb") as out:
        proc = subprocess.Popen([cli, "-u", url, "monitor"], stdout=out, stderr=subprocess.STDOUT)

    def await_marker(marker: str) -> None:
        deadline = time.monotonic() + 60
        while marker.encode() not in log.read_bytes():
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, f"redis-cli monitor never printed {marker}"
            client.echo(marker)  # again: the monitor may not have been attached yet
            time.sleep(0.05)

    try:
        await_marker(f"monitor-start-{uuid.uuid4().hex}")
        yield log
        await_marker(f"monitor-end-{uuid.uuid4().hex}")
    finally:
        proc.terminate()
        proc.wait(30)


def scripts_of(log: Path, prefix: str) -> list[Call]:
    """The acquire scripts on ``prefix``'s keys, in the order Redis ran them (one at a time:
    a script is atomic, and the monitor lists its inner calls right after it)."""
    line = re.compile(rb'^(\d+\.\d+) \[\d+ ([^\]]+)\] "([A-Z]+)"(?: "([^"]*)")?')
    mine = f'"{prefix}:'.encode()
    calls: list[Call] = []
    current: Call | None = None
    for raw in log.read_bytes().splitlines():
        found = line.match(raw)
        if not found:
            continue
        at, source, command, first = found.groups()
        if source != b"lua":
            current = None
            if command in (b"FCALL", b"EVALSHA") and mine in raw:
                current = Call(float("nan"), False)
        elif current is not None:
            if command == b"TIME":  # it runs (an FCALL or EVALSHA of an unloaded one does not)
                current.at_s = float(at)
                calls.append(current)
            elif (
                command in (b"SET", b"SETRANGE")
                and first is not None
                and first.startswith(mine[1:])
            ):
                current.admitted = True  # only an admission writes the state
    return calls


def most_in_any_window(admissions: list[float]) -> float:
    """max over i <= j of (admissions in [t_i, t_j]) - RATE x (t_j - t_i): a bucket of BURST
    tokens refilled at RATE (or a GCRA of that burst) keeps it <= BURST."""
    worst, lowest = 0.0, float("inf")
    for j, t in enumerate(admissions):
        lowest = min(lowest, j - RATE * t)  # i = j included: a window of one admission
        worst = max(worst, j - RATE * t - lowest + 1)
    return worst


def fewest_owed(calls: list[Call]) -> tuple[int, float, float]:
    """(admitted, owed, unused allowance) between the first and the last denial.

    A denial at t means fewer than 1 token was left at t. Between two consecutive denials
    Δ apart the bucket gains RATE x Δ tokens, of which at most max(0, RATE x Δ - (BURST - 1))
    can spill over a full bucket (it started below 1); everything else is in the bucket or
    was admitted. Summed, the levels telescope to less than 1 token: the limiter must have
    admitted at least RATE x (last - first) - 1 - the spill allowance. The allowance is the
    time nobody asked (a starved fleet), so it is returned to be kept small as well.
    """
    denials = [i for i, c in enumerate(calls) if not c.admitted]
    assert len(denials) >= 2, "nothing was denied: the processes did not contend"
    first, last = denials[0], denials[-1]
    admitted = sum(c.admitted for c in calls[first:last])
    spill = 0.0
    for a, b in itertools.pairwise(denials):
        spill += max(0.0, RATE * (calls[b].at_s - calls[a].at_s) - (BURST - 1))
    span = calls[last].at_s - calls[first].at_s
    return admitted, RATE * span - 1 - spill, spill


@pytest.mark.slow
@pytest.mark.parametrize(
    "specs",
    [
        [("300/s burst 30", "token_bucket")],
        [("300/s burst 30", "gcra")],
        # Three limits at once: the tightest (the token bucket) decides.
        [("300/s burst 30", "token_bucket"), ("1000/s", "gcra"), ("100000/d", "fixed_window")],
    ],
    ids=["token_bucket", "gcra", "three-limits"],
)
def test_fleet_admits_exactly_the_rate(
    redis_url: str, client: redis.Redis, specs: list[tuple[str, str]], tmp_path: Path
) -> None:
    prefix = f"fleet-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")
    ready, go, out = context.Queue(), context.Event(), context.Queue()
    workers = [
        context.Process(target=_hammer, args=(redis_url, prefix, specs, ready, go, out))
        for _ in range(PROCESSES)
    ]
    for worker in workers:
        worker.start()
    # Start together once all are up: spawning 8 interpreters takes seconds on a busy host
    for _ in workers:
        ready.get(timeout=120)
    with monitor(client, redis_url, tmp_path / "monitor.log") as log:
        go.set()
        results = [out.get(timeout=120) for _ in workers]
        for worker in workers:
            worker.join(timeout=30)
            assert worker.exitcode == 0
    admitted = sum(r[0] for r in results)
    calls = sum(r[1] for r in results)
    calls_seen = scripts_of(log, prefix)
    # The monitor saw every call and every admission the processes counted
    assert len(calls_seen) == calls
    assert sum(c.admitted for c in calls_seen) == admitted
    assert calls > admitted * 2, "the processes did not contend for the limit"
    # Every denial came from the binding limit (the lower bound reasons about it alone)
    assert sum(r[2] for r in results) == 0
    # Never more than the bucket allows, in any window
    worst = most_in_any_window([c.at_s for c in calls_seen if c.admitted])
    assert worst <= BURST + SLACK, worst
    # Nor fewer than it owed the calls it was asked for
    between, owed, spill = fewest_owed(calls_seen)
    assert between >= owed - SLACK, (between, owed, spill)
    span = calls_seen[-1].at_s - calls_seen[0].at_s
    assert spill < 0.25 * RATE * span, "the fleet left the limit idle too long to judge"
    print(
        f"admitted {admitted} in {span:.2f} s (Redis clock), worst window {worst:.2f} of "
        f"burst {BURST:g}; {between} between the first and last denial, owed >= {owed:.1f} "
        f"(idle allowance {spill:.1f}); {calls} calls"
    )
    for key in client.scan_iter(match=f"{prefix}:*"):
        client.delete(key)
