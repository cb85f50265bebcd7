"""The library and the scripts survive FUNCTION FLUSH and SCRIPT FLUSH, and the wheel ships
the only copy of each."""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support.clock import FakeClock
from tests.support.restart import kill, respawn
from tests.support.servers import RedisServer
from throttle import BackendUnavailable, Decision, Limit, Limiter
from throttle.redis.scripts import (
    ALGORITHM_FILES,
    LIBRARY_OPERATIONS,
    ONE_LIMIT_OPERATIONS,
    SEVERAL_LIMITS_ONLY,
    function_name,
    library_name,
    library_source,
    lua_dir,
    operation_source,
    script_source,
)

ROOT = Path(__file__).resolve().parents[2]
PARKING_OPERATIONS = [
    "park.lua",
    "claim_parked.lua",
    "commit_parked.lua",
    "accept_parked.lua",
    "purge_parked.lua",
]


@pytest.mark.parametrize("calls", ["functions", "scripts"])
def test_decisions_go_on_through_flushes(private_redis: RedisServer, calls: str) -> None:
    # On a server of our own: a flush would disturb anybody else's functions or scripts.
    client = private_redis.client()
    limiter = Limiter(client, prefix=f"flush-{calls}", clock_us=FakeClock())
    if calls == "scripts":
        limiter.library.functions = False  # as on Redis 6, or for a user denied FCALL
    limit = Limit.parse("1/h burst 1000", name="api")
    stop = threading.Event()
    flushes = 0

    def flusher() -> None:
        nonlocal flushes
        other = private_redis.client()
        while not stop.is_set():
            # what a restart without data, or an operator, does to the library or the cache
            other.function_flush() if calls == "functions" else other.script_flush()
            flushes += 1
            stop.wait(0.002)
        other.close()

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        allowed = sum(limiter.acquire(limit).allowed for _ in range(1500))
    finally:
        stop.set()
        thread.join()
    assert flushes > 10
    # The clock stands still: exactly the burst was admitted, not one more or less.
    assert allowed == 1000
    assert limiter.library.functions is (calls == "functions")
    client.close()


def test_a_flushed_library_or_script_is_reloaded_and_state_kept(
    private_redis: RedisServer,
) -> None:
    client = private_redis.client()
    limiter = Limiter(client, prefix="reload", clock_us=FakeClock())
    limit = Limit.parse("10/s", name="api")
    assert limiter.acquire(limit).remaining == 9
    assert limiter.library.functions is True  # Redis 7: the library was loaded
    client.function_flush()
    assert limiter.acquire(limit).remaining == 8
    assert [pairs(lib)[b"library_name"] for lib in client.function_list()] == [
        library_name().encode()
    ]
    limiter.library.functions = False
    client.script_flush()
    assert limiter.acquire(limit).remaining == 7
    # The script of a plain one-limit acquire (lua/acquire_one.lua) is back in Redis.
    assert client.script_exists(limiter._one[limit.code].script.sha) == [True]
    client.close()


def test_a_redis_restarted_empty_gets_the_library_again() -> None:
    # A restart without persistence: no keys, no library; the limiter keeps its client.
    with RedisServer() as server:
        limiter = Limiter(server.client(), prefix="restart", clock_us=FakeClock())
        limit = Limit.parse("10/s", name="api")
        assert limiter.acquire(limit).remaining == 9
        kill(server)
        respawn(server)
        with contextlib.suppress(BackendUnavailable):  # the connection the kill cut
            limiter.acquire(limit)
        assert limiter.acquire(limit).remaining in (8, 9)  # the state went with the data
        assert limiter.library.functions is True
        assert server.client().function_list(library=library_name()) != []


def test_the_library_holds_every_operation_of_the_limiter(private_redis: RedisServer) -> None:
    client = private_redis.client()
    client.function_load(library_source(), replace=True)
    (library,) = client.function_list(library=library_name())
    names = {pairs(function)[b"name"].decode() for function in pairs(library)[b"functions"]}
    one = [
        function_name(operation, code)
        for code in ("tb", "gcra", "fw", "sw")
        for operation in ONE_LIMIT_OPERATIONS
    ]
    assert names == {*one, *(function_name(op) for op in LIBRARY_OPERATIONS)}
    client.close()


def pairs(flat: list[Any]) -> dict[Any, Any]:
    """A FUNCTION LIST entry (RESP2: a flat list of names and values) as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


def test_lua_dir_is_the_repository_copy() -> None:
    assert lua_dir() == ROOT / "lua"
    assert sorted(p.name for p in lua_dir().glob("*.lua")) == sorted(
        [
            *ALGORITHM_FILES.values(),
            "prelude.lua",
            "acquire.lua",
            "acquire_one.lua",
            "acquire_series.lua",
            "settle.lua",
            "peek.lua",
            "hold.lua",
            "holds.lua",
            "space.lua",
            "adapt.lua",
            *PARKING_OPERATIONS,
        ]
    )


def test_every_script_opens_with_a_contract_header() -> None:
    for path in lua_dir().glob("*.lua"):
        first = path.read_text().splitlines()[0]
        assert first.startswith(f"-- {path.name}:"), path


def test_the_wheel_carries_the_scripts(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("celery_throttled-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        for path in lua_dir().glob("*.lua"):
            member = f"throttle/lua/{path.name}"
            assert member in names
            assert archive.read(member) == path.read_bytes()
        assert "throttle/py.typed" in names


def test_no_connection_is_opened_before_the_first_call() -> None:
    client = redis.Redis(port=1)  # nothing listens there: any round trip would fail
    limiter = Limiter(client)
    limiter._scripts_for(frozenset({"tb", "gcra"}))  # registering computes SHAs locally
    assert len(limiter._scripts) == 1


def test_one_limit_scripts_stop_each_file_at_the_marker() -> None:
    prelude = (lua_dir() / "prelude.lua").read_text()
    for code, name in ALGORITHM_FILES.items():
        text = (lua_dir() / name).read_text()
        assert text.count(SEVERAL_LIMITS_ONLY) == 1, name
        full = script_source("acquire", frozenset({code}))
        assert f"\nALGO.{code} = {{" in full, name
        if code in ("conc", "fair"):
            continue  # concurrency records a holder, fair uses its deny: acquire.lua
        for operation in ONE_LIMIT_OPERATIONS:  # acquire_one, acquire_series
            one = script_source(operation, frozenset({code}))
            # only the operation's own comments name the registry
            assert "ALGO" not in one.split("-- KEYS[1]")[1], name
            assert "local function limit_record" not in one
            # Everything before the marker, of the prelude and of the algorithm, is there
            # once.
            for source in (prelude, text):
                head = source.split(SEVERAL_LIMITS_ONLY)[0].rstrip("\n")
                assert one.count(head) == 1, name


def test_parking_operations_carry_the_prelude_up_to_the_marker() -> None:
    prelude = (lua_dir() / "prelude.lua").read_text()
    head = prelude.split(SEVERAL_LIMITS_ONLY)[0].rstrip("\n")
    for name in PARKING_OPERATIONS:
        source = operation_source(name.removesuffix(".lua"))
        assert source.count(head) == 1, name
        assert "local ALGO" not in source and "limit_record" not in source, name
        assert source.endswith((lua_dir() / name).read_text()), name


def test_asks_of_one_limit_and_key_decide_alike_as_a_function_and_as_a_script(
    private_redis: RedisServer,
) -> None:
    # The asks of one limit and key go in one call (lua/acquire_series.lua): the same
    # decisions from the library's function and from the script (Redis 6, EVALSHA).
    decided = {}
    for calls in ("functions", "scripts"):
        limiter = Limiter(private_redis.client(), prefix=f"series-{calls}", clock_us=FakeClock())
        if calls == "scripts":
            limiter.library.functions = False
        limiter.fence_s = 0.5  # the restart fence's marker, read by the series call too
        gcra = Limit.parse("10/s burst 2", name="g", algorithm="gcra")
        window = Limit.parse("2/h", name="w", algorithm="fixed_window")
        asks = [(gcra, "k", 1.0), (window, None, 1.0)] * 3
        decided[calls] = [
            (d.allowed, round(d.wait_s, 6), round(d.retry_after_s, 6))
            for d in limiter.acquire_each(asks, max_wait_s=1.0)
            if isinstance(d, Decision)
        ]
    assert decided["functions"] == decided["scripts"]
    # a fresh namespace's fence: no slot within 0.5 s; then one spacing (0.1 s) apart
    waits = [wait for _, wait, _ in decided["functions"][::2]]
    assert waits[0] >= 0.5
    assert [round(b - a, 6) for a, b in itertools.pairwise(waits)] == [0.1, 0.1]
    assert [allowed for allowed, _, _ in decided["functions"][1::2]] == [True, True, False]
