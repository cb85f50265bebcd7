"""``celery throttle set``, ``reset``, ``pause``, ``resume`` and ``check``: steering a
fleet's limits at run time, and validating a limits file before a fleet loads it.

The first four write to the fleet's Redis at once; workers follow within
``settings.refresh`` (a rate) or ``settings.pause_recheck`` (a pause), and nothing
restarts. ``check`` reads only the file (and, with ``-A``, the app's tasks).
"""

from __future__ import annotations

import math
import shlex
from typing import Any

import click

from throttle.admin import reset as reset_state
from throttle.celery.runtime import Throttler, unknown_limits, unknown_tasks
from throttle.celery.task import argument_errors
from throttle.celery.waiting import line_budget_s
from throttle.cli.base import (
    EXIT_ERRORS,
    amount,
    app_option,
    checked_key,
    counted,
    duration,
    known_limits,
    lookup,
    one_line_errors,
    plain,
    rate_spec,
    throttler_of,
)
from throttle.cli.parked import bring_back
from throttle.config import ThrottleConfig
from throttle.errors import ConfigError, ThrottleError
from throttle.rules import Rule
from throttle.spec import Limit


def _which(limit: str, key: str | None) -> str:
    """What a command acts on: ``key 'acme' of limit 'api'``, or ``limit 'api'``."""
    return f"key {key!r} of limit {limit!r}" if key is not None else f"limit {limit!r}"


key_option = click.option(
    "--key",
    metavar="KEY",
    help="One key of a keyed limit (a tenant), whatever its plan, instead of the whole limit.",
)


@click.command("set")
@click.argument("limit")
@click.argument("rate", required=False)
@click.option("--default", "default", is_flag=True, help="Go back to the limits file's rate.")
@key_option
@click.pass_context
def set_rate(
    ctx: click.Context, limit: str, rate: str | None, default: bool, key: str | None
) -> None:
    """Change LIMIT's RATE for the whole fleet, at run time ("1000/h", "10/s burst 1").

    Workers follow within settings.refresh; nothing restarts. A RATE without "burst" gets
    the smaller of the file's burst and its own count: a burst-1 shaper stays burst 1, a
    lowered "3500/m" gets burst 100 at "100/m". The change lasts until `set LIMIT --default`
    (or `clear LIMIT`).

    With --key KEY, the rate is KEY's alone (a negotiated exception for one tenant): it
    beats the key's plan and the whole limit's rate, and without "burst" it is no burstier
    than the key's plan (or the limit's own rate). `clear LIMIT --key KEY` drops it.
    """
    if rate is not None and default:
        raise click.UsageError("give a RATE or --default (the file's rate), not both")
    if rate is None and not default:
        raise click.UsageError("give a RATE, or --default to go back to the file's rate")
    app, throttler = throttler_of(ctx)
    entry = lookup(known_limits(app, throttler), limit)
    configured = entry.rule.limit
    refresh = duration(throttler.settings.refresh_s)
    if key is not None:
        _set_key(ctx, entry.rule, key, rate, refresh)
        return
    with one_line_errors():
        before = throttler.rates.current(configured)
    if default:
        with one_line_errors():
            throttler.rates.clear(limit)
        click.echo(
            f"limit {limit!r}: back to {_spec(configured)} (the configured rate); workers "
            f"follow within {refresh} (settings.refresh)"
            f"{_faster(app, throttler, before, configured)}"
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
        and configured.algorithm.reserves
        and configured.capacity < changed.count
    ):
        rate = f"{rate.strip()} burst {plain(configured.capacity)}"
        changed = Limit.parse(rate, name=limit, algorithm=configured.algorithm)
    cost = entry.rule.cost
    if isinstance(cost, float) and cost > changed.capacity:
        # Every task would fail with CostExceedsCapacity: refuse rather than break them.
        raise click.BadParameter(
            f"the burst {amount(changed.capacity)} of {rate!r} is below the cost "
            f"{amount(cost)} that each task of limit {limit!r} takes: no task could run "
            f"(give a burst: '{rate.split(' burst ')[0].strip()} burst {amount(cost)}')",
            param_hint="RATE",
        )
    with one_line_errors():
        throttler.rates.set(configured, rate)
    click.echo(
        f"limit {limit!r}: {_spec(changed)} for the whole fleet (configured "
        f"{_spec(configured)}); workers follow within {refresh} (settings.refresh)"
        f"{_faster(app, throttler, before, changed)}"
    )
    if not isinstance(cost, float) and changed.capacity < configured.capacity:
        # A cost taken from the task's arguments is not known here: one above the new burst
        # can never be admitted, and its task fails (CostExceedsCapacity).
        click.echo(
            f"warning: each task of limit {limit!r} costs what its arguments say; one costing "
            f"more than {amount(changed.capacity)} (the new burst, configured "
            f"{amount(configured.capacity)}) cannot be admitted and fails: give RATE a larger "
            'burst ("... burst N") if such tasks are queued',
            err=True,
        )


def _faster(app: Any, throttler: Throttler, before: Limit, after: Limit) -> str:
    """When the rate in force rose (``before`` -> ``after``), the tasks parked under the
    limit for the old pace are made due now (their workers' lines then serve them at the
    new one), as ``resume`` does; what to add to the message ('' when it did not rise).
    For one key's rate, every parked task of the limit: a parked task's key is not known
    without its arguments, and the others' lines park them again."""
    if after.algorithm.holds_units or after.rate_per_s <= before.rate_per_s:
        return ""
    with one_line_errors():
        back = bring_back(app, throttler, after.name)
    return f"; {counted(back, 'task')} parked for the old rate come back now" if back else ""


def _spec(limit: Limit) -> str:
    """A limit's rate as an operator writes it: with its burst, but for a concurrency
    limit, which has none."""
    if limit.algorithm.holds_units:
        return rate_spec(limit)
    return f"{rate_spec(limit)} burst {amount(limit.capacity)}"


def _set_key(ctx: click.Context, rule: Rule, key: str, rate: str | None, refresh: str) -> None:
    """``set LIMIT RATE --key KEY`` and ``set LIMIT --key KEY --default``."""
    app, throttler = throttler_of(ctx)
    checked_key(rule, key, "--key")
    what = _which(rule.name, key)
    with one_line_errors():
        before = throttler.rates.current(rule.limit, key)
    if rate is None:
        with one_line_errors():
            removed = throttler.rates.clear_key(rule.name, key)
        back = "its plan's rate" if rule.plan_limits else "the limit's rate"
        faster = _faster(app, throttler, before, throttler.rates.current(rule.limit, key))
        click.echo(
            f"{what}: back to {back}; workers follow within {refresh} (settings.refresh){faster}"
            if removed
            else f"{what} had no rate of its own: nothing to do"
        )
        return
    cost = rule.cost
    if isinstance(cost, float):
        # Whatever the key's plan, a burst below the cost fails every task of the key with
        # CostExceedsCapacity: refuse rather than break them (as `set` does for a limit).
        bases = [rule.limit, *rule.plan_limits.values()]
        smallest = min(throttler.rates.keyed_limit(base, rate).capacity for base in bases)
        if cost > smallest:
            raise click.BadParameter(
                f"the burst {amount(smallest)} that {rate!r} gives key {key!r} is below the "
                f"cost {amount(cost)} that each task of limit {rule.name!r} takes: no task "
                "of the key could run",
                param_hint="RATE",
            )
    try:
        changed = throttler.rates.set_key(rule.limit, key, rate)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="RATE") from None
    except ThrottleError as exc:
        raise click.ClickException(str(exc)) from None
    burst = f"burst {amount(changed.capacity)}"
    if rule.plan_limits and "burst" not in rate.lower() and rule.limit.algorithm.reserves:
        burst = f"burst at most its plan's ({amount(changed.capacity)} on the limit's own rate)"
    undo = ["celery", *app_option(ctx).split(), "throttle", "clear", rule.name, "--key", key]
    click.echo(
        f"{what}: {rate_spec(changed)} {burst}, whatever its plan; workers follow within "
        f"{refresh} (settings.refresh){_faster(app, throttler, before, changed)}. "
        f"Undo: {shlex.join(undo)}"
    )


@click.command()
@click.argument("limit")
@key_option
@click.pass_context
def clear(ctx: click.Context, limit: str, key: str | None) -> None:
    """Drop the rate set at run time for LIMIT (back to the limits file's), or with --key
    for one KEY (back to its plan's rate, or the limit's)."""
    app, throttler = throttler_of(ctx)
    entry = lookup(known_limits(app, throttler), limit)
    refresh = duration(throttler.settings.refresh_s)
    if key is not None:
        _set_key(ctx, entry.rule, key, None, refresh)
        return
    configured = entry.rule.limit
    with one_line_errors():
        before = throttler.rates.current(configured)
        throttler.rates.clear(limit)
    click.echo(
        f"limit {limit!r}: back to {_spec(configured)} (the configured rate); workers follow "
        f"within {refresh} (settings.refresh){_faster(app, throttler, before, configured)}"
    )


def _switch(ctx: click.Context, limit: str, mode: str | None) -> None:
    app, throttler = throttler_of(ctx)
    entry = lookup(known_limits(app, throttler), limit)
    if mode == "shadow" and entry.rule.limit.algorithm.holds_units:
        raise click.BadParameter(
            "a concurrency limit cannot run in shadow mode: it is always enforced",
            param_hint="LIMIT",
        )
    with one_line_errors():
        throttler.rates.set_mode(limit, mode)
        now = throttler.mode_of(entry.rule)
    refresh = duration(throttler.settings.refresh_s)
    what = {
        "enforce": "enforced: its tasks wait for it",
        "shadow": "in shadow mode: its tasks run at once, those waiting for it too (a "
        "backlog reaches the upstream together), and status shows what it would have done",
    }[now]
    click.echo(f"limit {limit!r} {what}; workers follow within {refresh} (settings.refresh)")


@click.command()
@click.argument("limit")
@click.option("--default", "default", is_flag=True, help="Back to the limits file's mode.")
@click.pass_context
def enforce(ctx: click.Context, limit: str, default: bool) -> None:
    """Enforce LIMIT for the whole fleet from now on (it was in shadow mode), at run time.

    With --default, the limits file's mode (the limit's `mode`, or settings.mode) again.
    """
    _switch(ctx, limit, None if default else "enforce")


@click.command("shadow")
@click.argument("limit")
@click.pass_context
def shadow_mode(ctx: click.Context, limit: str) -> None:
    """Put LIMIT in shadow mode for the whole fleet, at run time: its tasks run at once,
    the ones waiting for it too (a backlog reaches the upstream together), and `status`
    shows what it would have done. `enforce LIMIT` undoes it."""
    _switch(ctx, limit, "shadow")


@click.command()
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
    app, throttler = throttler_of(ctx)
    checked_key(lookup(known_limits(app, throttler), limit).rule, key, "KEY")
    what = _which(limit, key) + (" (every key)" if key is None else "")
    if not yes:
        click.confirm(f"Reset {what}? Its tokens, windows and holders are forgotten", abort=True)
    limiter = throttler.limiter
    with one_line_errors():
        deleted = reset_state(limiter.client, limiter.keyspace, limit, key)
    click.echo(
        f"reset {what}: {counted(deleted, 'Redis key')} deleted "
        "(holds and run-time rates unchanged)"
    )


@click.command()
@click.argument("limit")
@click.argument("key", required=False)
@click.pass_context
def pause(ctx: click.Context, limit: str, key: str | None) -> None:
    """Admit nothing of LIMIT (of its KEY only, when given) until `resume`.

    Its tasks are not lost: they wait in the workers' consumers (up to settings.line_max,
    less under a broker's visibility or consumer timeout; then sent back to the broker,
    reserving nothing, each looking again every settings.pause_recheck plus up to half
    of it of jitter) and go on after `resume`.
    """
    app, throttler = throttler_of(ctx)
    checked_key(lookup(known_limits(app, throttler), limit).rule, key, "KEY")
    with one_line_errors():
        throttler.limiter.hold(limit, key, None)
    what = _which(limit, key)
    settings = throttler.settings
    undo = ["celery", *app_option(ctx).split(), "throttle", "resume", limit]
    budget = line_budget_s(app, throttler)
    bound = (
        "settings.line_max" if budget >= settings.line_max_s
        else "under the broker's visibility or consumer timeout"
    )  # fmt: skip
    click.echo(
        f"paused {what}: its tasks wait in the workers (up to {duration(budget)}, {bound}; "
        f"then sent back, looking again every "
        f"{duration(settings.pause_recheck_s)}); none is lost. Undo: "
        + shlex.join(undo + ([key] if key is not None else []))
    )


@click.command()
@click.argument("limit")
@click.argument("key", required=False)
@click.pass_context
def resume(ctx: click.Context, limit: str, key: str | None) -> None:
    """Lift the pause (or a timed hold) of LIMIT, or of its KEY."""
    app, throttler = throttler_of(ctx)
    rule = lookup(known_limits(app, throttler), limit).rule
    limiter = throttler.limiter
    what = _which(limit, key)
    with one_line_errors():
        before = limiter.holds()
    if (limit, key) not in before:
        # A key its tasks cannot have is a usage error, as for pause (one held anyway,
        # from before the limits file changed, can still be lifted).
        checked_key(rule, key, "KEY")
    with one_line_errors():
        limiter.unhold(limit, key)
        after = limiter.holds()
    held = before.get((limit, key))
    if held is None:
        click.echo(f"{what} was neither paused nor held: nothing to do")
    else:
        with one_line_errors():
            back = bring_back(app, throttler, limit)
        lifted = "pause" if math.isinf(held) else f"hold ({duration(held)} left)"
        parked = f"; {counted(back, 'task')} parked meanwhile come back now" if back else ""
        click.echo(
            f"resumed {what} (lifted its {lifted}): the tasks waiting in the workers go on "
            f"now{parked}"
        )
    for (name, other), left in sorted(after.items(), key=str):
        if name == limit:
            which = f"key {other!r} of limit" if other is not None else "limit"
            state = "paused" if math.isinf(left) else f"held {duration(left)}"
            click.echo(f"  still {state}: {which} {limit!r}")


@click.command()
@click.argument("file")
@click.pass_context
def check(ctx: click.Context, file: str) -> None:
    """Validate a limits FILE: print every error with its place, exit 1 if any.

    With an app (-A), also that every limit its tasks name in @throttled is in the file,
    and that each key, plan and cost of their limits names an argument of the task,
    which a worker of the app checks when it starts; and warns (exit 0) of each task
    of tasks: that the app does not register. Without an app too, it warns of each
    upstream: that is a near miss of a dimension the providers name (tokenz).
    """
    errors = [str(error) for error in ThrottleConfig.check(file)]
    config = None
    if not errors:
        config = ThrottleConfig.load(file)
        for warning in config.warnings():
            click.echo(f"warning: {warning}")
        app = _given_app(ctx)
        if app is not None:
            app.loader.import_default_modules()
            errors += _task_errors(app, config, file)
            for warning in unknown_tasks(app, config):
                click.echo(f"warning: {warning}")
    for error in errors:
        click.echo(error)
    if errors:
        click.echo(f"{counted(len(errors), 'error')} in {file}", err=True)
        ctx.exit(EXIT_ERRORS)
    assert config is not None
    counts = {"limit": config.rules, "queue": config.queues, "task": config.tasks}
    click.echo(f"{file}: OK: " + ", ".join(counted(len(v), k) for k, v in counts.items()))


def _given_app(ctx: click.Context) -> Any:
    """The app the command was given (``-A``), or None: run by the ``celery`` program
    without ``-A``, its app is Celery's default one, which defines none of the tasks a
    file names (each would be warned of as unregistered)."""
    root = ctx.find_root()
    if "app" in root.params and not root.params["app"]:
        return None
    return getattr(ctx.obj, "app", None)


def _task_errors(app: Any, config: ThrottleConfig, file: str) -> list[str]:
    """What a worker of ``app`` would refuse to start on, from its tasks: limits they name
    that ``file`` lacks, keys, plans and costs naming arguments they do not have."""
    errors = unknown_limits(app, config) + argument_errors(app, config)
    return [str(error) for error in errors]
