"""Fixtures: real Redis servers only, started here on free loopback ports.

Tests use the server in ``THROTTLE_REDIS_URL`` when it is set, otherwise a private
``redis-server``; every test works under its own key prefix and deletes only its own keys,
so a user's Redis is never flushed. Tests that must disrupt the server (SCRIPT FLUSH) ask
for ``private_redis`` and always get a server of their own. ``redis_cluster`` is always a
private Redis Cluster of three masters (tests flush its scripts and move its slots).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis
from hypothesis import settings
from redis.cluster import RedisCluster

from tests.support.clock import FakeClock
from tests.support.cluster import LocalCluster
from tests.support.servers import RedisServer, TlsFiles
from throttle import Limiter

# Deterministic in CI; `HYPOTHESIS_PROFILE=explore` searches with fresh random examples.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True, max_examples=200)
settings.register_profile("explore", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def private_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    url = os.environ.get("THROTTLE_REDIS_URL")
    if url:
        return url
    server: RedisServer = request.getfixturevalue("private_redis")
    return server.url


@pytest.fixture
def prefix(client: redis.Redis) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:12]}"
    yield name
    # Remove only this test's keys (they would also expire on their own).
    keys = list(client.scan_iter(match=f"{name}:*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture(scope="session")
def client(redis_url: str) -> Iterator[redis.Redis]:
    """One connection pool for the session; tests keep apart by key prefix."""
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture
def limiter(client: redis.Redis, prefix: str) -> Limiter:
    return Limiter(client, prefix=prefix)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def clocked(client: redis.Redis, prefix: str, clock: FakeClock) -> Limiter:
    """A limiter on the test clock: the scripts use ``clock`` instead of Redis TIME."""
    return Limiter(client, prefix=prefix, clock_us=clock)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A test CA with a server certificate for 127.0.0.1 and a client certificate."""
    return TlsFiles.generate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A Redis Cluster of three masters, no replicas, on free loopback ports, created with
    ``redis-cli --cluster create`` and ready (``cluster_state:ok`` on every node); stopped,
    with its nodes.conf files, after the session. About 2 s to start."""
    with LocalCluster(masters=3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster_client(redis_cluster: LocalCluster) -> Iterator[RedisCluster]:
    """One redis-py cluster client for the session; tests keep apart by namespace."""
    connection = redis_cluster.client()
    yield connection
    connection.close()
