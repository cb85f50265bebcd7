"""TLS, ACL users, Sentinel, and passwords that never show.

Real servers only: ``redis-server`` over TLS (certificates made by the openssl CLI, mutual
TLS) with an ACL user holding the least privilege the limiter needs
(:func:`throttle.redis.urls.acl_rules`), a ``redis-server --sentinel`` with a master and a replica
(and a failover), a real ``celery worker``, a real Flower and the real ``celery throttle``
command, whose logs, events, metrics and output are searched for the password.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from tests.support.clock import FakeClock
from tests.support.servers import RedisSentinel, RedisServer, TlsFiles, free_port
from throttle import BackendError, BackendUnavailable, ConfigError, Limit, Limiter
from throttle.admin import reset
from throttle.aio import Limiter as AsyncLimiter
from throttle.celery import Throttler
from throttle.parking import ParkingLot
from throttle.rates import RateBook
from throttle.redis.urls import acl_rules, describe, parse_sentinel_url, redact
from throttle.stats import StatsBook
from workers.harness import ROOT, Worker, wait_ready

# A distinctive secret, with characters a URL must encode: searched raw and encoded.
SECRET = f"pw/{uuid.uuid4().hex}:+@"
CORE = SECRET[3:35]  # the hex part: present in every spelling of the password


def limiter_user(password: str = SECRET, prefix: str = "throttle") -> str:
    return f"user limiter on >{password} {acl_rules(prefix)}"


# -- redaction and parsing -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://limiter:hunter2@h:6380/1?ssl_ca_certs=/ca.pem", "rediss://limiter:***@h:6380/1?ssl_ca_certs=/ca.pem"),
        ("redis://h:6379/0", "redis://h:6379/0"),
        ("redis://limiter@h:6379/0", "redis://limiter@h:6379/0"),
        # malformed: an unencoded '/' or '@' in the password still hides all of it
        ("redis://u:hun/ter2@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis://u:hu@nter2@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis+sentinel://u:hunter2@a:1,b:2/svc/0?sentinel_password=hunter2&x=1", "redis+sentinel://u:***@a:1,b:2/svc/0?sentinel_password=***&x=1"),
        ("unix:///run/redis.sock?password=hunter2&db=2", "unix:///run/redis.sock?password=***&db=2"),
    ],
)  # fmt: skip
def test_redact_hides_every_password(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert "hunter2" not in redact(url) and "ter2" not in redact(url)


def test_sentinel_urls_are_parsed_and_bad_ones_named_without_the_password() -> None:
    parsed = parse_sentinel_url(
        "rediss+sentinel://limiter:p%2Fw@10.0.0.1:26379,[::1]:26380/cache/3"
        "?ssl_ca_certs=/ca.pem&socket_timeout=2&sentinel_password=sp"
    )
    assert parsed.sentinels == (("10.0.0.1", 26379), ("::1", 26380))
    assert (parsed.service, parsed.db) == ("cache", 3)
    master, sentinels = parsed.master_options, parsed.sentinel_options
    assert (master["username"], master["password"], master["ssl"]) == ("limiter", "p/w", True)
    assert master["socket_timeout"] == sentinels["socket_timeout"] == 2.0
    assert sentinels == {
        "ssl": True,
        "ssl_ca_certs": "/ca.pem",
        "socket_timeout": 2.0,
        "password": "sp",
    }
    assert "sentinel_password" not in master and "username" not in sentinels  # fmt: skip

    for url, problem in [
        ("redis+sentinel://u:hunter2@h:26379", "name the master's service"),
        ("redis+sentinel://u:hunter2@h/svc", "sentinel 'h' is not HOST:PORT"),
        ("redis+sentinel://u:hunter2@h:26379/svc/x", "database after the service"),
        ("redis+sentinel://u:hunter2@h:26379/svc?socket_timeout=soon", "cannot parse it"),
    ]:
        with pytest.raises(ConfigError) as caught:
            Limiter.from_url(url)
        assert problem in str(caught.value)
        assert "u:***@" in str(caught.value) and "hunter2" not in str(caught.value)


def test_a_malformed_url_is_a_config_error_without_the_password() -> None:
    # Given a password with an unencoded '/': redis-py's own error quotes a piece of it
    app = Celery("malformed", set_as_current=False)
    app.conf.throttle_redis_url = "redis://limiter:hunter/2@127.0.0.1:6379/0"
    app.conf.throttle_config = {"limits": {"x": {"rate": "1/s"}}}
    with pytest.raises(ConfigError) as caught:
        Throttler.from_app(app)
    message = str(caught.value)
    assert "field 'redis_url'" in message and "percent-encode" in message
    assert "limiter:***@127.0.0.1" in message and "hunter" not in message


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3/cr3t@127.0.0.1:6379/0",
        "rediss://u:s3cr3t#x@h:1/0",
        # a piece of the password that reads as a port: redis-py would connect there
        "redis://:27300/s3@127.0.0.1:27301/0",
        "redis+cluster://:27320/s3@127.0.0.1:27321",
        "redis+sentinel://admin:s3cr3t/x?y@127.0.0.1:26379/lim/0",
    ],
)
def test_a_limiter_from_a_malformed_url_is_a_config_error_without_the_password(url: str) -> None:
    clustered = url.startswith("redis+cluster")  # which the asyncio limiter refuses first
    for limiter in (Limiter,) if clustered else (Limiter, AsyncLimiter):
        with pytest.raises(ConfigError) as caught:
            limiter.from_url(url)
        message = str(caught.value)
        assert "field 'redis_url'" in message and "percent-encode" in message, message
        assert "s3" not in message, message


@pytest.mark.parametrize(
    ("query", "problem"),
    [
        pytest.param("?ssl_cert_reqs=bogus", "ssl_cert_reqs must be one of none, optional, "
                     "required (got 'bogus')", id="cert-reqs"),
        pytest.param("?ssl_ca_certs=/nonexistent/ca.pem", "ssl_ca_certs names no file on this "
                     "host (got '/nonexistent/ca.pem')", id="ca-file"),
        pytest.param("?ssl_ca_path=/nonexistent", "ssl_ca_path names no directory", id="ca-dir"),
    ],
)  # fmt: skip
def test_a_bad_tls_option_is_a_config_error_naming_where_the_url_came_from(
    query: str, problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py takes these and fails at the first call, which would read as an outage
    (on_redis_down, forever): refused when the limiter is built, naming the option and
    the setting the URL came from, never the password."""
    monkeypatch.setenv("THROTTLE_REDIS_URL", f"rediss://:hunter2@127.0.0.1:6380/0{query}")
    app = Celery("tls-options", set_as_current=False)
    app.conf.throttle_config = {"limits": {"x": {"rate": "1/s"}}}
    with pytest.raises(ConfigError) as caught:
        Throttler.from_app(app)
    message = str(caught.value)
    assert message.startswith("THROTTLE_REDIS_URL: field 'redis_url': " + problem), message
    assert "hunter2" not in message
    # a database that is not a number: redis-py reads it as 0
    app.conf.throttle_redis_url = "redis://127.0.0.1:6380/zz"
    with pytest.raises(ConfigError, match=r"^app.conf.throttle_redis_url: field 'redis_url': "
                       r"the database .* must be a number"):  # fmt: skip
        Throttler.from_app(app)
    # a scheme redis-py does not take (a typo, a URL of something else), sync and asyncio
    app.conf.throttle_redis_url = "Redis://127.0.0.1:6380/0"
    with pytest.raises(ConfigError, match=r"^app.conf.throttle_redis_url: field 'redis_url': "
                       r"a Redis URL starts with redis://, .* \(got 'Redis://'\)"):  # fmt: skip
        Throttler.from_app(app)
    with pytest.raises(ConfigError, match=r"field 'redis_url': a Redis URL .* \(got 'http://'\)"):
        AsyncLimiter.from_url("http://:hunter2@127.0.0.1:6380/0")


def test_a_client_certificate_tls_cannot_load_is_a_config_error_naming_it(
    tls_files: TlsFiles,
) -> None:
    """A client certificate without its key (or with another certificate's key) fails at
    every connection with OpenSSL's bare ``[SSL] PEM lib``, which reads as an outage
    (on_redis_down, forever): refused when the limiter is built, naming the options."""
    base = f"rediss://:hunter2@127.0.0.1:6380/0?ssl_ca_certs={tls_files.ca}"
    cases = [
        (f"&ssl_certfile={tls_files.client_cert}", "ssl_certfile must hold a PEM certificate "
         "and its own private key"),
        (f"&ssl_certfile={tls_files.client_cert}&ssl_keyfile={tls_files.key}",
         f"ssl_certfile and ssl_keyfile ({tls_files.key}) must hold"),
        (f"&ssl_keyfile={tls_files.client_key}", "give the certificate as ssl_certfile too"),
    ]  # fmt: skip
    for query, problem in cases:
        for limiter in (Limiter, AsyncLimiter):
            with pytest.raises(ConfigError) as caught:
                limiter.from_url(base + query)
            message = str(caught.value)
            assert "field 'redis_url'" in message and problem in message, message
            assert "hunter2" not in message
    # the certificate with its own key: built (it connects on its first call)
    query = f"&ssl_certfile={tls_files.client_cert}&ssl_keyfile={tls_files.client_key}"
    Limiter.from_url(base + query).client.close()


# -- TLS and ACL -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tls_files: TlsFiles) -> Iterator[RedisServer]:
    """TLS only, client certificates required, the least-privilege ``limiter`` user."""
    with RedisServer(tls=tls_files, client_certs=True, acl=[limiter_user()]) as server:
        yield server


def test_every_operation_over_mutual_tls_as_a_least_privilege_acl_user(
    tls_server: RedisServer,
) -> None:
    # Given the limiter as user 'limiter' over TLS with a client certificate
    url = tls_server.url_for("limiter", SECRET)
    assert url.startswith("rediss://limiter:") and "ssl_certfile=" in url
    limiter = Limiter.from_url(url)
    # and the same connection (same user, same certificate) on the test clock: the counts
    # below are judged at one instant, however long the calls take over TLS on a slow host
    # (at 5/s a token comes back every 200 ms, at 100/m 0.1 of one every 60 ms). The real
    # clock (Redis TIME, as this user) still runs the acquire after SCRIPT FLUSH below.
    clocked = Limiter(limiter.client, clock_us=FakeClock())
    admin = tls_server.client()
    try:
        # Then every algorithm, several limits at once, reservation and settle work
        for algorithm in ("token_bucket", "gcra", "sliding_window", "fixed_window"):
            limit = Limit.parse("5/s", name=f"tls-{algorithm}", algorithm=algorithm)
            assert [bool(clocked.acquire(limit, "k")) for _ in range(6)] == [True] * 5 + [False]
        bucket = Limit.parse("100/m", name="tokens")
        gate = Limit.parse("2 concurrent", name="gate")
        decision = clocked.acquire_many([(bucket, "t", 40), (gate, None)], acquisition_id="a-1")
        assert decision and decision.acquisition is not None
        assert clocked.settle(decision.acquisition, [10, None]).status == "settled"
        assert clocked.peek(bucket, "t").remaining == pytest.approx(90, abs=0.1)
        assert clocked.acquire(Limit.parse("1/s burst 1", name="slot", algorithm="gcra"))
        assert clocked.acquire(
            Limit.parse("1/s burst 1", name="slot", algorithm="gcra"), max_wait_s=2
        ).wait_s == pytest.approx(1, abs=0.1)
        # holds, run-time rates, parking, fleet stats, reset
        assert clocked.hold("gate", None, 5) == pytest.approx(5)
        assert set(clocked.holds()) == {("gate", None)}
        clocked.unhold("gate")
        book = RateBook(limiter.client, limiter.keyspace)
        book.set(bucket, "50/m")
        assert book.overrides() == {"tokens": "50/m"}
        lot = ParkingLot(limiter.client, limiter.keyspace)
        lot.park(b"payload", 0)
        [claimed] = lot.claim(lead_s=1)
        assert lot.accept(claimed.token, claimed.publish_id)
        assert lot.commit([claimed]) == 1 and lot.counts() == (0, 0)
        # (read a minute ahead: the current minute counts only once it is over; one instant,
        # so that a minute ending between the write and the read cannot move the write)
        now = time.time()
        StatsBook(limiter.client, limiter.keyspace, clock=lambda: now).record(
            ["tokens"], "denied", 3
        )
        ahead = StatsBook(limiter.client, limiter.keyspace, clock=lambda: now + 60)
        assert ahead.per_minute(1)["tokens"]["denied"] == 3
        assert reset(limiter.client, limiter.keyspace, "tokens") == 1
        # and after FUNCTION FLUSH and SCRIPT FLUSH the library and the scripts are
        # loaded again (FUNCTION LOAD and SCRIPT LOAD are allowed)
        admin.function_flush()
        admin.script_flush()
        assert limiter.acquire(Limit.parse("5/s", name="after-flush"))
        assert limiter.library.functions is True

        # But the same user cannot touch keys outside its prefix, nor other commands
        other = Limiter(limiter.client, prefix="other")
        with pytest.raises(
            BackendError, match="no permissions to access one of the keys"
        ) as caught:
            other.acquire(Limit.parse("5/s", name="x"))
        assert CORE not in str(caught.value)
        with pytest.raises(redis.exceptions.NoPermissionError):
            limiter.client.flushall()
        # and a client without a certificate is turned away by the server
        no_cert = tls_server.url_for("limiter", SECRET).split("&ssl_certfile")[0]
        with pytest.raises(BackendUnavailable):
            Limiter.from_url(no_cert).acquire(Limit.parse("5/s", name="x"))
    finally:
        limiter.client.close()
        admin.close()


@pytest.mark.parametrize("denied", ["-fcall", "-function|load"])
def test_a_user_denied_redis_functions_gets_the_scripts(denied: str) -> None:
    # Given a user whose ACL takes no functions (or cannot load them), as on Redis 6
    user = f"user scripts on >pw {acl_rules()} {denied}"
    with RedisServer(acl=[user]) as server:
        limiter = Limiter.from_url(server.url_for("scripts", "pw"))
        clocked = Limiter(limiter.client, clock_us=FakeClock())
        try:
            # When it acquires, settles, peeks and holds
            tb = Limit.parse("5/s", name="tb")
            gcra = Limit.parse("5/s", name="g", algorithm="gcra")
            assert [bool(clocked.acquire(tb, "k")) for _ in range(6)] == [True] * 5 + [False]
            decision = clocked.acquire_many([(tb, "j"), (gcra, None)], acquisition_id="a")
            assert decision.acquisition is not None
            assert clocked.settle(decision.acquisition, 0).status == "settled"
            assert clocked.peek(gcra).remaining == pytest.approx(5)
            assert clocked.hold(tb, None, 5) == pytest.approx(5)
            assert not clocked.acquire(tb, "j")
            assert limiter.acquire(Limit.parse("5/s", name="real"))  # on Redis TIME
            # Then every call went through the scripts, and no function was loaded
            assert limiter.library.functions is clocked.library.functions is False
            assert server.client().function_list() == []
        finally:
            limiter.client.close()


def test_a_user_whose_acl_lacks_exists_and_mget_gets_the_same_decisions() -> None:
    # Given a user with rules copied from an older acl_rules (no EXISTS, no MGET, which
    # acquire.lua reads with when it may) and a user with today's rules, on one clock
    old, new = (f"user {name} on >pw {acl_rules()}{rules}" for name, rules in
                (("old", " -exists -mget"), ("new", "")))  # fmt: skip
    with RedisServer(acl=[old, new]) as server:
        clock = FakeClock()
        limiters = [
            Limiter(
                redis.Redis.from_url(server.url_for(user, "pw")), namespace=user, clock_us=clock
            )
            for user in ("old", "new")
        ]
        limits = [
            (Limit.parse("3/s", name="tb"), "k"),
            (Limit.parse("2/s", name="g", algorithm="gcra"), None),
            (Limit.parse("4/m", name="fw", algorithm="fixed_window"), "k"),
        ]
        try:
            # When both acquire the same limits, before and during a hold of another limit
            seen: list[list[Any]] = [[], []]
            for step in range(12):
                if step == 6:
                    for limiter in limiters:
                        limiter.hold(Limit.parse("1/s", name="other"), None, 60)
                for limiter, decisions in zip(limiters, seen, strict=True):
                    decisions.append(limiter.acquire_many(limits, max_wait_s=0.4))
                clock.advance(0.3)
            # Then they were told the same, and some were denied; the old user's EXISTS and
            # MGET were refused (its reads were the others)
            assert seen[0] == seen[1]
            assert {d.allowed for d in seen[0]} == {True, False}
            refused = {(e["username"], e["object"]) for e in server.client().acl_log()}
            assert refused == {("old", "exists"), ("old", "mget")}
        finally:
            for limiter in limiters:
                limiter.client.close()


def test_a_wrong_password_is_a_clear_error_without_the_password(tls_server: RedisServer) -> None:
    wrong = f"wrong-{CORE}"
    limiter = Limiter.from_url(tls_server.url_for("limiter", wrong))
    with pytest.raises(BackendUnavailable) as caught:
        limiter.acquire(Limit.parse("5/s", name="x"))
    error = caught.value
    assert str(error).startswith("Redis refused the limiter's credentials: ")  # not "unreachable"
    assert "invalid username-password pair" in str(error)
    chain = f"{error!s} {error!r} {error.__cause__!s} {error.__cause__!r}"
    assert CORE not in chain and "wrong-" not in chain
    limiter.client.close()


# -- Sentinel --------------------------------------------------------------------------------


def test_sentinel_finds_the_master_and_follows_a_failover() -> None:
    acl = [limiter_user()]
    with (
        # (no 5 s wait for more replicas before the first full sync)
        RedisServer(("--repl-diskless-sync-delay", "0"), acl=acl) as master,
        RedisServer(acl=acl) as replica,
        contextlib.closing(master.client()) as on_master,
        contextlib.closing(replica.client()) as on_replica,
    ):
        on_replica.replicaof("127.0.0.1", master.port)
        wait_for(lambda: on_replica.info("replication")["master_link_status"] == "up")
        with RedisSentinel(master, "limits", down_after_ms=1000, password=SECRET) as sentinel:
            # Given a limiter and a Celery app on the Sentinel URL, as the ACL user
            url = sentinel.url("limiter", SECRET)
            assert url.startswith("redis+sentinel://limiter:") and "sentinel_password=" in url
            app = Celery("sentinel", set_as_current=False)
            app.conf.throttle_redis_url = url
            app.conf.throttle_config = {"limits": {"api": {"rate": "1000/s"}}}
            limiter = Throttler.from_app(app).limiter
            limit = Limit.parse("1000/s", name="api")
            try:
                # Then it reaches the master through the sentinel
                assert limiter.acquire(limit)
                assert on_master.keys(f"{limiter.keyspace.base}*")
                shown = describe(limiter.client)
                assert shown == f"redis+sentinel://127.0.0.1:{sentinel.port}/limits/0"

                # When the master dies, the sentinel promotes the replica
                master.stop()
                wait_for(lambda: sentinel.master_address() == ("127.0.0.1", replica.port), 20)
                # Then after at most a few failed calls the limiter works on the new master
                failures = 0
                deadline = time.monotonic() + 10
                while True:
                    try:
                        assert limiter.acquire(limit)
                        break
                    except BackendUnavailable as exc:
                        assert CORE not in str(exc)
                        failures += 1
                        assert time.monotonic() < deadline, exc
                        time.sleep(0.1)
                assert failures <= 2
                assert on_replica.info("replication")["role"] == "master"
            finally:
                limiter.client.close()


def wait_for(check: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- no password in logs, events, metrics, CLI output, Flower --------------------------------

CONFIG = """
settings:
  sleep_max: 0.2s
  park_after: 0.8s
  line_max: 0s  # every wait beyond sleep_max deferred: the deferrals log too
  park_lead: 0.3s
  metrics: true
  metrics_dir: {metrics_dir}
limits:
  slow: {{algorithm: gcra, rate: 4/s, burst: 1}}
"""


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
        return text


class AllEvents:
    """Every event on the broker, as a real receiver (Flower's kind) gets them."""

    def __init__(self, app: Celery) -> None:
        self.events: list[dict[str, Any]] = []
        self.connection = app.connection_for_read()
        self.receiver = app.events.Receiver(self.connection, handlers={"*": self.events.append})
        self.thread = threading.Thread(target=self._run, daemon=True, name="all-events")
        self.thread.start()
        with app.events.default_dispatcher() as dispatcher:  # subscribed once one arrives
            deadline = time.monotonic() + 10
            while not self.events and time.monotonic() < deadline:
                dispatcher.send("worker-probe")
                time.sleep(0.1)
        assert self.events, "the event receiver did not start"

    def _run(self) -> None:
        with contextlib.suppress(Exception):
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def stop(self) -> list[dict[str, Any]]:
        self.receiver.should_stop = True
        self.thread.join(5)
        self.connection.release()
        return list(self.events)


def throttle_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.tls_app", "throttle", *args],
        cwd=ROOT, env={**os.environ, **env}, text=True, capture_output=True, timeout=60,
        check=False,
    )  # fmt: skip


def start_flower(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        flower = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.apps.tls_app", "flower",
             f"--port={port}", "--address=127.0.0.1"],
            cwd=ROOT, env={**os.environ, **env, "FLOWER_UNAUTHENTICATED_API": "true"},
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return flower


def test_the_password_never_shows_in_logs_events_metrics_cli_or_flower(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    config = tmp_path / "limits.yaml"
    config.write_text(CONFIG.format(metrics_dir=tmp_path / "metrics"))
    metrics_port, flower_port = free_port(), free_port()
    with RedisServer() as broker, RedisServer(tls=tls_files, acl=[limiter_user()]) as limits:
        # Given a worker and Flower whose limiter URL carries the password (TLS, ACL user)
        url = limits.url_for("limiter", SECRET)
        assert CORE in url
        env = {
            "TLS_BROKER_URL": broker.url,
            "THROTTLE_CONFIG": str(config),
            "THROTTLE_REDIS_URL": url,
        }
        worker = Worker(
            "tls", {**env, "THROTTLE_METRICS_PORT": str(metrics_port)}, concurrency=2,
            queues="tls", app="tests.apps.tls_app", log=tmp_path / "worker.log",
            extra=["-E", "-l", "DEBUG"],
        )  # fmt: skip
        producer = Celery("tls", broker=broker.url, backend=broker.url, set_as_current=False)
        producer.conf.task_default_queue = "tls"
        flower = None
        events = AllEvents(producer)
        try:
            worker.start()
            flower = start_flower(env, flower_port, tmp_path / "flower.log")
            wait_ready(producer, [worker])
            # When tasks are throttled (slept for, deferred, parked)
            handles = [producer.send_task("tests.apps.tls_app.slow", (x,)) for x in range(8)]
            results = [handle.get(timeout=30) for handle in handles]
            assert sum(r["deferrals"] for r in results) >= 3
            status = throttle_cli(env, "status", "--json", "--timeout", "0")
            assert status.returncode == 0, status.stderr
            assert json.loads(status.stdout)["redis"] == f"rediss://127.0.0.1:{limits.port}/0"
            # (a wrong user: a clear error)
            wrong = throttle_cli(
                {**env, "THROTTLE_REDIS_URL": url.replace("limiter:", "nobody:")},
                "status",
                "--timeout",
                "0",
            )
            assert wrong.returncode == 1
            assert "invalid username-password pair" in wrong.stdout + wrong.stderr
            worker_metrics = get(f"http://127.0.0.1:{metrics_port}/metrics")
            assert 'throttle_decisions_total{decision="denied",limit="slow"}' in worker_metrics
            wait_for(lambda: "task-throttled" in _flower_metrics(flower_port), 20)
            flower_metrics = _flower_metrics(flower_port)
            flower_tasks = get(f"http://127.0.0.1:{flower_port}/api/tasks")
            assert handles[0].id in flower_tasks

            # And when the limiter's Redis goes away, so that the worker warns
            limits.stop()
            producer.send_task("tests.apps.tls_app.slow", (99,))
            log = tmp_path / "worker.log"
            wait_for(lambda: "Redis is unreachable" in log.read_text(errors="replace"), 20)
            down = throttle_cli(env, "status", "--timeout", "0")
            assert down.returncode == 1 and "Redis is unreachable" in down.stdout + down.stderr
        finally:
            seen = events.stop()
            worker.stop()
            if flower is not None:
                flower.terminate()
                flower.wait(10)
        # Then the password is nowhere: not in any log line, event, metric or output
        throttled = [e for e in seen if e.get("type") == "task-throttled"]
        assert throttled and all(e["limits"] == ["slow"] for e in throttled)
        assert {e["how"] for e in throttled} == {"republish", "park"}  # parking ran too
        texts = {
            "worker log": log.read_text(errors="replace"),
            "flower log": (tmp_path / "flower.log").read_text(errors="replace"),
            "events": json.dumps(seen, default=str),
            "worker metrics": worker_metrics,
            "flower metrics": flower_metrics,
            "flower tasks": flower_tasks,
            "cli status": status.stdout + status.stderr,
            "cli status, Redis down": down.stdout + down.stderr,
            "cli status, wrong user": wrong.stdout + wrong.stderr,
        }
        assert "throttle: Redis is unreachable" in texts["worker log"]
        # (and the least-privilege user was enough for the Celery layer: parking, stats)
        assert "permission" not in texts["worker log"].lower()
        assert "throttle" in texts["flower metrics"]
        leaks = [where for where, text in texts.items() if CORE in text]
        assert leaks == []


def _flower_metrics(port: int) -> str:
    try:
        return get(f"http://127.0.0.1:{port}/metrics")
    except OSError:
        return ""


def test_no_sentinel_answering_reads_as_an_outage_in_one_short_line() -> None:
    limiter = Limiter.from_url(f"redis+sentinel://127.0.0.1:{free_port()}/limits/0")
    with pytest.raises(BackendUnavailable) as caught:
        limiter.acquire(Limit.parse("1/s", name="x"))
    message = str(caught.value)
    assert message.startswith("Redis is unreachable: No master found for 'limits'"), message
    assert "<redis." not in message and len(message) < 200, message


@pytest.mark.parametrize(
    ("url", "shown"), [(None, "(got None)"), ("", "(got '')"), ("h:6379", "(got 'h:6379')")]
)
def test_a_redis_url_that_is_not_one_is_named_as_given(url: object, shown: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Limiter.from_url(url)  # type: ignore[arg-type]
    assert caught.value.field == "redis_url" and str(caught.value).endswith(shown)
