"""``make demo``: a Celery fleet calls a rate-capped API through the throttler.

It runs the services of docker-compose.yml as processes on this machine, from the same
commands (``workers/stack.py``), on loopback ports:

* a private ``redis-server`` (broker, result backend and limiter), so that the queues start
  empty and the machine's own Redis is never touched;
* the mock API of ``workers/mock_api.py``, which allows 20 calls/s with burst 2 and
  answers 429 to any call beyond, judged on arrival time. Burst 2 is one call of headroom
  over the fleet's strict spacing: on a busy machine the moment a call reaches the API
  trails the moment Redis admitted it by a jitter of about a millisecond, and a burst-1
  API would count two calls 49 ms apart as a violation (``make bench-celery`` measures
  that strictest case);
* two ``celery worker`` processes of ``workers/demo_app.py`` with task events on, 4 prefork
  children each, whose queue ``upstream`` is throttled by ``configs/demo.yaml`` (GCRA
  19.6/s burst 1: 2% under the upstream, the margin for that jitter);
* Flower, whose address it prints (the tasks page shows every task's state live);
* the producer (``workers/producer.py``), which enqueues a backlog at once (default 2,000:
  100 s of work), draws a progress bar, prints the summary and writes ``docs/demo.png``.

It exits with the producer's status: non-zero if a task was lost or ran twice, or if the
API counted a violation.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from workers.harness import LocalStack
from workers.stack import CONCURRENCY, PLOT, TASKS, WORKERS, services


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=TASKS, help="backlog size")
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="children per worker")
    parser.add_argument("--plot", default=PLOT, help="where the PNG goes (empty: no plot)")
    args = parser.parse_args(argv)

    stack = services(
        workers=args.workers, concurrency=args.concurrency, tasks=args.tasks, plot=args.plot
    )
    logs = Path(tempfile.mkdtemp(prefix="throttle-demo-"))
    print(f"starting redis, the mock API, {args.workers} workers x {args.concurrency} "
          f"children and Flower (logs in {logs})", flush=True)  # fmt: skip
    with LocalStack(stack, logs) as local:
        assert local.redis is not None
        print(f"redis {local.redis.url} | mock API {local.api_url} (20/s burst 2)")
        print(f"Flower {local.flower_url} (open /tasks while it runs; Prometheus metrics "
              f"on {local.flower_url}/metrics)", flush=True)  # fmt: skip
        producer = local.start("producer", foreground=True)
        assert producer.proc is not None
        code = producer.proc.wait()
        print(f"  Flower saw {_flower_states(local.flower_url, args.tasks)}")
        print(f"  Flower's /metrics: {_flower_decisions(local.flower_url)}")
    return code


def _flower_states(url: str, tasks: int, timeout_s: float = 10.0) -> str:
    """How many tasks Flower knows of, by state (through its API). Events trail results by
    a moment, so wait up to ``timeout_s`` for all ``tasks`` to show as finished."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/api/tasks", timeout=30) as response:
                found = json.load(response)
        except OSError as exc:
            return f"nothing: {exc}"
        states = collections.Counter(task.get("state") for task in found.values())
        if states["SUCCESS"] + states["FAILURE"] >= tasks or time.monotonic() > deadline:
            return f"{len(found)} tasks: " + ", ".join(
                f"{n} {state}" for state, n in states.most_common()
            )
        time.sleep(0.5)


def _flower_decisions(url: str) -> str:
    """The fleet's throttle_decisions_total as Flower serves it (summed over its workers and
    limits), by decision: the workers' Prometheus counters, read from their files."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            text = response.read().decode()
    except OSError as exc:
        return f"unreadable: {exc}"
    totals: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        found = re.match(r'throttle_decisions_total\{.*decision="(\w+)".*\} (\S+)$', line)
        if found:
            totals[found.group(1)] += int(float(found.group(2)))
    decisions = ", ".join(f"{n} {decision}" for decision, n in sorted(totals.items()))
    return f"throttle_decisions_total {decisions or 'absent'}"


if __name__ == "__main__":
    sys.exit(main())
