"""High rates: a fleet throttled at 100/s and 500/s against an API with 100 ms of latency,
beside the same fleet unthrottled, on gevent, threads and prefork.

``python -m bench.rates [--pools gevent:100,threads:50,prefork:4] [--latency 0.1]
[--seconds 10] [--json PATH]`` (``make bench-rates``)

What runs
---------
Per pool, on fresh pieces: a private ``redis-server`` (broker and limiter), the mock API
of ``workers/mock_api.py`` in a process of its own, answering every call after
``--latency`` s, and two ``celery worker -P POOL -c N`` of ``bench/rates_app.py`` (late
acks, one prefetched task per pool slot; each task one ``requests`` call on a kept-alive
session). Three phases run on the same workers, one after the other:

* ``unthrottled``: the task ``plain``, the API allowing everything: the pool's own
  ceiling on this machine, the control of the two phases after it;
* ``100/s`` and ``500/s``: ``limited_100`` and ``limited_500``, throttled by a GCRA limit
  of that rate, burst a twentieth of a second's worth (5, 25); the API allows the same
  rate with a tenth of a second's worth (10, 50), judged at each call's arrival.

A phase enqueues its tasks on a queue of its own, which the workers consume from their
start (a queue added with ``add_consumer`` would have no lane, where deferred tasks come
back). A throttled phase has ``--seconds`` x its rate tasks and
lasts until every one has reached the API (or 3 x its planned time + 30 s). The
unthrottled phase has as many as the pool could run in 2 x ``--seconds`` at its ceiling
2 x c / latency (at most :data:`CONTROL_MAX` a second) and stops after 2 x ``--seconds`` +
5 s: it measures a rate, not completion. What a phase leaves is deleted from its queue,
and the tasks the workers hold run out before the next phase starts.

What is measured, per phase
---------------------------
* the rate at the API over the steady part of the run: the arrivals between the 10th and
  the 90th percentile, (n - 1) / their span (the ramp-up of the first tasks and the tail
  of the last do not count), and over the whole run;
* that rate as a share of the limit, or of the pool's own unthrottled rate where that is
  lower (the target: at least 98 %);
* refusals at the API (target 0), tasks that reached it more than once (target 0), tasks
  that never did;
* broker publishes per task: list pushes (``LPUSH`` + ``RPUSH``, as kombu's Redis
  transport publishes and restores messages) in ``INFO commandstats``, counted from
  before the phase's enqueueing to its end, over its tasks: 1.00 when nothing is sent
  twice (the target: at most 1.1);
* the limiter's script calls per task (``FCALL``, ``EVALSHA``, ``EVAL``: acquisitions,
  denials and settles) and the server's read events per task (``total_reads_processed``
  in ``INFO stats``: about one per round trip, several pipelined calls in one; the
  broker's traffic included, the same in every phase);
* CPU: the workers' process trees, the API and redis-server, per call, and the machine's
  busy share over the phase (2 cores: 100 % is both), with the load average at its start
  and end: a CPU-bound phase shows it;
* in ``--json`` only, its ``timeline``: arrivals at the API per s in each quarter second
  from the first (a ramp, or a worker that fell behind, shows there).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
from celery import Celery

from bench.celery_fleet import ApiProcess
from bench.checkout import stop, wait_started
from bench.overhead import cpu_s, script_calls
from tests.support.servers import RedisServer
from workers.harness import ROOT
from workers.stack import worker_argv

APP = "bench.rates_app"
LIMITS = {100: 5, 500: 25}  # as bench/rates_app.py: rate per s -> our burst
API_BURST_S = 0.1
"""The API's burst, in seconds' worth of its rate."""
CONTROL_MAX = 500.0
"""The unthrottled phase enqueues at most this many tasks per second of ``--seconds``."""
TARGET_SHARE = 0.98
TARGET_PUBLISHES = 1.1
UNLIMITED = 1_000_000.0
TIMELINE_S = 0.25
"""The width of a bin of a phase's ``timeline`` in the JSON: arrivals at the API per s in
each quarter second from the first."""


def parse_pools(text: str) -> list[tuple[str, int]]:
    pools = []
    for item in text.split(","):
        pool, _, concurrency = item.partition(":")
        pools.append((pool, int(concurrency)))
    return pools


@contextlib.contextmanager
def fleet(
    app: str,
    pool: str,
    concurrency: int,
    queues: Sequence[str],
    broker: str,
    env: dict[str, str],
    logs: Path,
) -> Iterator[tuple[Celery, list[subprocess.Popen[bytes]], list[str]]]:
    """Two workers of ``app`` on ``pool`` consuming ``queues``, and a producer on
    ``broker``. Every queue is consumed from the start (not added later with
    ``add_consumer``): a worker consumes the lane of each queue it starts with, where
    deferred tasks come back."""
    procs = []
    names = [f"r1-{pool}", f"r2-{pool}"]
    for name in names:
        argv = worker_argv(
            name, app=app, concurrency=concurrency, pool=pool, queues=",".join(queues)
        )
        argv[0] = sys.executable
        full = {**os.environ, **env, "RATES_CONNECTIONS": str(concurrency + 10)}
        with open(logs / f"{name}.log", "wb") as out:
            procs.append(
                subprocess.Popen(argv, cwd=ROOT, env=full, stdout=out, stderr=subprocess.STDOUT)
            )
    producer = Celery("bench-producer", broker=broker)
    producer.conf.update(broker_connection_retry_on_startup=True)
    try:
        wait_started(producer, names, procs, f"{pool} workers (see {logs})")
        yield producer, procs, names
    finally:
        stop(procs)
        producer.close()


def pushes(client: Any) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("lpush", "rpush"))


def traffic(client: Any) -> tuple[int, int]:
    """The script calls (:func:`bench.overhead.script_calls`) and the server's read events
    (``total_reads_processed``: about one per round trip, pipelined calls included) so
    far."""
    return script_calls(client), int(client.info("stats")["total_reads_processed"])


def tree_cpu_s(procs: Sequence[subprocess.Popen[bytes]]) -> float:
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += cpu_s(proc.pid, tree=True)
    return total


def steady_rate(times: Sequence[float]) -> float:
    """(n - 1) / span of the arrivals between the 10th and 90th percentile (s)."""
    if len(times) < 10:
        return 0.0
    ordered = sorted(times)
    lo, hi = int(0.1 * len(ordered)), int(0.9 * len(ordered))
    window = ordered[lo : hi + 1]
    span = window[-1] - window[0]
    return (len(window) - 1) / span if span > 0 else 0.0


def phase(
    name: str,
    task: str,
    tasks: int,
    limit_s: float,
    api: ApiProcess,
    api_limit: tuple[float, float],
    producer: Celery,
    procs: list[subprocess.Popen[bytes]],
    server: RedisServer,
    index: int,
    spy: Path | None = None,
) -> dict[str, Any]:
    client = server.client()
    api.post("/limit", {"rate": api_limit[0], "burst": api_limit[1]})
    api.reset()
    queue = f"phase-{index}"
    pushed0 = pushes(client)
    traffic0 = traffic(client)
    load0 = os.getloadavg()[0]
    psutil.cpu_percent()  # starts the machine's busy share from here
    cpu0 = (tree_cpu_s(procs), cpu_s(api.proc.pid, False), cpu_s(server.process.pid, False))
    started = time.monotonic()
    spies = [
        subprocess.Popen(
            [
                "py-spy",
                "record",
                "-p",
                str(proc.pid),
                "-r",
                "200",
                "-f",
                "raw",
                "--nonblocking",
                "--subprocesses",
                "-o",
                str(spy / f"phase{index}-{proc.pid}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for proc in (procs if spy is not None else [])
    ]
    with producer.producer_or_acquire() as pub:
        for n in range(tasks):
            producer.send_task(f"{APP}.{task}", args=(n,), queue=queue, producer=pub)
    deadline = started + limit_s
    while api.get("/stats")["calls"] < tasks and time.monotonic() < deadline:
        time.sleep(0.25)
    elapsed = time.monotonic() - started
    time.sleep(1.0)  # a copy sent twice shows up late
    busy = psutil.cpu_percent()
    for proc in spies:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    cpu1 = (tree_cpu_s(procs), cpu_s(api.proc.pid, False), cpu_s(server.process.pid, False))
    arrivals = api.get("/arrivals")
    pushed = pushes(client) - pushed0
    scripts, reads = (b - a for a, b in zip(traffic0, traffic(client), strict=True))
    # What a phase left (its time was up) must not run into the next one: the queue goes,
    # and the tasks the workers hold run out first.
    client.delete(queue)
    drained = time.monotonic() + 120
    while client.hlen("unacked") and time.monotonic() < drained:
        time.sleep(0.25)
    client.close()
    ids = collections.Counter(a["task_id"] for a in arrivals)
    times = [a["at_s"] for a in arrivals]
    start = min(times, default=0.0)
    timeline = collections.Counter(int((t - start) / TIMELINE_S) for t in times)
    whole = (len(times) - 1) / (max(times) - min(times)) if len(times) > 1 else 0.0
    return {
        "phase": name, "tasks": tasks, "calls": len(arrivals),
        "refused": sum(not a["allowed"] for a in arrivals),
        "twice": sum(1 for c in ids.values() if c > 1), "missing": tasks - len(ids),
        "steady_rate": steady_rate(times), "whole_rate": whole, "elapsed_s": elapsed,
        "workers_cores": (cpu1[0] - cpu0[0]) / (elapsed + 1.0),
        "publishes_per_task": pushed / tasks,
        "scripts_per_task": scripts / tasks, "reads_per_task": reads / tasks,
        "workers_cpu_us": 1e6 * (cpu1[0] - cpu0[0]) / max(len(arrivals), 1),
        "api_cpu_us": 1e6 * (cpu1[1] - cpu0[1]) / max(len(arrivals), 1),
        "redis_cpu_us": 1e6 * (cpu1[2] - cpu0[2]) / max(len(arrivals), 1),
        "machine_busy": busy, "load": (load0, os.getloadavg()[0]),
        "timeline": [timeline[i] / TIMELINE_S for i in range(max(timeline, default=-1) + 1)],
    }  # fmt: skip


def run_pool(pool: str, concurrency: int, args: argparse.Namespace, logs: Path) -> list[dict]:
    rows: list[dict[str, Any]] = []
    api = ApiProcess(UNLIMITED, UNLIMITED, logs / f"api-{pool}.log",
                     extra=("--latency", str(args.latency)))  # fmt: skip
    try:
        with RedisServer() as server:
            env = {"RATES_BROKER_URL": server.url, "MOCK_API_URL": api.url}
            per_round = 1 + len(LIMITS)
            queues = [f"phase-{i}" for i in range(args.rounds * per_round)]
            with fleet(APP, pool, concurrency, queues, server.url, env, logs) as (
                producer,
                procs,
                _,
            ):
                ceiling = 2 * concurrency / args.latency
                control = round(2 * args.seconds * min(ceiling, CONTROL_MAX))
                for round_no in range(args.rounds):
                    first = round_no * per_round
                    common = (api, (UNLIMITED, UNLIMITED), producer, procs, server)
                    # The pool's ceiling: as many tasks as it could run in 2 x --seconds
                    # at 2 x c / latency (capped), stopped after that time.
                    row = phase("unthrottled", "plain", control, 2 * args.seconds + 5,
                                *common, first, args.spy)  # fmt: skip
                    row["round"] = round_no + 1
                    rows.append(row)
                    print(pool, concurrency, shown(row), flush=True)
                    own = row["steady_rate"]
                    for i, (rate, _) in enumerate(LIMITS.items(), start=first + 1):
                        api_limit = (float(rate), rate * API_BURST_S)
                        common = (api, api_limit, producer, procs, server)
                        tasks = round(args.seconds * rate)
                        row = phase(f"{rate}/s", f"limited_{rate}", tasks,
                                    3 * tasks / min(rate, own or rate) + 30, *common, i,
                                    args.spy)  # fmt: skip
                        row["round"] = round_no + 1
                        row["limit"] = rate
                        row["target_rate"] = min(float(rate), own)
                        row["share"] = row["steady_rate"] / row["target_rate"] if own else 0.0
                        rows.append(row)
                        print(pool, concurrency, shown(row), flush=True)
    finally:
        api.stop()
    for row in rows:
        row["pool"] = f"{pool} -c {concurrency}"
    return rows


def shown(row: dict[str, Any]) -> dict[str, Any]:
    """A phase's row as printed while the bench runs (its timeline is in the JSON)."""
    return {key: value for key, value in row.items() if key != "timeline"}


def table(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Two workers per pool, an API answering after {1000 * args.latency:.0f} ms; "
        f"--seconds {args.seconds:g}.",
        "",
        "| pool | round | phase | tasks | rate at the API, steady (whole) | of the target "
        "| refused "
        "| twice / missing | publishes per task | scripts / Redis reads per task "
        "| CPU µs/call: workers / API / redis | workers' cores | machine busy | load |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        share = ""
        if "limit" in r:
            share = f"{100 * r['share']:.1f} % of {r['target_rate']:.1f}/s"
        lines.append(
            f"| {r['pool']} | {r['round']} | {r['phase']} | {r['tasks']} "
            f"| {r['steady_rate']:.1f}/s "
            f"({r['whole_rate']:.1f}) | {share} | {r['refused']} | {r['twice']} / "
            f"{r['missing'] if 'limit' in r else 'n/a'} | {r['publishes_per_task']:.2f} | "
            f"{r['scripts_per_task']:.2f} / {r['reads_per_task']:.2f} | "
            f"{r['workers_cpu_us']:.0f} / "
            f"{r['api_cpu_us']:.0f} / {r['redis_cpu_us']:.0f} | {r['workers_cores']:.2f} | "
            f"{r['machine_busy']:.0f} % | "
            f"{r['load'][0]:.1f} -> {r['load'][1]:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pools", default="gevent:100,threads:50,prefork:4")
    parser.add_argument("--latency", type=float, default=0.1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="the three phases this many times on the same workers (each throttled phase "
        "judged against its own round's control: the load of a shared host drifts)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="keep the workers' and API's logs here")
    parser.add_argument(
        "--spy", type=Path, metavar="DIR",
        help="record each worker with py-spy (on PATH) during each phase, raw stacks in DIR",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.spy is not None:
        args.spy.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-rates-") as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for pool, concurrency in parse_pools(args.pools):
            rows.extend(run_pool(pool, concurrency, args, logs))
    print()
    print(table(rows, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
