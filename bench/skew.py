"""Workers whose wall clocks disagree: the share of the API's rate the fleet keeps.

``python -m bench.skew [--tasks 120] [--skews 0,0.25,2,30] [--brokers redis,rabbitmq]
[--before REV] [--json PATH]``

Each run starts two ``celery worker`` processes (4 prefork children each) of
``tests/apps/skew_app.py``, one whose wall clock is +S s off and one -S s off (the
LD_PRELOAD shim of ``tests/support/skew.py``: only the wall clock moves, monotonic clocks,
sleeps and timed waits stay true, as on a host whose NTP is off), a private ``redis-server``
(limiter and result backend; the broker too for ``redis``) or a private vhost of the
machine's RabbitMQ, and the mock API in a process of its own allowing 4 calls/s, burst 2,
judged on its own (true) clock. The fleet's limit is GCRA 3.96/s burst 1 with
``max_wait: 2m``; ``--tasks`` tasks are enqueued at once, so most wait up to 30 s.

``--before REV`` runs the same grid with the code of git revision REV (checked out into a
temporary directory; the skew app is copied into it), one run of each version alternating,
so that both versions meet the same load on the machine.

Measured per run: the share of the API's rate (calls the API allowed / (burst + rate x the
span from the first to the last arrival)), refusals (429s), tasks that ran more than once
or not at all, and the run's wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from bench.celery_fleet import ApiProcess
from bench.checkout import checkout, start_worker, stop, wait_started
from tests.support.servers import RedisServer
from tests.support.skew import build_shim, skewed_env
from workers.harness import ROOT

API_RATE, API_BURST = 4.0, 2.0
CONFIG = """
limits:
  upstream: {algorithm: gcra, rate: 3.96/s, burst: 1, max_wait: 2m}
queues:
  upstream: [upstream]
"""
APP = "tests.apps.skew_app"
RABBIT = "amqp://guest:guest@127.0.0.1:5672/{vhost}"


@dataclass
class Run:
    version: str
    broker: str
    skew_s: float
    share: float | None
    refused: int
    calls: int
    completed: int
    twice: int
    seconds: float


@contextlib.contextmanager
def rabbit_vhost() -> Iterator[str]:
    """A private vhost of the machine's RabbitMQ, deleted afterwards."""
    vhost = f"skew-{uuid.uuid4().hex[:8]}"
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        raise SystemExit("rabbitmqctl is missing: the rabbitmq broker runs need RabbitMQ")
    subprocess.run([ctl, "add_vhost", vhost], check=True, capture_output=True, timeout=60)
    try:
        subprocess.run(
            [ctl, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        yield RABBIT.format(vhost=vhost)
    finally:
        subprocess.run([ctl, "delete_vhost", vhost], check=False, capture_output=True, timeout=60)


def share_of(arrivals: list[dict[str, Any]]) -> float | None:
    """Allowed calls / (burst + rate x span), the span from the first to the last arrival."""
    if len(arrivals) < 2:
        return None
    span = arrivals[-1]["at_s"] - arrivals[0]["at_s"]
    return sum(a["allowed"] for a in arrivals) / (API_BURST + API_RATE * span)


def one_run(
    version: str, tree: Path, broker: str, skew_s: float, args: argparse.Namespace,
    api: ApiProcess, shim: Path, logs: Path,
) -> Run:  # fmt: skip
    with RedisServer() as server, contextlib.ExitStack() as stack:
        broker_url = server.url if broker == "redis" else stack.enter_context(rabbit_vhost())
        config = logs / "limits.yaml"
        config.write_text(CONFIG)
        env = {
            "DEMO_BROKER_URL": broker_url,
            "DEMO_BACKEND_URL": server.url,
            "THROTTLE_REDIS_URL": server.url,
            "THROTTLE_CONFIG": str(config),
            "MOCK_API_URL": api.url,
        }
        tag = f"{version}-{broker}-{skew_s:g}"
        procs = [
            start_worker(
                tree, APP, name, {**env, **skewed_env(shim, offset)}, logs / f"{tag}-{name}.log"
            )
            for name, offset in (("ahead", skew_s), ("behind", -skew_s))
        ]
        producer = Celery("skew", broker=broker_url, backend=server.url)
        producer.conf.update(task_default_queue="upstream", broker_connection_retry_on_startup=True)
        client = redis.Redis.from_url(server.url)
        try:
            wait_started(producer, ("ahead", "behind"), procs, f"workers of {tag} (see {logs})")
            api.reset()
            start = time.monotonic()
            handles = [
                producer.send_task(f"{APP}.call", args=(n,), queue="upstream")
                for n in range(args.tasks)
            ]
            completed = 0
            for handle in handles:
                left = max(args.timeout - (time.monotonic() - start), 0.1)
                with contextlib.suppress(Exception):
                    handle.get(timeout=left)
                    completed += 1
            seconds = time.monotonic() - start
            runs = [int(client.get(f"test:runs:{h.id}") or 0) for h in handles]
            arrivals = api.get("/arrivals")
        finally:
            stop(procs)
            client.close()
            producer.close()
        return Run(
            version, broker, skew_s, share_of(arrivals),
            sum(not a["allowed"] for a in arrivals), len(arrivals), completed,
            sum(n > 1 for n in runs), round(seconds, 1),
        )  # fmt: skip


def fmt_share(run: Run | None, tasks: int) -> str:
    if run is None:
        return "-"
    share = "n/a" if run.share is None else f"{100 * run.share:.1f} %"
    flaws = []
    if run.refused:
        flaws.append(f"{run.refused} refused")
    if run.completed < tasks:
        flaws.append(f"{tasks - run.completed} unfinished")
    if run.twice:
        flaws.append(f"{run.twice} twice")
    return share + (f" ({', '.join(flaws)})" if flaws else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=120)
    parser.add_argument(
        "--skews", default="0,0.25,2,30", help="offsets S in s: workers at +S and -S"
    )
    parser.add_argument("--brokers", default="redis,rabbitmq")
    parser.add_argument("--before", default=None, help="a git revision to run beside this tree")
    parser.add_argument("--timeout", type=float, default=240.0, help="per run, in s")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    skews = [float(s) for s in args.skews.split(",")]
    brokers = args.brokers.split(",")
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-skew-") as tmp, contextlib.ExitStack() as stack:
        logs = Path(tmp)
        shim = build_shim(logs)
        trees = {"ours": ROOT}
        if args.before:
            trees[f"before ({args.before})"] = stack.enter_context(
                checkout(args.before, "tests/apps/skew_app.py")
            )
        api = ApiProcess(API_RATE, API_BURST, logs / "api.log")
        stack.callback(api.stop)
        for broker in brokers:
            for skew in skews:
                for version, tree in trees.items():
                    run = one_run(version, tree, broker, skew, args, api, shim, logs)
                    runs.append(run)
                    share = fmt_share(run, args.tasks)
                    print(f"{version:>24}  {broker:8}  +/-{skew:<5g} s  {share}  ({run.seconds} s)")
    print()
    versions = list(dict.fromkeys(r.version for r in runs))
    print(
        f"Share of the API's rate (4/s burst 2; the limit is 3.96/s, 99 %), {args.tasks} tasks, "
        "two workers at +S and -S:"
    )
    print()
    print("| broker | skew | " + " | ".join(versions) + " |")
    print("|---|---|" + "---|" * len(versions))
    for broker in brokers:
        for skew in skews:
            cells = [
                fmt_share(next((r for r in runs if r.version == v and r.broker == broker
                                and r.skew_s == skew), None), args.tasks)
                for v in versions
            ]  # fmt: skip
            print(f"| {broker} | +/-{skew:g} s | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
