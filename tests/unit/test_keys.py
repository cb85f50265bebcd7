"""Keys: one cluster slot per namespace, no collisions between distinct (limit, key)."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from throttle import ConfigError, KeySpace, Limit

TRICKY = [
    "a",
    "a:b",
    "a%3Ab",
    "{a}",
    "}{",
    "a b",
    "tenant-1",
    "tenant-1 ",
    "ünïcødé",
    "#abc",
    "x" * 100,
    "x" * 101,
    "x" * 10_000,
    "x" * 10_001,
    "\x00",
    "%",
]


def test_distinct_keys_never_share_a_redis_key() -> None:
    space = KeySpace()
    limits = [Limit.parse("1/s", name=name) for name in ("api", "api:x", "a", "{api}")]
    names = [space.state_keys(limit, key) for limit in limits for key in [None, *TRICKY]]
    assert len(set(names)) == len(names)


def test_every_key_of_a_namespace_shares_one_cluster_slot() -> None:
    space = KeySpace(prefix="throttle", namespace="github")
    limit = Limit.parse("1/s", name="api")
    slots = {key_slot(k.encode()) for key in [None, *TRICKY] for k in space.state_keys(limit, key)}
    slots.add(key_slot(space.lease_key("{evil}").encode()))
    conc = Limit.parse("3 concurrent", name="c")
    slots.update(key_slot(k.encode()) for k in space.state_keys(conc, "{x}"))
    assert slots == {key_slot(b"github")}


def test_long_values_are_bounded() -> None:
    key = KeySpace().state_keys(Limit.parse("1/s", name="api"), "y" * 1_000_000)[0]
    assert len(key) < 150


@pytest.mark.parametrize("bad", [{"prefix": ""}, {"namespace": "a{b"}, {"prefix": "x}"}])
def test_bad_prefix_or_namespace(bad: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="without braces"):
        KeySpace(**bad)
