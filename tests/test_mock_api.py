"""The mock upstream API enforces its own limit on real arrival times and records them."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from workers.mock_api import MockApi, UpstreamLimit, serve


@pytest.fixture
def api() -> Iterator[tuple[MockApi, int]]:
    state = MockApi(rate=10, burst=2)
    server = serve(state)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, server.server_address[1]
    server.shutdown()
    server.server_close()


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


def test_the_burst_passes_then_429_with_retry_after(api: tuple[MockApi, int]) -> None:
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


def test_the_limit_can_be_lowered_mid_run(api: tuple[MockApi, int]) -> None:
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
