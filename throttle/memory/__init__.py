"""The scripts of ``lua/`` in Python: the in-memory limiter of eager tests."""

from throttle.memory.server import (
    Concurrency,
    Fair,
    FixedWindow,
    Gcra,
    MemoryLimiter,
    MemoryRedis,
    ModelLimiter,
    Params,
    Record,
    SlidingWindow,
    TokenBucket,
    adapt,
    ceil_us,
)

__all__ = [
    "Concurrency",
    "Fair",
    "FixedWindow",
    "Gcra",
    "MemoryLimiter",
    "MemoryRedis",
    "ModelLimiter",
    "Params",
    "Record",
    "SlidingWindow",
    "TokenBucket",
    "adapt",
    "ceil_us",
]
