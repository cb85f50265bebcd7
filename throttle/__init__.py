"""celery-throttled: fleet-wide rate limits for Celery tasks, enforced in Redis.

The limiter core (this package): atomic Lua scripts for token bucket, GCRA (leaky bucket
shaping with slot reservation), sliding and fixed windows and concurrency limits, against the
Redis clock, with multi-limit all-or-nothing acquisition and cost settle (refund or charge).
The Celery integration is :mod:`throttle.celery` (``@throttled``, ``ThrottledTask``,
``install``); limits files are read by :mod:`throttle.config`.
"""

from throttle.decision import Acquisition, Decision, LimitState, Settlement
from throttle.errors import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    CostExceedsCapacity,
    RequestError,
    Throttled,
    ThrottleError,
    ThrottleTimeout,
    UpstreamFinal,
    throttled_in,
)
from throttle.limiter import DEFAULT_LEASE_S, Acquire, Limiter
from throttle.redis.keys import KeySpace
from throttle.spec import Algorithm, Limit

__all__ = [
    "DEFAULT_LEASE_S",
    "Acquire",
    "Acquisition",
    "Algorithm",
    "BackendError",
    "BackendUnavailable",
    "ConfigError",
    "CostExceedsCapacity",
    "Decision",
    "KeySpace",
    "Limit",
    "LimitState",
    "Limiter",
    "RequestError",
    "Settlement",
    "ThrottleError",
    "ThrottleTimeout",
    "Throttled",
    "UpstreamFinal",
    "throttled_in",
]
