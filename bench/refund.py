"""Cost and refund: a token limit whose tasks reserve about twice what they report.

``python -m bench.refund [--tasks 150] [--pool prefork:4] [--json PATH]``
(``make bench-refund``)

What runs
---------
A private ``redis-server`` (broker and limiter), the mock OpenAI provider of
``workers/providers`` in a process of its own, and two ``celery worker`` of
``bench/refund_app.py`` (prefork, 4 children each by default; the throttler's default
settings). The provider allows **2,000 tokens/s** in a bucket of 4,000 (``--burst-s 2``;
requests unlimited) and charges each call its real usage at its arrival: the prompt (240
characters: 60 tokens) and the reply (``--fill`` 0.516 of ``max_tokens`` 1,000: 516
tokens), 576 tokens. Our limit is the same: 2,000 tokens/s, burst 4,000.

Two phases, each on fresh pieces (its own redis-server, provider and workers), each
``--tasks`` tasks enqueued at once (a backlog), ending when every task has called the
provider or after ``--timeout`` s:

* ``estimated``: each task reserves prompt + ``max_tokens`` = 1,060 tokens and reports its
  usage, 576, with ``report_cost``: the refund (484 tokens a task) should let the waiting
  tasks go sooner, as an LLM call's would;
* ``exact``: each task reserves 576, what it will report: the same fleet without refunds,
  the reference.

What is measured, per phase (at the provider)
---------------------------------------------
* the token rate used: tokens the provider charged over the run, as a share of what it
  allowed in that time (its bucket, full at the start, + 2,000 x the span from the first
  to the last arrival), and over the steady part (from :data:`SETTLE_S` s after the first
  arrival to the last: the initial bucket spent) as a share of 2,000/s (target: at least
  90 %);
* calls the provider refused, as a share of the calls (target: at most 1 %);
* tasks that reached it more than once, or never (target: every task once);
* broker publishes per task (``LPUSH`` + ``RPUSH`` in ``INFO commandstats``, the
  enqueueing included: 1.00 when no task is sent again);
* the load average at the start and end.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.celery_fleet import MockProcess
from bench.rates import fleet, parse_pools, pushes
from tests.support.servers import RedisServer

APP = "bench.refund_app"
RATE, BURST = 2000.0, 4000.0  # as bench/refund_app.py
PROMPT = "x" * 240  # 60 tokens as the mock counts them
MAX_TOKENS = 1000
FILL = 0.516  # the reply: 516 tokens of max_tokens
USAGE = 60 + round(MAX_TOKENS * FILL)
ESTIMATE = 60 + MAX_TOKENS
SETTLE_S = 5.0
TARGET_USED, TARGET_REFUSED = 0.90, 0.01


class ProviderProcess(MockProcess):
    """``python -m workers.providers openai``: 2,000 tokens/s in a bucket of 2 s' worth,
    requests unlimited, replies of :data:`FILL` x ``max_tokens``."""

    def __init__(self, log: Path) -> None:
        argv = ["workers.providers", "openai", "--requests-per-min", "100000000",
                "--tokens-per-min", str(RATE * 60), "--burst-s", str(BURST / RATE),
                "--fill", str(FILL)]  # fmt: skip
        super().__init__(argv, log, "/_mock/stats")


def measure(arrivals: list[dict[str, Any]], tasks: int) -> dict[str, Any]:
    allowed = [a for a in arrivals if a["allowed"]]
    times = [a["at_s"] for a in arrivals]
    first, last = (min(times), max(times)) if times else (0.0, 0.0)
    used = sum(a["charged"].get("tokens", 0.0) for a in allowed)
    span = last - first
    steady = [a for a in allowed if a["at_s"] >= first + SETTLE_S]
    steady_span = last - (first + SETTLE_S)
    ids = collections.Counter(a["task_id"] for a in arrivals)
    return {
        "calls": len(arrivals),
        "refused": len(arrivals) - len(allowed),
        "refused_share": (len(arrivals) - len(allowed)) / max(len(arrivals), 1),
        "twice": sum(1 for c in ids.values() if c > 1),
        "missing": tasks - len(ids),
        "span_s": span,
        "tokens": used,
        "used_share": used / (BURST + RATE * span) if span > 0 else 0.0,
        "steady_share": (
            sum(a["charged"].get("tokens", 0.0) for a in steady) / steady_span / RATE
            if steady_span > 0 else 0.0
        ),
        "tasks_per_s": (len(allowed) - 1) / span if span > 0 else 0.0,
    }  # fmt: skip


def run(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    return [run_phase(name, args, logs) for name in args.phases.split(",")]


def run_phase(name: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """One phase on fresh pieces (a phase that did not finish leaves nothing behind)."""
    (pool, concurrency), = parse_pools(args.pool)  # fmt: skip
    cost = ESTIMATE if name == "estimated" else USAGE
    (logs / name).mkdir(parents=True, exist_ok=True)
    provider = ProviderProcess(logs / name / "provider.log")
    try:
        with RedisServer() as server:
            env = {"REFUND_BROKER_URL": server.url, "MOCK_PROVIDER_URL": provider.url}
            with fleet(APP, pool, concurrency, ["bench"], server.url, env, logs / name) as (
                producer, _, _,
            ):  # fmt: skip
                client = server.client()
                provider.post("/_mock/reset", {})
                pushed0 = pushes(client)
                load0 = os.getloadavg()[0]
                started = time.monotonic()
                with producer.producer_or_acquire() as pub:
                    for _ in range(args.tasks):
                        producer.send_task(f"{APP}.{name}", args=(PROMPT, MAX_TOKENS, cost),
                                           queue="bench", producer=pub)  # fmt: skip
                deadline = started + args.timeout
                while (provider.get("/_mock/stats")["calls"] < args.tasks
                       and time.monotonic() < deadline):  # fmt: skip
                    time.sleep(0.25)
                time.sleep(1.0)  # a copy sent twice shows up late
                row = measure(provider.get("/_mock/arrivals"), args.tasks)
                row.update(phase=name, tasks=args.tasks, reserved=cost,
                           publishes_per_task=(pushes(client) - pushed0) / args.tasks,
                           elapsed_s=time.monotonic() - started,
                           load=(load0, os.getloadavg()[0]))  # fmt: skip
                client.close()
    finally:
        provider.stop()
    print(row, flush=True)
    return row


def table(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Two workers ({args.pool}), {args.tasks} tasks per phase enqueued at once; each uses "
        f"{USAGE} tokens; the provider allows {RATE:.0f} tokens/s, bucket {BURST:.0f}.",
        "",
        "| phase | reserved / used per task | tokens used of the provider's rate: whole run "
        "(steady) | tasks/s | refused at the provider | twice / missing "
        "| publishes per task | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['phase']} | {r['reserved']} / {USAGE} | {100 * r['used_share']:.1f} % "
            f"({100 * r['steady_share']:.1f} %) | {r['tasks_per_s']:.2f} | {r['refused']} "
            f"({100 * r['refused_share']:.1f} %) | {r['twice']} / {r['missing']} | "
            f"{r['publishes_per_task']:.2f} | {r['load'][0]:.1f} -> {r['load'][1]:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=150)
    parser.add_argument("--pool", default="prefork:4")
    parser.add_argument("--phases", default="estimated,exact")
    parser.add_argument(
        "--timeout", type=float, default=240.0,
        help="a phase ends after this many s, its tasks done or not (missing)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    parser.add_argument("--logs", type=Path, help="keep the workers' and provider's logs here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-refund-") as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        rows = run(args, logs)
    print()
    print(table(rows, args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
