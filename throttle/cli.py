"""The ``celery throttle`` command: see and steer a fleet's limits from a shell.

::

    celery -A proj throttle status [--json] [--watch N] [--timeout S]
    celery -A proj throttle set LIMIT RATE          # or: set LIMIT --default
    celery -A proj throttle reset LIMIT [KEY] [--yes]
    celery -A proj throttle pause LIMIT [KEY]
    celery -A proj throttle resume LIMIT [KEY]
    celery -A proj throttle check FILE
    celery -A proj throttle task TASK_ID [--json]
    celery -A proj throttle parked [--queue Q] [--limit L] [--json] [--max N]
    celery -A proj throttle purge (--queue Q | --limit L | --all) [--yes]

A subcommand of the ``celery`` program, installed through the ``celery.commands`` entry
point. The app is the one ``-A`` names (celery's ``CLIContext``, ``ctx.obj.app``); its
limits file and the limiter's Redis are found as a worker finds them
(:meth:`throttle.celery.Throttler.from_app`). The limits it knows are the file's and the
inline limits of the app's tasks (``@throttled("20/s")``).

Exit codes: 0 done; 1 errors found (a bad limits file, Redis unreachable, a reset not
confirmed); 2 usage (an unknown limit, a bad rate). Redis passwords are never printed.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any
from urllib.parse import unquote

import click
from kombu.serialization import loads

from throttle.admin import reset as reset_state
from throttle.celery.message import LANE_SUFFIX, queue_of
from throttle.celery.runtime import Throttler, declared_by
from throttle.config import ThrottleConfig
from throttle.errors import BackendError, ConfigError, ThrottleError
from throttle.parking import Parked
from throttle.redis.client import RedisClient, wrap_errors
from throttle.redis.clock import read_clocks
from throttle.redis.urls import describe
from throttle.rules import Rule
from throttle.spec import Algorithm, Limit
from throttle.stats import EVENTS, MAX_MINUTES, StatsBook

__all__ = ["throttle"]

EXIT_ERRORS = 1
"""Errors found: a bad limits file, Redis unreachable, a reset not confirmed."""
EXIT_USAGE = 2
"""Usage: an unknown limit, a bad rate, a missing argument (click's own code for these)."""

DEFAULT_MINUTES = 5
CLOCKS_SEEN_S = 300.0
"""``status`` shows the clocks of workers that recorded theirs within this time, in s
(a worker records it at start and each minute)."""
"""``status`` averages the denials over this many whole minutes unless told otherwise."""
_UNITS = (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0), ("ms", 0.001))


# -- the app, its throttler and its limits --------------------------------------------------


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """The package's errors as one line and exit code 1, not a traceback."""
    try:
        yield
    except ThrottleError as exc:
        raise click.ClickException(str(exc)) from None


def _app(ctx: click.Context) -> Any:
    app = getattr(ctx.obj, "app", None)
    if app is None:
        raise click.UsageError("run it as a celery command: celery -A proj throttle ...")
    # What `celery report` does: the modules of the app's `imports`/`include`, whose tasks
    # may carry inline limits.
    app.loader.import_default_modules()
    return app


def _app_option(ctx: click.Context) -> str:
    """The ``-A`` of the command line, to repeat in a command it suggests (" -A proj")."""
    given = ctx.find_root().params.get("app")
    return f" -A {given}" if isinstance(given, str) and given else ""


def _throttler(ctx: click.Context) -> tuple[Any, Throttler]:
    app = _app(ctx)
    with _errors():
        return app, Throttler.of(app)


@dataclass(frozen=True)
class _Known:
    """A limit the command can name: from the limits file, or inline on a task."""

    rule: Rule
    task: str | None = None
    """The task an inline limit belongs to (None: the limits file)."""


def _known(app: Any, throttler: Throttler) -> dict[str, _Known]:
    """The file's limits in its order, then the tasks' inline limits by name."""
    known = {name: _Known(rule) for name, rule in throttler.config.rules.items()}
    for task in sorted(app.tasks.values(), key=lambda task: str(task.name)):
        spec = declared_by(task)
        for rule in spec.rules if spec is not None else ():
            known.setdefault(rule.name, _Known(rule, str(task.name)))
    return known


def _lookup(known: Mapping[str, _Known], name: str) -> _Known:
    """The limit called ``name``; a usage error (exit 2) lists the known ones."""
    if name in known:
        return known[name]
    listed = ", ".join(known) or "none (no limits file, no @throttled inline limits)"
    raise click.BadParameter(f"unknown limit {name!r}; known limits: {listed}", param_hint="LIMIT")


# -- formatting -----------------------------------------------------------------------------


def _plain(number: float) -> str:
    """A number as the limit grammar reads it: no exponent, no trailing ``.0``."""
    text = format(Decimal(repr(float(number))), "f")
    return text[:-2] if text.endswith(".0") else text


def rate_spec(limit: Limit) -> str:
    """The rate of ``limit`` in the grammar of :meth:`Limit.parse`, without its burst:
    ``50/s``, ``1/3h``, ``8 concurrent``."""
    if limit.algorithm is Algorithm.CONCURRENCY:
        return f"{_plain(limit.count)} concurrent"
    for unit, size in _UNITS:
        multiple = limit.period_s / size
        if multiple >= 1 and abs(multiple - round(multiple)) < 1e-9 * multiple:
            every = "" if round(multiple) == 1 else _plain(round(multiple))
            return f"{_plain(limit.count)}/{every}{unit}"
    return f"{_plain(limit.count)}/{_plain(limit.period_s)}s"


def _seconds(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}".removesuffix(".0") + "s"
    if seconds < 7200:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _amount(value: float) -> str:
    return str(round(value)) if abs(value - round(value)) < 0.005 else f"{value:.2f}"


def _where(client: RedisClient) -> str:
    """Where the limiter's Redis is, built from the connection's host, port and database
    (the sentinels and service for Sentinel): never with its password."""
    return describe(client)


# -- status ---------------------------------------------------------------------------------


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
    known = _known(app, throttler)
    overrides = throttler.rates.overrides()
    followed = throttler.rates.followed_rates()
    learned = throttler.learned.states()
    holds = limiter.holds()
    counts = StatsBook(limiter.client, limiter.keyspace, clock=throttler.clock.now).per_minute(
        minutes
    )
    parked, releasing = _parked(throttler)
    workers: int | None = None
    flights: Counter[str] | None = None
    if timeout_s > 0:
        flights, workers = in_flight(app, throttler, timeout_s)
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
                "burst": configured.capacity,
                "override": override,
                "override_ignored": ignored,
                "followed": override is not None and followed.get(name) == override,
                "effective_rate": rate_spec(effective),
                "effective_burst": effective.capacity,
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
        "redis": _where(limiter.client),
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
        rate = f"{_amount(learned)}/s learned ({rate})"
    elif row["key_learned_per_s"]:
        rate = f"{rate} ({len(row['key_learned_per_s'])} keys learned)"
    burst = _amount(row["burst"] if row["override_ignored"] else row["effective_burst"])
    hold = row["hold"]
    next_slot = row["next_slot_s"]
    if row["key"] is not None:
        tokens = slot = "per key"
    else:
        tokens = _amount(row["tokens"])
        # No next slot: paused (a pause placed after the holds were read shows here first).
        slot = (
            "paused"
            if next_slot is None
            else "now"
            if next_slot == 0
            else f"in {_seconds(next_slot)}"
        )
    state = []
    if hold is not None:
        state.append("paused" if hold["paused"] else f"held {_seconds(hold['held_s'])}")
    key_holds = row["key_holds"]
    for key, held in list(key_holds.items())[:2]:
        state.append(
            f"{key}: " + ("paused" if held["paused"] else f"held {_seconds(held['held_s'])}")
        )
    if len(key_holds) > 2:
        state.append(f"+{len(key_holds) - 2} keys")
    flight = "?" if row["in_flight"] is None else str(row["in_flight"])
    per_minute = row["per_minute"]
    denied = _rate_of(per_minute["denied"])
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
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(_HEADERS)]

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
    span = _count(data["minutes"], "whole minute")
    out.append(f"denied   tasks deferred per minute over the last {span}, fleet-wide")
    workers = data["workers"]
    if workers is None:
        out.append("workers  not asked (--timeout 0): IN FLIGHT unknown")
    else:
        out.append(f"workers  {workers} replied within {_seconds(timeout_s)}")
    for clock in data["clocks"]:
        out.append(
            f"clock    {clock['worker']}: {clock['offset_s']:+.3f} s from Redis "
            f"(+/- {clock['error_s']:.3f} s, {_seconds(clock['age_s'])} ago)"
        )
    out.append(
        f"redis    {data['redis']}  prefix {data['prefix']}  namespace {data['namespace']}"
        f"  limits file {data['config'] or '(none)'}"
    )
    return "\n".join(out)


# -- the commands ---------------------------------------------------------------------------


@click.group()
def throttle() -> None:
    """Fleet-wide rate limits (celery-throttled): status, set, reset, pause, resume, check,
    task, parked, purge."""


@throttle.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option(
    "--watch",
    type=click.FloatRange(min=0.1),
    metavar="N",
    help="Redraw every N seconds until Ctrl-C (with --json: one JSON document per line).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=1.0,
    show_default=True,
    metavar="S",
    help="Seconds to wait for the workers' replies on their running tasks; 0: do not ask.",
)
@click.option(
    "--minutes",
    type=click.IntRange(1, MAX_MINUTES),
    default=DEFAULT_MINUTES,
    show_default=True,
    metavar="M",
    help="DENIED/MIN is averaged over the last M whole minutes.",
)
@click.pass_context
def status(
    ctx: click.Context, as_json: bool, watch: float | None, timeout: float, minutes: int
) -> None:
    """Every limit: rate, burst, tokens now, next free slot, holds, tasks in flight, denials.

    The limits are the limits file's and the tasks' inline ones. RATE is the one in force:
    a rate set at run time (`set`) shows with the file's, as does a rate that follows the
    upstream's stated limit (`upstream:`, "upstream; file ..."), and the rate an adaptive
    limit learned from the upstream's refusals before them. TOKENS and NEXT SLOT are read
    from Redis without taking anything; a limit with a key template has a state per key
    ("per key"). IN FLIGHT counts the tasks the workers are running whose rules include
    the limit. DENIED/MIN is how many of its tasks the fleet deferred per minute (and timed
    out, when any did). In JSON, a hold is {"paused": true} until resumed, or {"held_s":
    seconds left}; next_slot_s is null while paused; in_flight is null with --timeout 0;
    per_minute has the counts of "denied", "parked" (of the denied) and "timeout".
    """
    app, throttler = _throttler(ctx)

    def show() -> None:
        data = collect_status(app, throttler, timeout, minutes)
        if as_json:
            click.echo(json.dumps(data, allow_nan=False, indent=None if watch else 2))
        else:
            click.echo(render_status(data, timeout))

    if watch is None:
        with _errors():
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
                click.echo(f"celery throttle status  every {_plain(watch)}s  {stamp}  (Ctrl-C)")
            try:
                show()
            except BackendError as exc:
                # A watch outlives a Redis blip: it says so and tries again next round.
                click.echo(f"Error: {exc} (retrying)", err=True)
            stop.wait(max(watch - (time.monotonic() - started), 0.0))
    finally:
        signal.signal(signal.SIGINT, previous)
    ctx.exit(0)


@throttle.command("set")
@click.argument("limit")
@click.argument("rate", required=False)
@click.option("--default", "default", is_flag=True, help="Go back to the limits file's rate.")
@click.pass_context
def set_rate(ctx: click.Context, limit: str, rate: str | None, default: bool) -> None:
    """Change LIMIT's RATE for the whole fleet, at run time ("1000/h", "10/s burst 1").

    Workers follow within settings.refresh; nothing restarts. A RATE without "burst" gets
    the smaller of the file's burst and its own count: a burst-1 shaper stays burst 1, a
    lowered "3500/m" gets burst 100 at "100/m". The change lasts until `set LIMIT --default`.
    """
    if (rate is None) == (not default):
        raise click.UsageError("give a RATE, or --default to go back to the file's rate")
    app, throttler = _throttler(ctx)
    entry = _lookup(_known(app, throttler), limit)
    configured = entry.rule.limit
    refresh = _seconds(throttler.settings.refresh_s)
    if default:
        with _errors():
            throttler.rates.clear(limit)
        click.echo(
            f"limit {limit!r}: back to {rate_spec(configured)} burst {_amount(configured.capacity)}"
            f" (the configured rate); workers follow within {refresh} (settings.refresh)"
        )
        return
    assert rate is not None
    try:
        changed = Limit.parse(rate, name=limit, algorithm=configured.algorithm)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="RATE") from None
    # Without "burst", Limit.parse would make the burst the new count: "set github 2/s" on a
    # "1/s burst 1" shaper would let 2 calls through at once. A change of rate never makes
    # a limit burstier than its file unless RATE says so.
    if (
        "burst" not in rate.lower()
        and configured.algorithm in (Algorithm.TOKEN_BUCKET, Algorithm.GCRA)
        and configured.capacity < changed.count
    ):
        rate = f"{rate.strip()} burst {_plain(configured.capacity)}"
        changed = Limit.parse(rate, name=limit, algorithm=configured.algorithm)
    cost = entry.rule.cost
    if isinstance(cost, float) and cost > changed.capacity:
        # Every task would fail with CostExceedsCapacity: refuse rather than break them.
        raise click.BadParameter(
            f"the burst {_amount(changed.capacity)} of {rate!r} is below the cost "
            f"{_amount(cost)} that each task of limit {limit!r} takes: no task could run",
            param_hint="RATE",
        )
    with _errors():
        throttler.rates.set(configured, rate)
    click.echo(
        f"limit {limit!r}: {rate_spec(changed)} burst {_amount(changed.capacity)} for the whole "
        f"fleet (configured {rate_spec(configured)} burst {_amount(configured.capacity)}); "
        f"workers follow within {refresh} (settings.refresh)"
    )


@throttle.command()
@click.argument("limit")
@click.argument("key", required=False)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def reset(ctx: click.Context, limit: str, key: str | None, yes: bool) -> None:
    """Delete LIMIT's state in Redis (and its plans), of KEY or of every key: it starts
    afresh, full.

    Holds, pauses and rates set at run time stay. Tasks that already reserved a slot still
    run at it, so right after a reset the limit can admit up to a burst more than usual.
    """
    app, throttler = _throttler(ctx)
    _lookup(_known(app, throttler), limit)
    what = f"key {key!r} of limit {limit!r}" if key is not None else f"limit {limit!r} (every key)"
    if not yes:
        click.confirm(f"Reset {what}? Its tokens, windows and holders are forgotten", abort=True)
    limiter = throttler.limiter
    with _errors():
        deleted = reset_state(limiter.client, limiter.keyspace, limit, key)
    click.echo(
        f"reset {what}: {_count(deleted, 'Redis key')} deleted (holds and run-time rates unchanged)"
    )


@throttle.command()
@click.argument("limit")
@click.argument("key", required=False)
@click.pass_context
def pause(ctx: click.Context, limit: str, key: str | None) -> None:
    """Admit nothing of LIMIT (of its KEY only, when given) until `resume`.

    Its tasks are not lost: workers defer them, and each looks again every
    settings.pause_recheck (plus up to half of it of jitter).
    """
    app, throttler = _throttler(ctx)
    _lookup(_known(app, throttler), limit)
    with _errors():
        throttler.limiter.hold(limit, key, None)
    what = f"key {key!r} of limit {limit!r}" if key is not None else f"limit {limit!r}"
    recheck = _seconds(throttler.settings.pause_recheck_s)
    click.echo(
        f"paused {what}: its tasks are deferred and look again every {recheck} "
        f"(settings.pause_recheck); none is lost. Undo: celery{_app_option(ctx)} throttle "
        f"resume {limit}" + (f" {key}" if key is not None else "")
    )


@throttle.command()
@click.argument("limit")
@click.argument("key", required=False)
@click.pass_context
def resume(ctx: click.Context, limit: str, key: str | None) -> None:
    """Lift the pause (or a timed hold) of LIMIT, or of its KEY."""
    app, throttler = _throttler(ctx)
    _lookup(_known(app, throttler), limit)
    limiter = throttler.limiter
    what = f"key {key!r} of limit {limit!r}" if key is not None else f"limit {limit!r}"
    with _errors():
        before = limiter.holds()
        limiter.unhold(limit, key)
        after = limiter.holds()
    held = before.get((limit, key))
    if held is None:
        click.echo(f"{what} was neither paused nor held: nothing to do")
    else:
        recheck = throttler.settings.pause_recheck_s
        lifted = "pause" if math.isinf(held) else f"hold ({_seconds(held)} left)"
        click.echo(
            f"resumed {what} (lifted its {lifted}): paused tasks come back within "
            f"{_seconds(recheck * 1.5)} (settings.pause_recheck plus jitter)"
        )
    for (name, other), left in sorted(after.items(), key=str):
        if name == limit:
            which = f"key {other!r} of limit" if other is not None else "limit"
            state = "paused" if math.isinf(left) else f"held {_seconds(left)}"
            click.echo(f"  still {state}: {which} {limit!r}")


@throttle.command()
@click.argument("file")
@click.pass_context
def check(ctx: click.Context, file: str) -> None:
    """Validate a limits FILE: print every error with its place, exit 1 if any.

    With an app (-A), also that every limit its tasks name in @throttled is in the file,
    which a worker of the app checks when it starts.
    """
    errors = [str(error) for error in ThrottleConfig.check(file)]
    config = None
    if not errors:
        config = ThrottleConfig.load(file)
        app = getattr(ctx.obj, "app", None)
        if app is not None:
            app.loader.import_default_modules()
            errors += _task_errors(app, config, file)
    for error in errors:
        click.echo(error)
    if errors:
        click.echo(f"{_count(len(errors), 'error')} in {file}", err=True)
        ctx.exit(EXIT_ERRORS)
    assert config is not None
    counts = {"limit": config.rules, "queue": config.queues, "task": config.tasks}
    click.echo(f"{file}: OK: " + ", ".join(_count(len(v), k) for k, v in counts.items()))


def _task_errors(app: Any, config: ThrottleConfig, file: str) -> list[str]:
    defined = ", ".join(sorted(config.rules)) or "none"
    errors = []
    for task in sorted(app.tasks.values(), key=lambda task: str(task.name)):
        spec = declared_by(task)
        for name in spec.names if spec is not None else ():
            if name not in config.rules:
                errors.append(
                    str(
                        ConfigError(
                            f"task {task.name!r} names a limit the file does not define; "
                            f"it defines {defined}",
                            value=name,
                            source=file,
                        )
                    )
                )
    return errors


# -- parked tasks and single tasks ---------------------------------------------------------


@dataclass(frozen=True)
class _ParkedTask:
    """A parked task as the commands show it: its payload decoded."""

    parked: Parked
    task_id: str | None
    name: str | None
    queue: str | None
    """The queue it goes back to (its lane counts as the queue itself)."""
    lane: bool
    limits: tuple[str, ...]
    """The limits of its rules in this app (empty: a task this app does not know)."""


def _decode(app: Any, throttler: Throttler, parked: Parked) -> _ParkedTask:
    """Read a parked payload (``content type\\nencoding\\nbody``, the task's signature, as
    :func:`throttle.celery.reschedule.defer` wrote it); an unreadable one shows as
    unknown (name None) rather than stop the listing."""
    try:
        content_type, encoding, body = parked.payload.split(b"\n", 2)
        sig = loads(body, content_type.decode(), encoding.decode())  # type: ignore[no-untyped-call]
        options = sig.get("options") or {}
        name = sig.get("task")
    except Exception:
        return _ParkedTask(parked, parked.task_id, None, None, False, ())
    queue = options.get("queue") if isinstance(options.get("queue"), str) else None
    lane = queue is not None and queue.endswith(LANE_SUFFIX)
    if queue is not None and lane:
        queue = queue[: -len(LANE_SUFFIX)]
    task = app.tasks.get(name) if isinstance(name, str) else None
    limits: tuple[str, ...] = ()
    if task is not None:
        limits = tuple(rule.name for rule in throttler.rules(task, declared_by(task), queue))
    task_id = parked.task_id or (options.get("task_id") if isinstance(options, dict) else None)
    return _ParkedTask(
        parked, str(task_id) if task_id else None, name if isinstance(name, str) else None,
        queue, lane, limits,
    )  # fmt: skip


def _lot(app: Any, throttler: Throttler) -> list[_ParkedTask]:
    with _errors():
        return [_decode(app, throttler, parked) for parked in wrap_errors(lambda: _scan(throttler))]


def _scan(throttler: Throttler) -> list[Parked]:
    return list(throttler.parking.scan())


def _redis_now_us(throttler: Throttler) -> int:
    with _errors():
        now: int = wrap_errors(throttler.parking.now_us)
        return now


def _when(due_us: int, now_us: int) -> str:
    stamp = datetime.fromtimestamp(due_us / 1e6).strftime("%Y-%m-%d %H:%M:%S")
    left = (due_us - now_us) / 1e6
    return f"{stamp} ({'in ' + _seconds(left) if left >= 0 else _seconds(-left) + ' ago'})"


def _select(tasks: list[_ParkedTask], queue: str | None, limit: str | None) -> list[_ParkedTask]:
    return [
        task
        for task in tasks
        if (queue is None or task.queue == queue) and (limit is None or limit in task.limits)
    ]


def _check_filters(
    ctx: click.Context, app: Any, throttler: Throttler, queue: str | None, limit: str | None
) -> None:
    if limit is not None:
        try:
            _lookup(_known(app, throttler), limit)
        except click.BadParameter as exc:
            exc.param_hint = "'--limit'"
            raise
    if queue is not None and (not queue or queue.endswith(LANE_SUFFIX)):
        raise click.BadParameter(
            f"give the queue, not its lane: {queue[: -len(LANE_SUFFIX)]!r} "
            f"(its lane {queue!r} is included)"
            if queue
            else "the queue name is empty",
            param_hint="'--queue'",
        )


@throttle.command()
@click.option("--queue", "-Q", metavar="QUEUE", help="Only the tasks going back to QUEUE.")
@click.option("--limit", "-l", metavar="LIMIT", help="Only the tasks under LIMIT.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option(
    "--max",
    "most",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="List at most this many tasks (soonest due first); the counts are of all.",
)
@click.pass_context
def parked(
    ctx: click.Context, queue: str | None, limit: str | None, as_json: bool, most: int
) -> None:
    """The tasks parked in Redis: counts per limit and per queue, and the soonest due.

    Parked tasks wait in Redis, not at the broker: `celery inspect scheduled`, `celery
    inspect reserved` and `celery purge` do not see them. Each goes back to its queue's
    lane (QUEUE.throttled) when it is due; a task being published by a releaser right now
    shows as "releasing".
    """
    app, throttler = _throttler(ctx)
    _check_filters(ctx, app, throttler, queue, limit)
    now = _redis_now_us(throttler)
    tasks = _select(_lot(app, throttler), queue, limit)
    tasks.sort(key=lambda t: (t.parked.due_us is not None, t.parked.due_us or 0))
    per_limit: Counter[str] = Counter(name for task in tasks for name in task.limits)
    per_queue: Counter[str] = Counter(task.queue or "?" for task in tasks)
    rows = [
        {
            "task_id": task.task_id,
            "name": task.name,
            "queue": task.queue,
            "lane": task.lane,
            "limits": list(task.limits),
            "state": "parked" if task.parked.due_us is not None else "releasing",
            "due_in_s": None
            if task.parked.due_us is None
            else round((task.parked.due_us - now) / 1e6, 3),
        }
        for task in tasks[:most]
    ]
    if as_json:
        data = {
            "total": len(tasks),
            "per_limit": dict(per_limit),
            "per_queue": dict(per_queue),
            "tasks": rows,
        }
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"{_count(len(tasks), 'parked task')}" + _filters(queue, limit))
    for title, counts in (("per limit", per_limit), ("per queue", per_queue)):
        if counts:
            click.echo(f"{title}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for task in tasks[:most]:
        when = (
            "releasing now"
            if task.parked.due_us is None
            else f"due {_when(task.parked.due_us, now)}"
        )
        click.echo(
            f"  {task.task_id or '?'}  {task.name or '(unreadable payload)'}  "
            f"queue {task.queue or '?'}  limits {','.join(task.limits) or '-'}  {when}"
        )
    if len(tasks) > most:
        click.echo(f"  ... and {len(tasks) - most} more (--max)")


def _filters(queue: str | None, limit: str | None) -> str:
    parts = ([f"queue {queue!r}"] if queue else []) + ([f"limit {limit!r}"] if limit else [])
    return (" of " + " and ".join(parts)) if parts else ""


@throttle.command()
@click.option("--queue", "-Q", metavar="QUEUE", help="The parked tasks going back to QUEUE.")
@click.option("--limit", "-l", metavar="LIMIT", help="The parked tasks under LIMIT.")
@click.option("--all", "everything", is_flag=True, help="Every parked task.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def purge(
    ctx: click.Context, queue: str | None, limit: str | None, everything: bool, yes: bool
) -> None:
    """Delete parked tasks for good: by --queue, by --limit (both: either filter), or --all.

    Only the parked tasks in Redis: messages at the broker, in QUEUE and in its lane
    QUEUE.throttled, stay (`celery purge -Q QUEUE,QUEUE.throttled` empties those, and
    `celery purge` alone does not know the lanes). A task a releaser is publishing at that
    moment is not deleted (it will run): the deletion is one Redis script, atomic with the
    releasers' claims. Deleted tasks never run; their results never come.
    """
    if everything == (queue is not None or limit is not None):
        raise click.UsageError("give --queue QUEUE, --limit LIMIT (or both), or --all")
    app, throttler = _throttler(ctx)
    _check_filters(ctx, app, throttler, queue, limit)
    tasks = [t for t in _select(_lot(app, throttler), queue, limit) if t.parked.due_us is not None]
    what = _filters(queue, limit) or " (all)"
    if not tasks:
        click.echo(f"no parked tasks{what}: nothing to purge")
        return
    if not yes:
        click.confirm(
            f"Delete {_count(len(tasks), 'parked task')}{what}? They will never run", abort=True
        )
    with _errors():
        deleted: int = wrap_errors(lambda: throttler.parking.purge([t.parked.token for t in tasks]))
    click.echo(f"purged {_count(deleted, 'parked task')}{what}")
    if deleted < len(tasks):
        click.echo(f"  {len(tasks) - deleted} were being released meanwhile: not purged")
    lane = f"{queue},{queue}{LANE_SUFFIX}" if queue else "QUEUE,QUEUE" + LANE_SUFFIX
    click.echo(
        f"  broker messages are untouched: celery{_app_option(ctx)} purge -Q {lane} empties "
        "the queue and its lane"
    )


def _task_limits(keys: list[bytes | None], base: str) -> list[str]:
    """The limit names of a lease record's state keys (``base code:limit:key``)."""
    names = []
    for raw in keys:
        if raw is None:
            continue
        key = raw.decode(errors="replace")
        if key.startswith(base):
            parts = key[len(base) :].split(":")
            if len(parts) >= 2:
                names.append(unquote(parts[1]))
    return names


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def task_status(app: Any, throttler: Throttler, task_id: str) -> dict[str, Any]:
    """Where task ``task_id`` is, as far as the throttler's Redis knows (see ``task``)."""
    limiter = throttler.limiter
    keyspace = limiter.keyspace
    client = limiter.client
    now_us = throttler.parking.now_us()
    now = now_us / 1e6
    out: dict[str, Any] = {"task_id": task_id, "now": round(now, 3), "limits": []}

    found = throttler.parking.find(task_id)
    if found is not None:
        task = _decode(app, throttler, found)
        out.update(name=task.name, queue=task.queue, limits=list(task.limits))
        if found.due_us is None:
            return {**out, "state": "releasing", "until": None}
        return {**out, "state": "parked", "until": round(found.due_us / 1e6, 3)}

    lease = {_text(k): _bytes(v) for k, v in client.hgetall(keyspace.lease_key(task_id)).items()}
    if lease:
        count = int(lease.get("n", b"0"))
        out["limits"] = _task_limits(
            [lease.get(f"k{i}") for i in range(1, count + 1)], keyspace.base
        )
        slot = int(lease.get("at", b"0")) / 1e6
        out["slot"] = round(slot, 3)
    if lease.get("s") == b"1":
        if slot > now + throttler.settings.sleep_max_s:
            return {**out, "state": "republished", "until": round(slot, 3)}
        if slot > now:
            return {**out, "state": "sleeping", "until": round(slot, 3)}
        ttl = client.pttl(keyspace.lease_key(task_id))
        return {**out, "state": "running", "until": round(now + max(ttl, 0) / 1000, 3)}

    trail = {_text(k): _text(v) for k, v in client.hgetall(keyspace.task_key(task_id)).items()}
    if trail:
        limits = [str(name) for name in json.loads(trail.get("limits", "[]"))]
        until = float(trail.get("until", "0"))
        out.update(limits=limits, at=float(trail.get("at", "0")), until=round(until, 3))
        how = trail.get("how")
        if how in ("fail", "dead_letter", "expired"):
            return {**out, "state": "timed_out", "action": how}
        holds = limiter.holds()
        for name in limits:
            left = holds.get((name, None))
            if left is not None:
                state = "paused" if math.isinf(left) else "held"
                until_held = None if math.isinf(left) else round(now + left, 3)
                return {**out, "state": state, "held_by": name, "until": until_held}
        if how == "park":  # released: back at the broker (or running) since
            return {**out, "state": "released"}
        return {**out, "state": "republished" if until > now else "released"}
    if lease.get("s") == b"2":
        return {**out, "state": "done", "until": None}
    return {**out, "state": "unknown", "until": None}


_SAYS = {
    "parked": "parked in Redis until {until}: then a releaser sends it to its lane",
    "releasing": "being published to the broker by a releaser right now",
    "sleeping": "in a worker, sleeping to its slot at {until}",
    "running": "running (its slot at {slot} passed); its lease ends by {until}",
    "republished": "re-published to the broker, due back at {until}",
    "released": "sent back to the broker at {until}: queued, or running",
    "held": "held by limit {held_by} until {until}: it comes back then",
    "paused": "held by limit {held_by}, paused until `celery throttle resume {held_by}`",
    "timed_out": "timed out at {at} ({action})",
    "done": "finished: its slot at {slot} was settled",
    "unknown": (
        "unknown: never throttled, finished more than its lease ago, or not a task of this "
        "fleet (prefix and namespace)"
    ),
}


@throttle.command()
@click.argument("task_id", metavar="TASK_ID")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def task(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Why is TASK_ID waiting? Where the throttler has it, from Redis.

    One of: parked until T, being released, sleeping to its slot at T, running, re-published
    for T, held by limit L until T (or paused), timed out, done, unknown. Read from the
    parking lot's index, the task's lease record (its reserved slot and limits) and its
    trail (the last deferral or time out, kept an hour past its due time).
    """
    if not task_id.strip():
        raise click.BadParameter("the task id is empty", param_hint="TASK_ID")
    app, throttler = _throttler(ctx)
    with _errors():
        data = wrap_errors(lambda: task_status(app, throttler, task_id))
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    now_us = round(data["now"] * 1e6)

    def stamp(value: Any) -> str:
        return "?" if value is None else _when(round(value * 1e6), now_us)

    fields = {k: stamp(data.get(k)) for k in ("until", "slot", "at")}
    fields.update(held_by=data.get("held_by"), action=data.get("action"))
    click.echo(f"task {task_id}: " + _SAYS[data["state"]].format(**fields))
    if data.get("name") or data.get("queue"):
        click.echo(f"  task {data.get('name') or '?'}  queue {data.get('queue') or '?'}")
    if data["limits"]:
        click.echo("  limits " + ", ".join(data["limits"]))
