"""Fair share: three tenants flood one shared limit through a real Celery fleet.

``python -m bench.fair [--seconds 20] [--json PATH]`` (``make bench-fair``)

What runs
---------
A private ``redis-server`` (broker and limiter), the mock API (``workers/mock_api.py``,
20 calls/s burst 2, in a thread of this process) and **2** ``celery worker`` processes of
**4 prefork children** of ``bench/fair_app.py``. Three variants (a fourth on request), one
after the other on the same fleet, each a limit of 19.6/s burst 1 (GCRA) shared by tenants
``a``, ``b``, ``c``:

* ``fcfs``: today's shared limit (no key, no ``fair``): first come first served;
* ``fair``: ``fair: true`` over ``{tenant}``, equal weights: a share of 6.53/s each;
* ``weighted``: ``fair: true`` with ``weights: {a: 2}``: 9.8/s, 4.9/s and 4.9/s;
* ``unguarded`` (only when asked, ``--variants fair,unguarded``): ``fair`` with
  ``spacing_guard: false``: what the call-time spacing guard, on by default at burst 1,
  costs here (the mock API allows burst 2).

In each variant the three tenants send tasks at once, each faster than its share: ``a``
15/s, ``b`` 10/s, ``c`` 8/s, for ``--seconds``; then the variant waits until every task
has called the API. First come first served hands each tenant the rate in proportion to
what it sends (9/s, 6/s, 4.8/s); fair hands each its share.

What is measured
----------------
Each tenant's first and last call at the API (the API's own clock, from the variant's
first call), and its rate while all three are active at the API: from 1 s after the last
tenant's first call to the first tenant's last call. Beside it, its share of the limit's
rate (19.6/s x weight / sum of weights) and the deviation from it; the total rate over
that window, the API's refusals (429) over the whole variant, and how long the variant
took from the first to the last call. Before the fleet: the Redis time of one acquisition
of a fair limit with ten active keys, beside a plain GCRA limit's. Target (issue 12):
every tenant within +-10 % of its share under ``fair``.

"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from tests.support.servers import RedisServer
from throttle import Limit, Limiter
from workers.harness import Worker, running, start_api

API_RATE, API_BURST = 20.0, 2.0
LIMIT_RATE = 19.6
TENANTS = ("a", "b", "c")
SETTLE_S = 1.0
MIN_WINDOW_S = 3.0
OFFERED = {"a": 15.0, "b": 10.0, "c": 8.0}
"""Tasks per second each tenant sends: each above its share (6.53/s), 33/s in all."""
VARIANTS = {
    "fcfs": ("bench.fair_app.fcfs_call", {"a": 1.0, "b": 1.0, "c": 1.0}),
    "fair": ("bench.fair_app.fair_call", {"a": 1.0, "b": 1.0, "c": 1.0}),
    "weighted": ("bench.fair_app.weighted_call", {"a": 2.0, "b": 1.0, "c": 1.0}),
    "unguarded": ("bench.fair_app.unguarded_call", {"a": 1.0, "b": 1.0, "c": 1.0}),
}


def run_variant(app: Any, api: Any, name: str, seconds: float, timeout_s: float) -> dict[str, Any]:
    task_name, weights = VARIANTS[name]
    api.api.reset()
    plan = sorted(
        (i / rate, tenant) for tenant, rate in OFFERED.items() for i in range(int(rate * seconds))
    )
    tenant_of: dict[str, str] = {}
    began = time.monotonic()
    for n, (at_s, tenant) in enumerate(plan):
        time.sleep(max(0.0, began + at_s - time.monotonic()))
        result = app.send_task(task_name, args=(tenant, n), queue="upstream")
        tenant_of[result.id] = tenant
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # every task allowed once at the API (a refused one comes back and calls again)
        if sum(a["allowed"] for a in api.api.arrivals_json()) >= len(tenant_of):
            break
        time.sleep(0.5)
    arrivals = api.api.arrivals_json()
    return judge(name, arrivals, tenant_of, weights)


def judge(
    name: str,
    arrivals: list[dict[str, Any]],
    tenant_of: dict[str, str],
    weights: dict[str, float],
) -> dict[str, Any]:
    times: dict[str, list[float]] = {tenant: [] for tenant in TENANTS}
    for arrival in arrivals:
        tenant = tenant_of.get(arrival["task_id"])
        if tenant is not None:
            times[tenant].append(arrival["at_s"])
    first = min(a["at_s"] for a in arrivals)
    last = max(a["at_s"] for a in arrivals)
    # While all three are active at the API: from a second after the last tenant's first
    # call to the first tenant's last call.
    start = max(min(ts) for ts in times.values()) - first + SETTLE_S
    end = min(max(ts) for ts in times.values()) - first
    total_weight = sum(weights.values())
    rows = {}
    for tenant in TENANTS:
        share = LIMIT_RATE * weights[tenant] / total_weight
        rate = None
        if end - start >= MIN_WINDOW_S:
            rate = sum(start <= t - first < end for t in times[tenant]) / (end - start)
        rows[tenant] = {
            "first_s": min(times[tenant]) - first,
            "last_s": max(times[tenant]) - first,
            "per_s": [sum(k <= t - first < k + 1 for t in times[tenant]) for k in range(60)],
            "rate": rate,
            "share": share,
            "deviation_pct": None if rate is None else 100 * (rate - share) / share,
            "calls": len(times[tenant]),
        }
    rates = [r["rate"] for r in rows.values()]
    allowed = collections.Counter(a["task_id"] for a in arrivals if a["allowed"])
    return {
        "variant": name,
        "window_s": [start, end],
        "tenants": rows,
        "total_rate": None if None in rates else sum(rates),  # type: ignore[arg-type]
        "refused": sum(not a["allowed"] for a in arrivals),
        "calls": len(arrivals),
        "expected": len(tenant_of),
        "allowed_twice": sum(count > 1 for count in allowed.values()),
        "never_allowed": sum(task_id not in allowed for task_id in tenant_of),
        "duration_s": last - first,
    }


def _num(value: float | None, form: str, none: str = "n/a") -> str:
    return none if value is None else format(value, form)


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | tenant | weight | first call (s) | last call (s) | share (/s) "
        "| rate while all active (/s) | deviation |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        weights = VARIANTS[result["variant"]][1]
        for tenant, row in result["tenants"].items():
            lines.append(
                f"| {result['variant']} | {tenant} | {weights[tenant]:g} | {row['first_s']:.1f} "
                f"| {row['last_s']:.1f} | {row['share']:.2f} | {_num(row['rate'], '.2f')} "
                f"| {_num(row['deviation_pct'], '+.1f')} % |"
            )
    lines.append("")
    lines.append(
        "| variant | all active (s) | total rate then (/s) | refused | calls "
        "| tasks allowed twice / never | first to last (s) |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for result in results:
        start, end = result["window_s"]
        window = f"{start:.1f}-{end:.1f}" if end - start >= MIN_WINDOW_S else "never"
        lines.append(
            f"| {result['variant']} | {window} | {_num(result['total_rate'], '.2f')} "
            f"| {result['refused']} | {result['calls']}/{result['expected']} "
            f"| {result['allowed_twice']} / {result['never_allowed']} "
            f"| {result['duration_s']:.1f} |"
        )
    return "\n".join(lines).replace(" n/a %", " n/a")


def script_cost(url: str, calls: int = 3000) -> dict[str, float]:
    """Redis time per acquisition (INFO commandstats, us per EVALSHA) of a fair limit with
    ten active keys, beside a plain GCRA limit of one key per call: what fairness costs the
    server. A rate no call can exhaust: every call is admitted (and commits)."""
    client = redis.Redis.from_url(url)
    limiter = Limiter(client, prefix="cost")
    keys = [f"k{i}" for i in range(10)]
    cases = {
        "gcra": Limit.parse("1000000/s", name="plain", algorithm="gcra"),
        "fair": Limit.parse("1000000/s", name="shared", algorithm="gcra", fair=True),
    }
    out = {}
    for name, limit in cases.items():
        for i in range(200):  # warm: scripts loaded, every key active
            limiter.acquire(limit, keys[i % 10], max_wait_s=1)
        client.config_resetstat()
        for i in range(calls):
            limiter.acquire(limit, keys[i % 10], max_wait_s=1)
        # FCALL: the limiter's function library (Redis 7); EVALSHA where it uses scripts
        stats = client.info("commandstats")
        stat = stats.get("cmdstat_fcall") or stats["cmdstat_evalsha"]
        out[name] = float(stat["usec_per_call"])
    client.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=20.0, help="how long the tenants send, per variant"
    )
    parser.add_argument("--variants", default="fcfs,fair,weighted")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        api = start_api(API_RATE, API_BURST)
        env = {"DEMO_BROKER_URL": server.url, "MOCK_API_URL": api.url}
        os.environ.update(env)  # the producer imports the same app
        from bench.fair_app import app  # noqa: PLC0415

        app.conf.broker_url = app.conf.result_backend = server.url
        workers = [
            Worker(f"fair{i}", env, app="bench.fair_app", log=Path(tmp) / f"w{i}.log")
            for i in (1, 2)
        ]
        load = os.getloadavg()
        cost = script_cost(server.url)
        results = []
        try:
            with running(app, workers):
                for name in names:
                    # Every task at the limit's rate, and as long again.
                    timeout_s = sum(OFFERED.values()) * args.seconds / LIMIT_RATE * 2 + 30
                    results.append(run_variant(app, api, name, args.seconds, timeout_s))
                    print(f"{name}: done", file=sys.stderr)
        finally:
            api.stop()
    report = table(results)
    print(
        f"bench.fair: tenants sending {OFFERED} tasks/s for {args.seconds:g} s, "
        "2 workers x 4 children, "
        f"{platform.python_version()}, load {load[0]:.2f} at the start"
    )
    print(report)
    print(
        f"\nRedis time per acquisition (10 active keys): fair {cost['fair']:.0f} us, "
        f"gcra {cost['gcra']:.0f} us"
    )
    if args.json:
        args.json.write_text(json.dumps({"variants": results, "script_us": cost}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
