"""Tenants: a flood of one tenant and a trickle of another under a shared limit, and the
single-limit baseline, with a real Celery fleet, this tree beside an older revision.

Limits (``tests/apps/tenants_app.py``): ``tenant`` 15/s burst 1 per tenant (GCRA),
``shared`` 19.8/s burst 1 (GCRA, 99 % of the API). The mock API allows 20/s burst 2.

* Tenants: tenant A sends ``--flood`` tasks at once; ``--after`` s later (and once A's
  tasks have all left the queue) tenant B sends ``--trickle``. Reported: B's waits (Redis
  time, from its send to its granted slot) and their excess over B's own spacing (task i in
  slot order may wait i/15 s), the shared limit's use against what the keyed limits allowed
  (min(19.8, 15 x active tenants) integrated over the run, + its burst), API refusals.
* Baseline: ``--baseline`` tasks under ``shared`` alone, once per ``--guard`` variant
  (``default``: the limits file as above, where the call-time spacing guard is on, as
  for every burst-1 limit; ``off``: ``spacing_guard: false`` on ``shared``), each on a
  fleet of its own. Measured: the rate of the calls, (calls - 1) / (last call - first
  call) at the API, as a share of the limit's rate (19.8/s: how much of its limit the
  fleet uses; target 99 %) and of the API's (20/s); the limiter's own schedule, the same
  over the slots it granted (Redis time); how late the calls were behind their slots
  (median and the last call's); refusals. Beside them the former measure, allowed calls
  / (the API's burst + its rate x the span), whose ceiling for 300 calls at 19.8/s is
  98.7 % (300 / (2 + 20 x 299 / 19.8)): it counts the limit's 1 % headroom and the API's
  burst as losses.

Every part also reports broker publishes per task: the messages published to the private
redis-server broker from the first send until every task completed (one ``LPUSH`` each:
:func:`tests.support.publishes.broker_lpushes`), the producer's own included, divided by
the tasks; issue 25's target is <= 1.1 at a steady backlog.

``--park-lead`` sets how early a parked task comes back before its slot (it then sleeps
in its pool slot; capped at half of ``sleep_max``, 0.25 s here).

Run: ``.venv/bin/python -m bench.tenants --before f0eea23`` (2 workers x 4 children);
``--parts baseline`` for the baseline alone (both variants; ``--guard default`` for one).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from bench.celery_fleet import ApiProcess
from bench.checkout import checkout
from tests.support.publishes import broker_lpushes
from tests.support.servers import RedisServer
from tests.support.tenants import LIMITS
from tests.support.upstream import violations_explained
from workers.harness import ROOT
from workers.stack import worker_argv

APP = "tests.apps.tenants_app"
QUEUE = "upstream"
TENANT_RATE, SHARED_RATE = 15.0, 19.8
API_RATE, API_BURST = 20.0, 2.0


def redis_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return float(seconds) + micros / 1e6


@contextlib.contextmanager
def fleet(
    tree: Path, env: dict[str, str], logs: Path, tag: str, pool: str = "prefork",
    concurrency: int = 4,
) -> Iterator[Celery]:  # fmt: skip
    """Two workers of ``concurrency`` (4 prefork children by default) running ``tree``'s
    code, and a producer."""
    procs = []
    if concurrency > 8:
        env = {**env, "TENANTS_MAX_CONNECTIONS": str(concurrency + 10)}
    for name in ("w1", "w2"):
        argv = worker_argv(name, app=APP, concurrency=concurrency, queues=QUEUE, pool=pool)
        argv[0] = sys.executable
        full = {**os.environ, **env, "PYTHONPATH": str(tree)}
        with open(logs / f"{tag}-{name}.log", "wb") as out:
            procs.append(
                subprocess.Popen(argv, cwd=tree, env=full, stdout=out, stderr=subprocess.STDOUT)
            )
    producer = Celery(
        "tenants", broker=env["TENANTS_BROKER_URL"], backend=env["TENANTS_BROKER_URL"]
    )
    producer.conf.update(task_default_queue=QUEUE, broker_connection_retry_on_startup=True)
    try:
        deadline = time.monotonic() + 120
        while len({n for r in producer.control.ping(timeout=1.0) or [] for n in r}) < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"workers of {tag} did not start (see {logs})")
        yield producer
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        producer.close()


def p(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def allowed_calls(start: float, a_end: float, b_start: float, b_end: float) -> float:
    """What the keyed limits allowed the shared one over [start, end]: min(19.8, 15 x active
    tenants) integrated (10 ms steps), + the shared limit's burst."""
    total, t, step = 1.0, start, 0.01
    while t < max(a_end, b_end):
        active = (start <= t <= a_end) + (b_start <= t <= b_end)
        total += min(SHARED_RATE, TENANT_RATE * active) * step
        t += step
    return total


def tenants_run(
    producer: Celery, client: redis.Redis, api: ApiProcess, args: argparse.Namespace
) -> dict[str, Any]:
    origin = api.reset()
    lpushes = broker_lpushes(client)
    start = redis_now(client)
    flood = [producer.send_task(f"{APP}.call", args=("A", n)) for n in range(args.flood)]
    while redis_now(client) < start + args.after or client.llen(QUEUE):
        time.sleep(0.05)
    sent = redis_now(client)
    trickle = [producer.send_task(f"{APP}.call", args=("B", n)) for n in range(args.trickle)]
    done = [h.get(timeout=args.timeout) for h in flood + trickle]
    published = (broker_lpushes(client) - lpushes) / len(done)
    a = sorted(r["slot"] for r in done if r["tenant"] == "A")
    b = sorted(r["slot"] for r in done if r["tenant"] == "B")
    waits = [s - sent for s in b]
    excess = [w - i / TENANT_RATE for i, w in enumerate(waits)]
    used = allowed_calls(a[0], a[-1], sent, b[-1])
    # B's tail: a task deferred 0 times waited for a worker to take it (broker order, busy
    # pool slots); one deferred waited for the limiter.
    for r in sorted((r for r in done if r["tenant"] == "B"), key=lambda r: r["slot"]):
        print(
            f"  B {r['n']}: wait {r['slot'] - sent:.2f} s, deferrals {r['deferrals']}, "
            f"planned {r['planned']}"
        )
    return {
        "b_p50": statistics.median(waits), "b_p95": p(waits, 0.95), "b_excess_p95": p(excess, 0.95),
        "shared_use": len(a + b) / used, "refused": api.get("/stats")["violations"],
        "unexplained": unexplained(api, origin, done),
        "twice": sum(r["runs"] > 1 for r in done), "span": a[-1] - a[0],
        "publishes": published,
    }  # fmt: skip


def queue_run(
    producer: Celery, client: redis.Redis, api: ApiProcess, args: argparse.Namespace
) -> dict[str, Any]:
    """The tenants on one queue, as a producer sends them: A's flood at once, then B's
    trickle ``--after`` s later, one task every ``--spacing`` s, whatever is still queued
    (A's tasks are, when the fleet takes them at A's rate)."""
    origin = api.reset()
    lpushes = broker_lpushes(client)
    start = redis_now(client)
    flood = [producer.send_task(f"{APP}.call", args=("A", n)) for n in range(args.flood)]
    trickle, sent = [], []
    queued = 0
    for n in range(args.trickle):
        due = start + args.after + n * args.spacing
        while (now := redis_now(client)) < due:
            time.sleep(min(0.01, due - now))
        if n == 0:
            queued = int(client.llen(QUEUE))
        sent.append(redis_now(client))
        trickle.append(producer.send_task(f"{APP}.call", args=("B", n)))
    done = [h.get(timeout=args.timeout) for h in flood + trickle]
    published = (broker_lpushes(client) - lpushes) / len(done)
    a = sorted(r["slot"] for r in done if r["tenant"] == "A")
    b = [r["slot"] for r in sorted((r for r in done if r["tenant"] == "B"), key=lambda r: r["n"])]
    waits = [slot - at for slot, at in zip(b, sent, strict=True)]
    # B's own limit (15/s) lets task i start no earlier than this: its excess is the wait
    # beyond it.
    earliest: list[float] = []
    for at in sent:
        earliest.append(max(at, earliest[-1] + 1 / TENANT_RATE) if earliest else at)
    excess = [slot - e for slot, e in zip(b, earliest, strict=True)]
    for n, (wait, r) in enumerate(zip(waits, sorted(
        (r for r in done if r["tenant"] == "B"), key=lambda r: r["n"]), strict=True)):  # fmt: skip
        print(f"  B {n}: wait {wait:.2f} s, deferrals {r['deferrals']}, planned {r['planned']}")
    allowed = demand_allowed(a, sent, b)
    return {
        "b_p50": statistics.median(waits), "b_p95": p(waits, 0.95),
        "b_excess_p95": p(excess, 0.95), "b_max": max(waits),
        "shared_use": len(a + b) / allowed, "a_rate": (len(a) - 1) / (a[-1] - a[0]),
        "queued": queued, "refused": api.get("/stats")["violations"],
        "unexplained": unexplained(api, origin, done),
        "twice": sum(r["runs"] > 1 for r in done), "span": max(a[-1], b[-1]) - a[0],
        "publishes": published,
    }  # fmt: skip


def demand_allowed(a: Sequence[float], b_sent: Sequence[float], b: Sequence[float]) -> float:
    """What the keyed limits allowed the shared one, from A's first slot to the last call:
    min(19.8, 15 x tenants with a task waiting) integrated (10 ms steps), + the shared
    limit's burst. A waits from its first slot to its last; B while one of its tasks is sent
    and not yet started (its trickle is slower than its limit)."""
    total, t, step = 1.0, a[0], 0.01
    end = max(a[-1], b[-1])
    while t < end:
        waiting_a = t <= a[-1]
        waiting_b = sum(at <= t for at in b_sent) > sum(slot <= t for slot in b)
        total += min(SHARED_RATE, TENANT_RATE * (waiting_a + waiting_b)) * step
        t += step
    return total


def unexplained(api: ApiProcess, origin: float, done: list[dict[str, Any]]) -> int:
    """How many refusals calls on time cannot explain (the schedule's fault, not a late
    call's: :func:`tests.support.upstream.violations_explained`). An arrival's lateness is
    its API time (this host's monotonic clock, from ``origin``) behind its slot (Redis
    time; Redis runs on this host)."""
    arrivals = api.get("/arrivals")
    slot_of = {r["id"]: r["slot"] for r in done}
    epoch_of_monotonic = time.time() - time.monotonic()
    late = [epoch_of_monotonic + origin + a["at_s"] - slot_of[a["task_id"]] for a in arrivals]
    worst = sorted(late)[-3:]
    print(f"  latest calls behind their slots: {', '.join(f'{x * 1000:.0f} ms' for x in worst)}")
    return len(violations_explained(arrivals, late, API_RATE, API_BURST))


def baseline_run(
    producer: Celery, client: redis.Redis, api: ApiProcess, args: argparse.Namespace
) -> dict[str, Any]:
    origin = api.reset()
    lpushes = broker_lpushes(client)
    handles = [producer.send_task(f"{APP}.solo", args=(n,)) for n in range(args.baseline)]
    done = [h.get(timeout=args.timeout) for h in handles]
    published = (broker_lpushes(client) - lpushes) / len(done)
    arrivals = api.get("/arrivals")
    span = arrivals[-1]["at_s"] - arrivals[0]["at_s"]
    allowed = sum(x["allowed"] for x in arrivals)
    rate = (len(arrivals) - 1) / span
    slots = sorted(r["slot"] for r in done)
    # How late each call reached the API behind its slot (see unexplained()), in arrival
    # order: with the spacing guard, a late call pushes every later one back.
    slot_of = {r["id"]: r["slot"] for r in done}
    epoch_of_monotonic = time.time() - time.monotonic()
    late = [epoch_of_monotonic + origin + a["at_s"] - slot_of[a["task_id"]] for a in arrivals]
    return {
        "of_limit": rate / SHARED_RATE, "of_api": rate / API_RATE,
        "schedule": (len(slots) - 1) / (slots[-1] - slots[0]) / SHARED_RATE,
        "late_p50": statistics.median(late), "late_last": late[-1],
        "former": allowed / (API_BURST + API_RATE * span), "refused": len(arrivals) - allowed,
        "unexplained": unexplained(api, origin, done),
        "twice": sum(r["runs"] > 1 for r in done), "publishes": published,
    }  # fmt: skip


DEFAULT_LIMITS = LIMITS[LIMITS.index("limits:") :]
"""The tenants' limits under the default settings (the queue part)."""

SHARED = "shared: {algorithm: gcra, rate: 19.8/s, burst: 1"
GUARDS = {"default": LIMITS, "off": LIMITS.replace(SHARED, SHARED + ", spacing_guard: false")}
"""The limits file of each baseline variant (``--guard``): as is (the guard on, the default
for burst-1 limits), or without the guard on ``shared``."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flood", type=int, default=300)
    parser.add_argument("--trickle", type=int, default=10)
    parser.add_argument("--after", type=float, default=5.0)
    parser.add_argument("--baseline", type=int, default=300)
    parser.add_argument("--before", default=None, help="a git revision to run beside this tree")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument(
        "--parts", default="tenants,baseline", help="queue, tenants, baseline (comma-separated)"
    )
    parser.add_argument(
        "--pools", default="prefork:4,threads:8,gevent:50",
        help="queue: the pools (POOL:CONCURRENCY, comma-separated) of the 2 workers",
    )  # fmt: skip
    parser.add_argument("--spacing", type=float, default=0.5, help="queue: B's send interval")
    parser.add_argument(
        "--guard", default="default,off", help="baseline variants: default (guard on), off"
    )
    parser.add_argument(
        "--park-lead",
        default="1s",
        help="settings.park_lead of the baseline variants (capped at half of sleep_max); "
        "several, comma-separated: each guard variant with each",
    )
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    variants = [
        (guard, lead) for lead in args.park_lead.split(",") for guard in args.guard.split(",")
    ]
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    rows: list[tuple[str, dict[str, Any] | None, list[tuple[str, str, dict[str, Any]]]]] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-tenants-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        logs = Path(tmp)
        trees = {"ours": ROOT}
        if args.before:
            trees[f"before ({args.before})"] = stack.enter_context(
                checkout(args.before, "tests/apps/tenants_app.py")
            )
        # Its own process: the API stamps arrivals on time while this one waits for results.
        api = ApiProcess(API_RATE, API_BURST, logs / "api.log")
        stack.callback(api.stop)
        queue_rows: list[tuple[str, str, dict[str, Any]]] = []
        if "queue" in parts:
            config = logs / "limits-default.yaml"
            config.write_text(DEFAULT_LIMITS)
            for pool_spec in args.pools.split(","):
                pool, concurrency = pool_spec.split(":")
                for version, tree in trees.items():
                    with RedisServer() as server:
                        env = {
                            "TENANTS_BROKER_URL": server.url, "THROTTLE_CONFIG": str(config),
                            "MOCK_API_URL": api.url,
                        }  # fmt: skip
                        client = redis.Redis.from_url(server.url)
                        tag = f"{version.split()[0]}-{pool}"
                        with fleet(tree, env, logs, tag, pool, int(concurrency)) as producer:
                            row = queue_run(producer, client, api, args)
                        print(version, pool_spec, "queue", row)
                        queue_rows.append((version, pool_spec, row))
                        client.close()
        for version, tree in trees.items():
            if parts == ["queue"]:
                break
            tenants: dict[str, Any] | None = None
            bases: list[tuple[str, str, dict[str, Any]]] = []
            # A revision from before the spacing guard knows no such field (and no guard).
            known = "spacing_guard" in (tree / "throttle" / "rules.py").read_text()
            for i, (guard, lead) in enumerate(variants if known else variants[:1]):
                config = logs / f"limits-{guard}-{lead}.yaml"
                config.write_text(GUARDS[guard].replace("park_lead: 1s", f"park_lead: {lead}"))
                with RedisServer() as server:
                    env = {
                        "TENANTS_BROKER_URL": server.url, "THROTTLE_CONFIG": str(config),
                        "MOCK_API_URL": api.url,
                    }  # fmt: skip
                    client = redis.Redis.from_url(server.url)
                    tag = f"{version.split()[0]}-{guard}-{lead}"
                    with fleet(tree, env, logs, tag) as producer:
                        if i == 0 and "tenants" in parts:
                            tenants = tenants_run(producer, client, api, args)
                            print(version, "tenants", tenants)
                        if "baseline" in parts:
                            base = baseline_run(producer, client, api, args)
                            print(version, "baseline", guard, lead, base)
                            bases.append((guard if known else "none yet", lead, base))
                    client.close()
            rows.append((version, tenants, bases))
    print()
    print(
        f"Tenants: A floods {args.flood} tasks (tenant 15/s burst 1), B sends {args.trickle} "
        f"{args.after:g} s later; shared 19.8/s burst 1; API 20/s burst 2. Baseline: "
        f"{args.baseline} tasks under the shared limit alone."
    )
    if "queue" in parts:
        print()
        print(
            f"Tenants on one queue (default settings): A floods {args.flood} tasks (tenant "
            f"15/s burst 1); {args.after:g} s later B sends {args.trickle}, one every "
            f"{args.spacing:g} s, on the same queue; shared 19.8/s burst 1; API 20/s burst 2; "
            "2 workers."
        )
        print()
        print("| pool | version | A queued when B began | B wait p50 | B wait p95 | B max "
              "| B p95 beyond its spacing | shared used / allowed | A's rate "
              "| refused (unexplained) | twice | publishes / task |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for version, pool_spec, t in queue_rows:
            print(
                f"| {pool_spec.replace(':', ' -c ')} | {version} | {t['queued']} "
                f"| {t['b_p50']:.2f} s | {t['b_p95']:.2f} s | {t['b_max']:.2f} s "
                f"| {t['b_excess_p95']:.2f} s | {100 * t['shared_use']:.1f} % "
                f"| {t['a_rate']:.2f}/s | {t['refused']} ({t['unexplained']}) | {t['twice']} "
                f"| {t['publishes']:.2f} |"
            )
    if "tenants" in parts:
        print()
        print("| version | B wait p50 | B wait p95 | B p95 beyond its spacing "
              "| shared used / allowed | refused (unexplained) | publishes / task |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for version, t, _ in rows:
            assert t is not None
            print(
                f"| {version} | {t['b_p50']:.2f} s | {t['b_p95']:.2f} s "
                f"| {t['b_excess_p95']:.2f} s | {100 * t['shared_use']:.1f} % "
                f"| {t['refused']} ({t['unexplained']}) | {t['publishes']:.2f} |"
            )
    if "baseline" in parts:
        print()
        print("| version | spacing guard | park_lead | calls: rate / limit | rate / API "
              "| schedule / limit | late p50 | last call late | former measure "
              "| refused (unexplained) | publishes / task |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for version, _, bases in rows:
            for guard, lead, b in bases:
                print(
                    f"| {version} | {guard} | {lead} | {100 * b['of_limit']:.1f} % "
                    f"| {100 * b['of_api']:.1f} % | {100 * b['schedule']:.1f} % "
                    f"| {1000 * b['late_p50']:.0f} ms | {1000 * b['late_last']:.0f} ms "
                    f"| {100 * b['former']:.1f} % | {b['refused']} ({b['unexplained']}) "
                    f"| {b['publishes']:.2f} |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
