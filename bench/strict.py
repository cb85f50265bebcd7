"""A strict upstream (burst 1), the upstream hook on, the limit at 98 %: spacing guard off vs on.

``python -m bench.strict [--tasks 300] [--workers 2] [--children 4] [--rounds 1] [--percent 98]``

What runs
---------
For each variant, one after the other (``--rounds`` times, alternating), on fresh pieces
started here: a private broker ``redis-server`` and a separate one for the limiter (so that
its INFO commandstats count the throttler's script calls alone), the mock API of
``workers/mock_api.py`` at **20 calls/s burst 1** (one call every 50 ms, judged on arrival,
429 with ``Retry-After`` otherwise), and ``--workers`` ``celery worker`` x ``--children``
prefork children of ``tests/apps/upstream_app.py``: task ``fetch`` calls the API through
requests with ``upstream_hook(retry=True)`` (a 429 holds the limit fleet-wide and the task
runs again), throttled by a GCRA limit of **19.6/s burst 1** (98 % of the API;
``--percent 95,98`` runs each of those too) with ``spacing_guard: false`` or ``true``. The
whole backlog is sent at once.

What is measured
----------------
* refused: the API's 429s, as a share of all calls; and those after the first second
  (in it, each pool child makes its first call, on a new connection: a few ms slower,
  so the next call, on a kept-alive one, lands that much closer);
* rate: allowed calls per second over the span from the first to the last arrival, as a
  share of the API's 20/s;
* completed tasks (SUCCESS) and the time to drain the backlog (the states of the others
  are printed);
* script calls per completed task on the limiter's Redis (INFO commandstats, FCALL, EVALSHA and
  EVAL): the guard's cost is one more round trip per call.

Targets (issue 12): <= 0.5 % refused, >= 95 % of the API's rate.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.support.servers import RedisServer
from workers.harness import Worker, running, start_api

API_RATE = 20.0
CONFIG = """
settings: {{prefix: "strict-{guard}"}}
limits:
  api: {{algorithm: gcra, rate: {rate:g}/s, burst: 1, spacing_guard: {guard}}}
  solo: {{algorithm: gcra, rate: 19.6/s, burst: 1}}
  hurry: {{rate: 5/s, key: "{{account}}", max_wait: 2s}}
  learn: {{algorithm: gcra, rate: 19.6/s, burst: 1, adaptive: true, floor: 2/s}}
"""


def script_calls(server: RedisServer) -> int:
    client = server.client()
    try:
        stats: dict[str, Any] = client.info("commandstats")
    finally:
        client.close()
    names = ("fcall", "evalsha", "eval")  # the limiter's functions, or its scripts
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in names)


def run_variant(
    guard: bool, tasks: int, workers: int, children: int, tmp: Path,
    broker: RedisServer, limiter: RedisServer, app: Any, fetch: Any, percent: float = 98.0,
) -> dict[str, Any]:  # fmt: skip
    """One fleet of its own (its own prefix in the limiter's Redis, its own API)."""
    config = tmp / f"strict-{guard}.yaml"
    rate = round(API_RATE * percent / 100, 3)
    config.write_text(CONFIG.format(guard=str(guard).lower(), rate=rate))
    api = start_api(API_RATE, 1.0)
    env = {
        "UPSTREAM_BROKER_URL": broker.url,
        "THROTTLE_REDIS_URL": limiter.url,
        "THROTTLE_CONFIG": str(config),
        "MOCK_API_URL": api.url,
    }
    fleet = [
        Worker(f"strict{i}", env, concurrency=children, app="tests.apps.upstream_app",
               log=tmp / f"strict-{guard}-{i}.log")
        for i in range(1, workers + 1)
    ]  # fmt: skip
    try:
        with running(app, fleet, kill=True):
            fetch.delay(-1).get(timeout=60)  # the scripts loaded
            time.sleep(1.0)
            api.api.reset()
            before = script_calls(limiter)
            started = time.monotonic()
            sent = [fetch.delay(n) for n in range(tasks)]
            deadline = started + 60 + 3 * tasks / API_RATE
            while time.monotonic() < deadline and not all(r.ready() for r in sent):
                time.sleep(0.2)
            drained_s = time.monotonic() - started
            completed = sum(r.successful() for r in sent)
            others = collections.Counter(r.state for r in sent if not r.successful())
            calls_made = script_calls(limiter) - before
        broker.client().flushall()  # the next variant starts from an empty queue
    finally:
        api.stop()
    arrivals = api.api.arrivals_json()
    allowed = [a["at_s"] for a in arrivals if a["allowed"]]
    span = (arrivals[-1]["at_s"] - arrivals[0]["at_s"]) if len(arrivals) > 1 else 0.0
    warm = [a for a in arrivals if a["at_s"] >= arrivals[0]["at_s"] + 1.0] if arrivals else []
    if others:
        print(f"not completed: {dict(others)}", flush=True)
    return {
        "variant": ("guard on" if guard else "guard off") + f", limit {percent:g} %",
        "calls": len(arrivals),
        "refused": len(arrivals) - len(allowed),
        "refused_pct": 100.0 * (len(arrivals) - len(allowed)) / max(len(arrivals), 1),
        "refused_after_1s": sum(not a["allowed"] for a in warm),
        "refused_after_1s_pct": 100.0 * sum(not a["allowed"] for a in warm) / max(len(warm), 1),
        "rate_pct": 100.0 * (len(allowed) - 1) / span / API_RATE if span else 0.0,
        "completed": completed,
        "tasks": tasks,
        "drained_s": drained_s,
        "scripts_per_task": calls_made / max(completed, 1),
        "load": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--percent", default="98", help="the limit as % of the API's rate; a list: 95,98"
    )
    args = parser.parse_args(argv)
    percents = [float(p) for p in args.percent.split(",")]
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="strict-", dir="/tmp") as tmp,
        RedisServer() as broker,
        RedisServer() as limiter,
    ):
        os.environ["UPSTREAM_BROKER_URL"] = broker.url  # this process's producer
        from tests.apps.upstream_app import app, fetch  # noqa: PLC0415

        app.conf.broker_url = app.conf.result_backend = broker.url
        for _ in range(args.rounds):
            for percent in percents:
                for guard in (False, True):
                    row = run_variant(
                        guard, args.tasks, args.workers, args.children, Path(tmp),
                        broker, limiter, app, fetch, percent,
                    )  # fmt: skip
                    print(row, flush=True)
                    rows.append(row)
    load = os.getloadavg()[0]
    print(f"\n{args.workers} workers x {args.children} children, {args.tasks} tasks, "
          f"a GCRA limit of burst 1 at a 20/s burst-1 API, upstream_hook(retry=True); "
          f"load average {load:.1f}\n")  # fmt: skip
    print("| variant | calls | refused | refused % | after the first s | rate, % of the API's "
          "| completed | drained in | scripts per task | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['calls']} | {r['refused']} | {r['refused_pct']:.1f} % "
              f"| {r['refused_after_1s']} ({r['refused_after_1s_pct']:.1f} %) "
              f"| {r['rate_pct']:.1f} % | {r['completed']}/{r['tasks']} | {r['drained_s']:.1f} s "
              f"| {r['scripts_per_task']:.2f} | {r['load']:.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
