"""``make demo``: a Celery fleet calls a rate-capped API through the throttler.

What runs, all on this machine and all started here:

* a private ``redis-server`` (broker, result backend and limiter), so that the queues start
  empty and the machine's own Redis is never touched;
* the mock API of ``workers/mock_api.py``, which allows 20 calls/s with burst 2 and
  answers 429 to any call beyond, judged on arrival time. Burst 2 is one call of headroom
  over the fleet's strict spacing: on a busy machine the moment a call reaches the API
  trails the moment Redis admitted it by a jitter of about a millisecond, and a burst-1
  API would count two calls 49 ms apart as a violation (``make bench-celery`` measures
  that strictest case);
* two ``celery worker`` processes of ``workers/demo_app.py``, 4 prefork children each,
  whose queue ``upstream`` is throttled by ``configs/demo.yaml`` (GCRA 19.6/s burst 1: 2%
  under the upstream, the margin for the jitter between Redis admitting a call and the
  call reaching the API);
* a producer that enqueues a backlog of tasks at once (default 2,000: 100 s of work).

At the end it prints what the API saw (calls, violations, utilization of its limit), and
what the tasks saw (reschedules per task, lateness behind their slots), and exits non-zero
if a task was lost or ran twice, or if the API counted a violation.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from throttle.testing import RedisServer
from workers.harness import Worker, start_api, wait_ready

API_RATE, API_BURST = 20.0, 2.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000, help="backlog size")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4, help="children per worker")
    args = parser.parse_args(argv)

    logs = Path(tempfile.mkdtemp(prefix="throttle-demo-"))
    with RedisServer() as server:
        api = start_api(API_RATE, API_BURST)
        env = {"DEMO_BROKER_URL": server.url, "MOCK_API_URL": api.url}
        os.environ.update(env)
        from workers.demo_app import app, call_api  # noqa: PLC0415 (reads the env above)

        workers = [
            Worker(f"demo{i + 1}", env, concurrency=args.concurrency, log=logs / f"w{i + 1}.log")
            for i in range(args.workers)
        ]
        print(f"redis {server.url} | mock API {api.url} (20/s burst 2) | worker logs {logs}")
        try:
            for worker in workers:
                worker.start()
            wait_ready(app, workers)
            print(f"{len(workers)} workers x {args.concurrency} children ready; "
                  f"enqueueing {args.tasks} tasks")  # fmt: skip
            started = time.monotonic()
            handles = [call_api.delay(n) for n in range(args.tasks)]
            done_event = threading.Event()
            threading.Thread(
                target=_progress, args=(api.api, args.tasks, started, done_event), daemon=True
            ).start()
            results = [h.get(timeout=args.tasks / API_RATE * 2 + 60) for h in handles]
            done_event.set()
            elapsed = time.monotonic() - started
        finally:
            for worker in workers:
                worker.stop()
            api.stop()
    return _report(api.api, handles, results, elapsed)


def _progress(api: object, total: int, started: float, done: threading.Event) -> None:
    while not done.wait(5.0):
        stats = api.stats()  # type: ignore[attr-defined]
        print(f"  {time.monotonic() - started:5.1f} s: {stats['calls']:5d}/{total} calls, "
              f"{stats['violations']} violations", flush=True)  # fmt: skip


def _report(api: object, handles: list, results: list[dict], elapsed: float) -> int:  # type: ignore[type-arg]
    stats = api.stats()  # type: ignore[attr-defined]
    arrivals = api.arrivals_json()  # type: ignore[attr-defined]
    per_task = collections.Counter(a["task_id"] for a in arrivals)
    ids = [h.id for h in handles]
    lost = [i for i in ids if per_task[i] == 0]
    twice = [i for i, n in per_task.items() if n > 1]
    span = arrivals[-1]["at_s"] - arrivals[0]["at_s"] if arrivals else 0.0
    bound = API_BURST + API_RATE * span
    utilization = stats["allowed"] / bound if bound else 0.0
    deferrals = [r["deferrals"] for r in results]
    late = sorted(r["late_s"] for r in results if r.get("late_s") is not None)
    p95 = late[int(0.95 * (len(late) - 1))] if late else float("nan")
    rows = [
        ("tasks", f"{len(results)} completed of {len(ids)}"),
        ("calls at the API", f"{stats['calls']} in {span:.1f} s (run {elapsed:.1f} s)"),
        ("violations (429)", f"{stats['violations']}"),
        ("utilization of 20/s", f"{utilization:.1%} of burst + rate x span"),
        ("lost / ran twice", f"{len(lost)} / {len(twice)}"),
        ("reschedules per task", f"{statistics.mean(deferrals):.2f} mean, {max(deferrals)} max"),
        ("lateness behind slot", f"p50 {1000 * statistics.median(late):.1f} ms, "
                                 f"p95 {1000 * p95:.1f} ms"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    ok = not lost and not twice and stats["violations"] == 0
    print("\nOK" if ok else "\nFAILED: a task was lost or ran twice, or the API saw a violation")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
