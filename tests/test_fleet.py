"""Eight processes hammer one key: never more than capacity + rate x elapsed, nor much less.

Elapsed time is read from the Redis clock, the same clock the scripts use.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid

import pytest
import redis

from throttle import Limit, Limiter

PROCESSES = 8
RUN_S = 3.0


def _redis_now_s(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


def _hammer(
    url: str, prefix: str, specs: list[tuple[str, str]], start_at: float, out: object
) -> None:
    client = redis.Redis.from_url(url)
    limiter = Limiter(client, prefix=prefix)
    targets = [
        (Limit.parse(spec, name=f"l{i}", algorithm=algo), None)
        for i, (spec, algo) in enumerate(specs)
    ]
    while _redis_now_s(client) < start_at:
        time.sleep(0.001)
    began = _redis_now_s(client)
    admitted = calls = 0
    while True:
        admitted += limiter.acquire_many(targets).allowed
        calls += 1
        if calls % 16 == 0 and _redis_now_s(client) >= start_at + RUN_S:
            break
    ended = _redis_now_s(client)
    out.put((admitted, calls, began, ended))  # type: ignore[attr-defined]
    client.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "specs",
    [
        [("300/s burst 30", "token_bucket")],
        [("300/s burst 30", "gcra")],
        # Three limits at once: the tightest (the token bucket) decides.
        [("300/s burst 30", "token_bucket"), ("1000/s", "gcra"), ("100000/d", "fixed_window")],
    ],
    ids=["token_bucket", "gcra", "three-limits"],
)
def test_fleet_admits_exactly_the_rate(
    redis_url: str, client: redis.Redis, specs: list[tuple[str, str]]
) -> None:
    prefix = f"fleet-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    start_at = _redis_now_s(client) + 2.0  # time for every process to start
    workers = [
        context.Process(target=_hammer, args=(redis_url, prefix, specs, start_at, out))
        for _ in range(PROCESSES)
    ]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    admitted = sum(r[0] for r in results)
    calls = sum(r[1] for r in results)
    elapsed = max(r[3] for r in results) - min(r[2] for r in results)
    bound = 30 + 300 * elapsed
    assert calls > admitted * 2, "the processes did not contend for the limit"
    assert admitted <= bound
    assert admitted >= 0.97 * bound, (admitted, bound, elapsed)
    print(f"admitted {admitted} of bound {bound:.1f} ({admitted / bound:.2%}), {calls} calls")
    for key in client.scan_iter(match=f"{prefix}:*"):
        client.delete(key)
