"""Operator actions on a limit's state in Redis that the limiter does not offer: a reset.

What ``celery throttle reset`` runs. The keys come from :class:`throttle.redis.keys.KeySpace`
(the one place that names them); every key of a limit is found with ``SCAN`` on its key
pattern, never ``KEYS``, which blocks Redis for as long as it walks the whole keyspace.
"""

from __future__ import annotations

from throttle.redis.client import RedisClient, wrap_errors
from throttle.redis.keys import KeySpace
from throttle.spec import PLAN_SUFFIX, SHADOW_SUFFIX, Algorithm, Limit

__all__ = ["reset"]

_SCAN_COUNT = 1000
"""Keys asked for per SCAN call: few round trips, each short enough not to stall Redis."""


def _probes(name: str) -> list[Limit]:
    """A stand-in limit of this name for every algorithm. The state of a limit lives under
    its algorithm's code, and a limit whose algorithm was changed in the file leaves the
    old algorithm's state behind: a reset deletes the state under every code. And the state
    of the limit's plan (its twin ``NAME.plan``, see :mod:`throttle.celery.plan`): a plan
    left behind would make the key's next tasks come back as late as the forgotten backlog.
    And of its shadow twin (``NAME.shadow``, :mod:`throttle.celery.shadow`)."""
    names = (name, name + PLAN_SUFFIX, name + SHADOW_SUFFIX)
    probes = [Limit(n, algorithm, 1.0) for n in names for algorithm in Algorithm]
    fair = [Limit(n, Algorithm.TOKEN_BUCKET, 1.0, fair=True) for n in (name, name + SHADOW_SUFFIX)]
    return [*probes, *fair]


def reset(client: RedisClient, keyspace: KeySpace, limit: str, key: str | None = None) -> int:
    """Delete the state of limit ``limit`` (its tokens, timestamps, window counts and
    concurrency holders, its plan) for ``key``, or for every key when ``key`` is None. Returns how
    many Redis keys were deleted.

    The limit starts afresh, full. Holds and pauses (``celery throttle pause``) and rates
    set at run time are not state and stay. Acquisitions recorded before the reset keep
    their lease records: a task that already reserved a slot still runs at it, so right
    after a reset a limit can admit up to its burst on top of the slots reserved before.
    """
    if key is not None:
        # A fair limit's key: its own schedule only (the shared total and the active keys
        # are every key's).
        names = [
            name
            for probe in _probes(limit)
            for name in keyspace.state_keys(probe, key)[: 1 if probe.fair else None]
        ]
        deleted: int = wrap_errors(lambda: client.delete(*names))
        return deleted
    patterns = [keyspace.state_pattern(probe) for probe in _probes(limit)]

    def scan_and_delete() -> int:
        count = 0
        for pattern in patterns:
            batch: list[bytes] = []
            for name in client.scan_iter(match=pattern, count=_SCAN_COUNT):
                batch.append(name)
                if len(batch) >= _SCAN_COUNT:
                    count += int(client.delete(*batch))
                    batch = []
            if batch:
                count += int(client.delete(*batch))
        return count

    total: int = wrap_errors(scan_and_delete)
    return total
