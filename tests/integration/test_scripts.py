"""The scripts survive SCRIPT FLUSH, and the wheel ships the only copy of each."""

from __future__ import annotations

import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import redis

from tests.support.clock import FakeClock
from tests.support.servers import RedisServer
from throttle import Limit, Limiter
from throttle.redis.scripts import (
    ALGORITHM_FILES,
    ONE_LIMIT_OPERATION,
    SEVERAL_LIMITS_ONLY,
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


def test_decisions_go_on_through_script_flush(private_redis: RedisServer) -> None:
    # On a server of our own: SCRIPT FLUSH would disturb anybody else's scripts.
    client = private_redis.client()
    limiter = Limiter(client, prefix="flush", clock_us=FakeClock())
    limit = Limit.parse("1/h burst 1000", name="api")
    stop = threading.Event()
    flushes = 0

    def flusher() -> None:
        nonlocal flushes
        other = private_redis.client()
        while not stop.is_set():
            other.script_flush()
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
    client.close()


def test_a_flushed_script_is_reloaded_and_state_kept(private_redis: RedisServer) -> None:
    client = private_redis.client()
    limiter = Limiter(client, prefix="reload", clock_us=FakeClock())
    limit = Limit.parse("10/s", name="api")
    assert limiter.acquire(limit).remaining == 9
    client.script_flush()  # what a Redis restart or failover does to the script cache
    assert limiter.acquire(limit).remaining == 8
    # The script of a plain one-limit acquire (lua/acquire_one.lua) is back in Redis.
    assert client.script_exists(limiter._one[limit.code].sha) == [True]
    client.close()


def test_lua_dir_is_the_repository_copy() -> None:
    assert lua_dir() == ROOT / "lua"
    assert sorted(p.name for p in lua_dir().glob("*.lua")) == sorted(
        [
            *ALGORITHM_FILES.values(),
            "prelude.lua",
            "acquire.lua",
            "acquire_one.lua",
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
        if code == "conc":
            continue  # concurrency always records a holder: acquire.lua
        one = script_source(ONE_LIMIT_OPERATION, frozenset({code}))
        assert "ALGO" not in one.split("-- KEYS[1]")[1], name  # only acquire_one's comments
        assert "local function limit_record" not in one
        # Everything before the marker, of the prelude and of the algorithm, is there once.
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
