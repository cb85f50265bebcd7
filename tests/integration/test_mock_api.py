"""The mock upstream API enforces its own limit on real arrival times and records them."""

from __future__ import annotations

import http.client
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from workers import mock_api
from workers.harness import ROOT
from workers.mock_api import MockApi, UpstreamLimit, policy_of, serve


@pytest.fixture
def api() -> Iterator[tuple[MockApi, int]]:
    state = MockApi(rate=10, burst=2)
    server = serve(state)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def still(api: tuple[MockApi, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The mock API's clock stands still (after ``api`` started): calls made back to back
    arrive at one instant, however slow the host (at 10/s a token comes back every 100 ms,
    at 1/s every second). Wall-clock time (the epoch headers) still runs."""
    now = time.monotonic()
    monkeypatch.setattr(mock_api, "time", SimpleNamespace(monotonic=lambda: now, time=time.time))


def request(
    port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        data = json.dumps(body).encode() if body is not None else None
        connection.request(method, path, body=data, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        connection.close()


def test_the_burst_passes_then_429_with_retry_after(api: tuple[MockApi, int], still: None) -> None:
    _, port = api
    statuses = [request(port, "GET", "/call")[0] for _ in range(3)]
    assert statuses == [200, 200, 429]
    status, headers, body = request(port, "GET", "/call")
    assert status == 429
    assert body == {"error": "rate_limit_exceeded"}
    assert headers["Retry-After"] == "1"  # 0.1 s away, rounded up to whole seconds
    assert headers["RateLimit-Limit"] == "2"
    assert headers["RateLimit-Remaining"] == "0"


def test_calls_spaced_at_the_rate_all_pass(api: tuple[MockApi, int]) -> None:
    _, port = api
    for _ in range(5):
        assert request(port, "GET", "/call", headers={"X-Task-Id": "t1"})[0] == 200
        time.sleep(0.11)
    stats = request(port, "GET", "/stats")[2]
    assert (stats["calls"], stats["violations"]) == (5, 0)
    arrivals = request(port, "GET", "/arrivals")[2]
    assert [a["task_id"] for a in arrivals] == ["t1"] * 5
    assert all(b["at_s"] - a["at_s"] >= 0.1 for a, b in itertools.pairwise(arrivals))


def test_the_limit_can_be_lowered_mid_run(api: tuple[MockApi, int], still: None) -> None:
    _, port = api
    status, _, stats = request(port, "POST", "/limit", {"rate": 1, "burst": 1})
    assert (status, stats["rate"], stats["burst"]) == (200, 1.0, 1.0)
    assert [request(port, "POST", "/call", {})[0] for _ in range(2)] == [200, 429]
    assert request(port, "POST", "/limit", {"rate": "fast"})[0] == 400
    status, _, stats = request(port, "POST", "/reset", {})
    assert (status, stats["calls"]) == (200, 0)


def test_upstream_limit_arithmetic() -> None:
    limit = UpstreamLimit(rate=4, burst=1)
    now = limit.stamp
    assert limit.take(now) == (True, 0.0)
    allowed, retry = limit.take(now + 0.1)
    assert not allowed
    assert retry == pytest.approx(0.15)
    assert limit.take(now + 0.25)[0]
    with pytest.raises(ValueError, match="rate must be > 0"):
        UpstreamLimit(rate=0)


def test_429s_carry_retry_after_and_the_rate_limit_headers_of_every_dialect(
    api: tuple[MockApi, int], still: None
) -> None:
    _, port = api
    for _ in range(2):
        request(port, "GET", "/call")
    before = time.time()
    status, headers, _ = request(port, "GET", "/call")
    after = time.time()
    assert status == 429
    assert headers["Retry-After"] == "1"
    assert headers["RateLimit-Policy"] == '"default";q=10;w=1'
    assert headers["X-RateLimit-Limit"] == "10"
    assert headers["X-RateLimit-Remaining"] == "0"
    # GitHub's form: epoch seconds when the bucket is full again (2 tokens at 10/s: < 0.2 s),
    # rounded up, from the moment the API answered: between before and after
    assert before <= int(headers["X-RateLimit-Reset"]) <= after + 1.2
    assert "Date" in headers  # epochs can be read against the upstream's own clock


def test_the_stated_policy_follows_a_lowered_limit(api: tuple[MockApi, int]) -> None:
    state, port = api
    state.set_limit(0.5, 1)
    headers = request(port, "GET", "/call")[1]
    assert headers["RateLimit-Policy"] == '"default";q=1;w=2'
    assert state.stats()["changes"][-1][1:] == [0.5, 1.0]


def test_policy_of_states_a_rate_in_whole_numbers() -> None:
    assert policy_of(20.0) == (20, 1)
    assert policy_of(19.6) == (98, 5)
    assert policy_of(0.25) == (1, 4)
    assert policy_of(1 / 7200) == (1, 7200)
    assert policy_of(1 / 7000.5) == (1, 7001)  # no exact window: rounded to fewer calls
    assert policy_of(0.123456789) == (7, 60)  # no exact window: rounded down, never more


LOWER_AFTER_S = 2.0
"""The API lowers its limit this long after it started: the first call must come before,
with no more than a line of output to read in between (it was 0.5 s: a loaded host's
scheduler can stall a process that long). Then the test waits for the change itself."""


def test_the_limit_can_be_lowered_later_from_the_command_line() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.mock_api", "--port", "0", "--rate", "20",
         "--lower-to", "5", "--lower-after", str(LOWER_AFTER_S)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().split("http://127.0.0.1:")[1].split()[0])
        assert f"becomes 5/s after {LOWER_AFTER_S:g} s" in proc.stdout.readline()
        assert request(port, "GET", "/call")[1]["RateLimit-Policy"] == '"default";q=20;w=1'
        deadline = time.monotonic() + LOWER_AFTER_S + 30
        while request(port, "GET", "/stats")[2]["rate"] != 5.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, headers, _ = request(port, "GET", "/call")
        assert (status, headers["RateLimit-Policy"]) == (200, '"default";q=5;w=1')
        assert request(port, "GET", "/stats")[2]["rate"] == 5.0
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_in_retry_after_only_mode_a_429_says_only_retry_after(
    api: tuple[MockApi, int], still: None
) -> None:
    # Given the API of many real upstreams: no rate-limit headers
    state, port = api
    state.retry_after_only = True
    answers = [request(port, "GET", "/call") for _ in range(3)]
    # Then the calls it serves carry none, and its 429 carries only Retry-After
    assert [status for status, _, _ in answers] == [200, 200, 429]
    for _, headers, _ in answers:
        assert not [name for name in headers if "ratelimit" in name.lower()], headers
    assert answers[2][1]["Retry-After"] == "1"
