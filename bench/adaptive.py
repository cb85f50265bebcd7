"""An upstream that refuses, or changes its limit without saying so: how the fleet follows.

``python -m bench.adaptive [--before REV] [--scenarios drop,rise,strict] [--json PATH]``

Each run starts a private ``redis-server`` (broker, results, limiter), the mock API in a
process of its own (``workers.mock_api``, judging each call on its own clock) and two
``celery worker`` processes (4 prefork children each) of ``bench/adaptive_app.py``, whose
task calls the API through the README's ``upstream_hook(retry=True)``. A feeder keeps
:data:`OUTSTANDING` tasks not yet served (a steady supply rather than a dump: see the
docs' benchmark page for why). ``--before REV`` runs the same scenarios with the code of
git revision REV beside this tree's (one run of each version alternating), the limit
without the fields REV does not know.

Scenarios:

* ``drop``: the API (burst 2) answers 429s with only ``Retry-After``; it allows 20/s, then
  silently 10/s after :data:`CHANGE_AT_S`. The fleet's limit: GCRA 19.6/s burst 1 (ours:
  ``adaptive: true``). Measured: seconds from the drop until the served rate (a 5 s
  window) is at least 90 % of 10/s; the share of calls refused from then on; the share
  of 10/s served from then on; the highest call rate (5 s window) against the ceiling.
* ``rise``: the same API at 10/s, silently 20/s after :data:`CHANGE_AT_S`: seconds until
  the served rate is at least 90 % of 20/s.
* ``strict``: an API of 20/s burst 1 with its full headers (a 429 with an integer
  ``Retry-After``), limits not adaptive at 99, 98 and 95 % of it: calls refused and the
  share of the API's rate served (allowed / (1 + 20/s x the span of the calls)).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from bench.celery_fleet import ApiProcess
from bench.checkout import checkout, start_worker, stop, wait_started
from tests.support.servers import RedisServer
from workers.harness import ROOT

APP = "bench.adaptive_app"
OUTSTANDING = 24
"""Tasks sent and not yet served that the feeder keeps: enough for both workers' 8 pool
children and a second of slots at 20/s."""
CHANGE_AT_S = 15.0
"""When the API changes its limit, s after the run's start."""
WINDOW_S = 5.0
"""The window of a rate measured over time, in s."""
ADAPTIVE = "adaptive: true, floor: 2/s"


@dataclass
class Run:
    version: str
    scenario: str
    limit_per_s: float
    calls: int
    refused: int
    metrics: dict[str, float | None] = field(default_factory=dict)


def set_limit(api: ApiProcess, rate: float, burst: float) -> None:
    body = json.dumps({"rate": rate, "burst": burst}).encode()
    request = urllib.request.Request(api.url + "/limit", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def feed(
    producer: Celery, client: redis.Redis, stop_at: float, done: threading.Event, outstanding: int
) -> None:
    """Keep ``outstanding`` tasks sent and not yet served until ``stop_at`` (monotonic)."""
    sent = 0
    while time.monotonic() < stop_at and not done.is_set():
        served = int(client.get("bench:done") or 0)
        while sent - served < outstanding:
            producer.send_task(f"{APP}.call", args=(sent,), queue="upstream")
            sent += 1
        time.sleep(0.02)


def rates(
    times: list[float], start: float, end: float, step: float = 0.5
) -> list[tuple[float, float]]:
    """(t, events per s in the WINDOW_S before t) for t from start + WINDOW_S to end."""
    out = []
    t = start + WINDOW_S
    while t <= end + 1e-9:
        count = sum(1 for x in times if t - WINDOW_S <= x < t)
        out.append((t, count / WINDOW_S))
        t += step
    return out


def converged_at(series: list[tuple[float, float]], target: float) -> float | None:
    """The end of the first window whose rate is at least ``target``."""
    return next((t for t, rate in series if rate >= target), None)


def measure(
    scenario: str, arrivals: list[dict[str, Any]], change_at: float | None, end: float,
    api_rate: float,
) -> dict[str, float | None]:  # fmt: skip
    served = [a["at_s"] for a in arrivals if a["allowed"]]
    every = [a["at_s"] for a in arrivals]
    if scenario == "strict":
        span = every[-1] - every[0] if len(every) > 1 else 0.0
        return {"share": len(served) / (1 + api_rate * span) if span else None}
    assert change_at is not None
    after_rate = 10.0 if scenario == "drop" else 20.0
    series = rates(served, change_at, end)
    at = converged_at(series, 0.9 * after_rate)
    metrics: dict[str, float | None] = {
        "to_90_s": None if at is None else round(at - change_at, 1),
        "max_call_rate": max((r for _, r in rates(every, 0.0, end)), default=0.0),
    }
    if at is not None:
        later = [a for a in arrivals if a["at_s"] >= at]
        refused = sum(not a["allowed"] for a in later)
        metrics["refused_after"] = refused / len(later) if later else None
        metrics["share_after"] = (
            (len(later) - refused) / (after_rate * (end - at)) if end > at else None
        )
    return metrics


def one_run(
    version: str, tree: Path, scenario: str, limit_per_s: float, adaptive: bool,
    args: argparse.Namespace, logs: Path,
) -> Run:  # fmt: skip
    first, then = {"drop": (20.0, 10.0), "rise": (10.0, 20.0), "strict": (20.0, None)}[scenario]
    burst = 1.0 if scenario == "strict" else 2.0
    learn = f", {ADAPTIVE}" if adaptive else ""
    config_text = (
        f"limits:\n  api: {{algorithm: gcra, rate: {limit_per_s}/s, burst: 1{learn}}}\n"
        "queues:\n  upstream: [api]\n"
    )
    duration = args.strict_s if scenario == "strict" else CHANGE_AT_S + args.after_s
    tag = f"{version.split(maxsplit=1)[0]}-{scenario}-{limit_per_s:g}"
    api = ApiProcess(first, burst, logs / f"{tag}-api.log", retry_after_only=scenario != "strict")
    with RedisServer() as server:
        config = logs / f"{tag}.yaml"
        config.write_text(config_text)
        env = {
            "DEMO_BROKER_URL": server.url,
            "THROTTLE_REDIS_URL": server.url,
            "THROTTLE_CONFIG": str(config),
            "MOCK_API_URL": api.url,
        }
        names = ("a1", "a2")
        procs = [start_worker(tree, APP, n, env, logs / f"{tag}-{n}.log") for n in names]
        producer = Celery("adaptive", broker=server.url)
        producer.conf.update(task_default_queue="upstream", broker_connection_retry_on_startup=True)
        client = redis.Redis.from_url(server.url)
        done = threading.Event()
        try:
            wait_started(producer, names, procs, f"workers of {tag} (see {logs})")
            api.reset()
            start = time.monotonic()
            feeder = threading.Thread(
                target=feed,
                args=(producer, client, start + duration, done, args.outstanding),
                daemon=True,
            )
            feeder.start()
            if then is not None:
                time.sleep(max(start + CHANGE_AT_S - time.monotonic(), 0.0))
                set_limit(api, then, burst)
            feeder.join(duration + 30)
            stats = api.get("/stats")
            arrivals = [a for a in api.get("/arrivals") if a["at_s"] <= duration]
        finally:
            done.set()
            stop(procs)
            client.close()
            producer.close()
            api.stop()
    if args.arrivals is not None:
        args.arrivals.mkdir(parents=True, exist_ok=True)
        (args.arrivals / f"{tag}.json").write_text(
            json.dumps({"stats": stats, "arrivals": arrivals})
        )
    change_at = stats["changes"][0][0] if stats["changes"] else None
    metrics = measure(scenario, arrivals, change_at, duration, first)
    metrics["limit_max"] = limit_per_s
    return Run(
        version, scenario, limit_per_s, len(arrivals), sum(not a["allowed"] for a in arrivals),
        metrics,
    )  # fmt: skip


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=None, help="a git revision to run beside this tree")
    parser.add_argument("--scenarios", default="drop,rise,strict")
    parser.add_argument("--after-s", type=float, default=45.0, help="drop/rise: s after the change")
    parser.add_argument("--strict-s", type=float, default=20.0, help="strict: s per limit")
    parser.add_argument("--strict-limits", default="19.8,19.6,19")
    parser.add_argument(
        "--outstanding", type=int, default=OUTSTANDING,
        help="tasks sent and not yet served (a large number: a dump)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--arrivals", type=Path, default=None, help="a directory: each run's calls")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    scenarios = args.scenarios.split(",")
    runs: list[Run] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-adaptive-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        logs = Path(tmp)
        trees = {"ours": ROOT}
        if args.before:
            trees[f"before ({args.before})"] = stack.enter_context(
                checkout(args.before, "bench/adaptive_app.py")
            )
        plan: list[tuple[str, float]] = []
        for scenario in scenarios:
            if scenario == "strict":
                plan += [("strict", float(x)) for x in args.strict_limits.split(",")]
            else:
                plan.append((scenario, 19.6))
        for scenario, limit in plan:
            for version, tree in trees.items():
                adaptive = version == "ours" and scenario != "strict"
                run = one_run(version, tree, scenario, limit, adaptive, args, logs)
                runs.append(run)
                print(f"{version:>18}  {scenario:6} {limit:5g}/s  {run.calls} calls, "
                      f"{run.refused} refused  {run.metrics}")  # fmt: skip
    print()
    for scenario in ("drop", "rise"):
        chosen = [r for r in runs if r.scenario == scenario]
        if not chosen:
            continue
        target = "10/s" if scenario == "drop" else "20/s"
        print(f"Silent {scenario} (API {'20 -> 10' if scenario == 'drop' else '10 -> 20'}/s, "
              f"burst 2, 429 with Retry-After only; limit 19.6/s burst 1):")  # fmt: skip
        print()
        print(
            f"| version | s to 90 % of {target} | refused after | served after "
            "| calls | refused | highest call rate |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in chosen:
            m = r.metrics
            to90 = m.get("to_90_s")
            print(
                f"| {r.version} | {'never' if to90 is None else f'{to90:g} s'} | "
                f"{pct(m.get('refused_after'))} | {pct(m.get('share_after'))} | {r.calls} | "
                f"{r.refused} | {m.get('max_call_rate', 0):.1f}/s |"
            )
        print()
    strict = [r for r in runs if r.scenario == "strict"]
    if strict:
        print("Strict API (20/s burst 1, 429 with Retry-After 1 and rate-limit headers), hook on:")
        print()
        print("| limit | version | refused | share of the API's rate |")
        print("|---|---|---|---|")
        for r in strict:
            print(f"| {r.limit_per_s:g}/s ({100 * r.limit_per_s / 20:.0f} %) | {r.version} | "
                  f"{r.refused} of {r.calls} | {pct(r.metrics.get('share'))} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
