"""The connection pool of a client built from a URL: redis-py's default of 100 connections
refuses beyond ("Too many connections", which reads as Redis unreachable), and a gevent or
threads pool of 100 slots reaches it with the worker's own calls. One server's and
Sentinel's master's pools hold 1,000, unless the URL says otherwise. No connection is
opened to build them."""

from __future__ import annotations

import pytest

from throttle.redis.client import (
    DEFAULT_MAX_CONNECTIONS,
    async_client_from_url,
    client_from_url,
)


@pytest.mark.parametrize("build", [client_from_url, async_client_from_url])
@pytest.mark.parametrize(
    ("url", "size"),
    [
        ("redis://127.0.0.1:1/0", DEFAULT_MAX_CONNECTIONS),
        ("redis+sentinel://127.0.0.1:1/mymaster/0", DEFAULT_MAX_CONNECTIONS),
        ("redis://127.0.0.1:1/0?max_connections=7", 7),
    ],
)
def test_a_client_from_a_url_holds_up_to_a_thousand_connections(
    build: object, url: str, size: int
) -> None:
    client = build(url)  # type: ignore[operator]
    assert DEFAULT_MAX_CONNECTIONS == 1000
    assert client.connection_pool.max_connections == size
