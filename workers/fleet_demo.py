"""A fleet of processes sharing one rate limit in Redis: ``python -m workers.fleet_demo``.

What it shows:

* Several worker processes (each with its own Redis connection and :class:`Limiter`) share
  ONE limit, ``20/s burst 5`` by default, kept in Redis: no process knows about the others.
* GCRA reservation: ``acquire(limit, max_wait_s=...)`` does not make workers poll. It takes
  the next free slot at once and says how long to sleep until it (``decision.wait_s``), so
  the fleet calls at exactly the rate, spaced evenly, with no retry storm.
* The result as the rate-limited upstream sees it: every call is a real HTTP request to the
  mock API of ``workers/mock_api.py``, which enforces its own limit on arrival times and
  answers 429 to a call that breaks it. The upstream allows the fleet's rate with one call of
  headroom in its burst: a saturated fleet runs exactly at the limit's edge, and a few ms of
  scheduling jitter must not count as a violation (production limits keep the same margin).
  Call times are also read from the Redis clock and checked (count bound, GCRA conformance,
  calls per second).

Redis: the server named by ``THROTTLE_REDIS_URL`` if set (the demo only writes keys under a
fresh prefix, which expire by themselves, and never flushes anything), else a private
``redis-server`` started for the run and stopped at the end.
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue

import redis

from tests.support.servers import RedisServer, redis_url_from_env
from throttle import ConfigError, Limit, Limiter
from workers.mock_api import MockApi, serve

JITTER_S = 0.010
"""Scheduling jitter forgiven by the checks (see :func:`count_violations`)."""
START_DELAY_S = 1.5
"""How far ahead of "now" the common start is: time for every process to spawn."""


@dataclass(frozen=True)
class FleetPlan:
    """What every worker is told: where the limit lives, which limit, and when to run."""

    url: str
    api_port: int
    """The mock upstream API, on 127.0.0.1."""
    prefix: str
    limit: Limit
    max_wait_s: float
    start_at: float
    """Redis-clock time (s) at which the workers start, together."""
    end_at: float
    """Redis-clock time (s) after which they make no new acquisition."""


@dataclass
class WorkerReport:
    """What one worker sends back to the parent."""

    index: int
    pid: int
    calls: list[float] = field(default_factory=list)
    """Redis-clock times (s) at which the worker made its calls."""
    waited_s: float = 0.0
    """Total time spent sleeping until reserved slots."""
    denied: int = 0
    rejected: int = 0
    """Calls the upstream answered with 429."""
    error: str | None = None


def redis_now(client: redis.Redis) -> float:
    """The Redis server clock in seconds: the one clock every process agrees on."""
    seconds, micros = client.time()
    return seconds + micros / 1e6


def worker(index: int, plan: FleetPlan, results: Queue[WorkerReport]) -> None:
    """Call the "upstream API" as often as the shared limit allows between two Redis times."""
    report = WorkerReport(index, os.getpid())
    try:
        # Connections must not cross a process boundary: each process opens its own.
        client = redis.Redis.from_url(plan.url)
        limiter = Limiter(client, prefix=plan.prefix)
        api = http.client.HTTPConnection("127.0.0.1", plan.api_port, timeout=10)
        time.sleep(max(0.0, plan.start_at - redis_now(client)))
        while redis_now(client) < plan.end_at:
            decision = limiter.acquire(plan.limit, max_wait_s=plan.max_wait_s)
            if not decision:
                # Even a reservation would wait longer than max_wait_s: come back later.
                report.denied += 1
                time.sleep(decision.retry_after_s)
                continue
            # The slot is ours (the token is already taken): sleep until it comes.
            time.sleep(decision.wait_s)
            report.waited_s += decision.wait_s
            # The call to the upstream, and when it left (on the Redis clock).
            report.calls.append(redis_now(client))
            api.request("GET", "/call", headers={"X-Task-Id": f"{index}-{len(report.calls)}"})
            response = api.getresponse()
            response.read()
            report.rejected += response.status == 429
        api.close()
        client.close()
    except Exception:
        report.error = traceback.format_exc()
    results.put(report)


def collect(
    processes: list[BaseProcess], results: Queue[WorkerReport], timeout_s: float
) -> tuple[list[WorkerReport], list[str]]:
    """Wait for every worker's report; a worker that dies without one is an error."""
    reports: dict[int, WorkerReport] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(reports) + len(errors) < len(processes):
        try:
            report = results.get(timeout=0.5)
        except queue.Empty:
            for index, process in enumerate(processes):
                if index not in reports and process.exitcode not in (None, 0):
                    errors[index] = f"worker {index} died with exit code {process.exitcode}"
            if time.monotonic() > deadline:
                errors[-1] = f"workers did not report within {timeout_s:.0f} s"
                break
            continue
        if report.error is None:
            reports[report.index] = report
        else:
            errors[report.index] = f"worker {report.index} failed:\n{report.error}"
    return sorted(reports.values(), key=lambda r: r.index), list(errors.values())


def count_violations(times: list[float], limit: Limit, jitter_s: float = JITTER_S) -> int:
    """How many of the sorted call ``times`` a GCRA upstream with this limit would reject.

    Virtual scheduling: a call at t conforms when max(TAT, t) + T - t <= burst * T, with
    emission interval T = 1 / rate, and then moves TAT (the theoretical arrival time) to
    max(TAT, t) + T. A saturated fleet runs exactly at that edge, so the check allows
    ``jitter_s`` more: a call time is read after the process wakes from its sleep, late by
    a different amount in each process (scheduling, the TIME round trip), and a call
    recorded later than its successor makes that successor look early by the difference.
    Typically that is about 1 ms; 10 ms covers a loaded machine (6.5 ms seen on 2 busy CPUs).
    A real API sees network jitter of the same kind, which is why production limits keep a
    little margin below the upstream's.
    """
    interval = 1.0 / limit.rate_per_s
    tolerance = limit.capacity * interval + jitter_s
    tat = float("-inf")
    violations = 0
    for t in times:
        start = max(tat, t)
        if start + interval - t <= tolerance:
            tat = start + interval
        else:
            violations += 1  # rejected: a rejected call does not move TAT
    return violations


def print_histogram(times: list[float], rate: float) -> None:
    """Calls per second of the run (from the first call), as an ASCII bar chart."""
    first, last = times[0], times[-1]
    counts = [0] * (int(last - first) + 1)
    for t in times:
        counts[int(t - first)] += 1
    scale = max(1.0, max(counts) / 50)  # keep bars within 50 characters
    print(f"\ncalls per second (Redis clock, from the first call; limit {rate:g}/s):")
    for second, count in enumerate(counts):
        partial = "  (partial second)" if second == len(counts) - 1 else ""
        print(f"  {second:3d} s {count:5d} {'#' * round(count / scale)}{partial}")


def run(args: argparse.Namespace, limit: Limit, url: str, where: str) -> int:
    """Run the fleet against the Redis at ``url`` (described as ``where``); the exit status."""
    prefix = f"throttle-demo-{uuid.uuid4().hex[:12]}"  # keys of this run only
    client = redis.Redis.from_url(url)
    # A common start on the Redis clock, a moment ahead: the fleet begins together without
    # a handshake between processes (a late process simply joins late).
    start_at = redis_now(client) + START_DELAY_S
    client.close()
    # The upstream: the same rate, one call more of burst (see the module docstring).
    upstream = MockApi(limit.rate_per_s, limit.capacity + 1)
    server = serve(upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    api_port = server.server_address[1]
    plan = FleetPlan(url, api_port, prefix, limit, args.max_wait, start_at, start_at + args.seconds)

    print(f"upstream: mock API on 127.0.0.1:{api_port}, {limit.rate_per_s:g}/s burst "
          f"{limit.capacity + 1:g}, judging each call by its arrival time")  # fmt: skip
    print(f"limit:    {limit.name} = {args.rate} ({limit.algorithm.value}), shared by all")
    print(f"workers:  {args.workers} (processes), {args.seconds:g} s each")
    print(f"reserve:  max_wait_s={args.max_wait:g} (slots up to that far ahead, else denied)")
    print(f"redis:    {where}, keys prefixed {prefix}")

    context = mp.get_context("spawn")
    results: Queue[WorkerReport] = context.Queue()
    processes: list[BaseProcess] = [
        context.Process(
            target=worker,
            args=(i, plan, results),
            name=f"fleet-worker-{i}",
        )
        for i in range(args.workers)
    ]
    for process in processes:
        process.start()
    # Results come before join: a process does not exit until its queued data is read.
    reports, errors = collect(processes, results, START_DELAY_S + args.seconds + 30)
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.terminate()
    api_stats = upstream.stats()
    server.shutdown()
    server.server_close()
    if errors:
        print("\nFAILED:", *errors, sep="\n", file=sys.stderr)
        return 1

    print(f"\n{'worker':>6} {'pid':>8} {'calls':>6} {'denied':>7} {'avg wait':>9}")
    for r in reports:
        avg_wait_ms = 1000 * r.waited_s / max(len(r.calls), 1)
        print(f"{r.index:6d} {r.pid:8d} {len(r.calls):6d} {r.denied:7d} {avg_wait_ms:6.0f} ms")

    times = sorted(t for r in reports for t in r.calls)
    if len(times) < 2:
        print("\nFAILED: fewer than two calls were made", file=sys.stderr)
        return 1
    total = len(times)
    rate, burst = limit.rate_per_s, limit.capacity
    elapsed = times[-1] - times[0]
    bound = burst + rate * elapsed
    violations = count_violations(times, limit)
    print(f"\ntotal calls:    {total}")
    print(f"elapsed:        {elapsed:.3f} s (first to last call, Redis clock)")
    print(f"bound:          {bound:.1f} = burst {burst:g} + {rate:g}/s x {elapsed:.3f} s")
    # Of the most the limit allows over the run: 100% means the fleet used every slot.
    print(f"utilization:    {total / bound:.1%} of the bound")
    print(
        f"GCRA check:     {violations} of {total} calls too early for the upstream "
        f"(T = {1000 / rate:g} ms, tolerance {burst:g} T + {1000 * JITTER_S:g} ms jitter)"
    )
    rejected = sum(r.rejected for r in reports)
    print(
        f"upstream:       {api_stats['calls']} calls arrived, {api_stats['violations']} "
        f"answered 429 (the workers counted {rejected})"
    )
    print_histogram(times, rate)

    # The same jitter allowance as the GCRA check: the bound is tight at saturation.
    if total > burst + rate * (elapsed + JITTER_S) or violations or api_stats["violations"]:
        print(f"\nFAILED: the fleet exceeded {args.rate}", file=sys.stderr)
        return 1
    print(f"\nOK: {args.workers} processes made {total} calls and stayed within {args.rate}.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A fleet of processes sharing one limit.")
    parser.add_argument("--workers", type=int, default=6, help="processes (default 6)")
    parser.add_argument("--seconds", type=float, default=6.0, help="run time (default 6)")
    parser.add_argument("--rate", default="20/s burst 5", help='limit (default "20/s burst 5")')
    # Only these two can reserve a slot; windows and concurrency admit now or deny.
    parser.add_argument("--algorithm", default="gcra", choices=["gcra", "token_bucket"])
    parser.add_argument(
        "--max-wait", type=float, default=2.0, help="longest reservation, s (default 2)"
    )
    args = parser.parse_args(argv)
    if args.workers < 1 or args.seconds <= 0 or args.max_wait < 0:
        parser.error("--workers must be >= 1, --seconds > 0 and --max-wait >= 0")
    try:
        limit = Limit.parse(args.rate, name="upstream-api", algorithm=args.algorithm)
    except ConfigError as exc:
        parser.error(str(exc))

    url = redis_url_from_env()
    try:
        if url is not None:
            # Not printed: the URL may hold a password.
            return run(args, limit, url, "THROTTLE_REDIS_URL")
        with RedisServer() as server:
            return run(args, limit, server.url, f"private redis-server on port {server.port}")
    except (OSError, RuntimeError, redis.RedisError) as exc:
        # No redis-server on PATH, or it did not start, or the user's Redis is unreachable.
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
