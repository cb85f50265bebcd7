"""Kill while held, the full matrix: every execution pool x broker x ``acks_late``.

``python -m bench.kill_matrix [--pools prefork,threads,gevent,eventlet,solo]
[--brokers redis,classic,quorum] [--acks late,early] [--repeat N] [--json PATH]``

Each case is the scenario of tests/support/held.py (app: tests/apps/held_app.py): a worker
(the victim) takes a backlog of 20 tasks under a limit of 4/s (GCRA, burst 1), holds some
of them waiting for their slots (``celery inspect scheduled``), is killed with SIGKILL
between two bodies, and a second worker of the same pool takes over. Each case starts its
own redis-server (limiter, counts; the broker too for ``redis``); the RabbitMQ cases share
a private vhost of the RabbitMQ service at 127.0.0.1:5672, deleted at the end.

Reported per case: tasks lost (never ran) and run twice (counted per task id by the
bodies; apart, those run again after the victim had completed their body: killed before
the acknowledgement left, Celery's at-least-once), tasks that ran before the kill and that
the victim held, the time from the kill until every task had run (the Redis transport
waits for its ``visibility_timeout``, 6 s here; RabbitMQ gives a dropped connection's
messages back at once), and broker publishes per task (the producer's, plus the workers'
re-publishes and releases from parking, counted through Celery's publish signal).
``make test`` runs six of these cases (tests/system/test_kill_held.py: each pool once,
each broker with and without ``acks_late``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.held import Case, Outcome, rabbit_vhost, run_case

POOLS = ("prefork", "threads", "gevent", "eventlet", "solo")
BROKERS = ("redis", "classic", "quorum")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pools", default=",".join(POOLS))
    parser.add_argument("--brokers", default=",".join(BROKERS))
    parser.add_argument("--acks", default="late,early", help="late, early or both")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    args = parser.parse_args(argv)
    # A SIGTERM ends the run through the cleanups (workers, redis-servers, the vhost).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cases = [
        Case(pool, broker, acks == "late")
        for broker, acks, pool in itertools.product(
            args.brokers.split(","), args.acks.split(","), args.pools.split(",")
        )
    ]
    logs = Path(tempfile.mkdtemp(prefix="kill-matrix-"))
    print(f"{len(cases)} cases x {args.repeat}; logs in {logs}; load {os.getloadavg()}")
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        vhost = None
        if any(case.broker != "redis" for case in cases):
            vhost = stack.enter_context(rabbit_vhost("throttle-kill-matrix"))
        for case, run in itertools.product(cases, range(args.repeat)):
            started = time.monotonic()
            try:
                outcome = run_case(case, logs / f"{case.id}-{run}", vhost)
                row = summary(outcome)
            except Exception as exc:  # one case's failure is a row, not the end of the run
                row = {"case": case.id, "error": f"{type(exc).__name__}: {exc}"[:300]}
            row["took_s"] = round(time.monotonic() - started, 1)
            row["load"] = round(os.getloadavg()[0], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| pool | broker | acks | lost | twice | again after a body | ran before kill | held "
          "| recovered | publishes / task | case took | load |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        pool, broker, acks = row["case"].split("-")
        if "error" in row:
            print(f"| {pool} | {broker} | {acks} | error: {row['error']} ||||||||")
            continue
        print(
            f"| {pool} | {broker} | {acks} | {row['lost']} | {row['twice']} "
            f"| {row.get('rerun_after_body', 'n/a')} | {row['ran_before_kill']} | {row['held']} "
            f"| {row['recovered_s']:.1f} s "
            f"| {row['publishes_per_task']:.2f} | {row['took_s']:.0f} s | {row['load']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if "error" in r or r["lost"] or r["twice"]]
    return 1 if bad else 0


def summary(outcome: Outcome) -> dict[str, Any]:
    return {
        "case": outcome.case.id,
        "lost": len(outcome.lost),
        "twice": len(outcome.twice),
        "rerun_after_body": len(outcome.rerun_after_body),
        "ran_before_kill": outcome.ran_before_kill,
        "held": outcome.held_at_kill,
        "recovered_s": round(outcome.recovered_s, 2),
        "publishes_per_task": round(outcome.publishes_per_task, 3),
        "notes": outcome.notes,
        "lost_ids": outcome.lost,
        "twice_ids": outcome.twice,
    }


if __name__ == "__main__":
    sys.exit(main())
