"""Whether the limiter's Redis may evict keys when it runs out of memory.

Every key of the limiter is state that must not vanish: a limit's state read as new
admits a whole burst, a lease read as gone lets a redelivered task pay again, and a
parked task that is evicted is lost (its message was acknowledged when it was parked).
Redis evicts only with a ``maxmemory`` set and a ``maxmemory-policy`` other than
``noeviction``; ``volatile-*`` policies evict keys with a time to live, which most of the
limiter's keys have. Managed Redis services often default to an evicting policy.
:func:`eviction_policy` reads it (``INFO memory``: one round trip; on a Redis Cluster,
every node's, since a namespace may live on any master, and a replica may become one) so
that a worker warns at start and ``celery throttle status`` shows it.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import NoPermissionError

from throttle.redis.urls import LazyCluster

logger = logging.getLogger("throttle")

SAFE_POLICY = "noeviction"


def eviction_policy(client: Any) -> str | None:
    """The ``maxmemory-policy`` of the Redis behind ``client`` when it may evict keys (a
    ``maxmemory`` set and a policy other than ``noeviction``), else None; None as well
    when it cannot be told (a user without ``INFO``, an error: logged at DEBUG), since a
    check must not stop a worker. On a Redis Cluster every node is read (redis-py would
    ask one node, not necessarily the namespace's master): the first node that evicts,
    as ``POLICY on HOST:PORT``."""
    cluster = isinstance(client, (RedisCluster, LazyCluster))
    try:
        if cluster:
            nodes = client.info("memory", target_nodes=RedisCluster.ALL_NODES)
        else:
            nodes = {"": client.info("memory")}
    except NoPermissionError:  # a least-privilege user (acl_rules): no INFO, by design
        logger.debug("throttle: the limiter's Redis user may not run INFO: its "
                     "maxmemory-policy goes unchecked")  # fmt: skip
        return None
    except Exception as exc:  # Redis away
        logger.debug("throttle: cannot read the Redis memory policy: %s", exc)
        return None
    if not isinstance(nodes, dict):
        return None
    for node, info in sorted(nodes.items()):
        policy = _evicting(info)
        if policy is not None:
            return f"{policy} on {node}" if cluster else policy
    return None


def _evicting(info: Any) -> str | None:
    if not isinstance(info, dict):
        return None
    policy = info.get("maxmemory_policy")
    maxmemory = info.get("maxmemory")
    if not isinstance(policy, str) or not isinstance(maxmemory, int):
        return None
    return policy if maxmemory > 0 and policy != SAFE_POLICY else None


def eviction_warning(policy: str) -> str:
    """What a worker logs at start for a Redis that evicts under ``policy``."""
    return (
        f"the limiter's Redis evicts keys when it is full (maxmemory-policy {policy}): a "
        f"limit's state, a lease or a parked task can vanish without a trace (a whole "
        f"burst admitted again, a parked task lost); set maxmemory-policy {SAFE_POLICY} "
        f"on it, or give it no maxmemory"
    )
