"""The pools' own ceiling: plain, unthrottled Celery calling an API with 100 ms of latency.

Before judging the throttler on a pool, what does the pool reach without it? Two workers,
each ``-c N`` of one pool, drain ``--tasks`` tasks of ``bench/pools_app.py`` (one
``requests.post`` each, a new connection per call) into the mock API, which answers every
call after ``--latency`` s and never refuses (its limit is far above). Measured at the
API: the rate of the calls, (calls - 1) / (last - first arrival), beside the ceiling
2 x N / latency.

The variants explain a reading of 10 calls/s on ``-P gevent -c 10`` (issue 25):

* ``gevent``: ``celery worker -P gevent``: Celery monkey-patches at start.
* ``gevent (-P given twice)``: ``celery worker -P prefork ... -P gevent``, as the test
  harness wrote the command before: ``celery`` patches by the *first* ``-P``
  (``celery.maybe_patch_concurrency``) and runs the pool of the last, so the greenlets
  share unpatched, blocking sockets: one call at a time per worker.
* ``gevent (API backlog 5)``: the mock API with socketserver's default listen backlog.
* ``gevent (-Pgevent as one word)``: click reads ``-Pgevent`` as ``-P gevent``, but
  ``celery.maybe_patch_concurrency`` looks for ``-P`` as a word of its own (or
  ``--pool``): no monkey-patching.
* ``gevent (GEVENT_RESOLVER=block)``: gevent resolves host names in a pool of native
  threads by default (``gevent.resolver.thread``), a hand-over per ``getaddrinfo``, which
  ``requests`` calls for every new connection; ``block`` resolves in the calling greenlet.
* ``gevent (worker_pool setting and no -P)``: the pool named in the app's ``worker_pool``
  setting (here through ``POOLS_WORKER_POOL``) and not on the command line: Celery runs
  the gevent pool, and nothing patches.

Run: ``.venv/bin/python -m bench.pools [--tasks 400] [--latency 0.1]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from celery import Celery

from bench.celery_fleet import ApiProcess
from bench.checkout import stop
from tests.support.servers import RedisServer
from workers.harness import ROOT
from workers.stack import worker_argv

APP = "bench.pools_app"

ATTACHED = ("<attached>",)
"""Marks a variant whose command line says ``-Pgevent`` (one word, as click accepts it)."""
FROM_SETTING = ("<setting>",)
"""Marks a variant that names the pool in the app's ``worker_pool`` setting, without
``-P``."""

VARIANTS: dict[str, tuple[str, int, tuple[str, ...], tuple[str, ...]]] = {
    # name: (pool, concurrency, extra worker args, extra API args)
    "prefork -c 4": ("prefork", 4, (), ()),
    "threads -c 10": ("threads", 10, (), ()),
    "gevent -c 10": ("gevent", 10, (), ()),
    "gevent -c 10 (-P given twice)": ("prefork", 10, ("-P", "gevent"), ()),
    "gevent -c 10 (API backlog 5)": ("gevent", 10, (), ("--backlog", "5")),
    "gevent -c 50": ("gevent", 50, (), ()),
    "gevent -c 10 (-Pgevent as one word)": ("gevent", 10, ATTACHED, ()),
    "gevent -c 10 (worker_pool setting and no -P)": ("gevent", 10, FROM_SETTING, ()),
    "gevent -c 10 (GEVENT_RESOLVER=block)": ("gevent", 10, ("<env>", "GEVENT_RESOLVER=block"), ()),
    "gevent -c 100": ("gevent", 100, (), ()),
    "threads -c 50": ("threads", 50, (), ()),
}


@contextlib.contextmanager
def fleet(
    variant: tuple[str, int, tuple[str, ...], tuple[str, ...]], env: dict[str, str], logs: Path
) -> Iterator[Celery]:
    pool, concurrency, extra, _ = variant
    import subprocess  # noqa: PLC0415

    procs = []
    for name in ("p1", "p2"):
        marked = extra in (ATTACHED, FROM_SETTING) or extra[:1] == ("<env>",)
        argv = worker_argv(
            name, app=APP, concurrency=concurrency, pool=pool, extra=() if marked else extra
        )
        argv[0] = sys.executable
        full = {**os.environ, **env, "POOLS_CONNECTIONS": str(concurrency + 10)}
        at = argv.index("-P")
        if extra == ATTACHED:
            argv[at : at + 2] = [f"-P{pool}"]
        elif extra == FROM_SETTING:
            del argv[at : at + 2]
            full["POOLS_WORKER_POOL"] = pool
        elif extra[:1] == ("<env>",):
            name_, _, value = extra[1].partition("=")
            full[name_] = value
        with open(logs / f"{name}-{pool}-{concurrency}.log", "wb") as out:
            procs.append(
                subprocess.Popen(argv, cwd=ROOT, env=full, stdout=out, stderr=subprocess.STDOUT)
            )
    producer = Celery("pools", broker=env["POOLS_BROKER_URL"])
    producer.conf.update(task_default_queue="upstream", broker_connection_retry_on_startup=True)
    try:
        deadline = time.monotonic() + 120
        # Ready when each says so in its log: a gevent pool over unpatched sockets (-P
        # given twice) consumes tasks but never answers a ping.
        while not all(
            b" ready." in (logs / f"{name}-{pool}-{concurrency}.log").read_bytes()
            for name in ("p1", "p2")
        ):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"workers did not start (see {logs})")
            time.sleep(0.2)
        yield producer
    finally:
        stop(procs)
        producer.close()


def run(name: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    variant = VARIANTS[name]
    api = ApiProcess(100000, 100000, logs / f"api-{name}.log",
                     extra=("--latency", str(args.latency), *variant[3]))  # fmt: skip
    try:
        with RedisServer() as server:
            env = {"POOLS_BROKER_URL": server.url, "MOCK_API_URL": api.url}
            with fleet(variant, env, logs) as producer:
                api.reset()
                for n in range(args.tasks):
                    producer.send_task(f"{APP}.fetch", args=(n,))
                deadline = time.monotonic() + args.timeout
                while api.get("/stats")["calls"] < args.tasks:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                stats = api.get("/stats")
    finally:
        api.stop()
    calls, first, last = stats["calls"], stats["first_s"], stats["last_s"]
    rate = (calls - 1) / (last - first) if calls > 1 and last > first else 0.0
    ceiling = 2 * variant[1] / args.latency
    return {"calls": calls, "rate": rate, "ceiling": ceiling}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--latency", type=float, default=0.1)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-pools-") as tmp:
        for name in args.variants.split(","):
            row = run(name, args, Path(tmp))
            print(name, row)
            rows.append((name, row))
    print()
    print(f"Plain Celery, 2 workers, {args.tasks} tasks, one requests.post each to an API "
          f"answering after {1000 * args.latency:.0f} ms.")  # fmt: skip
    print()
    print("| pool | calls | calls/s at the API | ceiling (2 x c / latency) |")
    print("|---|---|---|---|")
    for name, row in rows:
        print(f"| {name} | {row['calls']} | {row['rate']:.1f} | {row['ceiling']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
