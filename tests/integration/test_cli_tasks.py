"""``celery throttle task``, ``parked`` and ``purge`` against a real redis-server: in
process through click's CliRunner, and once through a ``celery -A tests.apps.cli_app
throttle ...`` subprocess (the entry point). Times are judged on the Redis clock."""

from __future__ import annotations

import json
import re
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest

from tests.apps.cli_app import app as cli_app
from tests.integration import test_cli
from tests.integration.test_cli import Cli
from throttle import Limit
from throttle.celery import throttled
from throttle.celery.message import parked_payload
from throttle.celery.observe import TaskTrailReporter
from throttle.celery.runtime import Throttler


def park(task: str, queue: str, delay_s: float) -> str:
    """Park a task as ``defer`` does (its signature, serialized), indexed by its id."""
    task_id = uuid.uuid4().hex
    sig = cli_app.signature(
        task, args=(1,), options={"task_id": task_id, "queue": queue, "headers": {}}
    )
    Throttler.of(cli_app).parking.park(parked_payload(sig, "json"), delay_s, task_id=task_id)
    return task_id


def as_json(cli: Cli, *args: str) -> dict[str, Any]:
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.output)
    return data


cli = test_cli.cli  # the fixture: celery throttle of tests.apps.cli_app on this test's Redis

GATED, BUSY = "tests.apps.cli_app.gated", "tests.apps.cli_app.busy"


def test_parked_counts_per_limit_and_queue_and_lists_the_soonest(cli: Cli) -> None:
    first = park(GATED, "cli.throttled", 30.0)
    park(GATED, "cli.throttled", 60.0)
    park(BUSY, "other.throttled", 90.0)
    data = as_json(cli, "parked")
    assert data["total"] == 3
    # gated's limit, and the file's limit of queue cli (its lane counts as the queue)
    assert data["per_limit"] == {"gate": 2, "daily": 2, "busy": 1}
    assert data["per_queue"] == {"cli": 2, "other": 1}
    assert data["tasks"][0]["task_id"] == first
    assert data["tasks"][0]["lane"] is True
    assert 29.0 < data["tasks"][0]["due_in_s"] <= 30.0
    assert as_json(cli, "parked", "--limit", "busy")["total"] == 1
    assert as_json(cli, "parked", "--queue", "cli", "--max", "1")["tasks"][0]["task_id"] == first
    text = cli("parked").output
    assert text.startswith("3 parked tasks\n")
    assert "per limit: busy 1, daily 2, gate 2" in text
    assert f"  {first}  {GATED}  queue cli  limits gate,daily  due " in text


def test_resume_brings_the_tasks_parked_under_the_limit_back_at_once(cli: Cli) -> None:
    # Given a limit held for 10 minutes (an upstream's long reset), its tasks parked until
    # then, and a task of another limit parked as long
    limiter = Throttler.of(cli_app).limiter
    limiter.hold("gate", None, 600.0)
    held = [park(GATED, "cli.throttled", 600.0) for _ in range(2)]
    other = park(BUSY, "other.throttled", 600.0)
    # When an operator resumes the limit
    result = cli("resume", "gate")
    assert result.exit_code == 0, result.output
    assert "2 tasks parked meanwhile come back now" in result.output
    # Then its parked tasks are due now (the releasers send them on), the other not
    due = {task["task_id"]: task["due_in_s"] for task in as_json(cli, "parked")["tasks"]}
    assert all(due[task_id] <= 0.0 for task_id in held), due
    assert 590.0 < due[other] <= 600.0


def test_an_unreadable_payload_is_listed_as_such_and_purged_with_all(cli: Cli) -> None:
    # Given a parked task whose payload does not decode (written by hand), beside a good one
    good = park(GATED, "cli.throttled", 30.0)
    Throttler.of(cli_app).parking.park(b"application/json\nutf-8\n{nope", 20.0, task_id="bad")
    # Then the listing shows it as unreadable, first (soonest due), and does not stop there
    data = as_json(cli, "parked")
    assert data["total"] == 2
    assert [(t["task_id"], t["name"], t["limits"]) for t in data["tasks"]] == [
        ("bad", None, []),
        (good, GATED, ["gate", "daily"]),
    ]
    assert data["per_queue"] == {"?": 1, "cli": 1}
    assert "  bad  (unreadable payload)  queue ?  limits -  due " in cli("parked").output
    assert as_json(cli, "task", "bad")["state"] == "parked"
    # And no filter selects it, --all does
    assert "purged 1 parked task of queue 'cli'" in cli("purge", "-Q", "cli", "-y").output
    assert "purged 1 parked task (all)" in cli("purge", "--all", "-y").output


def test_purge_asks_then_deletes_by_queue_or_limit_only(cli: Cli) -> None:
    first = park(GATED, "cli.throttled", 30.0)
    park(GATED, "cli.throttled", 60.0)
    # the trail the worker writes when it parks a task (celery throttle task reads it)
    trail = cli.limiter.keyspace.task_key(first)
    now = time.time()
    cli.limiter.client.hset(
        trail, mapping={"how": "park", "limits": '["gate"]', "at": now, "until": now + 30}
    )
    cli.limiter.client.pexpire(trail, 60_000)
    # and the slot it reserved before it was parked (its lease record)
    reserved = cli.limiter.acquire_many(
        [(Limit.parse("1/h", name="gate-slot"), None)], acquisition_id=first
    )
    assert reserved.allowed
    kept = park(BUSY, "other.throttled", 90.0)
    # Not confirmed: nothing deleted
    result = cli("purge", "--queue", "cli", input="n\n")
    assert result.exit_code == 1
    assert "Delete 2 parked tasks of queue 'cli'? They will never run" in result.output
    assert as_json(cli, "parked")["total"] == 3
    # Confirmed
    result = cli("purge", "--queue", "cli", input="y\n")
    assert result.exit_code == 0, result.output
    assert "purged 2 parked tasks of queue 'cli'" in result.output
    assert "celery purge -Q cli,cli.throttled empties the queue and its lane" in result.output
    assert [t["task_id"] for t in as_json(cli, "parked")["tasks"]] == [kept]
    # and `task` says a purged task was purged (not "sent back to the broker"), its trail
    # kept no longer than before
    assert as_json(cli, "task", first)["state"] == "purged"
    assert 0 < cli.limiter.client.pttl(trail) <= 60_000
    # By limit, without asking
    result = cli("purge", "--limit", "gate", "--yes")
    assert "no parked tasks of limit 'gate': nothing to purge" in result.output
    result = cli("purge", "--limit", "busy", "--yes")
    assert "purged 1 parked task of limit 'busy'" in result.output
    assert as_json(cli, "parked")["total"] == 0


def test_bad_filters_are_usage_errors_naming_what_is_wrong(cli: Cli) -> None:
    park(GATED, "cli.throttled", 30.0)
    cases = {
        ("purge",): "give --queue QUEUE, --limit LIMIT (or both), or --all",
        ("purge", "--all", "--queue", "cli"): "give --queue QUEUE, --limit LIMIT",
        ("purge", "--limit", "nope", "--yes"): "unknown limit 'nope'; known limits: api",
        ("parked", "--limit", "nope"): "Invalid value for '--limit': unknown limit 'nope'",
        ("purge", "--queue", "cli.throttled", "--yes"): "give the queue, not its lane: 'cli'",
        ("task", " "): "Invalid value for TASK_ID: the task id is empty",
    }
    for args, message in cases.items():
        result = cli(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
    assert as_json(cli, "parked")["total"] == 1  # nothing deleted


def test_task_says_where_a_task_is(cli: Cli) -> None:
    throttler = Throttler.of(cli_app)
    # Parked
    parked_id = park(GATED, "cli.throttled", 30.0)
    data = as_json(cli, "task", parked_id)
    assert (data["state"], data["queue"], data["limits"]) == ("parked", "cli", ["gate", "daily"])
    assert 29.0 < data["until"] - data["now"] <= 30.0
    out = cli("task", parked_id).output
    assert f"task {parked_id}: parked in Redis until " in out
    assert re.search(r"\(in (30|2\d(\.\d)?)s\)", out), out  # a few ms of CLI pass
    # A reserved slot: far ahead (re-published to come back before it), near (sleeping),
    # passed (running), settled (done)
    shaper = cli.limit("shaper")  # 2/s burst 1: each acquisition is 0.5 s after the last
    ids = [f"slot-{n}" for n in range(8)]
    for task_id in ids:
        assert cli.limiter.acquire_many(
            [(shaper, None)], max_wait_s=10, acquisition_id=task_id
        ).allowed
    far = as_json(cli, "task", ids[-1])
    assert far["state"] == "republished" and far["limits"] == ["shaper"]
    assert 3.0 <= far["until"] - far["now"] <= 3.5
    assert as_json(cli, "task", ids[1])["state"] == "sleeping"
    assert as_json(cli, "task", ids[0])["state"] == "started"
    decision = cli.limiter.acquire_many([(shaper, None)], max_wait_s=10, acquisition_id="done")
    assert decision.acquisition is not None
    cli.limiter.settle(decision.acquisition, None)
    assert as_json(cli, "task", "done")["state"] == "done"
    # Denied: re-published for T; held while its limit is paused; timed out
    trail = TaskTrailReporter(cli.limiter.client, cli.limiter.keyspace, throttler.clock.now)
    denied: Any = SimpleNamespace(request=SimpleNamespace(id="denied"))
    trail.deferred(denied, ["gate"], "republish", 20.0, 1)
    data = as_json(cli, "task", "denied")
    assert data["state"] == "republished" and data["limits"] == ["gate"]
    assert 19.0 < data["until"] - data["now"] <= 20.5
    assert cli("pause", "gate").exit_code == 0
    data = as_json(cli, "task", "denied")
    assert (data["state"], data["held_by"], data["until"]) == ("paused", "gate", None)
    assert (
        "held by limit gate, paused until `celery throttle resume gate`"
        in cli("task", "denied").output
    )
    cli.limiter.unhold("gate", None)
    cli.limiter.hold("gate", None, 40.0)
    data = as_json(cli, "task", "denied")
    assert data["state"] == "held" and 39.0 < data["until"] - data["now"] <= 40.5
    late: Any = SimpleNamespace(request=SimpleNamespace(id="late"))
    trail.timed_out(late, ["gate"], "fail")
    data = as_json(cli, "task", "late")
    assert (data["state"], data["action"]) == ("timed_out", "fail")
    # Unknown
    out = cli("task", "never-seen").output
    assert out.startswith("task never-seen: unknown: never throttled")


def test_the_celery_program_runs_task_parked_and_purge(cli: Cli) -> None:
    task_id = park(GATED, "cli.throttled", 30.0)
    runs = {
        "task": cli.run("task", task_id, "--json"),
        "parked": cli.run("parked", "--json"),
    }
    done = {name: (*proc.communicate(timeout=30), proc.returncode) for name, proc in runs.items()}
    assert done["task"][2] == 0, done["task"]
    assert json.loads(done["task"][0])["state"] == "parked"
    assert json.loads(done["parked"][0])["total"] == 1
    proc = cli.run("purge", "--all", "--yes")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "purged 1 parked task (all)" in out
    assert as_json(cli, "parked")["total"] == 0


# Celery's Redis result backend writes with redis-py's setex, which warns as deprecated.
@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_task_tells_a_revoked_task_from_one_that_ran(cli: Cli) -> None:
    """The result backend says REVOKED: revoked in a worker's line (nothing of it in the
    throttler's Redis) or after its slot was reserved; a finished one without a slot
    reads without one."""
    from celery.backends.redis import RedisBackend  # noqa: PLC0415

    backend = RedisBackend(app=cli_app, url=cli.redis_url)
    cli_app._local.backend = backend  # what app.backend caches, for this thread
    try:
        backend.mark_as_revoked("in-line")
        assert as_json(cli, "task", "in-line")["state"] == "revoked"
        assert "revoked (the result backend says REVOKED): it does not run" in (
            cli("task", "in-line").output
        )
        shaper = cli.limit("shaper")
        assert cli.limiter.acquire_many([(shaper, None)], acquisition_id="slotted").allowed
        backend.mark_as_revoked("slotted")
        assert as_json(cli, "task", "slotted")["state"] == "revoked"
        backend.store_result("ran", 1, "SUCCESS")
        assert "task ran: finished (SUCCESS)\n" in cli("task", "ran").output
    finally:
        del cli_app._local.backend
        backend.client.close()


def test_a_key_s_rate_raised_or_cleared_brings_back_the_limit_s_parked_tasks(cli: Cli) -> None:
    # Given a task of a keyed limit, parked for the key's slow pace (a parked task's key is
    # not known without its arguments: every parked task of the limit comes back, and the
    # other keys' lines park theirs again)
    @cli_app.task(name="tests.cli_tasks.keyed", shared=False)
    @throttled("tenant")
    def keyed(tenant: str) -> str:
        return tenant

    try:
        cli("set", "tenant", "10/h", "--key", "acme")
        parked = park(keyed.name, "celery", 600.0)
        # When the key's rate is raised above what it was, its parked task is due now
        result = cli("set", "tenant", "1000/h", "--key", "acme")
        assert result.exit_code == 0, result.output
        assert "1 task parked for the old rate come back now" in result.output
        due = {t["task_id"]: t["due_in_s"] for t in as_json(cli, "parked")["tasks"]}
        assert due[parked] <= 0.0, due
        # and lowered, nothing comes back; cleared (back to 100/h, faster), it does
        parked = park(keyed.name, "celery", 600.0)
        result = cli("set", "tenant", "5/h", "--key", "acme")
        assert result.exit_code == 0 and "come back now" not in result.output, result.output
        result = cli("clear", "tenant", "--key", "acme")
        assert "1 task parked for the old rate come back now" in result.output, result.output
    finally:
        cli_app.tasks.pop("tests.cli_tasks.keyed", None)
