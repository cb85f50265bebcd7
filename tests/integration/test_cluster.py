"""Every operation on a real Redis Cluster of three masters (tests/conftest.py: redis_cluster).

Each test works in a namespace of its own. A namespace is the hash tag of all its keys, so
each is one slot, served by one master; the tests check that every script of the package
(acquire, acquire_one, settle, peek, hold, holds, the parking lot's, the rate book's
commands) runs there without CROSSSLOT errors, survives SCRIPT FLUSH on every master, and
follows its slot when the slot moves to another master (MOVED).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from redis.cluster import RedisCluster

from tests.apps.cli_app import app as cli_app
from tests.support.clock import FakeClock, redis_now_s
from tests.support.cluster import LocalCluster
from tests.support.eager import close_throttler
from tests.support.servers import RedisServer
from throttle import BackendError, BackendUnavailable, ConfigError, KeySpace, Limit, Limiter
from throttle.admin import reset
from throttle.celery import ThrottledTask, Throttler, outage, report_cost, throttled
from throttle.cli import throttle
from throttle.parking import ParkingLot
from throttle.rates import RateBook
from throttle.redis.client import run_script
from throttle.redis.memory import eviction_policy
from throttle.redis.urls import LazyCluster, acl_rules, cluster_client
from throttle.stats import StatsBook

TOKEN_BUCKET = Limit.parse("3/s", name="tb")
GCRA = Limit.parse("3/s", name="gcra", algorithm="gcra")
SLIDING = Limit.parse("3/s", name="sw", algorithm="sliding_window")
FIXED = Limit.parse("3/s", name="fw", algorithm="fixed_window")
CONCURRENCY = Limit.parse("3 concurrent", name="conc")
HOURLY = Limit.parse("3/h", name="hourly")  # refills too slowly to blur a count
EVERY_ALGORITHM = [TOKEN_BUCKET, GCRA, SLIDING, FIXED, CONCURRENCY]


@pytest.fixture
def namespace() -> str:
    return f"ns-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def nodes(redis_cluster: LocalCluster) -> Iterator[list[redis.Redis]]:
    """A plain client of each master, for commands aimed at one node."""
    clients = redis_cluster.node_clients()
    yield clients
    for client in clients:
        client.close()


def about(tokens: float) -> object:
    """``tokens``, give or take the rounding of a GCRA slot to whole microseconds."""
    return pytest.approx(tokens, abs=1e-3)


def tag_slot(client: RedisCluster, namespace: str) -> int:
    slot: int = client.keyslot(f"{{{namespace}}}")
    return slot


def owner_port(client: RedisCluster, key: str) -> int:
    """The port of the master that serves ``key`` (in the client's slot map)."""
    port: int = client.get_node_from_key(key).port
    return port


def namespace_keys(node: redis.Redis, namespace: str) -> set[str]:
    return {key.decode() for key in node.scan_iter(match=f"throttle:{{{namespace}}}:*")}


def namespaces_on_distinct_masters(client: RedisCluster, count: int) -> list[str]:
    """``count`` namespaces whose slots are served by ``count`` different masters."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < count:
        name = f"spread-{uuid.uuid4().hex[:8]}-{i}"
        found.setdefault(owner_port(client, f"{{{name}}}"), name)
        i += 1
    return list(found.values())


@pytest.mark.parametrize(
    "limit", [pytest.param(lim, id=lim.algorithm.value) for lim in EVERY_ALGORITHM]
)
def test_each_algorithm_acquires_peeks_and_settles_on_the_cluster(
    cluster_client: RedisCluster, namespace: str, clock: FakeClock, limit: Limit
) -> None:
    limiter = Limiter(cluster_client, namespace=namespace, clock_us=clock)
    if limit is not CONCURRENCY:
        # The plain call (acquire_one.lua); concurrency always records its holder.
        assert limiter.acquire(limit, "other").remaining == about(2)
    taken = [limiter.acquire(limit, "acme", acquisition_id=f"task-{i}") for i in range(3)]
    assert [d.allowed for d in taken] == [True, True, True]
    denied = limiter.acquire(limit, "acme", acquisition_id="task-3")
    assert not denied.allowed
    assert denied.denied_by == (limit.name,)
    assert limiter.peek(limit, "acme").remaining == about(0)
    # A redelivered acquisition takes nothing twice.
    assert limiter.acquire(limit, "acme", acquisition_id="task-1").held
    # Settling at cost 0 gives its token (its unit) back, once.
    assert taken[0].acquisition is not None
    assert limiter.settle(taken[0].acquisition, 0).status == "settled"
    assert limiter.settle(taken[0].acquisition, 0).status == "already_settled"
    assert limiter.peek(limit, "acme").remaining == about(1)
    assert limiter.acquire(limit, "acme", acquisition_id="task-4").allowed


def test_one_acquisition_of_many_limits_and_keys_is_one_slot_on_one_master(
    cluster_client: RedisCluster, nodes: list[redis.Redis], namespace: str, clock: FakeClock
) -> None:
    limiter = Limiter(cluster_client, namespace=namespace, clock_us=clock)
    # Keys that would carry a hash tag of their own if they were not encoded, and a long one
    # that is hashed: none moves the namespace's tag.
    keys = ["acme", "{other-tag}", "a:b}{c", "ü" * 80, None]
    targets = [(limit, key) for limit in EVERY_ALGORITHM for key in keys]
    decision = limiter.acquire_many(targets, cost=1, acquisition_id="big")
    assert decision.allowed and len(decision.limits) == 25
    assert decision.acquisition is not None
    written = set(decision.acquisition.keys)  # 4 x 5 state keys, 5 x 2 concurrency, 1 lease
    assert len(written) == 31
    slots = {cluster_client.keyslot(key) for key in [limiter.keyspace.holds_key(), *written]}
    assert slots == {tag_slot(cluster_client, namespace)}
    # All of it on the one master of that slot, nothing anywhere else.
    owner = owner_port(cluster_client, limiter.keyspace.holds_key())
    for node in nodes:
        port = node.connection_pool.connection_kwargs["port"]
        assert namespace_keys(node, namespace) == (written if port == owner else set())

    # All or nothing across the 25 targets: one full key denies, and takes nothing.
    assert limiter.acquire(FIXED, "acme", cost=2).allowed
    denied = limiter.acquire_many(targets, cost=1, acquisition_id="big-2")
    assert not denied.allowed
    assert denied.denied_by == ("fw",)
    assert limiter.peek(TOKEN_BUCKET, "{other-tag}").remaining == about(2)
    assert limiter.peek(CONCURRENCY, None).remaining == about(2)
    # Settle refunds every one of the 25 at once.
    settled = limiter.settle(decision.acquisition, 0)
    assert settled.status == "settled" and settled.deltas == (-1.0,) * 25
    assert limiter.peek(GCRA, "ü" * 80).remaining == about(3)
    assert limiter.peek(CONCURRENCY, None).remaining == about(3)


def test_limits_of_two_namespaces_are_never_acquired_together(
    cluster_client: RedisCluster, namespace: str
) -> None:
    # Impossible by the API: a Limit has no namespace, and every key of an acquisition comes
    # from its Limiter's one KeySpace. Two namespaces are two limiters, whose acquisitions
    # are each atomic on their own master, and not atomic together.
    north, south = namespaces_on_distinct_masters(cluster_client, 2)
    targets = [(TOKEN_BUCKET, "acme"), (GCRA, None)]
    decisions = [
        Limiter(cluster_client, namespace=name).acquire_many(targets, acquisition_id="t")
        for name in (north, south)
    ]
    assert all(decision.allowed for decision in decisions)
    homes = {owner_port(cluster_client, d.acquisition.keys[0]) for d in decisions if d.acquisition}
    assert len(homes) == 2
    # Below the API, a script handed the keys of both namespaces is refused before it is
    # sent, with an error that says why (a Redis server would answer CROSSSLOT).
    script = cluster_client.register_script("return 1")
    keys = [KeySpace(namespace=name).holds_key() for name in (north, south)]
    with pytest.raises(BackendError, match="same key slot"):
        run_script(cluster_client, script, keys, [])


def test_namespaces_spread_over_the_masters(cluster_client: RedisCluster) -> None:
    homes = set()
    for i in range(30):
        limiter = Limiter(cluster_client, namespace=f"tenant-{i}")
        assert limiter.acquire(TOKEN_BUCKET, "acme").allowed  # on the Redis clock
        homes.add(owner_port(cluster_client, limiter.keyspace.holds_key()))
    assert len(homes) == 3


def test_holds_and_pauses_on_the_cluster(cluster_client: RedisCluster, namespace: str) -> None:
    # The Redis clock (no clock_us): holds.lua reads TIME on the master that keeps the holds.
    limiter = Limiter(cluster_client, namespace=namespace)
    assert limiter.hold(TOKEN_BUCKET, "acme", 5.0) == pytest.approx(5.0)
    assert limiter.hold("gcra", None, None) == math.inf
    holds = limiter.holds()
    assert set(holds) == {("tb", "acme"), ("gcra", None)}
    assert 4.0 < holds[("tb", "acme")] <= 5.0
    assert holds[("gcra", None)] == math.inf
    denied = limiter.acquire(TOKEN_BUCKET, "acme")
    assert not denied.allowed and 4.0 < denied.retry_after_s <= 5.0
    assert limiter.acquire(TOKEN_BUCKET, "other").allowed
    assert limiter.acquire(GCRA, "any").retry_after_s == math.inf
    limiter.unhold(TOKEN_BUCKET, "acme")
    limiter.unhold("gcra")
    assert limiter.holds() == {}
    assert limiter.acquire(TOKEN_BUCKET, "acme").allowed
    assert limiter.acquire(GCRA, "any").allowed


def test_the_parking_lot_on_the_cluster(
    cluster_client: RedisCluster, namespace: str, clock: FakeClock
) -> None:
    lot = ParkingLot(cluster_client, KeySpace(namespace=namespace), clock_us=clock)
    token = lot.park(b"message", 10.0)
    assert lot.counts() == (1, 0)  # a pipeline of two commands on the lot's slot
    assert lot.claim(lead_s=2.0) == []
    clock.advance(8.0)
    [claimed] = lot.claim(lead_s=2.0)
    assert (claimed.token, claimed.payload) == (token, b"message")
    assert lot.counts() == (0, 1)
    assert lot.commit([claimed]) == 1
    assert lot.counts() == (0, 0)
    assert lot.accept(token, claimed.publish_id)
    assert not lot.accept(token, "another-copy")
    # A copy's number is written with it, in the lot's slot (one script call)
    lot.park(b"copy", 10.0, task_id="task-1", copy=1)
    assert lot.stale_copy("task-1", 0) and not lot.stale_copy("task-1", 1)


def test_the_rate_book_on_the_cluster(cluster_client: RedisCluster, namespace: str) -> None:
    book = RateBook(cluster_client, KeySpace(namespace=namespace), refresh_s=0.0)
    assert book.current(TOKEN_BUCKET) is TOKEN_BUCKET
    lowered = book.set(TOKEN_BUCKET, "1/s")
    assert book.current(TOKEN_BUCKET) == lowered and lowered.count == 1
    assert book.overrides() == {"tb": "1/s"}
    book.follow(TOKEN_BUCKET, "1/2s")  # the upstream's rate: its own hash, in the same slot
    assert book.current(TOKEN_BUCKET).rate_per_s == 0.5
    assert book.followed_rates() == {"tb": "1/2s"}
    book.clear("tb")
    assert book.current(TOKEN_BUCKET) is TOKEN_BUCKET
    assert book.followed_rates() == {}


def test_every_script_comes_back_after_script_flush_on_every_master(
    cluster_client: RedisCluster, nodes: list[redis.Redis], namespace: str, clock: FakeClock
) -> None:
    limiter = Limiter(cluster_client, namespace=namespace, clock_us=clock)
    lot = ParkingLot(cluster_client, limiter.keyspace, clock_us=clock)

    def every_operation(n: int) -> None:
        assert limiter.acquire(TOKEN_BUCKET, "acme").remaining == 2 - n
        decision = limiter.acquire_many([(GCRA, "acme"), (CONCURRENCY, None)], acquisition_id="a")
        assert decision.allowed and decision.acquisition is not None
        assert limiter.settle(decision.acquisition, 0).status == "settled"
        assert limiter.peek(TOKEN_BUCKET, "acme").remaining == 2 - n
        limiter.hold(FIXED, "acme", 1.0)
        assert set(limiter.holds()) == {("fw", "acme")}
        limiter.unhold(FIXED, "acme")
        lot.park(b"x", 0.0)
        assert lot.commit(lot.claim(lead_s=0.0)) == 1
        assert lot.accept(f"token-{n}", "p")

    every_operation(0)
    for node in nodes:
        node.script_flush()
    # The clock stands still: the bucket goes on from its stored state (2 -> 1).
    every_operation(1)
    # Each script was reloaded on every master (redis-py's SCRIPT LOAD goes to all).
    routines = (*limiter._one.values(), *limiter._peek.values())
    shas = [s.sha for s in (*(r.script for r in routines), lot._park)]
    for node in nodes:
        assert node.script_exists(*shas) == [True] * len(shas)


def move_slot(
    slot: int, source: RedisServer, target: RedisServer, others: list[RedisServer]
) -> None:
    """Reshard one slot, as ``redis-cli --cluster reshard`` does: mark it migrating and
    importing, MIGRATE its keys, then give it to the target on every node."""
    src, dst = source.client(), target.client()
    try:
        src_id, dst_id = src.cluster("MYID"), dst.cluster("MYID")
        dst.cluster("SETSLOT", slot, "IMPORTING", src_id)
        src.cluster("SETSLOT", slot, "MIGRATING", dst_id)
        while keys := src.cluster("GETKEYSINSLOT", slot, 100):
            src.migrate("127.0.0.1", target.port, keys, 0, 5000)
        for server in (target, source, *others):
            node = server.client()
            node.cluster("SETSLOT", slot, "NODE", dst_id)
            node.close()
    finally:
        src.close()
        dst.close()


def test_a_namespace_moved_to_another_master_keeps_its_state(
    redis_cluster: LocalCluster, cluster_client: RedisCluster, namespace: str, clock: FakeClock
) -> None:
    limiter = Limiter(cluster_client, namespace=namespace, clock_us=clock)
    api = Limit.parse("10/s", name="api")
    assert limiter.acquire(api, "acme").remaining == about(9)
    recorded = limiter.acquire_many([(api, "acme"), (FIXED, "acme")], acquisition_id="t1")
    assert recorded.remaining == about(2) and recorded.acquisition is not None
    slot = tag_slot(cluster_client, namespace)
    by_port = {server.port: server for server in redis_cluster.nodes}
    source = by_port.pop(owner_port(cluster_client, limiter.keyspace.holds_key()))
    target, *others = by_port.values()

    move_slot(slot, source, target, others)
    with target.client() as node:
        node.script_flush()  # and the new master has never seen the scripts

    # The client still sends to the old master: MOVED, then NOSCRIPT on the new one.
    assert limiter.acquire(api, "acme").remaining == about(7)
    assert owner_port(cluster_client, limiter.keyspace.holds_key()) == target.port
    assert limiter.settle(recorded.acquisition, 0).status == "settled"
    assert limiter.peek(api, "acme").remaining == about(8)
    assert limiter.peek(FIXED, "acme").remaining == about(3)
    with source.client() as node:
        assert namespace_keys(node, namespace) == set()
        stats = node.info("commandstats")
    # The old master turned EVALSHA calls away: the redirection really happened.
    assert stats["cmdstat_evalsha"]["rejected_calls"] >= 1


def test_from_url_reads_a_cluster_url(redis_cluster: LocalCluster, namespace: str) -> None:
    for url in (redis_cluster.url, redis_cluster.url.split(",")[0]):  # all nodes, or one
        limiter = Limiter.from_url(url, namespace=namespace)
        assert isinstance(limiter.client, LazyCluster)  # reads the slot map on first use
        assert isinstance(limiter.client.built, RedisCluster)
        assert len(limiter.client.get_primaries()) == 3
        assert limiter.acquire(TOKEN_BUCKET, "acme").allowed
        limiter.client.close()


def test_an_acl_user_with_the_cluster_rules_uses_the_cluster(
    redis_cluster: LocalCluster, nodes: list[redis.Redis], namespace: str
) -> None:
    name = f"limiter-{uuid.uuid4().hex[:8]}"
    hosts = redis_cluster.url.partition("://")[2]
    url = f"redis+cluster://{name}:pw@{hosts}"
    try:
        # Given a user with the limiter's rules on every master, without the cluster's
        for node in nodes:
            node.execute_command("ACL", "SETUSER", name, "on", ">pw", *acl_rules().split())
        limiter = Limiter.from_url(url, namespace=namespace)
        # Then the cluster client cannot even read the slot map, and says what is missing
        with pytest.raises(BackendUnavailable, match=r"needs acl_rules\(cluster=True\)"):
            limiter.acquire(TOKEN_BUCKET, "acme")
        # and with acl_rules(cluster=True) it acquires, peeks and settles, every command
        # allowed (nothing in the masters' ACL logs for this user)
        for node in nodes:
            node.execute_command("ACL", "LOG", "RESET")
            node.execute_command(
                "ACL", "SETUSER", name, "reset", "on", ">pw", *acl_rules(cluster=True).split()
            )
        limiter = Limiter.from_url(url, namespace=namespace)
        decision = limiter.acquire(TOKEN_BUCKET, "acme", acquisition_id="t-acl")
        assert decision.allowed and decision.acquisition is not None
        limiter.settle(decision.acquisition, 0.0)
        assert limiter.peek(TOKEN_BUCKET, "acme").remaining == about(3)
        limiter.client.close()
        denied = [entry for node in nodes for entry in node.execute_command("ACL", "LOG")]
        assert not [e for e in denied if name.encode() in repr(e).encode()], denied
    finally:
        for node in nodes:
            node.execute_command("ACL", "DELUSER", name)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        pytest.param("redis+cluster://u:s3cret@127.0.0.1:7000/2", "only database 0", id="db"),
        pytest.param("redis+cluster://127.0.0.1", "'127.0.0.1' is not HOST:PORT", id="no-port"),
        pytest.param("redis+cluster://u:s3cret@h:1,h:x", "'h:x' is not HOST:PORT", id="bad-port"),
        pytest.param("rediss+cluster://", "'' is not HOST:PORT", id="no-node"),
    ],
)
def test_a_malformed_cluster_url_is_a_config_error(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as error:
        Limiter.from_url(url)
    assert "redis_url" in str(error.value)
    assert "s3cret" not in str(error.value)


def test_an_unusable_cluster_is_backend_unavailable(private_redis: RedisServer) -> None:
    # Built without a connection (as a single server's client); the first call fails.
    limiter = Limiter.from_url("redis+cluster://u:s3cret@127.0.0.1:1", socket_connect_timeout=1)
    with pytest.raises(BackendUnavailable, match=r"redis\+cluster://u:\*\*\*@127.0.0.1:1\b"):
        limiter.acquire(TOKEN_BUCKET)
    # A server without cluster mode is named as such.
    with pytest.raises(BackendUnavailable, match="Cluster mode is not enabled"):
        cluster_client(f"redis+cluster://127.0.0.1:{private_redis.port}")


@contextlib.contextmanager
def frozen(server: RedisServer) -> Iterator[None]:
    """``server`` stopped (SIGSTOP) inside the block: it accepts connections, answers none."""
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.process.send_signal(signal.SIGCONT)


@pytest.fixture
def one_master() -> Iterator[LocalCluster]:
    """A cluster of its own, to stop without disturbing the other tests' cluster."""
    with LocalCluster(masters=1) as cluster:
        yield cluster


def test_a_limiter_built_while_the_cluster_is_down_works_once_it_is_back(
    one_master: LocalCluster, namespace: str
) -> None:
    with frozen(one_master.nodes[0]):
        limiter = Limiter.from_url(
            one_master.url, namespace=namespace, socket_timeout=0.3, socket_connect_timeout=0.3
        )  # a pool child starting during the outage: nothing raised yet
        for _ in range(2):  # every call tries again, and fails, while it is down
            with pytest.raises(BackendUnavailable, match="cannot be used"):
                limiter.acquire(HOURLY, "acme")
    decision = limiter.acquire(HOURLY, "acme")  # back: the slot map is read now
    assert decision.allowed
    assert limiter.peek(HOURLY, "acme").remaining == about(2)  # the failed calls took none
    limiter.client.close()


@pytest.mark.parametrize(
    ("policy", "runs"),
    [("allow", True), ("local", True), ("defer", False)],
)
def test_a_worker_starting_while_the_cluster_is_down_applies_on_redis_down(
    one_master: LocalCluster, namespace: str, policy: str, runs: bool
) -> None:
    # Throttler.of builds the limiter in each pool child on its first task: during an
    # outage that must apply the limit's policy, not fail the task.
    app = Celery("cluster-down", set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        task_always_eager=True,
        throttle_redis_url=f"{one_master.url}?socket_timeout=0.3&socket_connect_timeout=0.3",
        throttle_config={
            "settings": {"namespace": namespace, "fleet_workers": 1},
            "limits": {"api": {"rate": "3/h", "on_redis_down": policy}},
        },
    )

    @app.task(shared=False)
    @throttled("api")
    def call(n: int) -> int:
        return n

    with frozen(one_master.nodes[0]):
        if runs:
            assert call.delay(1).get() == 1
        else:  # eager calls cannot be deferred: the outage is raised to the caller
            with pytest.raises(BackendUnavailable):
                call.delay(1).get()
    # The task's two calls failed: the process asks again PROBE_S later (outage.Breaker)
    time.sleep(outage.PROBE_S + 0.05)
    assert call.delay(2).get() == 2  # back: limited through the cluster again
    limiter = Throttler.of(app).limiter
    assert limiter.peek(dataclasses.replace(HOURLY, name="api")).remaining == about(2)
    limiter.client.close()


def test_an_eager_celery_task_is_throttled_through_the_cluster(
    redis_cluster: LocalCluster, namespace: str
) -> None:
    app = Celery("cluster", set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        task_always_eager=True,
        throttle_redis_url=redis_cluster.url,
        throttle_config={
            "settings": {"namespace": namespace},
            "limits": {
                "spaced": {"algorithm": "gcra", "rate": "10/s", "burst": 1},
                "budget": {"rate": "1000/d", "key": "{tenant}", "cost": "estimate"},
            },
        },
    )

    @app.task(shared=False)
    @throttled("spaced", "budget")
    def call(tenant: str, estimate: int) -> str:
        report_cost(1, limit="budget")
        return tenant

    node = redis_cluster.nodes[0].client()  # any node: Redis TIME, for the refill below
    redis_started = redis_now_s(node)
    started = time.monotonic()
    assert [call.delay("acme", 50).get() for _ in range(3)] == ["acme"] * 3
    assert time.monotonic() - started >= 0.19  # 100 ms apart: the limit held
    limiter = Throttler.of(app).limiter
    try:
        assert isinstance(limiter.client, LazyCluster)
        assert isinstance(limiter.client.built, RedisCluster)
        budget = Limit.parse("1000/d", name="budget")
        # Each call reserved 50 and settled at 1: 997, plus what 1000/d refilled meanwhile
        # on the Redis clock (0.01 in 0.86 s, which the three calls can take on a slow host)
        remaining = limiter.peek(budget, "acme").remaining
        refilled = (redis_now_s(node) - redis_started) * 1000 / 86400
        assert 997 - 0.01 <= remaining <= 997 + refilled + 0.01
    finally:
        limiter.client.close()
        node.close()


def test_stats_and_reset_on_the_cluster(cluster_client: RedisCluster, namespace: str) -> None:
    keyspace = KeySpace(namespace=namespace)
    minute = 29_000_000
    book = StatsBook(cluster_client, keyspace, clock=lambda: minute * 60.0 + 5)
    book.record_events(["tb", "gcra"], ("denied", "parked"), 3)  # one pipeline, one slot
    later = StatsBook(cluster_client, keyspace, clock=lambda: (minute + 1) * 60.0)
    counts = later.per_minute(1)
    assert counts["tb"]["denied"] == counts["gcra"]["parked"] == 3.0

    limiter = Limiter(cluster_client, namespace=namespace)
    for key in ("a", "b{c}"):
        assert limiter.acquire(TOKEN_BUCKET, key, cost=3).allowed
    hourly = Limit.parse("3/h", name="hourly", algorithm="gcra")
    assert limiter.acquire(hourly, "a").allowed
    assert reset(cluster_client, keyspace, "tb", "a") == 1
    assert reset(cluster_client, keyspace, "tb") == 1  # SCAN on every master: "b{c}"
    assert limiter.peek(TOKEN_BUCKET, "b{c}").remaining == about(3)
    assert limiter.peek(hourly, "a").remaining == about(2)  # another limit: untouched


def test_the_celery_throttle_command_on_the_cluster(
    redis_cluster: LocalCluster, cluster_client: RedisCluster, namespace: str, tmp_path: Path
) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(
        f"settings: {{namespace: {namespace}}}\nlimits:\n  api: {{rate: 1/h burst 5}}\n"
    )
    saved = cli_app.conf.get("throttle_config"), cli_app.conf.get("throttle_redis_url")
    cli_app.conf.throttle_config, cli_app.conf.throttle_redis_url = str(path), redis_cluster.url

    def run(*args: str) -> Result:
        obj = CLIContext(app=cli_app, no_color=True, workdir=None, quiet=False)
        result = CliRunner().invoke(throttle, list(args), obj=obj)
        assert result.exit_code == 0, result.output
        return result

    def drop_throttler() -> None:
        close_throttler(cli_app, forget=True)

    limiter = Limiter(cluster_client, namespace=namespace)
    api = Limit.parse("1/h burst 5", name="api")
    drop_throttler()
    try:
        assert limiter.acquire(api).allowed
        status = json.loads(run("status", "--json", "--timeout", "0").output)
        assert status["redis"].startswith("redis+cluster://127.0.0.1:")
        assert status["namespace"] == namespace
        [row] = [row for row in status["limits"] if row["name"] == "api"]
        assert row["tokens"] == about(4)
        run("pause", "api")
        assert limiter.holds() == {("api", None): math.inf}
        run("resume", "api")
        assert limiter.holds() == {}
        run("set", "api", "2/h")
        assert RateBook(cluster_client, limiter.keyspace).overrides() == {"api": "2/h"}
        run("reset", "api", "--yes")
        assert limiter.peek(api).remaining == about(5)
    finally:
        drop_throttler()
        cli_app.conf.throttle_config, cli_app.conf.throttle_redis_url = saved


@pytest.mark.parametrize("masters", [1, 2])
def test_small_clusters_form_and_serve_every_slot(masters: int, namespace: str) -> None:
    # Clusters of fewer than 3 masters are joined by hand (redis-cli asks for 3): each
    # master must learn the others' bus ports, or they never meet.
    with LocalCluster(masters=masters) as cluster:
        client = cluster.client()
        try:
            assert len(client.get_primaries()) == masters
            limiter = Limiter(client, namespace=namespace)
            assert limiter.acquire(HOURLY, "acme").allowed
        finally:
            client.close()
        for node in cluster.node_clients():
            info = node.cluster("INFO")
            node.close()
            assert info["cluster_state"] == "ok"
            assert int(info["cluster_slots_assigned"]) == 16384
            assert int(info["cluster_known_nodes"]) == masters


def test_a_plain_url_of_a_cluster_node_says_to_use_a_cluster_url(
    redis_cluster: LocalCluster,
) -> None:
    # Given a redis:// URL of each node in turn: the limiter's keys live on one of them
    limit = Limit.parse("10/s", name=f"moved-{uuid.uuid4().hex[:6]}")
    errors = []
    for node in redis_cluster.nodes:
        try:
            Limiter.from_url(node.url).acquire(limit)
        except BackendError as exc:
            errors.append(str(exc))
    # Then a node that does not hold them answers MOVED, which names the fix
    assert errors, "every node served the call"
    assert all("use a redis+cluster:// URL" in error for error in errors), errors


def test_an_evicting_policy_on_any_master_is_found_and_named(
    nodes: list[redis.Redis], namespace: str
) -> None:
    """redis-py sends ``INFO`` to one node (its default), not necessarily the master of the
    namespace's slot: every node is read, and the one that evicts is named."""
    limiter = Limiter.from_url(
        "redis+cluster://" + ",".join(
            f"127.0.0.1:{node.connection_pool.connection_kwargs['port']}" for node in nodes
        ),
        namespace=namespace,
    )  # fmt: skip
    try:
        assert eviction_policy(limiter.client) is None
        for node in nodes:  # each master in turn, the default node among them
            port = node.connection_pool.connection_kwargs["port"]
            node.config_set("maxmemory", "512mb")
            node.config_set("maxmemory-policy", "volatile-lru")
            try:
                assert eviction_policy(limiter.client) == f"volatile-lru on 127.0.0.1:{port}"
            finally:
                node.config_set("maxmemory-policy", "noeviction")
                node.config_set("maxmemory", "0")
        assert eviction_policy(limiter.client) is None
    finally:
        limiter.client.close()
