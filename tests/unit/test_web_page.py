"""The limits page's pure parts: the admitted rate from counters or from tokens, the
busiest keys, JSON without infinities; and the server's answers that need no fleet
(assets, read-only refusal, token checks), over real HTTP on a loopback port."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.http import post_json
from throttle.spec import Limit
from throttle.web import LimitsPage
from throttle.web.server import _finite
from throttle.web.snapshot import TOP_KEYS, Sampler, _admitted, _by_key

GCRA = Limit.parse("10/s burst 5", name="api", algorithm="gcra")
SLOTS = Limit.parse("4 concurrent", name="pool")
TOKEN = "0123456789abcdef-token"


def test_admitted_from_the_workers_counters() -> None:
    previous = (10.0, {"api": 100.0}, {"api": 5.0})
    assert _admitted("api", GCRA, 10.0, 12.0, {"api": 118.0}, 0.0, previous) == (9.0, "counters")
    # a restarted worker's counters drop: not a negative rate
    assert _admitted("api", GCRA, 10.0, 12.0, {"api": 3.0}, 0.0, previous) == (0.0, "counters")
    # a limit that admitted nothing before has no sample yet: it counts from 0
    assert _admitted("api", GCRA, 10.0, 12.0, {"api": 4.0}, 0.0, (10.0, {}, {})) == (
        2.0, "counters",
    )  # fmt: skip


def test_admitted_estimated_from_the_level_of_the_bucket() -> None:
    # Binding at both ends (the level is tokens less the slots handed out ahead): 2 s
    # refilled 20, the level went from -3 to -4: 21 taken in 2 s
    assert _admitted("api", GCRA, 10.0, 2.0, None, -4.0, (0.0, None, {"api": -3.0})) == (
        10.5, "tokens",
    )  # fmt: skip
    # Idle at full: nothing spent (the refill beyond the burst is not counted as use)
    assert _admitted("api", GCRA, 10.0, 2.0, None, 5.0, (0.0, None, {"api": 5.0})) == (
        0.0,
        "tokens",
    )
    # Full, then 2 taken: the burst caps the refill
    assert _admitted("api", GCRA, 10.0, 2.0, None, 3.0, (0.0, None, {"api": 5.0})) == (
        1.0,
        "tokens",
    )
    # No earlier snapshot, or a concurrency limit (tokens are free slots, not a rate)
    assert _admitted("api", GCRA, 10.0, 2.0, None, 5.0, None) == (None, None)
    assert _admitted("pool", SLOTS, 4.0, 2.0, None, 1.0, (0.0, None, {"pool": 4.0})) == (None, None)


def test_the_busiest_keys_first() -> None:
    counts = {None: 2, **{f"k{i}": i for i in range(1, TOP_KEYS + 3)}}
    shown = _by_key(counts)
    assert shown["total"] == 2 + sum(range(1, TOP_KEYS + 3))
    assert [k["key"] for k in shown["keys"]] == [f"k{i}" for i in range(TOP_KEYS + 2, 2, -1)]
    assert shown["more_keys"] == 2


def test_json_has_no_infinity() -> None:
    assert _finite({"a": [float("inf"), 1.5], "b": (float("nan"),)}) == {
        "a": [None, 1.5],
        "b": [None],
    }


class _Sampler:
    """What the server reads of a sampler: one snapshot with one limit."""

    def __init__(self) -> None:
        self.held: list[tuple[str, Any]] = []

    def pause(self, limit: str, key: str | None) -> None:
        self.held.append(("hold", limit))

    def resume(self, limit: str, key: str | None) -> None:
        self.held.append(("unhold", limit))

    def names(self) -> list[str]:
        return ["api"]

    def latest(self) -> dict[str, Any]:
        return {"limits": [{"name": "api", "hold": None}], "history": []}

    def sample(self) -> dict[str, Any]:
        return self.latest()


def _page(token: str | None) -> Iterator[tuple[str, _Sampler]]:
    sampler = _Sampler()
    page = LimitsPage(sampler, interval_s=60, control_token=token)  # type: ignore[arg-type]
    host, port = page.start("127.0.0.1", 0)
    try:
        yield f"http://{host}:{port}", sampler
    finally:
        page.stop()


@pytest.fixture
def read_only() -> Iterator[tuple[str, _Sampler]]:
    yield from _page(None)


@pytest.fixture
def controlled() -> Iterator[tuple[str, _Sampler]]:
    yield from _page(TOKEN)


def test_the_page_and_its_files_are_served_with_safe_headers(read_only: Any) -> None:
    url, _ = read_only
    for path, kind in (
        ("/", "text/html"),
        ("/page.js", "text/javascript"),
        ("/page.css", "text/css"),
    ):
        with urllib.request.urlopen(url + path, timeout=10) as response:
            assert response.headers["Content-Type"].startswith(kind)
            assert response.headers["X-Frame-Options"] == "DENY"
            assert "default-src 'self'" in response.headers["Content-Security-Policy"]
            assert response.read()
    with urllib.request.urlopen(url + "/api/state", timeout=10) as response:
        assert json.load(response)["control"] is False


def test_read_only_refuses_control_even_with_a_token(read_only: Any) -> None:
    url, sampler = read_only
    status, answer = post_json(url + "/api/pause", {"limit": "api"}, TOKEN)
    assert status == 403 and "--allow-control" in answer["error"]
    assert sampler.held == []


def test_control_wants_the_token_and_a_known_limit(controlled: Any) -> None:
    url, sampler = controlled
    for token in (None, "", "wrong", TOKEN + "x"):
        status, answer = post_json(url + "/api/pause", {"limit": "api"}, token)
        assert status == 401 and "token" in answer["error"]
    assert post_json(url + "/api/pause", {"limit": "nope"}, TOKEN)[0] == 400
    assert post_json(url + "/api/pause", ["api"], TOKEN)[0] == 400
    assert post_json(url + "/api/pause", {"limit": "api", "key": ""}, TOKEN)[0] == 400
    assert sampler.held == []
    assert post_json(url + "/api/pause", {"limit": "api"}, TOKEN) == (
        200, {"ok": True, "action": "pause", "limit": "api", "key": None}
    )  # fmt: skip
    assert post_json(url + "/api/resume", {"limit": "api"}, TOKEN)[0] == 200
    assert sampler.held == [("hold", "api"), ("unhold", "api")]


def test_a_short_token_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 characters"):
        LimitsPage(_Sampler(), control_token="short")  # type: ignore[arg-type]


def test_a_snapshot_begun_before_the_one_kept_is_not_kept() -> None:
    # The page's loop is taking a snapshot when a pause takes one at once: the pause's,
    # begun later, finishes first; the loop's, older, must not replace it
    release = threading.Event()

    class Overtaken(Sampler):
        calls = 0

        def _collect(self) -> dict[str, Any]:
            self.calls += 1
            if self.calls == 1:
                release.wait(10)
                return {"limits": [], "seen": "before the pause"}
            return {"limits": [], "seen": "after the pause"}

    sampler = Overtaken(None, None)  # type: ignore[arg-type]
    loop = threading.Thread(target=sampler.sample)
    loop.start()
    while sampler.calls == 0:
        time.sleep(0.001)
    sampler.sample()
    release.set()
    loop.join(10)
    latest = sampler.latest()
    assert latest is not None and latest["seen"] == "after the pause"
