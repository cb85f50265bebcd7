"""A backlog of 100,000 throttled tasks: where do they wait, and does worker memory stay flat?

``python -m bench.backlog [--tasks 100000] [--seconds 90] [--json PATH]``

One private redis-server (broker, results, limiter), the mock API (20/s burst 2), and two
``celery worker`` processes of ``workers/demo_app.py`` (4 prefork children each) whose queue
is throttled by GCRA at ``--rate`` per second, burst 1 (default 5/s). The producer enqueues
the whole backlog at once.

At a fast rate the backlog simply stays in the broker: each of the 8 children takes a task,
reserves the next slot, sleeps until it (under ``sleep_max``) and calls; nothing is
rescheduled (``make demo`` shows that case). At a slow rate the children cannot sleep that
long: a task whose slot is beyond ``sleep_max`` is re-published for it, and a slot beyond
``park_after`` (10 s) is parked in Redis. So the backlog leaves the broker for the parking
lot, each task with its own reserved slot, and the workers hold only the tasks due within
the next ~12 s (as ETA messages) plus one prefetched message per child.

Sampled every 5 s: tasks still in the broker queue, parked in Redis, executed; the memory
(PSS) of each worker (main process and pool children, summed) and Redis ``used_memory``.
The point is the memory columns: flat while 100,000 tasks wait, because they wait in Redis,
not in workers. (Each pool child grows by about 100 MB over its first few hundred
re-publications and then stays there: Celery handles every ``Retry`` through billiard's
``ExceptionInfo``, which copies the code positions of every frame on the stack, and the
allocator keeps that high-water mark. A task's own ``self.retry()`` costs the same.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import redis

from tests.support.servers import RedisServer
from throttle.parking import ParkingLot
from throttle.redis.keys import KeySpace
from workers.harness import Worker, start_api, wait_ready


def rss_mb(worker: Worker) -> float:
    """The worker's memory: PSS (proportional set size) summed over the main process and its
    pool children. Not RSS: forked children share most pages with their parent, and RSS
    would count each shared page once per child."""
    assert worker.proc is not None
    try:
        main = psutil.Process(worker.proc.pid)
        procs = [main, *main.children(recursive=True)]
        return sum(p.memory_full_info().pss for p in procs) / 2**20
    except psutil.Error:
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=90.0, help="run time after enqueueing")
    parser.add_argument("--rate", type=float, default=5.0, help="the limit, per second")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    with RedisServer() as server:
        api = start_api(20.0, 2.0)
        config = Path(tempfile.mkdtemp(prefix="throttle-backlog-")) / "limits.yaml"
        config.write_text(
            f"limits:\n  upstream: {{algorithm: gcra, rate: {args.rate}/s, burst: 1}}\n"
            "  tokens: {rate: 20000/m, key: '{tenant}', cost: max_tokens}\n"
            "queues:\n  upstream: [upstream]\n"
        )
        env = {
            "DEMO_BROKER_URL": server.url,
            "MOCK_API_URL": api.url,
            "THROTTLE_CONFIG": str(config),
        }
        os.environ.update(env)
        from workers.demo_app import app, call_api  # noqa: PLC0415 (reads the env above)

        client = redis.Redis.from_url(server.url)
        lot = ParkingLot(client, KeySpace())
        workers = [Worker(f"backlog{i}", env, log=config.parent / f"w{i}.log") for i in (1, 2)]
        for worker in workers:
            worker.start()
        wait_ready(app, workers)
        base_rss = [rss_mb(w) for w in workers]
        started = time.monotonic()
        with app.producer_or_acquire() as producer:
            for n in range(args.tasks):
                call_api.apply_async((n,), producer=producer, ignore_result=True)
        enqueued_s = time.monotonic() - started
        print(f"enqueued {args.tasks} tasks in {enqueued_s:.1f} s; workers at "
              f"{base_rss[0]:.0f} + {base_rss[1]:.0f} MB (PSS) before")  # fmt: skip
        header = f"{'t s':>6} {'in broker':>10} {'parked':>8} {'API calls':>10} " \
                 f"{'PSS w1 MB':>10} {'PSS w2 MB':>10} {'Redis MB':>9}"  # fmt: skip
        print(header)
        samples: list[dict[str, Any]] = []
        end = time.monotonic() + args.seconds
        while True:
            parked, _ = lot.counts()
            sample = {
                "t_s": round(time.monotonic() - started, 1),
                "in_broker": int(client.llen("upstream")),
                "parked": parked,
                "api_calls": api.api.stats()["calls"],
                "rss_mb": [round(rss_mb(w), 1) for w in workers],
                "redis_mb": round(int(client.info("memory")["used_memory"]) / 2**20, 1),
            }
            samples.append(sample)
            print(f"{sample['t_s']:>6} {sample['in_broker']:>10} {sample['parked']:>8} "
                  f"{sample['api_calls']:>10} {sample['rss_mb'][0]:>10} "
                  f"{sample['rss_mb'][1]:>10} {sample['redis_mb']:>9}", flush=True)  # fmt: skip
            if time.monotonic() >= end:
                break
            time.sleep(5)
        stats = api.api.stats()
        for worker in workers:
            assert worker.proc is not None
            main_proc = psutil.Process(worker.proc.pid)
            parts = [main_proc, *main_proc.children(recursive=True)]
            pss = [round(p.memory_full_info().pss / 2**20) for p in parts]
            print(f"{worker.name} PSS MB, main process then children: {pss}")
        for worker in workers:
            worker.kill()  # no warm shutdown: the ETA messages they hold would be re-sent
        api.stop()
    rss = [s["rss_mb"] for s in samples]
    summary = {
        "tasks": args.tasks,
        "enqueue_s": round(enqueued_s, 1),
        "rss_before_mb": [round(x, 1) for x in base_rss],
        "rss_max_mb": [max(r[i] for r in rss) for i in range(2)],
        "rss_end_mb": rss[-1],
        "max_parked": max(s["parked"] for s in samples),
        "api_calls": stats["calls"],
        "violations": stats["violations"],
        "samples": samples,
    }
    print(f"\nworker PSS before / max / end (MB): {summary['rss_before_mb']} / "
          f"{summary['rss_max_mb']} / {summary['rss_end_mb']}; most parked at once: "
          f"{summary['max_parked']}; API: {stats['calls']} calls, {stats['violations']} "
          "violations")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
