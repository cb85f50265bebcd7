"""``celery throttle parked`` and ``purge``: the tasks parked in Redis, listed and counted
per limit and per queue, or deleted for good.

Parked tasks wait in Redis, not at the broker (:mod:`throttle.parking`), so Celery's own
``inspect`` and ``purge`` do not see them. Each payload is read with
:func:`throttle.celery.message.parked_signature`, as the releaser reads it.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

import click

from throttle.celery.message import LANE_SUFFIX, parked_signature
from throttle.celery.runtime import Throttler, declared_by
from throttle.cli.base import (
    app_option,
    counted,
    known_limits,
    lookup,
    moment,
    one_line_errors,
    throttler_of,
)
from throttle.parking import Parked
from throttle.redis.client import wrap_errors


@dataclass(frozen=True)
class ParkedTask:
    """A parked task as the commands show it: its payload decoded."""

    parked: Parked
    task_id: str | None
    name: str | None
    queue: str | None
    """The queue it goes back to (its lane counts as the queue itself)."""
    lane: bool
    limits: tuple[str, ...]
    """The limits of its rules in this app (empty: a task this app does not know)."""


def read_parked(app: Any, throttler: Throttler, parked: Parked) -> ParkedTask:
    """Read a parked payload (:func:`throttle.celery.message.parked_signature`); an
    unreadable one shows as unknown (name None) rather than stop the listing."""
    try:
        sig = parked_signature(parked.payload)
    except Exception:
        return ParkedTask(parked, parked.task_id, None, None, False, ())
    name = sig.get("task")
    options = sig.get("options")
    if not isinstance(options, dict):
        options = {}
    queue = options.get("queue") if isinstance(options.get("queue"), str) else None
    lane = queue is not None and queue.endswith(LANE_SUFFIX)
    if queue is not None and lane:
        queue = queue[: -len(LANE_SUFFIX)]
    task = app.tasks.get(name) if isinstance(name, str) else None
    limits: tuple[str, ...] = ()
    if task is not None:
        limits = tuple(rule.name for rule in throttler.rules(task, declared_by(task), queue))
    task_id = parked.task_id or options.get("task_id")
    return ParkedTask(
        parked, str(task_id) if task_id else None, name if isinstance(name, str) else None,
        queue, lane, limits,
    )  # fmt: skip


def bring_back(app: Any, throttler: Throttler, limit: str) -> int:
    """Make the tasks parked under ``limit`` due now (``resume``: parked until its hold
    ended, or for ``pause_recheck``, they would come back that late): the releasers send
    them to the workers, whose lines take them. Returns how many; a Redis error raises
    (BackendError)."""
    parked = [task.parked for task in _select(_read_lot(app, throttler), None, limit)]
    moved: int = wrap_errors(lambda: throttler.parking.bring_forward(parked))
    return moved


def _read_lot(app: Any, throttler: Throttler) -> list[ParkedTask]:
    """Every parked task, read; a Redis error raises (BackendError)."""
    return [read_parked(app, throttler, one) for one in wrap_errors(lambda: _scan(throttler))]


def _lot(app: Any, throttler: Throttler) -> list[ParkedTask]:
    with one_line_errors():
        return _read_lot(app, throttler)


def _scan(throttler: Throttler) -> list[Parked]:
    return list(throttler.parking.scan())


def _redis_now_us(throttler: Throttler) -> int:
    with one_line_errors():
        now: int = wrap_errors(throttler.parking.now_us)
        return now


def _select(tasks: list[ParkedTask], queue: str | None, limit: str | None) -> list[ParkedTask]:
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
            lookup(known_limits(app, throttler), limit)
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


@click.command()
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
    app, throttler = throttler_of(ctx)
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
    click.echo(f"{counted(len(tasks), 'parked task')}" + _filters(queue, limit))
    for title, counts in (("per limit", per_limit), ("per queue", per_queue)):
        if counts:
            click.echo(f"{title}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for task in tasks[:most]:
        when = (
            "releasing now"
            if task.parked.due_us is None
            else f"due {moment(task.parked.due_us, now)}"
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


def _mark_purged(throttler: Throttler, task_ids: list[str]) -> None:
    """Note in each purged task's trail (the record ``celery throttle task`` reads) that
    it was purged, for as long as the trail was kept."""
    client, keyspace = throttler.limiter.client, throttler.limiter.keyspace
    keys = [keyspace.task_key(task_id) for task_id in task_ids]
    with client.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.pttl(key)
        ttls = pipe.execute()
    with client.pipeline(transaction=False) as pipe:
        for key, ttl in zip(keys, ttls, strict=True):
            if isinstance(ttl, int) and ttl > 0:  # a trail, kept that long still
                pipe.hset(key, "how", "purged")
                pipe.pexpire(key, ttl)
        pipe.execute()


@click.command()
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
    app, throttler = throttler_of(ctx)
    _check_filters(ctx, app, throttler, queue, limit)
    tasks = [t for t in _select(_lot(app, throttler), queue, limit) if t.parked.due_us is not None]
    what = _filters(queue, limit) or " (all)"
    if not tasks:
        click.echo(f"no parked tasks{what}: nothing to purge")
        return
    if not yes:
        click.confirm(
            f"Delete {counted(len(tasks), 'parked task')}{what}? They will never run", abort=True
        )
    with one_line_errors():
        deleted: int = wrap_errors(lambda: throttler.parking.purge([t.parked.token for t in tasks]))
    click.echo(f"purged {counted(deleted, 'parked task')}{what}")
    if deleted < len(tasks):
        click.echo(f"  {len(tasks) - deleted} were being released meanwhile: not purged")
    else:  # which were purged is known: `celery throttle task ID` says so
        with contextlib.suppress(Exception):  # a trail is for people: not worth an error
            _mark_purged(throttler, [t.task_id for t in tasks if t.task_id])
    lane = f"{queue},{queue}{LANE_SUFFIX}" if queue else "QUEUE,QUEUE" + LANE_SUFFIX
    click.echo(
        f"  broker messages are untouched: celery{app_option(ctx)} purge -Q {lane} empties "
        "the queue and its lane"
    )
