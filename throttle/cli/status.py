"""``celery throttle status``: every limit's state, collected from Redis and the workers,
rendered as a table or JSON, once or every N seconds (``--watch``).

:func:`collect_status` reads (the limits, the rates set at run time and learned, the
tokens, the holds, the denials per minute, the parking lot, the workers' running tasks and
clocks); :func:`render_status` writes the table; the command ties them together.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import click
from click.decorators import FC

from throttle.celery.message import queue_of
from throttle.celery.runtime import Throttler, declared_by
from throttle.cli.base import (
    amount,
    counted,
    duration,
    known_limits,
    one_line_errors,
    plain,
    rate_spec,
    throttler_of,
)
from throttle.errors import BackendError, ConfigError
from throttle.redis.client import wrap_errors
from throttle.redis.clock import REFRESH_S, read_clocks
from throttle.redis.memory import eviction_policy, eviction_warning
from throttle.redis.urls import describe
from throttle.rules import Rule
from throttle.spec import Limit
from throttle.stats import EVENTS, MAX_MINUTES, StatsBook

DEFAULT_MINUTES = 5
"""``status`` averages the denials over this many whole minutes unless told otherwise."""
CLOCKS_SEEN_S = 2.5 * REFRESH_S
"""``status`` shows the clocks of workers that recorded theirs within this time, in s (a
worker records it at start and each minute, and drops it when it stops cleanly: a
worker killed shows for this long)."""


def _hold(seconds: float | None) -> dict[str, Any] | None:
    if seconds is None:
        return None
    paused = math.isinf(seconds)
    return {"paused": paused, "held_s": None if paused else round(seconds, 3)}


def in_flight(app: Any, throttler: Throttler, timeout_s: float) -> tuple[Counter[str], int]:
    """Tasks running now, per limit among their rules, from ``inspect().active()``, and how
    many workers replied within ``timeout_s``.

    A task counts from the moment a worker starts it, so a task sleeping until its
    reserved slot (at most ``settings.sleep_max``) counts too. A task whose name this app
    does not know (a module the app does not import) cannot be told and is left out.
    """
    replies = app.control.inspect(timeout=timeout_s).active() or {}
    counts: Counter[str] = Counter()
    for tasks in replies.values():
        for info in tasks or ():
            task = app.tasks.get(info.get("name"))
            if task is None:
                continue
            queue = queue_of(info.get("delivery_info"))
            for rule in throttler.rules(task, declared_by(task), queue):
                counts[rule.name] += 1
    return counts, len(replies)


def collect_status(
    app: Any, throttler: Throttler, timeout_s: float, minutes: int = DEFAULT_MINUTES
) -> dict[str, Any]:
    """What ``status`` shows, as the JSON of ``status --json``; see the command's help."""
    limiter = throttler.limiter
    known = known_limits(app, throttler)
    overrides = throttler.rates.overrides()
    followed = throttler.rates.followed_rates()
    key_rates = throttler.rates.key_overrides()
    shadows = StatsBook(limiter.client, limiter.keyspace, clock=throttler.clock.now).shadow(minutes)
    learned = throttler.learned.states()
    workers: int | None = None
    flights: Counter[str] | None = None
    if timeout_s > 0:  # first: the workers take up to timeout_s to answer
        flights, workers = in_flight(app, throttler, timeout_s)
    holds = limiter.holds()  # read with the limits' states, a moment apart
    counts = StatsBook(limiter.client, limiter.keyspace, clock=throttler.clock.now).per_minute(
        minutes
    )
    parked, releasing = _parked(throttler)
    rows = []
    for name, entry in known.items():
        configured = entry.rule.limit
        override = overrides.get(name)
        effective, ignored = configured, False
        if override is not None:
            try:
                effective = Limit.parse(override, name=name, algorithm=configured.algorithm)
            except ConfigError:
                ignored = True  # written by hand: the workers ignore it too (RateBook.current)
        keyed = entry.rule.key is not None
        state = None if keyed else limiter.peek(effective)
        next_slot = None
        if state is not None and not math.isinf(state.retry_after_s):
            next_slot = round(state.retry_after_s, 3)
        rows.append(
            {
                "name": name,
                "task": entry.task,
                "algorithm": configured.algorithm.value,
                "fair": configured.fair,
                "rate": rate_spec(configured),
                # A concurrency limit's units are its rate ("8 concurrent"): no burst.
                "burst": None if configured.algorithm.holds_units else configured.capacity,
                "override": override,
                "override_ignored": ignored,
                "followed": override is not None and followed.get(name) == override,
                "effective_rate": rate_spec(effective),
                "effective_burst": None if effective.algorithm.holds_units else effective.capacity,
                "adaptive": entry.rule.adaptive is not None,
                "learned_per_s": _learned(learned.get((name, None)), effective),
                "key_learned_per_s": {
                    key: _learned(rate, effective)
                    for (limit, key), rate in sorted(learned.items(), key=str)
                    if limit == name and key is not None
                },
                "key": _key_label(entry.rule),
                "tokens": None if state is None else round(state.remaining, 3),
                "next_slot_s": next_slot,
                "hold": _hold(holds.get((name, None))),
                "plans": {
                    plan: {"rate": rate_spec(planned), "burst": planned.capacity}
                    if not planned.fair
                    else {"weight": planned.default_weight}
                    for plan, planned in entry.rule.plan_limits.items()
                },
                "mode": throttler.mode_of(entry.rule),
                "mode_set": throttler.rates.mode(name),
                "shadow": shadows.get(name),
                "key_rates": {
                    key: spec
                    for (limit, key), spec in sorted(key_rates.items(), key=str)
                    if limit == name and key is not None
                },
                "key_holds": {
                    key: _hold(left)
                    for (limit, key), left in sorted(holds.items(), key=str)
                    if limit == name and key is not None
                },
                "in_flight": None if flights is None else flights.get(name, 0),
                "per_minute": counts.get(name, dict.fromkeys(EVENTS, 0.0)),
            }
        )
    return {
        "redis": describe(limiter.client),  # host, port, database: never the password
        "evicts": eviction_policy(limiter.client),  # an evicting maxmemory-policy, or None
        "prefix": limiter.keyspace.prefix,
        "namespace": limiter.keyspace.namespace,
        "config": throttler.config.source,
        "workers": workers,
        "parked": parked,
        "releasing": releasing,
        "minutes": minutes,
        "limits": rows,
        "clocks": [
            {
                "worker": record.worker,
                "offset_s": round(-record.offset_s, 6),
                "error_s": round(record.error_s, 6),
                "age_s": round(record.age_s, 3),
            }
            for record in read_clocks(
                limiter.client, limiter.keyspace.clocks_key(), newer_than_s=CLOCKS_SEEN_S
            )
        ],
    }


def _learned(rate: float | None, effective: Limit) -> float | None:
    """A learned rate as the workers use it (never above the rate in force), rounded."""
    return None if rate is None else round(min(rate, effective.rate_per_s), 3)


def _parked(throttler: Throttler) -> tuple[int, int]:
    """(parked, being released) of the parking lot, Redis errors wrapped."""
    counts: tuple[int, int] = wrap_errors(throttler.parking.counts)
    return counts


def _key_label(rule: Rule) -> str | None:
    if rule.key is None:
        return None
    return rule.key if isinstance(rule.key, str) else "<callable>"


def _cells(row: Mapping[str, Any]) -> list[str]:
    rate = row["effective_rate"]
    if row["override"] is not None and row["override_ignored"]:
        rate = f"{row['rate']} (set {row['override']!r} ignored: bad rate)"
    elif row["followed"]:
        rate = f"{rate} (upstream; file {row['rate']})"
    elif row["override"] is not None:
        rate = f"{rate} (set; file {row['rate']})"
    learned = row["learned_per_s"]
    if learned is not None:
        rate = f"{amount(learned)}/s learned ({rate})"
    elif row["key_learned_per_s"]:
        rate = f"{rate} ({len(row['key_learned_per_s'])} keys learned)"
    if row["plans"]:
        rate = f"{rate} + {counted(len(row['plans']), 'plan')}"
    key_rates = list(row["key_rates"].items())
    for key, spec in key_rates[:2]:
        rate = f"{rate}; {key}: {spec}"
    if len(key_rates) > 2:
        rate = f"{rate}; +{len(key_rates) - 2} keys set"
    if key_rates and row["fair"]:  # stored, but a fair limit has no rate per key
        rate = f"{rate} (ignored: fair)"
    shown = row["burst"] if row["override_ignored"] else row["effective_burst"]
    burst = "-" if shown is None else amount(shown)
    hold = row["hold"]
    next_slot = row["next_slot_s"]
    if row["key"] is not None:
        tokens = slot = "per key"
    else:
        tokens = amount(row["tokens"])
        # No next slot: paused (a pause placed after the holds were read shows here first).
        slot = (
            "paused"
            if next_slot is None
            else "now"
            if next_slot == 0
            # A unit comes back when a running task ends; the peek's time is only when the
            # oldest lease would expire (a task that never ends), an upper bound.
            else "on release"
            if row["algorithm"] == "concurrency"
            else f"in {duration(next_slot)}"
        )
    state = []
    if hold is not None:
        state.append("paused" if hold["paused"] else f"held {duration(hold['held_s'])}")
    key_holds = row["key_holds"]
    for key, held in list(key_holds.items())[:2]:
        state.append(
            f"{key}: " + ("paused" if held["paused"] else f"held {duration(held['held_s'])}")
        )
    if len(key_holds) > 2:
        state.append(f"+{len(key_holds) - 2} keys")
    flight = "?" if row["in_flight"] is None else str(row["in_flight"])
    per_minute = row["per_minute"]
    denied = _rate_of(per_minute["denied"] + per_minute.get("waited", 0.0))
    if per_minute["timeout"]:
        denied += f" ({_rate_of(per_minute['timeout'])} timed out)"
    return [
        row["name"], row["algorithm"] + (", fair" if row["fair"] else ""), rate, burst, tokens,
        slot, ", ".join(state) or "-",
        flight, denied,
    ]  # fmt: skip


def _rate_of(per_minute: float) -> str:
    return "0" if per_minute == 0 else f"{per_minute:.3g}"


_HEADERS = [
    "LIMIT", "ALGORITHM", "RATE", "BURST", "TOKENS", "NEXT SLOT", "HOLD", "IN FLIGHT",
    "DENIED/MIN",
]  # fmt: skip
_RIGHT = {"BURST", "TOKENS", "IN FLIGHT", "DENIED/MIN"}


def render_status(data: Mapping[str, Any], timeout_s: float) -> str:
    """The table of ``status``, with a footer on the parking lot, workers and Redis."""
    rows = [_cells(row) for row in data["limits"]]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(_HEADERS)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.rjust(width) if header in _RIGHT else cell.ljust(width)
            for cell, width, header in zip(cells, widths, _HEADERS, strict=True)
        ).rstrip()

    out = [line(_HEADERS), *(line(r) for r in rows)]
    if not rows:
        out.append("(no limits: no limits file, and no task has inline limits)")
    out.append("")
    out.append(f"parked   {data['parked']} tasks in Redis, {data['releasing']} being released")
    span = counted(data["minutes"], "whole minute")
    out.append(
        f"denied   tasks per minute that waited for their slot or were deferred, "
        f"fleet-wide, over the last {span}"
    )
    for row in data["limits"]:
        if row.get("mode_set") is not None:
            out.append(
                f"mode     {row['name']}: {row['mode_set']}, set at run time (`enforce "
                f"{row['name']} --default`: the limits file's mode)"
            )
    for row in data["limits"]:
        seen = row["shadow"]
        if row["mode"] != "shadow" and seen is None:
            continue
        name, minutes = row["name"], counted(data["minutes"], "minute")
        if seen is None or not seen["tasks"]:
            out.append(f"shadow   {name}: in shadow mode, no task seen over the last {minutes}")
            continue
        mode = "in shadow mode" if row["mode"] == "shadow" else "enforced now"
        told = (
            f"shadow   {name} ({mode}): would have delayed {seen['delayed']} of "
            f"{seen['tasks']} tasks over the last {minutes}"
        )
        if seen["delayed"]:
            told += f", by {duration(seen['p50_s'])} at p50, {duration(seen['p95_s'])} at p95"
        out.append(told)
    workers = data["workers"]
    if workers is None:
        out.append("workers  not asked (--timeout 0): IN FLIGHT unknown")
    else:
        out.append(f"workers  {workers} replied within {duration(timeout_s)}")
    for clock in data["clocks"]:
        out.append(
            f"clock    {clock['worker']}: {clock['offset_s']:+.3f} s from Redis "
            f"(+/- {clock['error_s']:.3f} s, {duration(clock['age_s'])} ago)"
        )
    out.append(
        f"redis    {data['redis']}  prefix {data['prefix']}  namespace {data['namespace']}"
        f"  limits file {data['config'] or '(none)'}"
    )
    if data.get("evicts"):
        out.append(f"WARNING  {eviction_warning(data['evicts'])}")
    return "\n".join(out)


def timeout_option(default_s: float) -> Callable[[FC], FC]:
    """``--timeout S``: how long to wait for the workers' replies (``status``, ``web``,
    ``task``)."""
    return click.option(
        "--timeout",
        type=click.FloatRange(min=0),
        default=default_s,
        show_default=True,
        metavar="S",
        help="Seconds to wait for the workers' replies on their tasks; 0: do not ask.",
    )


def minutes_option(counted: str) -> Callable[[FC], FC]:
    """``--minutes M`` (``status``, ``web``): over how many whole minutes the per-minute
    counts of ``counted`` (the command's own words) are averaged."""
    return click.option(
        "--minutes",
        type=click.IntRange(1, MAX_MINUTES),
        default=DEFAULT_MINUTES,
        show_default=True,
        metavar="M",
        help=f"{counted} are averaged over the last M whole minutes.",
    )


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option(
    "--watch",
    type=click.FloatRange(min=0.1),
    metavar="N",
    help="Redraw every N seconds until Ctrl-C (with --json: one JSON document per line).",
)
@timeout_option(1.0)
@minutes_option(
    "The tasks not admitted at once per minute (DENIED/MIN: they waited for their slot or "
    "were deferred)"
)
@click.pass_context
def status(
    ctx: click.Context, as_json: bool, watch: float | None, timeout: float, minutes: int
) -> None:
    """Every limit: rate, burst, tokens now, next free slot, holds, tasks in flight, denials.

    The limits are the limits file's and the tasks' inline ones. RATE is the one in force: a
    rate set at run time (`set`) shows with the file's, as does a rate that follows the
    upstream's stated limit (`upstream:`, "upstream; file ..."), and the rate an adaptive
    limit learned from the upstream's refusals before them; then how many plans the limit
    has, and the keys with a rate of their own (`set --key`, "acme: 250/s"). TOKENS and NEXT
    SLOT are read from Redis without taking anything; a limit with a key template has a
    state per key ("per key"). IN FLIGHT counts the tasks the workers are running whose
    rules include the limit. DENIED/MIN is how many of its tasks were not admitted at once,
    per minute, fleet-wide: they waited in the worker for their slot, or were deferred (and
    timed out, when any did). In JSON, a hold is {"paused": true} until resumed, or
    {"held_s": seconds left}; next_slot_s is null while paused; in_flight is null with
    --timeout 0; per_minute has the counts of "denied" (deferred), "parked" (of the denied),
    "timeout" and "waited" (slept to their slot in the worker); mode is "enforce" or
    "shadow", mode_set the mode set at run time with `enforce` and `shadow` (null: the
    limits file's, which `enforce --default` goes back to); shadow (null when the limit
    looked at no task in shadow mode over the last M minutes, the current one included) has
    the tasks it looked at, how many it would have delayed, and their would-be wait at p50_s
    and p95_s, also shown under the table; plans maps each plan to its rate and burst (a
    fair limit's: its weight); key_rates maps each key with a rate of its own to it.
    """
    app, throttler = throttler_of(ctx)

    def show() -> None:
        data = collect_status(app, throttler, timeout, minutes)
        if as_json:
            click.echo(json.dumps(data, allow_nan=False, indent=None if watch else 2))
        else:
            click.echo(render_status(data, timeout))

    if watch is None:
        with one_line_errors():
            show()
        return
    # Ctrl-C ends the watch between two redraws, not inside one: raised in the middle of a
    # Redis call, KeyboardInterrupt could leave a connection half-read, or surface as a
    # connection error that the retry below would swallow.
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.is_set():
            started = time.monotonic()
            if not as_json:
                click.clear()  # only on a terminal; piped, the tables follow each other
                stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
                click.echo(f"celery throttle status  every {plain(watch)}s  {stamp}  (Ctrl-C)")
            try:
                show()
            except BackendError as exc:
                # A watch outlives a Redis blip: it says so and tries again next round.
                click.echo(f"Error: {exc} (retrying)", err=True)
            stop.wait(max(watch - (time.monotonic() - started), 0.0))
    finally:
        signal.signal(signal.SIGINT, previous)
    ctx.exit(0)
