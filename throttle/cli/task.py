"""``celery throttle task TASK_ID``: where the throttler has one task, and why it waits.

Read from Redis: the parking lot's index (parked, being released), the task's lease record
(its reserved slot and limits: sleeping, running, re-published, done) and its trail (the
last deferral or time out, kept an hour past its due time). A task that waits in a worker
reserves nothing in Redis until its slot is near, so when Redis does not know it (or knows
it only as sent back to the broker), the workers are asked (``throttle_waiting``).
"""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import unquote

import click
from celery.states import READY_STATES

from throttle.celery.plan import rule_name
from throttle.celery.runtime import Throttler
from throttle.cli.base import moment, one_line_errors, throttler_of
from throttle.cli.parked import read_parked
from throttle.cli.status import timeout_option
from throttle.redis.client import wrap_errors


def _task_limits(keys: list[bytes | None], base: str) -> list[str]:
    """The limit names of a lease record's state keys (``base code:limit:key``), each once: a
    plan's state (``LIMIT.plan``, see :mod:`throttle.celery.plan`) is its limit's."""
    names: list[str] = []
    for raw in keys:
        if raw is None:
            continue
        key = raw.decode(errors="replace")
        if key.startswith(base):
            parts = key[len(base) :].split(":")
            if len(parts) >= 2:
                name = rule_name(unquote(parts[1]))
                if name not in names:
                    names.append(name)
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
        task = read_parked(app, throttler, found)
        out.update(name=task.name, queue=task.queue, limits=list(task.limits))
        if found.due_us is None:
            return {**out, "state": "releasing", "until": None}
        return {**out, "state": "parked", "until": round(found.due_us / 1e6, 3)}

    with client.pipeline(transaction=False) as pipe:  # one round trip
        pipe.hgetall(keyspace.task_key(task_id))
        pipe.hgetall(keyspace.lease_key(task_id))
        trail_fields, lease_fields = pipe.execute()
    trail = {_text(k): _text(v) for k, v in trail_fields.items()}
    if trail.get("how") == "purged":  # first: a reservation it held outlives it, unused
        limits = json.loads(trail.get("limits", "[]"))
        out["limits"] = list(dict.fromkeys(rule_name(str(n)) for n in limits))
        return {**out, "state": "purged"}
    lease = {_text(k): _bytes(v) for k, v in lease_fields.items()}
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
        until = round(now + max(ttl, 0) / 1000, 3)
        # The lease outlives the run (a redelivered copy must find its reservation), and the
        # end of a run writes nothing to the throttler's Redis: the result backend tells.
        result = finished(app, task_id)
        if result is not None:
            return _ended(out, result, until)
        return {**out, "state": "started", "until": until}

    if lease.get("s") == b"2":  # settled: it ran, whatever deferrals came before
        return {**out, "state": "done", "result": finished(app, task_id), "until": None}
    if trail:
        limits = list(
            dict.fromkeys(rule_name(str(n)) for n in json.loads(trail.get("limits", "[]")))
        )
        until = float(trail.get("until", "0"))
        out.update(limits=limits, at=float(trail.get("at", "0")), until=round(until, 3))
        how = trail.get("how")
        if how in ("fail", "dead_letter", "expired"):
            return {**out, "state": "timed_out", "action": how}
        if how == "purged":
            return {**out, "state": "purged"}
        holds = limiter.holds()
        for name in limits:
            left = holds.get((name, None))
            if left is not None:
                state = "paused" if math.isinf(left) else "held"
                until_held = None if math.isinf(left) else round(now + left, 3)
                return {**out, "state": state, "held_by": name, "until": until_held}
        if until > now and how != "park":
            return {**out, "state": "republished"}
        # released (back at the broker, or running since), unless the results say it ended
        result = finished(app, task_id)
        if result is not None:
            return _ended(out, result)
        return {**out, "state": "released"}
    # Nothing in the throttler's Redis (a task revoked in a worker's line leaves nothing
    # there): the result backend may still tell how it ended.
    result = finished(app, task_id)
    if result is not None:
        return _ended(out, result)
    return {**out, "state": "unknown", "until": None}


def _ended(out: dict[str, Any], result: str, until: float | None = None) -> dict[str, Any]:
    """A task whose result backend says it ended: ``revoked`` (it does not run, or was
    stopped), else ``done``."""
    state = "revoked" if result == "REVOKED" else "done"
    return {**out, "state": state, "result": result, "until": until}


def waiting_in_worker(app: Any, task_id: str, timeout_s: float) -> dict[str, Any] | None:
    """Where a worker holds ``task_id`` unreserved (its line, or waiting for a free pool
    slot: :func:`throttle.celery.waiting.throttle_waiting`), asking the workers for at
    most ``timeout_s``; None when none does (or none answered)."""
    if timeout_s <= 0:
        return None
    try:
        replies = app.control.broadcast("throttle_waiting", reply=True, timeout=timeout_s)
    except Exception:  # the broker away: the answer is only "not known"
        return None
    for reply in replies or ():
        for worker, entries in reply.items() if isinstance(reply, dict) else ():
            for entry in entries if isinstance(entries, list) else ():
                request = entry.get("request") if isinstance(entry, dict) else None
                if isinstance(request, dict) and request.get("id") == task_id:
                    return {
                        "state": "waiting", "worker": worker, "where": entry.get("where"),
                        "waited_s": entry.get("waited_s"), "name": request.get("name"),
                        "queue": entry.get("queue"), "limits": entry.get("limits") or [],
                    }  # fmt: skip
    return None


def finished(app: Any, task_id: str) -> str | None:
    """The task's final state in the app's result backend (``SUCCESS``, ``FAILURE``,
    ``REVOKED``), or None: not finished, no result backend, or the backend unreachable (a
    status command does not fail for it)."""
    backend = app.backend
    if type(backend).__name__ == "DisabledBackend":
        return None
    try:
        state = str(backend.get_task_meta(task_id).get("status"))
    except Exception:  # any backend's error: the answer is only "not known"
        return None
    return state if state in READY_STATES else None


_SAYS = {
    "parked": "parked in Redis until {until}: then a releaser sends it to its lane",
    "releasing": "being published to the broker by a releaser right now",
    "sleeping": "in a worker, sleeping to its slot at {until}",
    "started": (
        "started at its slot at {slot}: running, or finished with no result backend to tell "
        "(its lease, kept against a second copy, ends by {until})"
    ),
    "republished": "re-published to the broker, due back at {until}",
    "released": "sent back to the broker at {until}: queued, or running",
    "held": "held by limit {held_by} until {until}: it comes back then",
    "paused": "held by limit {held_by}, paused until `celery throttle resume {held_by}`",
    "timed_out": "timed out at {at} ({action})",
    "purged": "deleted from the parking lot (celery throttle purge): it never runs",
    "done": "finished ({result}){after}",
    "revoked": "revoked (the result backend says {result}): it does not run",
    "unknown": (
        "unknown: never throttled, finished more than its lease ago, or not a task of this "
        "fleet (prefix and namespace)"
    ),
    "waiting": "waiting in worker {worker} {where}, reserving nothing{waited}",
}
_WHERE = {"line": "for its limits to admit it", "pool": "for a free pool slot"}


@click.command()
@click.argument("task_id", metavar="TASK_ID")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@timeout_option(1.0)
@click.pass_context
def task(ctx: click.Context, task_id: str, as_json: bool, timeout: float) -> None:
    """Why is TASK_ID waiting? Where the throttler has it, from Redis.

    One of: parked until T, being released, sleeping to its slot at T, started (finished,
    with its result state, when the app has a result backend), re-published
    for T, held by limit L until T (or paused), timed out, done, revoked, waiting in a
    worker, unknown. Read from the parking lot's index, the task's lease record (its reserved slot
    and limits) and its trail (the last deferral or time out, kept an hour past its due
    time); the workers are asked when Redis does not know where the task waits.
    """
    if not task_id.strip():
        raise click.BadParameter("the task id is empty", param_hint="TASK_ID")
    app, throttler = throttler_of(ctx)
    with one_line_errors():
        data = wrap_errors(lambda: task_status(app, throttler, task_id))
    if data["state"] in ("unknown", "released"):
        held = waiting_in_worker(app, task_id, timeout)
        if held is not None:
            data = {
                **data, **held, "name": data.get("name") or held["name"],
                "limits": data["limits"] or held["limits"],
            }  # fmt: skip
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    now_us = round(data["now"] * 1e6)

    def stamp(value: Any) -> str:
        return "?" if value is None else moment(round(value * 1e6), now_us)

    fields = {k: stamp(data.get(k)) for k in ("until", "slot", "at")}
    fields["after"] = "" if data.get("slot") is None else f" after its slot at {fields['slot']}"
    fields.update(
        held_by=data.get("held_by"),
        action=data.get("action"),
        result=data.get("result") or "settled",
        worker=data.get("worker"),
        where=_WHERE.get(data.get("where") or "", "for capacity"),
        waited="" if data.get("waited_s") is None else f", for {data['waited_s']:.1f} s so far",
    )
    click.echo(f"task {task_id}: " + _SAYS[data["state"]].format(**fields))
    if data.get("name") or data.get("queue"):
        click.echo(f"  task {data.get('name') or '?'}  queue {data.get('queue') or '?'}")
    if data["limits"]:
        click.echo("  limits " + ", ".join(data["limits"]))
