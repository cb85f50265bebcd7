"""``celery throttle refusals``: the record of the refusals the upstream reported
(:mod:`throttle.refusals`), newest first: "why did tenant X get 429s at 14:02"."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import click

from throttle.cli.base import (
    checked_key,
    counted,
    duration,
    known_limits,
    lookup,
    one_line_errors,
    throttler_of,
)
from throttle.refusals import Refusal

_HEADERS = ["TIME (UTC)", "KEY", "TASK ID", "STATUS", "HEADER", "HOLD", "FLEET"]


def _cells(refusal: Refusal) -> list[str]:
    stamp = "?"
    if refusal.at is not None:
        moment = datetime.fromtimestamp(refusal.at, tz=timezone.utc)
        stamp = moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d}"
    return [
        stamp,
        "-" if refusal.key is None else refusal.key,
        refusal.task_id or "?",
        "?" if refusal.status is None else str(refusal.status),
        refusal.header or "-",
        duration(refusal.hold_s) if refusal.hold_s else "-",
        "held" if refusal.held else "task only",
    ]


@click.command()
@click.argument("limit")
@click.option("--key", metavar="KEY", help="Only the refusals of this key of LIMIT.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option(
    "--max", "count", type=click.IntRange(min=1), default=50, show_default=True, metavar="N",
    help="At most N refusals, the newest.",
)  # fmt: skip
@click.pass_context
def refusals(ctx: click.Context, limit: str, key: str | None, as_json: bool, count: int) -> None:
    """The refusals (429s...) the upstream reported for LIMIT, newest first, fleet-wide.

    Each: when (the Redis clock, UTC), the key, the task id, the HTTP status, the header
    that decided the hold (Retry-After, X-RateLimit-Reset...; "default" for a bare 429),
    the upstream's time, and whether the refusal held this limit for the fleet ("held":
    the limit, or its key) or not ("task only": a refusal the limit's schedule explains,
    or one whose headers blamed another of the task's limits). Kept: the last
    settings.refusals_max per limit (and none older than settings.refusals_for, when
    set). In JSON: a list of objects with at (epoch s), limit,
    key, task_id, task, status, header, hold_s and held.
    """
    app, throttler = throttler_of(ctx)
    known = known_limits(app, throttler)
    if limit in known:
        checked_key(known[limit].rule, key, "--key")
    with one_line_errors():
        found = throttler.refusals.read(limit, key=key, count=count)
    if limit not in known and not found:
        # A limit of code of its own (asyncio, apply_upstream) is read by its name once
        # it has a refusal; with none, the name is more likely a typo.
        lookup(known, limit)
    if as_json:
        click.echo(json.dumps([refusal.as_json() for refusal in found], indent=2))
        return
    what = f"key {key!r} of limit {limit!r}" if key is not None else f"limit {limit!r}"
    if not found:
        click.echo(f"no refusal recorded for {what}")
        return
    rows = [_cells(refusal) for refusal in found]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(_HEADERS)]
    for cells in [_HEADERS, *rows]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    said = f"{counted(len(found), 'refusal')} of {what}, newest first"
    if len(found) == count:  # read stops at --max: there may be older ones
        said += f" (the newest {count}: --max {count})"
    click.echo(f"\n{said}")
