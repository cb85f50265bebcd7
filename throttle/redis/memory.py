"""Whether the limiter's Redis may evict keys when it runs out of memory.

Every key of the limiter is state that must not vanish: a limit's state read as new
admits a whole burst, a lease read as gone lets a redelivered task pay again, and a
parked task that is evicted is lost (its message was acknowledged when it was parked).
Redis evicts only with a ``maxmemory`` set and a ``maxmemory-policy`` other than
``noeviction``; ``volatile-*`` policies evict keys with a time to live, which most of the
limiter's keys have. Managed Redis services often default to an evicting policy.
:func:`eviction_policy` reads it (``INFO memory``: one round trip) so that a worker warns
at start and ``celery throttle status`` shows it.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("throttle")

SAFE_POLICY = "noeviction"


def eviction_policy(client: Any) -> str | None:
    """The ``maxmemory-policy`` of the Redis behind ``client`` when it may evict keys (a
    ``maxmemory`` set and a policy other than ``noeviction``), else None; None as well
    when it cannot be told (a user without ``INFO``, a Redis Cluster client, an error:
    logged at DEBUG), since a check must not stop a worker."""
    try:
        info = client.info("memory")
    except Exception as exc:  # NOPERM, a cluster's per-node replies, Redis away
        logger.debug("throttle: cannot read the Redis memory policy: %s", exc)
        return None
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
