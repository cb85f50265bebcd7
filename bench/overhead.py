"""What throttling costs a real worker per task: no-op tasks, plain and under ``@throttled``.

``python -m bench.overhead [--tasks 2000] [--rounds 5] [--concurrency 4] [--before REV]
[--seed N] [--json PATH]``

What runs
---------
One private ``redis-server`` (broker and limiter) and one ``celery worker -P prefork -c 4``
of ``bench/overhead_app.py`` per version of the code: this tree, and with ``--before REV``
the tree of git revision REV (``git archive`` into a temporary directory, the app copied
into it; its worker runs with ``PYTHONPATH`` on that tree, in the same virtualenv). The
tasks (``bench/overhead_app.py``):

* ``plain``: not throttled, no arguments: the baseline of ``one_limit``;
* ``one_limit``: a token bucket far above the rate (it never binds), cost 1;
* ``plain_args``: not throttled, with the arguments of the next two: their baseline (a
  task's arguments cost the worker too, throttled or not);
* ``two_limits``: a GCRA limit and a per-tenant token budget whose cost is an argument (an
  estimate the body does not correct);
* ``reported``: as ``two_limits``, and the body reports its actual cost, so the
  acquisition must be settled: the price of a settle;
* ``shadowed``: a per-tenant GCRA limit in shadow mode (issue 27's "shadow changes
  nothing"): the task runs at once, its look is gathered and sent by a thread of the
  process, one round trip per batch.

A block is ``--tasks`` messages of one task enqueued at once while no worker consumes
their queue, then the worker is told to consume it (``add_consumer``) and the block is
timed until the queue and the broker's unacked messages are empty (late acks: a message is
acknowledged when its task returns), polled every 5 ms. Each round runs one block of every
task on every version, in an order shuffled per round (fixed seed): drift on a shared
machine hits every case alike. A first round of 200 tasks per block warms up connections,
scripts and keys and is not recorded.

What is printed
---------------
Per version and task: the median block time (and the best), µs per task, the ratio to its
plain twin (``plain`` or ``plain_args``, :data:`BASELINE`) of the same version (medians of
the same run) and the µs per task above it; the
CPU time of the worker (main process and pool children; and of the pool children alone)
and of redis-server per task, less sensitive than wall time to other tenants of a shared
machine; and the script calls (FCALL + EVALSHA + EVAL in ``INFO commandstats``) per task.
Nothing but the throttled tasks runs scripts on this server (the app does not start the
releaser, whose polls would).

``--prefetch N`` sets the workers' ``worker_prefetch_multiplier`` (default 1, the demo's
late-ack setting; Celery's own default is 4).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis
from celery import Celery

from bench.checkout import checkout
from tests.support.servers import RedisServer
from workers.harness import ROOT
from workers.stack import worker_argv

APP = "bench.overhead_app"
TASKS = ("plain", "one_limit", "plain_args", "two_limits", "reported", "shadowed")
ARGS: dict[str, tuple[Any, ...]] = {
    "plain": (),
    "one_limit": (),
    "plain_args": ("acme", 1000),
    "two_limits": ("acme", 1000),
    "reported": ("acme", 1000),
    "shadowed": ("acme", 1000),
}
POLL_S = 0.005
WARMUP_TASKS = 200
BASELINE = {
    "plain": "plain",
    "one_limit": "plain",
    "plain_args": "plain_args",
    "two_limits": "plain_args",
    "reported": "plain_args",
    "shadowed": "plain_args",
}
"""Each task's plain twin: the same no-op task, with the same arguments, not throttled."""
SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


@dataclass
class Version:
    """One version of the code and its worker."""

    label: str
    tree: Path
    queue: str
    node: str
    proc: subprocess.Popen[bytes] | None = None
    seconds: dict[str, list[float]] = field(default_factory=dict)
    scripts: dict[str, int] = field(default_factory=dict)
    worker_cpu_s: dict[str, list[float]] = field(default_factory=dict)
    pool_cpu_s: dict[str, list[float]] = field(default_factory=dict)
    redis_cpu_s: dict[str, list[float]] = field(default_factory=dict)


def cpu_s(pid: int, tree: bool) -> float:
    """User + system CPU seconds of a process (and, with ``tree``, of its children)."""
    process = psutil.Process(pid)
    return own_cpu_s(process) + (children_cpu_s(pid) if tree else 0.0)


def own_cpu_s(process: psutil.Process) -> float:
    """User + system CPU seconds of ``process`` alone (0 once it is gone)."""
    with contextlib.suppress(psutil.Error):
        times = process.cpu_times()
        return times.user + times.system
    return 0.0


def children_cpu_s(pid: int) -> float:
    """User + system CPU seconds of the children of ``pid`` (a worker's pool)."""
    return sum(own_cpu_s(child) for child in psutil.Process(pid).children(recursive=True))


def start_worker(version: Version, concurrency: int, env: dict[str, str], log: Path) -> None:
    argv = worker_argv(
        version.node.split("@")[0], app=APP, concurrency=concurrency, queues=version.queue
    )
    argv[0] = sys.executable
    full = {**os.environ, **env, "PYTHONPATH": str(version.tree)}
    with open(log, "wb") as out:
        version.proc = subprocess.Popen(
            argv, cwd=version.tree, env=full, stdout=out, stderr=subprocess.STDOUT
        )


def wait_ready(app: Celery, versions: list[Version], timeout_s: float = 120.0) -> None:
    wanted = {v.node for v in versions}
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for v in versions:
            if v.proc is not None and v.proc.poll() is not None:
                raise RuntimeError(f"the worker of {v.label} exited ({v.proc.returncode})")
        for reply in app.control.ping(timeout=0.5) or []:
            seen.update(reply)
        if wanted <= seen:
            return
    raise TimeoutError(f"workers not ready after {timeout_s} s: {sorted(wanted - seen)}")


def script_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in SCRIPT_COMMANDS)


def block(
    app: Celery, client: redis.Redis, server_pid: int, version: Version, task: str, n: int
) -> tuple[float, int, float, float, float]:
    """Enqueue ``n`` tasks while nobody consumes them, let the version's worker drain them:
    seconds from add_consumer to empty, script calls, CPU seconds of the worker (its main
    process and pool children), of its pool children alone and of redis-server
    meanwhile."""
    assert version.proc is not None
    name = f"{APP}.{task}"
    with app.producer_or_acquire() as producer:
        for _ in range(n):
            app.send_task(name, ARGS[task], queue=version.queue, producer=producer)
    assert client.llen(version.queue) == n, "the queue must hold the whole block"
    calls = script_calls(client)
    worker_cpu, redis_cpu = cpu_s(version.proc.pid, True), cpu_s(server_pid, False)
    pool_cpu = children_cpu_s(version.proc.pid)
    started = time.perf_counter()
    app.control.add_consumer(version.queue, destination=[version.node], reply=True, timeout=10)
    while True:
        pipe = client.pipeline(transaction=False)
        pipe.llen(version.queue).hlen("unacked")
        queued, unacked = pipe.execute()
        if not queued and not unacked:
            break
        time.sleep(POLL_S)
    elapsed = time.perf_counter() - started
    worker_cpu = cpu_s(version.proc.pid, True) - worker_cpu
    redis_cpu = cpu_s(server_pid, False) - redis_cpu
    pool_cpu = children_cpu_s(version.proc.pid) - pool_cpu
    scripts = script_calls(client) - calls
    app.control.cancel_consumer(version.queue, destination=[version.node], reply=True, timeout=10)
    # A BRPOP the worker issued before the cancel may block for up to 1 s on the queue:
    # let it end before the next block fills the queue.
    time.sleep(1.2)
    return elapsed, scripts, worker_cpu, pool_cpu, redis_cpu


def report(versions: list[Version], n: int) -> list[dict[str, Any]]:
    rows = []
    for version in versions:
        for task in TASKS:
            base = BASELINE[task]
            plain = statistics.median(version.seconds[base])
            plain_cpu = statistics.median(version.worker_cpu_s[base])
            plain_redis = statistics.median(version.redis_cpu_s[base])
            plain_pool = statistics.median(version.pool_cpu_s[base])
            samples = version.seconds[task]
            median = statistics.median(samples)
            worker_cpu = statistics.median(version.worker_cpu_s[task])
            redis_cpu = statistics.median(version.redis_cpu_s[task])
            pool_cpu = statistics.median(version.pool_cpu_s[task])
            rows.append({
                "version": version.label,
                "task": task,
                "median_s": median,
                "us_per_task": median / n * 1e6,
                "ratio": median / plain,
                "extra_us_per_task": (median - plain) / n * 1e6,
                "scripts_per_task": version.scripts[task] / (n * len(samples)),
                "worker_cpu_us_per_task": worker_cpu / n * 1e6,
                "worker_cpu_ratio": worker_cpu / plain_cpu,
                "pool_cpu_us_per_task": pool_cpu / n * 1e6,
                "pool_cpu_extra_us_per_task": (pool_cpu - plain_pool) / n * 1e6,
                "redis_cpu_us_per_task": redis_cpu / n * 1e6,
                "redis_cpu_extra_us_per_task": (redis_cpu - plain_redis) / n * 1e6,
                "best_s": min(samples),
                "samples_s": samples,
            })  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]], n: int, rounds: int, prefetch: int) -> None:
    print(f"\n{n} no-op tasks per block, {rounds} rounds, prefetch multiplier {prefetch}, medians")
    print(
        "| version | task | median s (best) | µs/task | vs plain | µs/task over plain "
        "| worker CPU µs/task (vs plain) | of which pool children (over plain) "
        "| redis CPU µs/task | script calls/task |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['version']} | {r['task']} | {r['median_s']:.3f} ({r['best_s']:.3f}) "
            f"| {r['us_per_task']:.0f} | {r['ratio']:.2f}x | {r['extra_us_per_task']:+.0f} "
            f"| {r['worker_cpu_us_per_task']:.0f} ({r['worker_cpu_ratio']:.2f}x) "
            f"| {r['pool_cpu_us_per_task']:.0f} ({r['pool_cpu_extra_us_per_task']:+.0f}) "
            f"| {r['redis_cpu_us_per_task']:.0f} ({r['redis_cpu_extra_us_per_task']:+.0f}) "
            f"| {r['scripts_per_task']:.2f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--before", default=None, help="a git revision to run beside this tree")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--prefetch",
        type=int,
        default=1,
        help="the workers' worker_prefetch_multiplier (1, the demo's; Celery's default is 4)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="overhead-")))
        versions = [Version("this tree", ROOT, "overhead-this", "this@overhead")]
        if args.before:
            tree = stack.enter_context(checkout(args.before, "bench/overhead_app.py"))
            versions.append(Version(f"before ({args.before})", tree, "overhead-before",
                                    "before@overhead"))  # fmt: skip
        env = {"OVERHEAD_BROKER_URL": server.url, "OVERHEAD_PREFETCH": str(args.prefetch)}
        os.environ.update(env)
        from bench.overhead_app import app  # noqa: PLC0415

        app.conf.broker_url = server.url
        assert server.process is not None
        server_pid = server.process.pid
        client = redis.Redis.from_url(server.url)
        stack.callback(client.close)
        try:
            for version in versions:
                version.node = f"{version.node.split('@')[0]}@{socket.gethostname()}"
                start_worker(version, args.concurrency, env, logs / f"{version.queue}.log")
            wait_ready(app, versions)
            for version in versions:
                app.control.cancel_consumer(
                    version.queue, destination=[version.node], reply=True, timeout=10
                )
            time.sleep(1.2)
            for version in versions:  # warm-up, not recorded
                for task in TASKS:
                    block(app, client, server_pid, version, task, WARMUP_TASKS)
            for round_no in range(args.rounds):
                cases = [(v, t) for v in versions for t in TASKS]
                rng.shuffle(cases)
                for version, task in cases:
                    seconds, scripts, worker_cpu, pool_cpu, redis_cpu = block(
                        app, client, server_pid, version, task, args.tasks
                    )
                    version.seconds.setdefault(task, []).append(seconds)
                    version.worker_cpu_s.setdefault(task, []).append(worker_cpu)
                    version.pool_cpu_s.setdefault(task, []).append(pool_cpu)
                    version.redis_cpu_s.setdefault(task, []).append(redis_cpu)
                    version.scripts[task] = version.scripts.get(task, 0) + scripts
                    print(
                        f"round {round_no + 1}: {version.label:<22} {task:<10} "
                        f"{seconds:.3f} s, worker CPU {worker_cpu:.3f} s, "
                        f"{scripts / args.tasks:.2f} scripts/task",
                        flush=True,
                    )
        finally:
            for version in versions:
                if version.proc is not None and version.proc.poll() is None:
                    version.proc.terminate()
            for version in versions:
                if version.proc is not None:
                    try:
                        version.proc.wait(30)
                    except subprocess.TimeoutExpired:
                        version.proc.kill()
                        version.proc.wait(10)
    rows = report(versions, args.tasks)
    print_table(rows, args.tasks, args.rounds, args.prefetch)
    load = os.getloadavg()
    print(
        f"\n{started}, {platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average at the end {load[0]:.1f}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"started": started, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
