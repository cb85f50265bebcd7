"""The limiter's own connections (throttle/redis/direct.py), against a real redis-server:
every call reads its own reply, whatever happened to the calls before it."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from redis.backoff import NoBackoff
from redis.connection import Connection
from redis.retry import Retry
from redis.sentinel import Sentinel

from tests.support.restart import kill, respawn
from tests.support.servers import RedisServer
from throttle import Limit, Limiter
from throttle.celery.runtime import Throttler
from throttle.errors import BackendUnavailable
from throttle.redis import direct
from throttle.redis.direct import DirectCalls, direct_calls


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def _direct(client: redis.Redis) -> DirectCalls:
    calls = direct_calls(client)
    assert calls is not None
    return calls


def _clients(admin: redis.Redis) -> int:
    return len(admin.client_list())


def test_a_call_interrupted_between_its_write_and_its_read_leaves_no_reply_behind(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An exception raised into a call after its command went out (Celery's soft time
    # limit, say): the reply of that command must never be read by the next call.
    calls = _direct(server.client())
    assert calls("ECHO", "warm") == b"warm"

    class Interrupted(BaseException):
        pass

    real = Connection.read_response

    def interrupted(self: Connection, *args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(Connection, "read_response", real)
        raise Interrupted

    monkeypatch.setattr(Connection, "read_response", interrupted)
    with pytest.raises(Interrupted):
        calls("ECHO", "first")
    assert calls("ECHO", "second") == b"second"
    assert calls("ECHO", "third") == b"third"


def test_calls_that_time_out_give_their_connections_back_to_the_pool(
    server: RedisServer,
) -> None:
    # Given a client whose calls time out after 30 ms, on a pool of 3 connections
    admin = server.client()
    client = redis.Redis(port=server.port, socket_timeout=0.03, retry=None, max_connections=3)
    limiter = Limiter(client)
    limit = Limit.parse("100000/s", name="t")
    limiter.acquire(limit)
    # When Redis stops answering for 60 ms, ten times (more calls than the pool holds),
    # and a call is made during each pause and after it
    for _ in range(10):
        admin.execute_command("CLIENT", "PAUSE", 60, "ALL")
        for _ in range(2):
            with contextlib.suppress(BackendUnavailable):
                limiter.acquire(limit)
            time.sleep(0.08)
    # Then, Redis answering again, the limiter and the client's own commands have a
    # connection: none was left counted as in use by the pool. (Their timeout raised
    # first: a loaded host may well take 30 ms to answer.)
    time.sleep(0.3)
    client.connection_pool.connection_kwargs["socket_timeout"] = 10.0
    for idle in [*_direct(client).idle, *client.connection_pool._available_connections]:
        idle.disconnect()
        idle.socket_timeout = 10.0
    assert limiter.acquire(limit).allowed
    assert client.ping()
    assert len(_direct(client).idle) == 1


def test_an_error_reply_keeps_the_connection(server: RedisServer) -> None:
    admin = server.client()
    calls = _direct(server.client())
    calls("ECHO", "warm")
    before = _clients(admin)
    with pytest.raises(redis.ResponseError, match="Function not found"):
        calls("FCALL", "no_such_function", 0)
    assert calls("ECHO", "after") == b"after"
    assert len(calls.idle) == 1
    assert _clients(admin) == before


def test_commands_sent_together_each_get_their_own_reply_or_error(server: RedisServer) -> None:
    admin = server.client()
    calls = _direct(server.client())
    calls("ECHO", "warm")
    before = _clients(admin)
    # Given three commands in one write, the middle one an error on the server
    replies = calls.each([("ECHO", "a"), ("FCALL", "no_such_function", 0), ("ECHO", "b")])
    # Then each has its own reply in its place, and the connection goes back clean
    assert replies[0] == b"a" and replies[2] == b"b"
    assert isinstance(replies[1], redis.ResponseError)
    assert "Function not found" in str(replies[1])
    assert calls("ECHO", "after") == b"after"
    assert (len(calls.idle), _clients(admin)) == (1, before)
    assert calls.each([]) == []


def test_threads_each_read_their_own_replies(server: RedisServer) -> None:
    calls = _direct(server.client())
    wrong: list[tuple[bytes, Any]] = []

    def run(thread: int) -> None:
        for i in range(300):
            value = f"{thread}-{i}".encode()
            reply = calls("ECHO", value)
            if reply != value:
                wrong.append((value, reply))

    threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    assert 1 <= len(calls.idle) <= 8


def test_a_forked_child_does_not_share_the_parents_connection(server: RedisServer) -> None:
    calls = _direct(server.client())
    calls("ECHO", "warm")  # an idle connection the child inherits
    inherited = calls.idle[0]
    with warnings.catch_warnings():
        # Python 3.12+ warns on fork() while other threads run (earlier tests may have left
        # some): the child here only talks to Redis and exits.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: its own connection, its own replies
        code = 0
        try:
            if calls.idle:
                code = 3
            for i in range(500):
                if calls("ECHO", f"child-{i}") != f"child-{i}".encode():
                    code = 2
            if calls.idle[0] is inherited:
                code = 4
        except BaseException:
            code = 1
        os._exit(code)
    wrong = [i for i in range(500) if calls("ECHO", f"parent-{i}") != f"parent-{i}".encode()]
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert wrong == []
    assert calls.idle == [inherited]


def test_client_close_closes_its_connections_and_a_later_call_reconnects(
    server: RedisServer,
) -> None:
    admin = server.client()
    client = server.client()
    calls = _direct(client)
    calls("ECHO", "warm")
    with_ours = _clients(admin)
    client.close()
    # The server sees the socket close on its next turn: wait for it (bounded).
    deadline = time.monotonic() + 10
    while _clients(admin) != with_ours - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _clients(admin) == with_ours - 1
    assert calls("ECHO", "again") == b"again"
    assert _clients(admin) == with_ours


def test_a_restarted_redis_is_reconnected_to_on_the_next_call(server: RedisServer) -> None:
    limiter = Limiter(server.client(), prefix="direct")
    limit = Limit.parse("1000/s", name="api")
    assert limiter.acquire(limit).allowed
    kill(server)
    respawn(server)
    # The idle connection is dead: the call retries on a new one (the client's retry policy).
    assert limiter.acquire(limit).allowed
    assert limiter._direct is not None and len(limiter._direct.idle) == 1


def test_only_a_plain_client_on_a_plain_pool_gets_direct_calls(server: RedisServer) -> None:
    assert isinstance(direct_calls(server.client()), DirectCalls)
    assert direct_calls(server.client(single_connection_client=True)) is None
    assert direct_calls(server.client(protocol=3)) is None
    blocking = redis.BlockingConnectionPool(host="127.0.0.1", port=server.port)
    assert direct_calls(redis.Redis(connection_pool=blocking)) is None
    sentinel = Sentinel([("127.0.0.1", 1)])  # no connection is made here
    assert isinstance(direct_calls(sentinel.master_for("mymaster")), DirectCalls)
    assert direct_calls(object()) is None


def test_limiters_on_one_client_share_its_connections(server: RedisServer) -> None:
    admin = server.client()
    client = server.client()
    limit = Limit.parse("1000/s", name="api")
    Limiter(client, prefix="direct").acquire(limit)
    before = _clients(admin)
    for _ in range(50):  # a limiter per call, as some code makes them
        assert Limiter(client, prefix="direct").acquire(limit).allowed
    assert _clients(admin) == before


@pytest.mark.parametrize("options", [{}, {"encoding": "latin-1"}], ids=["hiredis", "redis-py"])
def test_commands_are_packed_as_the_client_packs_them(
    server: RedisServer, options: dict[str, Any]
) -> None:
    client = server.client(**options)
    calls = _direct(client)
    values = ["é", 0.1, 1e300, 10**20, -3, b"\x00bytes"]
    for value in values:
        assert calls("ECHO", value) == client.echo(value)
    with pytest.raises(redis.DataError):
        calls("ECHO", True)
    assert calls("ECHO", "after") == b"after"


def test_without_hiredis_commands_are_packed_by_the_connection(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `pip install celery-throttled` without the [hiredis] extra: the connection packs.
    monkeypatch.setattr(direct, "_hiredis_pack", None)
    client = server.client()
    calls = DirectCalls(client.connection_pool)
    for value in ["é", 0.1, 1e300, 10**20, -3, b"\x00bytes"]:
        assert calls("ECHO", value) == client.echo(value)
    with pytest.raises(redis.DataError):
        calls("ECHO", True)
    assert calls("ECHO", "after") == b"after"
    assert len(calls.idle) == 1


def test_a_connection_the_server_closed_while_idle_is_replaced_before_the_call() -> None:
    # Redis's idle timeout closes the connection; without any retry (redis-py 5's default),
    # the next call must still go through: it is checked as the pool checks one.
    with RedisServer(("--timeout", "1")) as server:
        admin = server.client()
        client = server.client(retry=Retry(NoBackoff(), 0))
        calls = _direct(client)
        assert calls("ECHO", "before") == b"before"
        with_ours = _clients(admin)
        deadline = time.monotonic() + 15
        while _clients(admin) == with_ours and time.monotonic() < deadline:
            time.sleep(0.05)  # admin stays busy: only our idle connection is closed
        assert _clients(admin) == with_ours - 1
        assert calls("ECHO", "after") == b"after"


def test_a_limiter_told_not_to_keeps_to_the_client(server: RedisServer) -> None:
    client = server.client()
    limiter = Limiter(client, prefix="direct", own_connections=False)
    assert limiter.acquire(Limit.parse("1000/s", name="api")).allowed
    assert limiter._direct is None
    assert client.connection_pool._in_use_connections == set()  # back in the pool


def test_a_call_to_a_dead_redis_tries_to_connect_as_often_as_the_clients_own_call(
    server: RedisServer,
) -> None:
    # Counted at a listener that takes the dead server's port and hangs up on everyone:
    # the limiter's call must fail after as many connection attempts as redis-py's own
    # (its retry policy's), not after retries of retries.
    client = server.client(retry=Retry(NoBackoff(), 2), socket_connect_timeout=2)
    calls = _direct(client)
    assert calls("ECHO", "up") == b"up"
    client.ping()  # an idle connection in the pool too
    kill(server)
    accepted = 0
    listener = socket.create_server(("127.0.0.1", server.port), reuse_port=False)
    stop = threading.Event()

    def hang_up() -> None:
        nonlocal accepted
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                peer, _ = listener.accept()
            except TimeoutError:
                continue
            accepted += 1
            peer.close()

    thread = threading.Thread(target=hang_up)
    thread.start()
    try:
        counts = []
        for call in (lambda: calls("ECHO", "x"), lambda: client.echo("x")) * 2:
            before = accepted
            with pytest.raises(redis.ConnectionError):
                call()
            # Complete: each attempt fails only once the listener hung up on it, after
            # counting it.
            counts.append(accepted - before)
    finally:
        stop.set()
        thread.join()
        listener.close()
    # A stale connection first (found by the check before sending), then a closed one.
    assert counts[0] == counts[1] > 0
    assert counts[2] == counts[3] > 0


def test_a_worker_told_not_to_sends_every_call_through_the_client(server: RedisServer) -> None:
    apps = {}
    for own in (True, False):
        app = Celery(f"direct-{own}", set_as_current=False)
        app.conf.throttle_redis_url = server.url
        app.conf.throttle_config = {"settings": {"redis_own_connections": own}}
        apps[own] = Throttler.of(app).limiter
    assert isinstance(apps[True]._direct, DirectCalls)
    assert apps[False]._direct is None
    for limiter in apps.values():
        assert limiter.acquire(Limit.parse("1000/s", name="api")).allowed
