"""Latency of one admitted acquire, client side and Redis side, beside a raw script and peers.

What is measured
----------------
One private ``redis-server`` started here (never a shared one) and one Python process
calling it one call at a time, with no pipelining and no concurrency: the latency that one
worker sees per decision. The cases:

* ``ping``: redis-py PING, the floor of one round trip through redis-py.
* ``raw_evalsha``: a minimal token bucket Lua script (HMGET, refill arithmetic on a clock
  the client sends, HSET, PEXPIRE) called through redis-py's ``Script``. This is what any
  Lua limiter has to pay; the distance from it is our own overhead.
* Each algorithm of :class:`throttle.Limiter` on one limit. ``concurrency`` records a lease
  and must give its units back, so that case is an acquire *and* a release, two round trips
  per sample, and is labelled so.
* ``three_limits``: one atomic ``acquire_many`` over a per-key token bucket, a global GCRA
  and a per-key daily fixed window.
* ``gcra keyed (task's arguments)`` and ``gcra keyed, plan table (task's arguments)``: a
  keyed GCRA rule evaluated on a task's arguments (:func:`throttle.rules.targets`: the
  key template, and the plan looked up in a table of three) and then acquired, as a worker
  does: the plan lookup must stay in Python (one round trip, the same server time).
* ``... (EVALSHA)``: the token bucket and the three limits again, by a limiter told to use
  the scripts (EVALSHA), as it does on Redis 6 or for a user denied ``FCALL``; the others
  call the function library (``FCALL``, see :mod:`throttle.redis.library`).
* ``token_bucket (redis-py call)``: the token bucket's ``FCALL`` sent through redis-py's
  ``Redis.execute_command``, as the raw script and the peers send theirs, where the limiter
  uses connections of its own (:mod:`throttle.redis.direct`): it tells how much of the
  distance to them is the client path, and how much the script.
* Peers on the same server: ``limits`` (moving window, ``RedisStorage``, ``hit()``) and
  ``throttled-py`` (token bucket, ``RedisStore``, ``limit()``).

Every limit is far above the rate one client reaches, so every call is admitted and the
numbers are those of the common, admitted path; a denied call is counted and reported.
Each case uses one fixed key so that its state stays warm in Redis, as a hot limit's does.

Client side: p50 and p99 of ``time.perf_counter_ns`` around each call. Server side: the
``usec`` that ``INFO commandstats`` charges to the top-level commands of the case's block
(EVALSHA, PING, ...), divided by the samples: the time Redis spends executing them, without
the network and the protocol. Redis also counts every command a script runs (the HSET
inside an EVALSHA) on its own line, and that time is already inside the script's time:
those lines are kept apart as a breakdown and never added a second time (adding every
``cmdstat_*`` would count a script's commands twice).

Why interleaved
---------------
On a shared machine, CPU frequency, other tenants and the state of Redis drift over
minutes. Running one case for a minute and then the next would charge that drift to the
case. So the run is R rounds; each round runs every case for a block of B calls, in an
order shuffled per round with a fixed seed (so that reruns are comparable). Drift hits
every case alike, and the ratios (ours vs raw EVALSHA, vs the peers) stay meaningful even
when the absolute numbers move. A first round, not recorded, warms up connections, script
caches and keys.

Run from the repository root: ``python -m bench.core [--rounds 20] [--block 500]
[--json PATH]``; ``--profile CASE`` profiles the Python side of one case instead.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.metadata
import json
import math
import os
import platform
import pstats
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis
from limits import RateLimitItemPerSecond
from limits.storage import RedisStorage
from limits.strategies import MovingWindowRateLimiter
from throttled import RateLimiterType, RedisStore, Throttled, per_sec

from tests.support.servers import RedisServer
from throttle import Limit, Limiter
from throttle.redis.library import Routine
from throttle.rules import Rule
from throttle.rules import targets as task_targets

# Far above what one client can reach (tens of thousands of calls per second): every call
# is admitted, including the fixed and sliding windows that count every call.
HUGE = 1_000_000_000
RATE = f"{HUGE}/s"
KEY = "bench"  # the one key of every keyed case: a hot, warm limit
BASELINE = "raw_evalsha"
CONCURRENCY = "concurrency (acquire+release)"
TASK_KEYED = "gcra keyed (task's arguments)"
TASK_PLANS = "gcra keyed, plan table (task's arguments)"

# The baseline: a correct token bucket with nothing else. The clock comes from the client
# (ARGV[3]) so the script does not even call TIME; numbers go back to Redis as %.17g
# strings because Lua's default number format (%.14g) would round a timestamp in us.
RAW_TOKEN_BUCKET = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local s = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(s[1]) or burst
local ts = tonumber(s[2]) or now
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate)
  ts = now
end
if tokens < cost then
  return {0, math.ceil((cost - tokens) / rate)}
end
tokens = tokens - cost
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens),
           'ts', string.format('%.17g', ts))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate / 1000) + 1000)
return {1, math.floor(tokens)}
"""

# Top-level commands that run scripts: their usec includes every command the script runs.
SCRIPT_COMMANDS = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"})
# Commands a script cannot run (or that no script here runs): always a client's own command.
CLIENT_COMMANDS = frozenset({"ping", "hello", "auth", "select"})
CLIENT_PREFIXES = ("script|", "client|")
# The benchmark's own bookkeeping, never charged to a case.
ADMIN_COMMANDS = frozenset({"config", "info"})


@dataclass
class Case:
    """One measured operation and everything recorded about it."""

    name: str
    kind: str  # "floor", "baseline", "ours" or "peer"
    call: Callable[[], Any]
    admitted: Callable[[Any], bool]
    samples_ns: list[int] = field(default_factory=list)
    round_p50_ns: list[float] = field(default_factory=list)
    denied: int = 0
    server_usec: int = 0
    top_calls: int = 0
    # Commands run inside this case's scripts: name -> [calls, usec] (already in server_usec).
    nested: dict[str, list[int]] = field(default_factory=dict)
    # The one call this case sends (a limiter's Routine, or a raw Script: a callable taking
    # keys, args and client), to replay it in a pipeline for the warm server time; None
    # where it cannot be captured (peers, two-call cases).
    replay: tuple[Callable[..., Any], list[Any], list[Any]] | None = None
    warm_usec: int = 0
    warm_calls: int = 0


@dataclass
class Fixture:
    """The server, the clients and the cases built on them."""

    server: RedisServer
    admin: redis.Redis
    cases: list[Case]
    closers: list[Callable[[], None]]

    def close(self) -> None:
        for close in self.closers:
            close()
        self.admin.close()
        self.server.stop()


def build_cases(server: RedisServer) -> tuple[list[Case], list[Callable[[], None]]]:
    """Every case, each on a key of its own, with the function that says it was admitted."""
    client = server.client()
    limiter = Limiter(client, namespace="bench")
    scripted = Limiter(client, namespace="bench-scripted")
    scripted.library.functions = False  # EVALSHA, as on Redis 6
    pooled = Limiter(client, namespace="bench-pooled", own_connections=False)

    def ours(name: str, call: Callable[[], Any], by: Limiter = limiter) -> Case:
        return Case(name, "ours", call, bool, replay=capture(by, call))

    raw = client.register_script(RAW_TOKEN_BUCKET)
    raw_keys = ["bench:raw:tb"]
    raw_rate_per_us = HUGE / 1e6
    raw_clock = time.time_ns

    def raw_args() -> list[Any]:
        # The clock is read per call, as a client-clock limiter must.
        return [raw_rate_per_us, HUGE, raw_clock() // 1000, 1]

    def raw_call() -> Any:
        return raw(raw_keys, raw_args())

    def single(limit: Limit, by: Limiter = limiter) -> Callable[[], Any]:
        return lambda: by.acquire(limit, KEY)

    conc = Limit.parse(f"{HUGE} concurrent", name="conc")

    def concurrency_pair() -> bool:
        decision = limiter.acquire(conc, KEY)
        if decision.acquisition is None:
            return False
        return limiter.release(decision.acquisition).status == "settled"

    three = [
        (Limit.parse(RATE, name="three-tb"), KEY),
        (Limit.parse(RATE, name="three-gcra", algorithm="gcra"), None),
        (Limit.parse(f"{HUGE}/d", name="three-daily", algorithm="fixed_window"), KEY),
    ]

    # A task's keyed GCRA limit, evaluated on the task's arguments as the worker does
    # (rules.targets: key template, plan lookup) then acquired: without and with a plan
    # table. The plan is looked up in Python; the script gets the plan's numbers as it
    # gets any limit's, so the same one round trip and the same Redis work are expected.
    def task(tenant: str, plan: str) -> None: ...

    keyed = Rule(Limit.parse(RATE, name="task-keyed", algorithm="gcra"), key="{tenant}")
    planned = Rule(
        Limit.parse(RATE, name="task-plans", algorithm="gcra"), key="{tenant}", plan="{plan}",
        plans={"free": f"{HUGE // 100}/s", "pro": f"{HUGE // 10}/s", "enterprise": RATE},
    )  # fmt: skip

    def evaluated(rule: Rule) -> Callable[[], Any]:
        rules = (rule,)
        return lambda: limiter.acquire_many(task_targets(rules, task, (KEY, "pro"), {}))

    # Peers: each builds its own client from a URL, as their users do. Note that with a limit
    # this large the moving window is at its cheapest: its list of timestamps only grows
    # during the run (LTRIM cuts at the limit) and its LINDEX probe at position limit - 1
    # falls past the end of the list, which Redis answers in O(1).
    url = f"redis://127.0.0.1:{server.port}"
    storage = RedisStorage(url)
    moving = MovingWindowRateLimiter(storage)
    item = RateLimitItemPerSecond(HUGE)
    throttled = Throttled(
        key="bench-throttled",
        using=RateLimiterType.TOKEN_BUCKET.value,
        quota=per_sec(HUGE),
        store=RedisStore(server=url),
    )

    cases = [
        Case("ping", "floor", client.ping, lambda r: r is True),
        Case(
            BASELINE, "baseline", raw_call, lambda r: r[0] == 1, replay=(raw, raw_keys, raw_args())
        ),
        ours("token_bucket", single(Limit.parse(RATE, name="tb"))),
        ours("gcra", single(Limit.parse(RATE, name="gcra", algorithm="gcra"))),
        ours("sliding_window", single(Limit.parse(RATE, name="sw", algorithm="sliding_window"))),
        ours("fixed_window", single(Limit.parse(RATE, name="fw", algorithm="fixed_window"))),
        Case(CONCURRENCY, "ours", concurrency_pair, lambda r: r is True),
        ours("three_limits", lambda: limiter.acquire_many(three)),
        ours(TASK_KEYED, evaluated(keyed)),
        ours(TASK_PLANS, evaluated(planned)),
        ours(
            "token_bucket (EVALSHA)",
            single(Limit.parse(RATE, name="tb"), scripted),
            scripted,
        ),
        ours("three_limits (EVALSHA)", lambda: scripted.acquire_many(three), scripted),
        ours("token_bucket (redis-py call)", single(Limit.parse(RATE, name="tb"), pooled), pooled),
        Case("limits (moving window)", "peer", lambda: moving.hit(item, "bench-limits"), bool),
        Case("throttled-py (token bucket)", "peer", throttled.limit, lambda r: not r.limited),
    ]
    return cases, [client.close]


def capture(
    limiter: Limiter, call: Callable[[], Any]
) -> tuple[Callable[..., Any], list[Any], list[Any]]:
    """The (call, keys, args) of the one FCALL or EVALSHA that ``call`` sends through
    ``limiter``, ``call`` taking a pipeline as ``client``.

    Recorded from a real call, so the replay is exactly what the limiter sends (the args
    leave the clock to Redis TIME, so a replayed call is a real, current acquisition).
    """
    sent: list[tuple[Callable[..., Any], list[Any], list[Any]]] = []
    real = limiter._call

    def record(routine: Routine[Any], keys: list[Any], args: list[Any]) -> Any:
        reply = real(routine, keys, args)  # first: it tells whether FCALL is taken
        sent.append((replayer(routine), list(keys), list(args)))
        return reply

    limiter._call = record  # type: ignore[method-assign]
    try:
        call()
    finally:
        del limiter._call  # back to the class's method
    (one,) = sent
    return one


def replayer(routine: Routine[Any]) -> Callable[..., Any]:
    """``routine`` as its limiter sends it: FCALL of its function, or its script."""
    if not routine.library.functions:
        return cast(Callable[..., Any], routine.script)

    def fcall(keys: list[Any], args: list[Any], client: Any) -> Any:
        return client.fcall(routine.function, len(keys), *keys, *args)

    return fcall


def measure_warm(fixture: Fixture, rounds: int, batch: int, seed: int) -> None:
    """Server time per call with Redis running hot: each replayable case's EVALSHA sent
    ``batch`` at a time in a pipeline, rounds interleaved like the client-side blocks.

    One call at a time, Redis goes idle between requests and every script starts with
    cold caches: on a small shared VM that adds several us to even the smallest script,
    more to a larger one. Under a fleet's load Redis runs hot, and this is its CPU per call.
    """
    order = [case for case in fixture.cases if case.replay is not None]
    shuffle = random.Random(seed).shuffle
    admin = fixture.admin
    for round_no in range(rounds + 1):
        shuffle(order)
        for case in order:
            assert case.replay is not None
            script, keys, args = case.replay
            pipe = admin.pipeline(transaction=False)
            for _ in range(batch):
                script(keys, args, client=pipe)
            admin.config_resetstat()
            pipe.execute()
            stats = read_stats(admin)
            if round_no == 0:
                continue
            for command in SCRIPT_COMMANDS:
                calls, usec = stats.get(command, (0, 0))
                case.warm_calls += calls
                case.warm_usec += usec


def start() -> Fixture:
    # Always a fresh private server: CONFIG RESETSTAT and the bench keys must never touch
    # a Redis that someone else uses (THROTTLE_REDIS_URL is deliberately ignored).
    server = RedisServer().start()
    try:
        cases, closers = build_cases(server)
    except BaseException:
        server.stop()
        raise
    return Fixture(server, server.client(), cases, closers)


def read_stats(admin: redis.Redis) -> dict[str, tuple[int, int]]:
    """INFO commandstats as command name -> (calls, usec), without our own bookkeeping."""
    stats: dict[str, tuple[int, int]] = {}
    for name, value in admin.info("commandstats").items():
        command = name.removeprefix("cmdstat_")
        if command.split("|")[0] in ADMIN_COMMANDS:
            continue
        stats[command] = (int(value["calls"]), int(value["usec"]))
    return stats


def attribute(case: Case, stats: dict[str, tuple[int, int]]) -> None:
    """Charge a block's server time to its case, counting script-run commands only once."""
    ran_scripts = any(command in SCRIPT_COMMANDS for command in stats)
    for command, (calls, usec) in stats.items():
        top_level = (
            not ran_scripts
            or command in SCRIPT_COMMANDS
            or command in CLIENT_COMMANDS
            or command.startswith(CLIENT_PREFIXES)
        )
        if top_level:
            case.server_usec += usec
            case.top_calls += calls
        else:
            entry = case.nested.setdefault(command, [0, 0])
            entry[0] += calls
            entry[1] += usec


def run_block(case: Case, block: int) -> tuple[list[int], int]:
    """``block`` timed calls of one case: the durations in ns and the number denied."""
    call = case.call
    admitted = case.admitted
    clock = time.perf_counter_ns
    samples = [0] * block
    denied = 0
    for i in range(block):
        begin = clock()
        result = call()
        samples[i] = clock() - begin
        # Checked outside the timed span: verifying costs the case nothing.
        if not admitted(result):
            denied += 1
    return samples, denied


def measure(fixture: Fixture, rounds: int, block: int, seed: int) -> None:
    """The warm-up round, then ``rounds`` recorded rounds of every case in shuffled order."""
    order = list(fixture.cases)
    shuffle = random.Random(seed).shuffle
    admin = fixture.admin
    for round_no in range(rounds + 1):
        shuffle(order)
        for case in order:
            # Collect now so that garbage left by the previous case is not collected
            # inside this case's timed calls.
            gc.collect()
            admin.config_resetstat()
            samples, denied = run_block(case, block)
            stats = read_stats(admin)
            if round_no == 0:
                continue  # warm-up: scripts loaded, connections open, keys warm
            case.samples_ns.extend(samples)
            case.round_p50_ns.append(percentile(sorted(samples), 0.50))
            case.denied += denied
            attribute(case, stats)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    rank = max(math.ceil(q * len(sorted_values)) - 1, 0)
    return float(sorted_values[rank])


def version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info(admin: redis.Redis) -> dict[str, Any]:
    server = admin.info("server")
    return {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "redis_server": server["redis_version"],
        "redis_py": redis.__version__,
        "hiredis": version("hiredis"),
        "limits": version("limits"),
        "throttled_py": version("throttled-py"),
    }


def summarize(case: Case) -> dict[str, Any]:
    ordered = sorted(case.samples_ns)
    n = len(ordered)
    return {
        "case": case.name,
        "kind": case.kind,
        "samples": n,
        "denied": case.denied,
        "p50_us": percentile(ordered, 0.50) / 1e3,
        "p99_us": percentile(ordered, 0.99) / 1e3,
        "mean_us": sum(ordered) / n / 1e3,
        "min_us": ordered[0] / 1e3,
        "round_p50_us": [p / 1e3 for p in case.round_p50_ns],
        "server_us_per_call": case.server_usec / n,
        "warm_server_us_per_call": case.warm_usec / case.warm_calls if case.warm_calls else None,
        "top_level_commands_per_call": case.top_calls / n,
        "nested_per_call": {
            command: {"calls": calls / n, "us": usec / n}
            for command, (calls, usec) in sorted(case.nested.items())
        },
    }


def targets(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each with a verdict and the numbers behind it."""
    raw = rows[BASELINE]
    tb = rows["token_bucket"]
    three = rows["three_limits"]
    out: list[dict[str, Any]] = []

    def check(name: str, passed: bool, detail: str) -> None:
        out.append({"target": name, "passed": passed, "detail": detail})

    for ours in ("token_bucket", "gcra"):
        row = rows[ours]
        bound = 1.05 * raw["p50_us"]
        # The same ratio taken round by round (both blocks ran in the same round, under the
        # same drift), then its median: a cross-check of the pooled ratio that drift
        # cannot skew.
        paired = sorted(
            t / r for t, r in zip(row["round_p50_us"], raw["round_p50_us"], strict=True)
        )
        check(
            f"{ours} p50 <= 1.05 x raw_evalsha p50",
            row["p50_us"] <= bound,
            f"{row['p50_us']:.1f} us vs bound {bound:.1f} us "
            f"(ratio {row['p50_us'] / raw['p50_us']:.3f}, median per-round ratio "
            f"{percentile(paired, 0.5):.3f}, difference {row['p50_us'] - raw['p50_us']:+.1f} us)",
        )
    for ours in ("token_bucket", "gcra"):
        for peer in (row for row in rows.values() if row["kind"] == "peer"):
            check(
                f"{ours} p50 not behind {peer['case']} p50",
                rows[ours]["p50_us"] <= peer["p50_us"],
                f"{rows[ours]['p50_us']:.1f} us vs {peer['p50_us']:.1f} us",
            )
    # Server CPU per call is judged warm (Redis busy, as under a fleet's load); the cold
    # figure of the one-at-a-time run is reported beside it.
    for ours in ("token_bucket", "gcra"):
        warm = rows[ours]["warm_server_us_per_call"]
        raw_warm = raw["warm_server_us_per_call"]
        check(
            f"{ours} server time <= raw_evalsha + 1 us (warm)",
            warm <= raw_warm + 1.0,
            f"{warm:.2f} us warm vs raw script {raw_warm:.2f} us ({warm - raw_warm:+.2f}); "
            f"cold {rows[ours]['server_us_per_call']:.2f} us (raw {raw['server_us_per_call']:.2f})",
        )
    check(
        "three_limits p50 <= 2 x token_bucket p50",
        three["p50_us"] <= 2 * tb["p50_us"],
        f"{three['p50_us']:.1f} us vs bound {2 * tb['p50_us']:.1f} us "
        f"(ratio {three['p50_us'] / tb['p50_us']:.2f})",
    )
    for label, column in (("warm", "warm_server_us_per_call"), ("cold", "server_us_per_call")):
        check(
            f"three_limits server <= 2 x token_bucket server ({label})",
            three[column] <= 2 * tb[column],
            f"{three[column]:.2f} us vs bound {2 * tb[column]:.2f} us "
            f"(ratio {three[column] / tb[column]:.2f})",
        )
    plans, keyed = rows[TASK_PLANS], rows[TASK_KEYED]
    check(
        "a plan table: one round trip per acquire",
        plans["top_level_commands_per_call"] == keyed["top_level_commands_per_call"] == 1.0,
        f"{plans['top_level_commands_per_call']:.2f} top-level commands per call "
        f"(without plans {keyed['top_level_commands_per_call']:.2f})",
    )
    for label, column in (("warm", "warm_server_us_per_call"), ("cold", "server_us_per_call")):
        check(
            f"a plan table: server time <= 1.05 x without ({label})",
            plans[column] <= 1.05 * keyed[column],
            f"{plans[column]:.2f} us vs {keyed[column]:.2f} us without plans "
            f"(ratio {plans[column] / keyed[column]:.3f})",
        )
    paired = sorted(
        p / k for p, k in zip(plans["round_p50_us"], keyed["round_p50_us"], strict=True)
    )
    out.append(
        {
            "target": "a plan table: client p50 (reported, no target)",
            "passed": True,
            "detail": f"{plans['p50_us']:.1f} us vs {keyed['p50_us']:.1f} us without plans "
            f"(median per-round ratio {percentile(paired, 0.5):.3f}; the lookup is Python)",
        }
    )
    return out


def print_report(
    info: dict[str, Any],
    params: dict[str, Any],
    rows: list[dict[str, Any]],
    checks: list[dict[str, Any]],
) -> None:
    print("## Machine")
    for key, value in info.items():
        print(f"- {key}: {value}")
    print(
        f"- run: {params['rounds']} rounds x {params['block']} calls per case "
        f"(+1 warm-up round), seed {params['seed']}, {params['elapsed_s']:.1f} s"
    )
    print()
    raw_p50 = next(row["p50_us"] for row in rows if row["case"] == BASELINE)
    print(
        "| case | p50 µs | p99 µs | p50 vs raw EVALSHA "
        "| server µs/call (cold) | server µs/call (warm) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        ratio = f"{row['p50_us'] / raw_p50:.2f}x ({row['p50_us'] - raw_p50:+.1f} µs)"
        warm = row["warm_server_us_per_call"]
        print(
            f"| {row['case']} | {row['p50_us']:.1f} | {row['p99_us']:.1f} | {ratio} "
            f"| {row['server_us_per_call']:.2f} | {'n/a' if warm is None else f'{warm:.2f}'} |"
        )
    print()
    print(f"`{CONCURRENCY}` is two round trips per sample (acquire, then release).")
    print(
        "Server µs: INFO commandstats usec of the top-level commands (EVALSHA, PING). Cold: "
        "the one-call-at-a-time run above. Warm: the same EVALSHA replayed in pipelined "
        "batches, Redis busy as under a fleet's load (peers cannot be replayed: n/a)."
    )
    print()
    # Where the server time goes: inside a script, the commands it runs versus Lua itself.
    print("| case | top-level cmds/call | script-run cmds/call | their µs/call | Lua+call µs |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        nested_calls = sum(v["calls"] for v in row["nested_per_call"].values())
        nested_us = sum(v["us"] for v in row["nested_per_call"].values())
        print(
            f"| {row['case']} | {row['top_level_commands_per_call']:.2f} | {nested_calls:.2f} "
            f"| {nested_us:.2f} | {row['server_us_per_call'] - nested_us:.2f} |"
        )
    print()
    print(
        "Script-run commands (HMGET, HSET, ...) are inside the server µs; Lua+call is the rest:"
        " the interpreter, the script's own setup and the cost of each redis.call around them."
    )
    print()
    for name in (BASELINE, "token_bucket"):
        row = next(row for row in rows if row["case"] == name)
        spread = row["round_p50_us"]
        print(f"Noise: per-round p50 of {name} ranged {min(spread):.1f}-{max(spread):.1f} µs.")
    print()
    denied = [row for row in rows if row["denied"]]
    for row in denied:
        print(f"WARNING: {row['case']} had {row['denied']} denied calls; targets are for admitted")
    print("## Targets")
    for check in checks:
        verdict = "PASS" if check["passed"] else "FAIL"
        print(f"- {verdict}: {check['target']}: {check['detail']}")


def profile(fixture: Fixture, name: str, calls: int) -> None:
    """Profile the Python side of one case: where the client-side microseconds go."""
    case = next((c for c in fixture.cases if c.name == name), None)
    if case is None:
        known = ", ".join(c.name for c in fixture.cases)
        raise SystemExit(f"unknown case {name!r}; one of: {known}")
    run_block(case, 1000)  # warm up outside the profile
    profiler = cProfile.Profile()
    profiler.enable()
    run_block(case, calls)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(25)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.core",
        description="Single-client latency of our acquire vs raw EVALSHA, PING and peers.",
    )
    parser.add_argument("--rounds", type=int, default=20, help="recorded rounds (default 20)")
    parser.add_argument(
        "--block", type=int, default=500, help="calls per case per round (default 500)"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the per-round order")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write results here")
    parser.add_argument(
        "--profile", metavar="CASE", help="instead: cProfile the Python side of CASE"
    )
    parser.add_argument(
        "--profile-calls", type=int, default=20_000, help="calls profiled (default 20000)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.block < 1:
        parser.error("--rounds and --block must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    fixture = start()
    try:
        if args.profile:
            profile(fixture, args.profile, args.profile_calls)
            return 0
        info = machine_info(fixture.admin)
        began = time.monotonic()
        measure(fixture, args.rounds, args.block, args.seed)
        measure_warm(fixture, args.rounds, args.block, args.seed)
        params = {
            "rounds": args.rounds,
            "block": args.block,
            "seed": args.seed,
            "elapsed_s": time.monotonic() - began,
        }
    finally:
        fixture.close()
    rows = [summarize(case) for case in fixture.cases]
    checks = targets({row["case"]: row for row in rows})
    print_report(info, params, rows, checks)
    if args.json is not None:
        result = {"machine": info, "params": params, "cases": rows, "targets": checks}
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0 if all(row["denied"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
