"""Soak: 100,000 throttled tasks through a two-worker fleet with the limiter at its rate.

``python -m bench.soak [--tasks 100000] [--rate 150] [--settle-s 150] [--json PATH]``
(``make soak``; not part of ``make test``: it takes several minutes)

Two private redis-servers: one is the fleet's broker and limiter (what is measured), the
other only counts executions, so that the count does not weigh on the measured memory.
Two ``celery worker`` processes of ``tests/apps/kill_app.py`` (4 prefork children each) run
``tick``, an almost empty task throttled by one GCRA limit ``soak`` at ``--rate`` per second:
the limiter and the fleet are what is measured, not the task. Results are not stored
(``ignore_result``), so the broker's keys can go back to their baseline.

Reported:

* lost: task ids sent that never completed; twice: ids that completed more than once
  (``HINCRBY soak:done ID 1`` in the body, read back with ``HSCAN``);
* the broker Redis's key count and ``used_memory``: at baseline (workers ready, nothing
  sent), at the peak of the run, when the last task completed, and after the TTLs passed
  (sampled until the key count is back to the baseline, or ``--settle-s`` after the end);
* each worker's memory (PSS of the main process and its children, summed: not RSS, which
  counts the pages the forked children share once per child), sampled every 5 s.

The producer sends the tasks while the fleet runs them, so the queue is never empty; the
achieved rate is reported next to the limit (the limit binds when they match). The default
150/s sits below what one Python producer sends (210-310/s) and what this fleet runs
(140-260/s) on a shared 2-core machine: 100,000 tasks take about 12 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import redis

from tests.support.servers import RedisServer
from workers.harness import Worker, wait_ready

SAMPLE_S = 5.0


def pss_mb(worker: Worker) -> float:
    """The worker's PSS in MB: main process and pool children, summed."""
    assert worker.proc is not None
    try:
        main = psutil.Process(worker.proc.pid)
        procs = [main, *main.children(recursive=True)]
        return sum(p.memory_full_info().pss for p in procs) / 2**20
    except psutil.Error:
        return float("nan")


def redis_state(client: redis.Redis) -> dict[str, Any]:
    """Key count and used_memory (MB) of the broker Redis, and its keys by first component."""
    kinds: dict[str, int] = {}
    for key in client.scan_iter(count=1000):
        name = key.decode(errors="replace")
        kind = name.split(":", 3)[2] if name.startswith("throttle:") else name.split(":")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return {
        "keys": int(client.dbsize()),
        "used_mb": round(int(client.info("memory")["used_memory"]) / 2**20, 2),
        "kinds": kinds,
    }


def count_done(counts: redis.Redis, sent: set[str]) -> tuple[int, int, int, int]:
    """(completed ids, lost ids, ids completed twice or more, ids never sent)."""
    seen: dict[str, int] = {}
    for task_id, runs in counts.hscan_iter("soak:done", count=5000):
        seen[task_id.decode()] = int(runs)
    lost = len(sent - seen.keys())
    twice = sum(1 for runs in seen.values() if runs > 1)
    strange = len(seen.keys() - sent)
    return len(seen), lost, twice, strange


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=150.0, help="the limit, per second")
    parser.add_argument("--settle-s", type=float, default=150.0,
                        help="how long to wait for the TTLs after the last task")  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="throttle-soak-"))
    config = tmp / "limits.yaml"
    # sleep_max + park_after + park_lead = 12.5 s: under half the visibility timeout (60 s).
    config.write_text(
        "settings: {sleep_max: 0.5s, park_after: 10s, park_lead: 2s}\n"
        f"limits:\n  soak: {{algorithm: gcra, rate: {args.rate:g}/s, burst: 1}}\n"
        "  slots: {rate: 4 concurrent}\n"
        "  tokens: {rate: 1000/d, key: '{run}', cost: estimate}\n"
    )
    with RedisServer() as server, RedisServer() as count_server:
        env = {
            "KILL_BROKER_URL": server.url,
            "KILL_COUNT_URL": count_server.url,
            "THROTTLE_CONFIG": str(config),
            "KILL_VISIBILITY_S": "60",
        }
        os.environ.update(env)
        from tests.apps.kill_app import app, tick  # noqa: PLC0415 (reads the env above)

        client = redis.Redis.from_url(server.url)
        counts = redis.Redis.from_url(count_server.url)
        workers = [
            Worker(f"soak{i}", env, concurrency=4, queues="kill", app="tests.apps.kill_app",
                   log=tmp / f"w{i}.log")
            for i in (1, 2)
        ]  # fmt: skip
        for worker in workers:
            worker.start()
        wait_ready(app, workers)
        time.sleep(2)  # let the workers finish starting (their first Redis keys)
        baseline = redis_state(client)
        pss_before = [round(pss_mb(w), 1) for w in workers]
        print(f"baseline: {baseline['keys']} keys, {baseline['used_mb']} MB; workers "
              f"{pss_before} MB PSS", flush=True)  # fmt: skip

        sent: set[str] = set()
        sent_s: list[float] = []

        def produce() -> None:
            start = time.monotonic()
            with app.producer_or_acquire() as producer:
                for n in range(args.tasks):
                    sent.add(tick.apply_async((n,), producer=producer).id)
            sent_s.append(time.monotonic() - start)

        started = time.monotonic()
        producer = threading.Thread(target=produce, name="producer")
        producer.start()
        samples: list[dict[str, Any]] = []
        print(f"{'t s':>6} {'sent':>7} {'done':>7} {'queue':>6} {'keys':>6} {'Redis MB':>9} "
              f"{'PSS w1':>7} {'PSS w2':>7}")  # fmt: skip
        last_done, last_change = -1, time.monotonic()
        first_done_at: float | None = None
        while True:
            done = int(counts.hlen("soak:done"))
            if done and first_done_at is None:
                first_done_at = time.monotonic()
            state = redis_state(client) if len(samples) % 6 == 0 else None
            sample = {
                "t_s": round(time.monotonic() - started, 1),
                "sent": len(sent),
                "done": done,
                "queue": int(client.llen("kill")),
                "keys": int(client.dbsize()),
                "used_mb": round(int(client.info("memory")["used_memory"]) / 2**20, 2),
                "pss_mb": [round(pss_mb(w), 1) for w in workers],
                "kinds": None if state is None else state["kinds"],
            }
            samples.append(sample)
            print(f"{sample['t_s']:>6} {sample['sent']:>7} {done:>7} {sample['queue']:>6} "
                  f"{sample['keys']:>6} {sample['used_mb']:>9} {sample['pss_mb'][0]:>7} "
                  f"{sample['pss_mb'][1]:>7}", flush=True)  # fmt: skip
            if done != last_done:
                last_done, last_change = done, time.monotonic()
            if done >= args.tasks and not producer.is_alive():
                break
            if time.monotonic() - last_change > 120:
                print("no progress for 120 s: giving up", flush=True)
                break
            time.sleep(SAMPLE_S)
        producer.join()
        end_time = time.monotonic()
        assert first_done_at is not None
        run_s = end_time - first_done_at
        at_end = redis_state(client)
        completed, lost, twice, strange = count_done(counts, sent)
        print(f"done: {completed} ids completed, lost {lost}, twice {twice}, unknown {strange}; "
              f"{args.tasks} tasks in about {run_s:.0f} s ({args.tasks / run_s:.0f}/s against "
              f"a limit of {args.rate:g}/s); producer {sent_s[0]:.0f} s", flush=True)  # fmt: skip
        print(f"at the end: {at_end}", flush=True)
        lease_ttls = [
            client.pttl(key) / 1000
            for key in list(client.scan_iter(match="throttle:*lease:*", count=1000))[:50]
        ]
        if lease_ttls:
            print(f"lease records: {at_end['kinds'].get('lease', 0)}, TTL left "
                  f"{min(lease_ttls):.0f}-{max(lease_ttls):.0f} s", flush=True)  # fmt: skip

        settle: list[dict[str, Any]] = []
        while time.monotonic() - end_time < args.settle_s:
            time.sleep(SAMPLE_S)
            state = redis_state(client)
            state["t_s"] = round(time.monotonic() - end_time, 1)
            state["pss_mb"] = [round(pss_mb(w), 1) for w in workers]
            settle.append(state)
            print(f"+{state['t_s']} s: {state['keys']} keys, {state['used_mb']} MB, "
                  f"{state['kinds']}, PSS {state['pss_mb']}", flush=True)  # fmt: skip
            if state["keys"] <= baseline["keys"]:
                break
        after = settle[-1] if settle else at_end
        for worker in workers:
            worker.stop()

    pss = [s["pss_mb"] for s in samples]
    steady = pss[len(pss) // 4 :] or pss  # after warm-up: the first quarter of the run
    summary = {
        "tasks": args.tasks,
        "rate": args.rate,
        "run_s": round(run_s, 1),
        "achieved_per_s": round(args.tasks / run_s, 1),
        "producer_s": round(sent_s[0], 1),
        "completed": completed,
        "lost": lost,
        "twice": twice,
        "unknown": strange,
        "redis": {
            "baseline": baseline,
            "peak_keys": max(s["keys"] for s in samples),
            "peak_used_mb": max(s["used_mb"] for s in samples),
            "at_end": at_end,
            "after": after,
        },
        "pss_before_mb": pss_before,
        "pss_min_max_steady_mb": [
            [min(p[i] for p in steady), max(p[i] for p in steady)] for i in range(2)
        ],
        "pss_end_mb": pss[-1],
        "samples": samples,
        "settle": settle,
    }
    print(json.dumps({k: v for k, v in summary.items() if k not in ("samples", "settle")},
                     indent=1))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if lost == 0 and twice == 0 and strange == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
