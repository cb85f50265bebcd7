"""One clock: two clients whose clocks differ by 30 s get the same decisions.

The clients run as subprocesses under `faketime` (libfaketime), which shifts every clock
call of the process, so nothing in the client could read a true local time. Each decision
is checked against the Redis time read just before and after its client ran (a client
takes seconds to start on a loaded host, and the bucket refills meanwhile), not against a
fixed "about 30 s".
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

ROOT = Path(__file__).resolve().parents[2]


TOKEN_S = 30.0
"""The refill time of the clients' limit, 2/m (a token bucket of burst 2)."""
US = 1e-6
"""Slack for the reply's rounding: waits are whole microseconds, rounded up."""


@dataclass
class Run:
    """One client's decision and the Redis time just before it started and after it ended:
    the script's own time lies in between, whenever the loaded host let the process run."""

    reply: dict[str, Any]
    before_s: float
    after_s: float


def redis_now_s(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def run_client(client: redis.Redis, redis_url: str, prefix: str, shift: str | None) -> Run:
    command = [sys.executable, "-m", "tests.support.skewed_client", redis_url, prefix, "acquire"]
    if shift is not None:
        faketime = shutil.which("faketime")
        assert faketime, "faketime is missing: `make test` installs it (apt-get install faketime)"
        command = [faketime, "-f", shift, *command]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = redis_now_s(client)
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env=env, check=True, timeout=60
    )
    after = redis_now_s(client)
    return Run(json.loads(done.stdout), before, after)


@pytest.mark.parametrize("shift", ["+30s", "-30s"])
def test_skewed_clients_get_the_same_decisions(
    client: redis.Redis, redis_url: str, shift: str
) -> None:
    # The same sequence, once with both clients on true time, once with one 30 s off.
    offset_s = 30.0 if shift == "+30s" else -30.0
    for skew in (None, shift):
        prefix = f"skew-{uuid.uuid4().hex[:8]}"
        runs = [run_client(client, redis_url, prefix, s) for s in (None, skew, None, skew)]
        for run, s in zip(runs, (None, skew, None, skew), strict=True):
            # faketime really moved the skewed client's clock (the host's clock is Redis's)
            local_s = run.reply["local_time_s"] - (0.0 if s is None else offset_s)
            assert run.before_s - 0.05 <= local_s <= run.after_s + 0.05, (s, run)
        # Every client gets what the Redis clock says, whatever its own clock says: a 2/m
        # bucket of 2 admits two, then the next token is 30 s after the first call, less
        # the time since (a client-clock limiter would be 30 s off for the skewed ones).
        assert [r.reply["allowed"] for r in runs] == [True, True, False, False]
        first = runs[0]
        for n, run in enumerate(runs[1:], start=2):
            since_lo = run.before_s - first.after_s  # the Redis time from call 1 to call n
            since_hi = run.after_s - first.before_s
            remaining = run.reply["remaining"]
            assert since_lo / TOKEN_S - US <= remaining <= since_hi / TOKEN_S + US, (n, runs)
            if n > 2:
                retry_after_s = run.reply["retry_after_s"]
                assert TOKEN_S - since_hi - US <= retry_after_s, (n, runs)
                assert retry_after_s <= TOKEN_S - since_lo + US, (n, runs)
