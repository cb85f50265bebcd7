"""The reference models of the Lua scripts: moved into the package, :mod:`throttle.memory`,
where they are the in-memory limiter of users' eager tests (:mod:`throttle.testing`).
Re-exported here for the property tests and the tools that import them from here."""

from __future__ import annotations

from throttle.memory import (
    Concurrency,
    FixedWindow,
    Gcra,
    ModelLimiter,
    Params,
    Record,
    SlidingWindow,
    TokenBucket,
    ceil_us,
)

__all__ = [
    "Concurrency",
    "FixedWindow",
    "Gcra",
    "ModelLimiter",
    "Params",
    "Record",
    "SlidingWindow",
    "TokenBucket",
    "ceil_us",
]
