"""A client for test_clock.py, run under `faketime` so that its clock is off by seconds.

Usage: python -m tests.support.skewed_client URL PREFIX ACTION; prints one JSON line with the
local wall clock it saw and the decision.
"""

from __future__ import annotations

import json
import sys
import time

import redis

from throttle import Limit, Limiter

LIMIT = Limit.parse("2/m", name="skew")


def main() -> None:
    url, prefix, _action = sys.argv[1:4]
    limiter = Limiter(redis.Redis.from_url(url), prefix=prefix)
    decision = limiter.acquire(LIMIT, "tenant")
    print(
        json.dumps(
            {
                "local_time_s": time.time(),
                "allowed": decision.allowed,
                "remaining": decision.remaining,
                "retry_after_s": decision.retry_after_s,
            }
        )
    )


if __name__ == "__main__":
    main()
