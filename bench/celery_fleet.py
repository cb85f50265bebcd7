"""A Celery fleet against a strict upstream: ours vs Celery's ``rate_limit`` vs a naive recipe.

``python -m bench.celery_fleet [--seconds 60] [--backlog 2000] [--json PATH]``

What runs
---------
Three variants, one after the other, each on fresh pieces started here: a private
``redis-server`` (broker, result backend, limiter; never the machine's Redis), the mock API
of ``workers/mock_api.py`` allowing **20 calls/s with burst 1** (strict spacing: one call
every 50 ms, judged on the moment each call really arrives), and **2** ``celery worker``
processes of **4 prefork children** each:

* ``ours``: task ``call_api`` of ``workers/demo_app.py`` on queue ``upstream``, throttled by
  ``configs/demo.yaml`` (GCRA 19.6/s burst 1, 2% under the API: the margin for the jitter
  between Redis admitting a call and the call reaching the API);
* ``rate_limit``: ``bench/celery_apps.py:rate_limited_call``, Celery's built-in
  ``rate_limit="20/s"``. It is per worker, so two workers may send 40/s;
* ``naive``: ``bench/celery_apps.py:naive_call``: a fixed one-second window counted in Redis
  with GET, then INCR + EXPIRE (not atomic), ``self.retry(countdown=1)`` when full,
  ``max_retries=None``.

The mock API runs in its own process, so that this process's bookkeeping (polling Redis,
reading memory) cannot delay the moment the API stamps an arrival. A variant enqueues the
whole backlog at once, then runs for ``--seconds`` (counted from the start of enqueueing)
or until every task has completed; then its workers are killed (SIGKILL: the tasks they
hold in memory or have parked are abandoned with the Redis) and the API and the result
backend are read.

What is measured, per variant
-----------------------------
* calls at the API, violations (its 429s), and utilization of its limit: allowed calls /
  (burst + rate x span), the span being first to last arrival. Our limit is 98% of the
  API's, so ours can reach about 98.0% at most: every lost slot shows.
* tasks completed (SUCCESS in the result backend) and remaining; task ids that reached the
  API more than once; when every task completed, whether every id arrived exactly once.
* reschedules per executed task: ours, the ``throttle_deferrals`` header each result
  reports (re-publications by the throttler); naive, ``request.retries``; rate_limit
  re-publishes nothing (it holds tasks in worker memory: see "held by workers").
* broker publishes per executed task, counted at the broker (every message is one
  ``LPUSH`` to the private redis-server: :func:`tests.support.publishes.broker_lpushes`)
  from the first enqueue to the end of the run: the producer's message, plus each
  re-publish, release from parking or retry. Exact when every task completed.
* lateness of a call behind its slot (ours: ``late_s`` of the results, the call's time
  minus the slot the limiter reserved for it). The baselines have no slot: n/a. For every
  variant, the API-side view: the excess of each gap between consecutive arrivals over the
  50 ms spacing (idle time of the limit), p95 and max.
* wait of a task from its enqueueing to its arrival at the API (p50 and max).
* messages in the broker queue and held by workers (delivered but not acknowledged: the
  Redis transport's ``unacked`` hash; ETA messages and rate-limited tasks wait there), and
  for ours the tasks parked in Redis; the maximum of each, sampled every second.
* worker memory: the RSS of each worker's process tree (main process and pool children),
  summed over both workers, at the start (after the workers are ready), at the end and the
  maximum sampled; and the PSS at start and end (RSS counts a page shared by the forked
  children once per child, PSS splits it).
* the machine's load average at the start and end of each variant (the machine may be
  shared: a busy machine delays wake-ups and calls, which is what lateness shows).

Targets, from the issue (they concern ours; the baselines are scored on them for the
comparison): 0 violations, utilization >= 98%, <= 1.1 reschedules and <= 1.1 broker
publishes per executed task, and no task lost or run twice (verifiable only when the run
lasts long enough for every task to complete: 2,000 tasks at 19.6/s take about 102 s, so
use ``--seconds 130`` for that).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import redis
from celery import Celery

from tests.support.publishes import broker_lpushes
from tests.support.servers import RedisServer, free_port
from throttle.config import ThrottleConfig
from throttle.parking import ParkingLot
from throttle.redis.keys import KeySpace
from workers.harness import ROOT, Worker, demo_env, wait_ready

API_RATE, API_BURST = 20.0, 1.0
WORKERS, CONCURRENCY = 2, 4
QUEUE = "upstream"
SAMPLE_S = 1.0
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"

TARGET_UTILIZATION = 0.98
TARGET_RESCHEDULES = 1.1
TARGET_PUBLISHES = 1.1
"""Broker publishes per executed task, the producer's own one included (issue 25)."""


@dataclass(frozen=True)
class Variant:
    key: str
    title: str
    app: str  # the worker's -A
    task: str  # the task name the producer sends
    reschedules: str | None  # the result field counting re-publications


VARIANTS = {
    "ours": Variant("ours", "ours", "workers.demo_app",
                    "workers.demo_app.call_api", "deferrals"),
    "rate_limit": Variant("rate_limit", "celery rate_limit", "bench.celery_apps",
                          "bench.celery_apps.rate_limited_call", "retries"),
    "naive": Variant("naive", "naive retry(countdown=1)", "bench.celery_apps",
                     "bench.celery_apps.naive_call", "retries"),
}  # fmt: skip


# -- the mock API in its own process ------------------------------------------------------


class MockProcess:
    """A mock server, ``python -m MODULE ARGS --port N`` on a free port, in a process of
    its own (its clock and threads are not the benchmark's), read through its HTTP
    endpoints; ready once ``probe`` answers."""

    def __init__(self, module_args: Sequence[str], log: Path, probe: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", *module_args, "--port", str(self.port)],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                self.get(probe)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{module_args[0]} did not start (see {log})") from None
                time.sleep(0.05)

    def _open(self, request: urllib.request.Request | str) -> Any:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def get(self, path: str) -> Any:
        return self._open(self.url + path)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        return self._open(urllib.request.Request(self.url + path, data=data, method="POST"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class ApiProcess(MockProcess):
    """``python -m workers.mock_api`` (:class:`MockProcess`)."""

    def __init__(
        self, rate: float, burst: float, log: Path, *, retry_after_only: bool = False,
        extra: Sequence[str] = (),
    ) -> None:  # fmt: skip
        extra = [*(["--retry-after-only"] if retry_after_only else []), *extra]
        argv = ["workers.mock_api", "--rate", str(rate), "--burst", str(burst), *extra]
        super().__init__(argv, log, "/stats")

    def reset(self) -> float:
        """Forget every arrival and refill the bucket; returns our monotonic time of the
        API's new origin (arrival ``at_s`` values count from it), within a round trip."""
        before = time.monotonic()
        self._open(urllib.request.Request(self.url + "/reset", data=b"{}", method="POST"))
        return (before + time.monotonic()) / 2


# -- measuring ----------------------------------------------------------------------------


def tree_memory_mb(workers: Sequence[Worker], pss: bool = False) -> float:
    """RSS (or PSS) of every worker's process tree, summed, in MB."""
    total = 0
    for worker in workers:
        if worker.proc is None:
            continue
        try:
            main = psutil.Process(worker.proc.pid)
            procs = [main, *main.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in procs:
            with contextlib.suppress(psutil.Error):  # a pool child replaced just now
                total += proc.memory_full_info().pss if pss else proc.memory_info().rss
    return total / 2**20


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile; None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    return float(ordered[max(math.ceil(q * len(ordered)) - 1, 0)])


def completed_results(client: redis.Redis, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The results of the tasks that succeeded, by id, read from the result backend."""
    done: dict[str, dict[str, Any]] = {}
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        for task_id, raw in zip(
            chunk, client.mget([f"celery-task-meta-{i}" for i in chunk]), strict=True
        ):
            if raw is None:
                continue
            meta = json.loads(raw)
            if meta.get("status") == "SUCCESS" and isinstance(meta.get("result"), dict):
                done[task_id] = meta["result"]
    return done


def count_completed(client: redis.Redis, ids: Sequence[str]) -> int:
    """How many tasks succeeded (a cheap test on the raw result, no JSON parsing)."""
    count = 0
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        for raw in client.mget([f"celery-task-meta-{i}" for i in chunk]):
            if raw is not None and b'"SUCCESS"' in raw:
                count += 1
    return count


def our_title(config: Path) -> str:
    """``ours (GCRA 19.6/s burst 1)``: the limit of queue ``upstream`` in the limits file."""
    rules = ThrottleConfig.from_source(str(config)).rules_for("workers.demo_app.call_api", QUEUE)
    if len(rules) != 1:
        return "ours"
    limit = rules[0].limit
    return (
        f"ours ({limit.algorithm.value.upper()} {limit.count:g}/"
        f"{limit.period_s:g}s burst {limit.burst:g})"
    ).replace("/1s", "/s")


def run_variant(variant: Variant, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    load_start = os.getloadavg()
    cpu_start = psutil.cpu_times()
    api = ApiProcess(API_RATE, API_BURST, logs / f"{variant.key}-api.log")
    server = RedisServer().start()
    client = server.client()
    workers: list[Worker] = []
    producer = Celery(f"bench-{variant.key}", broker=server.url, backend=server.url)
    try:
        # TMPDIR: the demo limits' metric files in this run's directory (the default is
        # shared by every worker of the namespace on this host, e.g. make demo's).
        env = demo_env(server.url, api.url, THROTTLE_CONFIG=str(args.config), TMPDIR=str(logs))
        workers = [
            Worker(f"{variant.key}{i + 1}", env, concurrency=CONCURRENCY, queues=QUEUE,
                   app=variant.app, log=logs / f"{variant.key}-w{i + 1}.log")
            for i in range(WORKERS)
        ]  # fmt: skip
        for worker in workers:
            worker.start()
        wait_ready(producer, workers)
        time.sleep(1.0)  # let the pool children finish starting before the first sample
        lot = ParkingLot(client, KeySpace())
        rss_start = tree_memory_mb(workers)
        pss_start = tree_memory_mb(workers, pss=True)

        origin = api.reset()
        lpushes_start = broker_lpushes(client)
        started = time.monotonic()
        ids: list[str] = []
        enqueued_at: dict[str, float] = {}  # in seconds of the API's arrival clock
        with producer.producer_or_acquire() as publisher:
            for n in range(args.backlog):
                handle = producer.send_task(variant.task, (n,), queue=QUEUE, producer=publisher)
                ids.append(handle.id)
                enqueued_at[handle.id] = time.monotonic() - origin
        enqueue_s = time.monotonic() - started
        print(f"  enqueued {args.backlog} tasks in {enqueue_s:.1f} s", flush=True)

        samples: list[dict[str, Any]] = []
        end = started + args.seconds
        next_print = started + 10
        while True:
            now = time.monotonic()
            done = count_completed(client, ids)
            sample = {
                "t_s": round(now - started, 1),
                "completed": done,
                "in_broker": int(client.llen(QUEUE)),
                "held_by_workers": int(client.hlen("unacked")),
                "parked": sum(lot.counts()) if variant.key == "ours" else 0,
                "rss_mb": round(tree_memory_mb(workers), 1),
            }
            # Every task is somewhere in Redis: completed, queued, held unacknowledged (this
            # includes the ones running: late acks) or parked. Fewer means tasks vanished.
            sample["accounted"] = (
                done + sample["in_broker"] + sample["held_by_workers"] + sample["parked"]
            )
            samples.append(sample)
            if now >= next_print:
                next_print += 10
                stats = api.get("/stats")
                print(f"  {sample['t_s']:5.0f} s: {done:5d} completed, {stats['calls']:5d} "
                      f"calls, {stats['violations']:5d} violations, {sample['in_broker']:5d} "
                      f"in broker, {sample['held_by_workers']:5d} held by workers, "
                      f"{sample['parked']:5d} parked, RSS {sample['rss_mb']:.0f} MB",
                      flush=True)  # fmt: skip
            if done >= args.backlog or now >= end:
                break
            time.sleep(max(0.0, min(SAMPLE_S, end - time.monotonic())))
        elapsed = time.monotonic() - started
        published = broker_lpushes(client) - lpushes_start
        rss_end = tree_memory_mb(workers)
        pss_end = tree_memory_mb(workers, pss=True)
    finally:
        for worker in workers:
            worker.kill()  # nothing more reaches the API after this
    try:
        stats = api.get("/stats")
        arrivals = api.get("/arrivals")
        results = completed_results(client, ids)
    finally:
        client.close()
        producer.close()
        server.stop()
        api.stop()
    load_end = os.getloadavg()
    cpu = {
        name: getattr(psutil.cpu_times(), name, 0.0) - getattr(cpu_start, name, 0.0)
        for name in ("user", "system", "idle", "steal")
    }
    row = summarize(
        variant, args, ids, enqueued_at, stats, arrivals, results, samples,
        {"rss_start": rss_start, "rss_end": rss_end, "pss_start": pss_start, "pss_end": pss_end},
        elapsed=elapsed, enqueue_s=enqueue_s, load=(load_start, load_end), cpu=cpu,
    )  # fmt: skip
    row["broker_publishes"] = published
    row["publishes_per_task"] = published / len(results) if results else None
    return row


def summarize(
    variant: Variant,
    args: argparse.Namespace,
    ids: Sequence[str],
    enqueued_at: dict[str, float],
    stats: dict[str, Any],
    arrivals: list[dict[str, Any]],
    results: dict[str, dict[str, Any]],
    samples: list[dict[str, Any]],
    memory: dict[str, float],
    *,
    elapsed: float,
    enqueue_s: float,
    load: tuple[tuple[float, ...], tuple[float, ...]],
    cpu: dict[str, float],
) -> dict[str, Any]:
    times = [a["at_s"] for a in arrivals]
    span = times[-1] - times[0] if times else 0.0
    bound = API_BURST + API_RATE * span
    per_id = collections.Counter(a["task_id"] for a in arrivals)
    wanted = set(ids)
    twice = sorted(i for i, n in per_id.items() if n > 1)
    strangers = sorted(i for i in per_id if i not in wanted)
    all_done = len(results) == len(ids)
    exactly_once = all_done and per_id == collections.Counter({i: 1 for i in ids})
    reschedules = [int(r.get(variant.reschedules or "", 0) or 0) for r in results.values()]
    late = [float(r["late_s"]) for r in results.values() if r.get("late_s") is not None]
    spacing = 1.0 / API_RATE
    gaps = [max(b - a - spacing, 0.0) for a, b in itertools.pairwise(times)]
    # For each 429: how long after the last allowed call it arrived (50 ms would have been
    # allowed): how far inside the spacing the call landed.
    before_429: list[float] = []
    last_allowed: float | None = None
    for a in arrivals:
        if a["allowed"]:
            last_allowed = a["at_s"]
        elif last_allowed is not None:
            before_429.append(a["at_s"] - last_allowed)
    first_arrival: dict[str, float] = {}
    for a in arrivals:
        first_arrival.setdefault(a["task_id"], a["at_s"])
    waits = [at - enqueued_at[i] for i, at in first_arrival.items() if i in enqueued_at]
    rss = [s["rss_mb"] for s in samples]

    def ms(value: float | None) -> float | None:
        return None if value is None else round(1000 * value, 1)

    return {
        "variant": variant.key,
        "title": variant.title,
        "seconds_run": round(elapsed, 1),
        "enqueue_s": round(enqueue_s, 2),
        "load_avg_start": [round(x, 2) for x in load[0]],
        "load_avg_end": [round(x, 2) for x in load[1]],
        "cpu_s": {name: round(value, 1) for name, value in cpu.items()},
        "min_accounted": min((s["accounted"] for s in samples), default=len(ids)),
        "calls": stats["calls"],
        "allowed": stats["allowed"],
        "violations": stats["violations"],
        "span_s": round(span, 2),
        "utilization": stats["allowed"] / bound if times else 0.0,
        "completed": len(results),
        "remaining": len(ids) - len(results),
        "ids_arrived": len(per_id.keys() & wanted),
        "ids_arrived_twice": len(twice),
        "unknown_arrivals": len(strangers),
        "all_completed": all_done,
        "each_id_exactly_once": exactly_once if all_done else None,
        "reschedules_per_task": (sum(reschedules) / len(reschedules)) if reschedules else None,
        "reschedules_max": max(reschedules, default=None),
        "late_p50_ms": ms(percentile(late, 0.50)),
        "late_p95_ms": ms(percentile(late, 0.95)),
        "late_max_ms": ms(max(late, default=None)),
        "gap_excess_p95_ms": ms(percentile(gaps, 0.95)),
        "gap_excess_max_ms": ms(max(gaps, default=None)),
        "idle_s": round(sum(gaps), 2),
        "gaps_over_100ms": sum(g > 0.05 for g in gaps),
        "gap_before_429_p50_ms": ms(percentile(before_429, 0.50)),
        "gap_before_429_min_ms": ms(min(before_429, default=None)),
        "wait_p50_s": percentile(waits, 0.50),
        "wait_max_s": max(waits, default=None),
        "max_in_broker": max((s["in_broker"] for s in samples), default=0),
        "max_held_by_workers": max((s["held_by_workers"] for s in samples), default=0),
        "max_parked": max((s["parked"] for s in samples), default=0),
        "rss_start_mb": round(memory["rss_start"], 1),
        "rss_end_mb": round(memory["rss_end"], 1),
        "rss_max_mb": round(max([*rss, memory["rss_end"]]), 1),
        "pss_start_mb": round(memory["pss_start"], 1),
        "pss_end_mb": round(memory["pss_end"], 1),
        "samples": samples,
        "arrivals": arrivals,  # written to --json only
    }


# -- reporting ----------------------------------------------------------------------------


def targets(row: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """(target, met or None when the run cannot tell, detail) for one variant."""
    per_task = row["reschedules_per_task"]
    published = row.get("publishes_per_task")
    if row["all_completed"]:
        once: bool | None = bool(row["each_id_exactly_once"])
        once_detail = (
            "all completed, each id arrived once"
            if once
            else (
                f"{row['ids_arrived_twice']} ids arrived twice, "
                f"{row['completed'] - row['ids_arrived']} completed without arriving"
            )
        )
    elif row["ids_arrived_twice"]:
        once, once_detail = False, f"{row['ids_arrived_twice']} ids arrived twice"
    else:
        once = None
        once_detail = f"no id twice; {row['remaining']} not completed yet (run longer to tell)"
    return [
        ("0 violations", row["violations"] == 0, str(row["violations"])),
        (f"utilization >= {TARGET_UTILIZATION:.0%}", row["utilization"] >= TARGET_UTILIZATION,
         f"{row['utilization']:.2%}"),
        (f"<= {TARGET_RESCHEDULES} reschedules per executed task",
         None if per_task is None else per_task <= TARGET_RESCHEDULES,
         "n/a" if per_task is None else f"{per_task:.2f}"),
        (f"<= {TARGET_PUBLISHES} broker publishes per executed task",
         None if published is None else published <= TARGET_PUBLISHES,
         "n/a" if published is None else f"{published:.2f}"),
        ("no task lost or run twice", once, once_detail),
    ]  # fmt: skip


def fmt(value: Any, spec: str = "", none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


def print_report(rows: list[dict[str, Any]], params: dict[str, Any]) -> None:
    print()
    print(f"## {params['backlog']} tasks, {params['seconds']:g} s, {WORKERS} workers x "
          f"{CONCURRENCY} prefork children, API {API_RATE:g}/s burst {API_BURST:g}")  # fmt: skip
    print()
    print("| | " + " | ".join(row["title"] for row in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    lines: list[tuple[str, Any]] = [
        ("load avg (1 min) start / end",
         lambda r: f"{r['load_avg_start'][0]:.2f} / {r['load_avg_end'][0]:.2f}"),
        ("machine CPU s: user+system / idle / steal",
         lambda r: f"{r['cpu_s']['user'] + r['cpu_s']['system']:.0f} / "
                   f"{r['cpu_s']['idle']:.0f} / {r['cpu_s']['steal']:.1f}"),
        ("run s (enqueue s)", lambda r: f"{r['seconds_run']:.1f} ({r['enqueue_s']:.1f})"),
        ("calls at the API", lambda r: str(r["calls"])),
        ("violations (429)", lambda r: str(r["violations"])),
        ("utilization of 20/s", lambda r: f"{r['utilization']:.2%}"),
        ("span of arrivals s", lambda r: f"{r['span_s']:.1f}"),
        ("completed / remaining", lambda r: f"{r['completed']} / {r['remaining']}"),
        ("ids arrived twice", lambda r: str(r["ids_arrived_twice"])),
        ("each id exactly once", lambda r: {None: "n/a (not all done)", True: "yes",
                                            False: "NO"}[r["each_id_exactly_once"]]),
        ("reschedules / executed task (max)",
         lambda r: f"{fmt(r['reschedules_per_task'], '.2f')} ({fmt(r['reschedules_max'])})"),
        ("broker publishes / executed task (publishes)",
         lambda r: f"{fmt(r['publishes_per_task'], '.2f')} ({r['broker_publishes']})"),
        ("late behind slot p50 / p95 / max ms",
         lambda r: "n/a (no slot)" if r["late_p95_ms"] is None else
         f"{r['late_p50_ms']:.1f} / {r['late_p95_ms']:.1f} / {r['late_max_ms']:.1f}"),
        ("API gap excess over 50 ms p95 / max ms",
         lambda r: f"{fmt(r['gap_excess_p95_ms'], '.1f')} / {fmt(r['gap_excess_max_ms'], '.1f')}"),
        ("API idle beyond 50 ms spacing: total s (gaps > 100 ms)",
         lambda r: f"{r['idle_s']:.2f} ({r['gaps_over_100ms']})"),
        ("429s: gap since last allowed call p50 / min ms",
         lambda r: f"{fmt(r['gap_before_429_p50_ms'], '.1f')} / "
                   f"{fmt(r['gap_before_429_min_ms'], '.1f')}"),
        ("wait enqueue -> API p50 / max s",
         lambda r: f"{fmt(r['wait_p50_s'], '.1f')} / {fmt(r['wait_max_s'], '.1f')}"),
        ("max in broker / held by workers / parked",
         lambda r: f"{r['max_in_broker']} / {r['max_held_by_workers']} / {r['max_parked']}"),
        ("worker RSS MB start / end / max",
         lambda r: f"{r['rss_start_mb']:.0f} / {r['rss_end_mb']:.0f} / {r['rss_max_mb']:.0f}"),
        ("worker PSS MB start / end",
         lambda r: f"{r['pss_start_mb']:.0f} / {r['pss_end_mb']:.0f}"),
    ]  # fmt: skip
    for name, cell in lines:
        print(f"| {name} | " + " | ".join(cell(row) for row in rows) + " |")
    print()
    print("Memory is summed over both workers' process trees (main process + 4 children).")
    print("Lateness: call time minus the slot the limiter reserved (ours only). Gap excess: how")
    print("much each gap between consecutive API arrivals exceeds 50 ms (idle limit).")
    print()
    for row in rows:
        # In-flight slack: a message between the broker list and the unacked hash, a result
        # being stored, a re-publication under way: a few per child at most.
        missing = params["backlog"] - row["min_accounted"]
        if missing > 4 * WORKERS * CONCURRENCY:
            print(f"WARNING: {row['title']}: {missing} tasks were at one point nowhere in Redis "
                  "(not completed, queued, held or parked): something outside the benchmark "
                  "touched its Redis; this column is not valid.")  # fmt: skip
            print()
    print("## Targets")
    print()
    print("| target | " + " | ".join(row["title"] for row in rows) + " |")
    print("|---|" + "---|" * len(rows))
    verdicts = {True: "met", False: "NOT met", None: "unknown"}
    per_row = [targets(row) for row in rows]
    for i, (name, _, _) in enumerate(per_row[0]):
        cells = [f"{verdicts[checks[i][1]]} ({checks[i][2]})" for checks in per_row]
        print(f"| {name} | " + " | ".join(cells) + " |")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.celery_fleet",
        description="A Celery fleet against a 20/s burst-1 API: ours vs rate_limit vs naive.",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=60.0,
        help="run time per variant, from the start of enqueueing (default 60)",
    )
    parser.add_argument("--backlog", type=int, default=2000, help="tasks enqueued at once")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, of {', '.join(VARIANTS)} (default all)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEMO_CONFIG,
        help="the limits file of ours (default configs/demo.yaml)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results here")
    args = parser.parse_args(argv)  # fmt: skip
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in VARIANTS]
    if unknown or not args.variant_list:
        parser.error(f"unknown variants {unknown}; choose among {', '.join(VARIANTS)}")
    if args.seconds <= 0 or args.backlog < 1:
        parser.error("--seconds must be > 0 and --backlog >= 1")
    args.config = args.config.resolve()
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="throttle-bench-celery-"))
    print(f"worker and API logs: {logs}; load avg {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    rows = []
    for key in args.variant_list:
        variant = VARIANTS[key]
        if key == "ours":
            variant = replace(variant, title=our_title(args.config))
        print(f"{variant.title}:", flush=True)
        rows.append(run_variant(variant, args, logs))
    params = {
        "seconds": args.seconds,
        "backlog": args.backlog,
        "workers": WORKERS,
        "concurrency": CONCURRENCY,
        "api": {"rate": API_RATE, "burst": API_BURST},
        "config": str(args.config),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print_report(rows, params)
    if args.json is not None:
        out = {
            "params": params,
            "variants": rows,
            "targets": {
                row["variant"]: [
                    {"target": name, "met": met, "detail": detail}
                    for name, met, detail in targets(row)
                ]
                for row in rows
            },
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    # A failure of the run itself: one of our tasks reached the API twice, or was lost.
    ours = next((row for row in rows if row["variant"] == "ours"), None)
    if ours is not None and (ours["ids_arrived_twice"] or ours["each_id_exactly_once"] is False):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
