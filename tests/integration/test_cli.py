"""``celery throttle``: every subcommand against a real redis-server, through click's
CliRunner for speed and through real ``celery -A tests.apps.cli_app throttle ...`` subprocesses
(the entry point), and one story with a real ``celery worker``: pause, nothing runs,
resume, everything runs once."""

from __future__ import annotations

import json
import math
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from tests.apps.cli_app import app as cli_app
from tests.support.eager import close_throttler
from tests.support.servers import RedisServer
from throttle import Limit, Limiter, config
from throttle.adaptive import ADAPTIVE_FIELDS, LearnedRates
from throttle.celery.plan import plan_limit
from throttle.cli import throttle
from throttle.cli.base import rate_spec
from throttle.cli.status import render_status
from throttle.config import _SETTINGS_FIELDS as SETTINGS_FIELDS
from throttle.config import ThrottleConfig
from throttle.parking import ParkingLot
from throttle.rates import RateBook
from throttle.refusals import Refusal, RefusalBook
from throttle.spec import PLAN_SUFFIX, UNIT_NAMES
from throttle.stats import StatsBook
from throttle.units import parse_duration
from workers.harness import ROOT, Worker, wait_ready

LIMITS = """
settings:
  prefix: PREFIX
  refresh: 0.5s
  pause_recheck: 1s
  jitter: 0.1s
limits:
  api: {rate: 1/h burst 5}
  shaper: {algorithm: gcra, rate: 2/s, burst: 1}
  tenant: {rate: 100/h, key: "{tenant}"}
  tenant-eu: {rate: 100/h, key: "{tenant}", cost: 2}
  pool: {rate: 3 concurrent}
  tokens: {rate: 1000/m, cost: 10}
  daily: {algorithm: fixed_window, rate: 1000/d}
  gate: {algorithm: gcra, rate: 20/s, burst: 1}
  busy: {rate: 100/s}
  learner: {algorithm: gcra, rate: 20/s, burst: 1, adaptive: true}
  tenant-learner: {algorithm: gcra, rate: 20/s, burst: 1, adaptive: true, key: "{tenant}"}
  tiers:
    {algorithm: gcra, rate: 10/s, key: "{tenant}", plan: "{plan}",
     plans: {free: 10/s burst 5, pro: 100/s burst 50}}
  estimate: {rate: 1000/m, cost: max_tokens}
  nowhere: {rate: 1/s}
queues:
  cli: [daily]
"""
FILE_LIMITS = [
    "api", "shaper", "tenant", "tenant-eu", "pool", "tokens", "daily", "gate", "busy", "learner",
    "tenant-learner", "tiers", "estimate",
]  # fmt: skip
KNOWN = [*FILE_LIMITS, "nowhere", "tests.apps.cli_app.inline"]


def _foreign(name: str) -> bool:
    """A task (or its inline limit) of another module: ``@app.task`` is shared by default,
    and Celery adds a shared task to every app of the process, tests.apps.cli_app too (in the
    full run: tests.apps.celery_app, workers.demo_app...). The file's limit names have no dot."""
    return "." in name and not name.startswith("tests.apps.cli_app.")


def _ours(names: list[str]) -> list[str]:
    return [name for name in names if not _foreign(name)]


def _limit(config: ThrottleConfig, name: str) -> Limit:
    return config.rules[name].limit


@dataclass
class Cli:
    """``celery throttle`` of tests.apps.cli_app, in this process, on the test's Redis and
    prefix."""

    config_path: Path
    config: ThrottleConfig
    redis_url: str
    limiter: Limiter

    def __call__(self, *args: str, input: str | None = None) -> Result:
        obj = CLIContext(app=cli_app, no_color=True, workdir=None, quiet=False)
        return CliRunner().invoke(throttle, list(args), obj=obj, input=input)

    def limit(self, name: str) -> Limit:
        return _limit(self.config, name)

    def runs(self, task_id: str) -> int:
        """How many times a task of tests.apps.cli_app ran (it counts itself)."""
        return int(self.limiter.client.get(f"{self.limiter.keyspace.prefix}:runs:{task_id}") or 0)

    def started(self, task_id: str) -> float:
        """When that task's (last) run started, epoch s."""
        return float(self.limiter.client.get(f"{self.limiter.keyspace.prefix}:at:{task_id}") or 0)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a ``celery -A tests.apps.cli_app ...`` subprocess."""
        return {
            **os.environ,
            "THROTTLE_CONFIG": str(self.config_path),
            "THROTTLE_REDIS_URL": self.redis_url,
            **extra,
        }

    def run(self, *args: str, **extra_env: str) -> subprocess.Popen[str]:
        """Start ``celery -A tests.apps.cli_app throttle ARGS`` (the installed entry point)."""
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "throttle", *args],
            cwd=ROOT, env=self.env(**extra_env), text=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip


def _drop_throttler() -> None:
    close_throttler(cli_app, forget=True)


@pytest.fixture
def cli(tmp_path: Path, redis_url: str, client: redis.Redis, prefix: str) -> Iterator[Cli]:
    path = tmp_path / "limits.yaml"
    path.write_text(LIMITS.replace("PREFIX", prefix))
    _drop_throttler()
    cli_app.conf.throttle_config = str(path)
    cli_app.conf.throttle_redis_url = redis_url
    try:
        yield Cli(path, ThrottleConfig.load(path), redis_url, Limiter(client, prefix=prefix))
    finally:
        _drop_throttler()
        cli_app.conf.throttle_config = cli_app.conf.throttle_redis_url = None


def _status(cli: Cli, *args: str) -> dict[str, Any]:
    result = cli("status", "--json", "--timeout", "0", *args)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.output)
    return data


def _rows(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in data["limits"]}


# -- status ---------------------------------------------------------------------------------


def test_status_json_reports_what_the_limiter_holds(cli: Cli) -> None:
    # Given: 3 of api's 5 tokens taken, the shaper's slot taken, 1 of the pool's 3 units
    # held, a rate set at run time, a pause, a timed hold on one key, one parked task
    for _ in range(3):
        assert cli.limiter.acquire(cli.limit("api")).allowed
    assert cli.limiter.acquire(cli.limit("shaper")).allowed
    assert cli.limiter.acquire(cli.limit("pool"), acquisition_id="t1").allowed
    RateBook(cli.limiter.client, cli.limiter.keyspace).set(cli.limit("daily"), "500/d")
    cli.limiter.hold("gate", None, None)
    cli.limiter.hold("tenant", "acme", 30.0)
    ParkingLot(cli.limiter.client, cli.limiter.keyspace).park(b"a task", 60.0)
    # and the fleet's counts of the last minute (the current one is not over: not counted)
    _last_minute(cli).record_events(["api"], ["denied", "parked"], 10)
    _last_minute(cli).record(["api"], "timeout", 4)

    data = _status(cli, "--minutes", "2")
    rows = _rows(data)

    assert _ours(list(rows)) == KNOWN
    api = rows["api"]
    assert (api["algorithm"], api["rate"], api["burst"]) == ("token_bucket", "1/h", 5)
    pool = rows["pool"]
    assert (pool["rate"], pool["burst"], pool["effective_burst"]) == ("3 concurrent", None, None)
    # 1/h refills 0.0003 tokens per second: what is left is burst - N
    assert api["tokens"] == pytest.approx(5 - 3, abs=0.01)
    assert api["next_slot_s"] == 0
    # 2/s burst 1: the slot comes back 0.5 s after it was taken, refilling as it goes
    shaper = rows["shaper"]
    assert 0.3 < shaper["next_slot_s"] <= 0.5
    assert shaper["tokens"] == pytest.approx(1 - 2 * shaper["next_slot_s"], abs=0.01)
    assert rows["pool"]["tokens"] == 2
    # a keyed limit has a state per key
    assert rows["tenant"]["key"] == "{tenant}"
    assert rows["tenant"]["tokens"] is None and rows["tenant"]["next_slot_s"] is None
    assert rows["tenant"]["key_holds"]["acme"]["paused"] is False
    assert rows["tenant"]["key_holds"]["acme"]["held_s"] == pytest.approx(30, abs=2)
    assert rows["tenant"]["hold"] is None
    # a pause: no next slot until resumed
    assert rows["gate"]["hold"] == {"paused": True, "held_s": None}
    assert rows["gate"]["next_slot_s"] is None
    # the run-time rate is shown with the configured one, and peeked at
    daily = rows["daily"]
    assert (daily["rate"], daily["override"], daily["effective_rate"]) == (
        "1000/d", "500/d", "500/d"
    )  # fmt: skip
    assert daily["tokens"] == 500
    # an inline limit of a task
    inline = rows["tests.apps.cli_app.inline"]
    assert inline["task"] == "tests.apps.cli_app.inline"
    assert (inline["algorithm"], inline["rate"], inline["burst"]) == ("gcra", "30/m", 3)
    assert data["parked"] == 1 and data["releasing"] == 0
    assert data["workers"] is None and api["in_flight"] is None  # --timeout 0
    assert data["prefix"] == cli.limiter.keyspace.prefix
    assert api["per_minute"] == {"denied": 5.0, "parked": 5.0, "timeout": 2.0, "waited": 0.0}
    assert rows["shaper"]["per_minute"] == {
        "denied": 0.0,
        "parked": 0.0,
        "timeout": 0.0,
        "waited": 0.0,
    }


def _last_minute(cli: Cli) -> StatsBook:
    """The fleet's stats, recorded as if one minute ago."""
    return StatsBook(cli.limiter.client, cli.limiter.keyspace, clock=lambda: time.time() - 60)


def test_status_table_shows_holds_overrides_keys_and_denials(cli: Cli) -> None:
    _last_minute(cli).record(["api"], "denied", 6)
    _last_minute(cli).record(["api"], "timeout", 2)
    cli.limiter.hold("gate", None, None)
    cli.limiter.hold("tenant", "acme", 30.0)
    RateBook(cli.limiter.client, cli.limiter.keyspace).set(cli.limit("shaper"), "1/s burst 1")
    for task_id in ("t1", "t2", "t3"):  # the concurrency limit full: 3 running tasks
        assert cli.limiter.acquire(cli.limit("pool"), acquisition_id=task_id).allowed
    result = cli("status", "--timeout", "0")
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    assert lines["pool"].split()[5:8] == ["0", "on", "release"]  # a unit back when one ends
    assert lines["pool"].split()[4] == "-"  # its units are its rate: no burst
    assert lines["LIMIT"].split()[:3] == ["LIMIT", "ALGORITHM", "RATE"]
    assert lines["gate"].split()[-3:] == ["paused", "?", "0"]
    assert lines["api"].endswith("1.2 (0.4 timed out)")  # over 5 minutes by default
    assert "per key" in lines["tenant"] and "acme: held" in lines["tenant"]
    assert "1/s (set; file 2/s)" in lines["shaper"]
    assert "workers  not asked" in result.output


def test_status_shows_the_learned_rate_next_to_the_configured_one(cli: Cli) -> None:
    # Given the upstream refused a call of each adaptive limit (one key of the keyed one)
    learned = LearnedRates(cli.limiter.client, cli.limiter.keyspace)
    learner = cli.config.rules["learner"]
    assert learner.adaptive is not None
    learned.refused(learner.limit, None, learner.adaptive)
    tenant = cli.config.rules["tenant-learner"]
    assert tenant.adaptive is not None
    learned.refused(tenant.limit, "acme", tenant.adaptive)
    rows = _rows(_status(cli))
    # Then the JSON has the learned rate beside the configured one
    assert rows["learner"]["adaptive"] is True and rows["learner"]["rate"] == "20/s"
    assert rows["learner"]["learned_per_s"] == pytest.approx(16.0)
    assert rows["tenant-learner"]["learned_per_s"] is None
    assert rows["tenant-learner"]["key_learned_per_s"] == {"acme": pytest.approx(16.0)}
    assert rows["shaper"]["adaptive"] is False and rows["shaper"]["learned_per_s"] is None
    # and so does the table
    result = cli("status", "--timeout", "0")
    lines = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    assert "16/s learned (20/s)" in lines["learner"]
    assert "20/s (1 keys learned)" in lines["tenant-learner"]


def test_status_names_an_unreachable_redis_without_its_password(cli: Cli) -> None:
    _drop_throttler()
    cli_app.conf.throttle_redis_url = "redis://:hunter2@127.0.0.1:1/0"
    result = cli("status", "--timeout", "0")
    assert result.exit_code == 1
    assert "Redis is unreachable" in result.output
    assert "hunter2" not in result.output


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        ("50/s", "50/s"),
        ("1/3h", "1/3h"),
        ("3500/m burst 100", "3500/m"),
        ("2.5/90s", "2.5/90s"),
        ("5000000/d", "5000000/d"),
        ("250/100ms", "250/100ms"),
        ("8 concurrent", "8 concurrent"),
    ],
)
def test_rates_are_shown_in_the_grammar_they_are_written_in(limit: str, expected: str) -> None:
    assert rate_spec(Limit.parse(limit)) == expected
    assert Limit.parse(expected).rate_per_s == Limit.parse(limit).rate_per_s


# -- set ------------------------------------------------------------------------------------


def test_set_changes_a_rate_for_the_fleet_and_back(cli: Cli) -> None:
    book = RateBook(cli.limiter.client, cli.limiter.keyspace)
    result = cli("set", "shaper", "4/s")
    assert result.exit_code == 0, result.output
    # the file's burst 1 is kept: a strict shaper stays strict at a higher rate
    assert book.overrides() == {"shaper": "4/s burst 1"}
    current = book.current(cli.limit("shaper"))
    assert (current.rate_per_s, current.burst) == (4.0, 1.0)
    assert "4/s burst 1 for the whole fleet (configured 2/s burst 1)" in result.output
    assert "within 500ms (settings.refresh)" in result.output
    # api is "1/h burst 5": raised, its burst stays 5; lowered below it, the count caps it
    for rate, stored, burst in [("10/h", "10/h burst 5", 5), ("2/d", "2/d", 2)]:
        assert cli("set", "api", rate).exit_code == 0
        assert book.overrides()["api"] == stored
        assert _rows(_status(cli))["api"]["effective_burst"] == burst
    # an explicit burst is the operator's
    assert cli("set", "api", "3/h burst 20").exit_code == 0
    assert book.overrides()["api"] == "3/h burst 20"
    assert _rows(_status(cli))["api"]["effective_burst"] == 20

    result = cli("set", "shaper", "--default")
    assert result.exit_code == 0, result.output
    assert "shaper" not in book.overrides()
    assert "back to 2/s burst 1" in result.output
    # a concurrency limit has no burst to tell
    result = cli("set", "pool", "5 concurrent")
    assert "'pool': 5 concurrent for the whole fleet (configured 3 concurrent)" in result.output
    assert "back to 3 concurrent (the configured rate)" in cli("clear", "pool").output
    # a cost from the task's arguments: a burst lowered below the file's is told of
    assert "warning" not in cli("set", "estimate", "2000/s burst 5000").output
    result = cli("set", "estimate", "10/s")
    assert result.exit_code == 0, result.output
    assert "more than 10 (the new burst, configured 1000) cannot be admitted" in result.output


def test_set_key_gives_one_key_its_own_rate_shown_in_status_and_clear_drops_it(
    cli: Cli,
) -> None:
    book = RateBook(cli.limiter.client, cli.limiter.keyspace)
    result = cli("set", "tiers", "250/s", "--key", "acme")
    assert result.exit_code == 0, result.output
    assert "key 'acme' of limit 'tiers': 250/s burst at most its plan's (10 on" in result.output
    assert "throttle clear tiers --key acme" in result.output
    assert book.key_overrides() == {("tiers", "acme"): "250/s"}
    # the plan's burst holds for the key (pro: 50), the limit's own rate is untouched
    pro = cli.config.rules["tiers"].plan_limits["pro"]
    assert (book.current(pro, "acme").rate_per_s, book.current(pro, "acme").burst) == (250, 50)
    assert book.current(cli.limit("tiers"), "other") == cli.limit("tiers")
    row = _rows(_status(cli))["tiers"]
    assert row["key_rates"] == {"acme": "250/s"}
    assert row["plans"] == {
        "free": {"rate": "10/s", "burst": 5.0}, "pro": {"rate": "100/s", "burst": 50.0}
    }  # fmt: skip
    assert "10/s + 2 plans; acme: 250/s" in cli("status", "--timeout", "0").output
    # the undo it suggests is a command a shell runs as it reads, whatever the key
    spaced = cli("set", "tiers", "20/s", "--key", "never ran")
    assert "throttle clear tiers --key 'never ran'" in spaced.output, spaced.output
    assert cli("clear", "tiers", "--key", "never ran").exit_code == 0
    # a bad rate, a key on an unkeyed limit: usage errors, nothing stored
    assert cli("set", "tiers", "fast", "--key", "acme").exit_code == 2
    zero = cli("set", "tiers", "0/s", "--key", "acme")
    assert zero.exit_code == 2  # named as `set` without --key names it: no "rate: " first
    assert "Invalid value for RATE: limit 'tiers': field 'rate': its count" in zero.output
    assert cli("set", "api", "5/s", "--key", "acme").exit_code == 2
    # a burst below the cost of each task (tenant-eu's 2): no task of the key could run
    result = cli("set", "tenant-eu", "1/s", "--key", "acme")
    assert result.exit_code == 2, result.output
    assert "the burst 1 that '1/s' gives key 'acme' is below the cost 2" in " ".join(
        result.output.split()
    )
    assert book.key_overrides() == {("tiers", "acme"): "250/s"}
    assert cli("set", "tenant-eu", "1/s burst 2", "--key", "acme").exit_code == 0
    assert cli("clear", "tenant-eu", "--key", "acme").exit_code == 0

    result = cli("clear", "tiers", "--key", "acme")
    assert result.exit_code == 0, result.output
    assert "back to its plan's rate" in result.output
    assert book.key_overrides() == {}
    assert "had no rate of its own" in cli("clear", "tiers", "--key", "acme").output
    # clear without --key is set --default
    assert cli("set", "api", "5/h").exit_code == 0
    assert cli("clear", "api").exit_code == 0
    assert book.overrides() == {}


def test_shadow_and_enforce_switch_a_limit_and_status_tells_what_it_would_have_done(
    cli: Cli,
) -> None:
    assert _rows(_status(cli))["busy"]["mode"] == "enforce"
    result = cli("shadow", "busy")
    assert result.exit_code == 0, result.output
    assert "limit 'busy' in shadow mode: its tasks run at once" in result.output
    assert cli("shadow", "pool").exit_code == 2  # concurrency: always enforced
    stats = StatsBook(cli.limiter.client, cli.limiter.keyspace)
    stats.record_shadow(["busy"], [0.0])
    for wait in (0.1, 0.2, 0.3, 0.4):
        stats.record_shadow(["busy"], [wait])
    row = _rows(_status(cli))["busy"]
    assert row["mode"] == "shadow"
    assert (row["shadow"]["tasks"], row["shadow"]["delayed"]) == (5, 4)
    assert row["shadow"]["p50_s"] == pytest.approx(0.2, rel=0.06)
    text = cli("status", "--timeout", "0").output
    assert "shadow   busy (in shadow mode): would have delayed 4 of 5 tasks over the last" in text
    result = cli("enforce", "busy")
    assert result.exit_code == 0, result.output
    assert "limit 'busy' enforced: its tasks wait for it" in result.output
    assert _rows(_status(cli))["busy"]["mode"] == "enforce"
    text = cli("status", "--timeout", "0").output
    assert "shadow   busy (enforced now)" in text
    # a mode set at run time, even the file's own, shows: it outlives a change of the file
    assert _rows(_status(cli))["busy"]["mode_set"] == "enforce"
    assert "mode     busy: enforce, set at run time (`enforce busy --default`" in text
    assert cli("enforce", "busy", "--default").exit_code == 0
    assert RateBook(cli.limiter.client, cli.limiter.keyspace).modes() == {}
    assert _rows(_status(cli))["busy"]["mode_set"] is None
    assert "mode     busy" not in cli("status", "--timeout", "0").output


def test_refusals_lists_a_limit_s_record_newest_first_per_key_and_as_json(cli: Cli) -> None:
    book = RefusalBook(cli.limiter.client, cli.limiter.keyspace)
    assert "no refusal recorded for limit 'tenant'" in cli("refusals", "tenant").output
    for i, key in enumerate(["acme", "other", "acme"]):
        book.record([Refusal("tenant", key, f"task-{i}", "proj.call", 429, "Retry-After",
                             2.0, i == 2)])  # fmt: skip
    result = cli("refusals", "tenant", "--key", "acme")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["TIME", "(UTC)", "KEY", "TASK", "ID", "STATUS", "HEADER",
                                "HOLD", "FLEET"]  # fmt: skip
    assert "task-2" in lines[1] and "held" in lines[1] and "Retry-After" in lines[1]
    assert "task-0" in lines[2] and "task only" in lines[2] and "429" in lines[2]
    assert "2 refusals of key 'acme' of limit 'tenant', newest first\n" in result.output
    cut = cli("refusals", "tenant", "--max", "2").output
    assert "2 refusals of limit 'tenant', newest first (the newest 2: --max 2)" in cut
    data = json.loads(cli("refusals", "tenant", "--json", "--max", "2").output)
    assert [(e["task_id"], e["key"], e["hold_s"]) for e in data] == [
        ("task-2", "acme", 2.0), ("task-1", "other", 2.0)
    ]  # fmt: skip
    assert cli("refusals", "nope").exit_code == 2
    # a limit of code of its own (asyncio's apply_upstream, not in the limits file) is
    # read by its name once it has refusals
    book.record([Refusal("own-aio", None, None, None, 429, "retry-after", 3.0, True)])
    mine = cli("refusals", "own-aio")
    assert mine.exit_code == 0 and "1 refusal of limit 'own-aio'" in mine.output, mine.output


def test_status_tells_a_rate_that_follows_the_upstream_and_set_replaces_it(cli: Cli) -> None:
    book = RateBook(cli.limiter.client, cli.limiter.keyspace)
    book.follow(cli.limit("shaper"), "1/1s burst 1")  # as the upstream hook stores it
    row = _rows(_status(cli))["shaper"]
    assert (row["override"], row["followed"], row["effective_rate"]) == (
        "1/1s burst 1",
        True,
        "1/s",
    )
    text = cli("status", "--timeout", "0")
    assert "1/s (upstream; file 2/s)" in text.output
    assert cli("set", "shaper", "3/s").exit_code == 0  # the operator's word is the last
    row = _rows(_status(cli))["shaper"]
    assert (row["override"], row["followed"]) == ("3/s burst 1", False)
    assert book.followed_rates() == {}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("set", "shaper", "10/fortnight"), "unknown time unit 'fortnight'"),
        (("set", "shaper", "10 concurrent"), "'N concurrent' is a concurrency limit, not gcra"),
        (("set", "tokens", "100/m burst 5"), "below the cost 10 that each task"),
        (("set", "nope", "1/s"), "unknown limit 'nope'; known limits: " + ", ".join(KNOWN[:-1])),
        (("set", "shaper"), "give a RATE, or --default"),
        (("set", "shaper", "1/s", "--default"), "give a RATE or --default (the file's rate), not"),
        (("pause", "nope"), "unknown limit 'nope'"),
        (("resume", "nope"), "unknown limit 'nope'"),
        (("reset", "nope", "--yes"), "unknown limit 'nope'"),
    ],
    ids=["bad-unit", "wrong-kind", "below-cost", "unknown-limit", "no-rate", "both",
         "pause-unknown", "resume-unknown", "reset-unknown"],
)  # fmt: skip
def test_bad_input_is_a_usage_error_that_changes_nothing(
    cli: Cli, args: tuple[str, ...], message: str
) -> None:
    result = cli(*args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert RateBook(cli.limiter.client, cli.limiter.keyspace).overrides() == {}
    assert cli.limiter.holds() == {}


# -- reset ----------------------------------------------------------------------------------


def _keys(cli: Cli) -> set[str]:
    base = cli.limiter.keyspace.base
    return {k.decode() for k in cli.limiter.client.scan_iter(match=f"{base}*", count=1000)}


def test_reset_deletes_one_key_or_every_key_of_one_limit_only(cli: Cli) -> None:
    # Given tenant's state for three keys (one full of awkward characters), the state of
    # limits sharing its name's start (tenant-eu) or unkeyed (api), and a pause
    tenant, eu, api = cli.limit("tenant"), cli.limit("tenant-eu"), cli.limit("api")
    awkward = "x:y{z}*?[a]"
    for key in ("a", "b", awkward):
        assert cli.limiter.acquire(tenant, key, cost=10).allowed
    assert cli.limiter.acquire(eu, "a").allowed
    assert cli.limiter.acquire(api).allowed
    cli.limiter.hold("tenant", None, None)
    before = _keys(cli)

    # No confirmation: nothing happens
    result = cli("reset", "tenant", input="n\n")
    assert result.exit_code == 1 and "Aborted" in result.output
    assert _keys(cli) == before

    # One key
    result = cli("reset", "tenant", "a", "--yes")
    assert result.exit_code == 0, result.output
    assert "1 Redis key deleted" in result.output
    assert _keys(cli) == before - set(cli.limiter.keyspace.state_keys(tenant, "a"))

    # Every key, after confirming
    result = cli("reset", "tenant", input="y\n")
    assert result.exit_code == 0, result.output
    assert "2 Redis keys deleted" in result.output
    gone = {k for key in ("a", "b", awkward) for k in cli.limiter.keyspace.state_keys(tenant, key)}
    assert _keys(cli) == before - gone
    assert cli.limiter.peek(eu, "a").remaining == pytest.approx(99, abs=0.1)
    assert cli.limiter.peek(api).remaining == pytest.approx(4, abs=0.1)
    # the limit starts full (once resumed), and the pause stayed
    assert cli.limiter.holds() == {("tenant", None): math.inf}
    cli.limiter.unhold("tenant")
    assert cli.limiter.peek(tenant, "b").remaining == pytest.approx(100, abs=0.1)


def test_reset_clears_the_plans_of_a_limit_and_status_lists_no_plan(cli: Cli) -> None:
    # Given tenant's plan twin (tenant.plan, see throttle/celery/plan.py) with a backlog on
    # two keys, beside tenant's own state
    tenant = cli.limit("tenant")
    twin = plan_limit(tenant)
    for key in ("a", "b"):
        assert cli.limiter.acquire(twin, key, cost=100, max_wait_s=3600).allowed
    assert cli.limiter.acquire(tenant, "a").allowed
    # status shows the limit once, and no plan as a limit of its own
    names = [row["name"] for row in _status(cli)["limits"]]
    assert names.count("tenant") == 1 and not any(n.endswith(PLAN_SUFFIX) for n in names)

    # One key: its state and its plan
    result = cli("reset", "tenant", "a", "--yes")
    assert result.exit_code == 0, result.output
    assert "2 Redis keys deleted" in result.output
    assert cli.limiter.peek(twin, "a").remaining == pytest.approx(100, abs=0.1)
    assert cli.limiter.peek(twin, "b").remaining < 1

    # Every key: the plan's too
    result = cli("reset", "tenant", "--yes")
    assert result.exit_code == 0, result.output
    assert cli.limiter.peek(twin, "b").remaining == pytest.approx(100, abs=0.1)
    assert not {k for k in _keys(cli) if f"{PLAN_SUFFIX}:" in k}


# -- pause, resume --------------------------------------------------------------------------


def test_pause_and_resume_a_limit_or_one_key(cli: Cli) -> None:
    api, tenant = cli.limit("api"), cli.limit("tenant")
    result = cli("pause", "api")
    assert result.exit_code == 0, result.output
    assert "its tasks wait in the workers" in result.output
    assert "looking again every 1s" in result.output
    assert cli.limiter.holds() == {("api", None): math.inf}
    denied = cli.limiter.acquire(api)
    assert not denied.allowed and math.isinf(denied.retry_after_s)

    result = cli("resume", "api")
    assert result.exit_code == 0, result.output
    assert "lifted its pause" in result.output
    assert cli.limiter.holds() == {}
    assert cli.limiter.acquire(api).allowed

    assert cli("pause", "tenant", "acme").exit_code == 0
    assert not cli.limiter.acquire(tenant, "acme").allowed
    assert cli.limiter.acquire(tenant, "beta").allowed
    cli.limiter.hold("tenant", "beta", 60.0)  # an upstream's timed hold
    result = cli("resume", "tenant", "acme")
    assert result.exit_code == 0, result.output
    assert "still held" in result.output and "'beta'" in result.output
    assert cli.limiter.acquire(tenant, "acme").allowed

    result = cli("resume", "api")
    assert result.exit_code == 0 and "nothing to do" in result.output

    # A key that no task of the limit can have is refused (exit 2), not paused in vain:
    # a limit without a key, an empty key
    for args in (
        ("pause", "api", "acme"), ("pause", "tenant", ""), ("reset", "api", "x"),
        ("resume", "api", "acme"),
    ):  # fmt: skip
        result = cli(*args)
        assert result.exit_code == 2, result.output
    assert "limit 'api' has no key" in cli("pause", "api", "acme").output
    assert cli("refusals", "api", "--key", "acme").exit_code == 2
    assert cli("clear", "api", "--key", "acme").exit_code == 2
    assert cli.limiter.holds() == {("tenant", "beta"): pytest.approx(60.0, abs=5.0)}
    # a key held anyway (placed before the limits file dropped the limit's key) is lifted
    cli.limiter.hold("api", "stale", 60.0)
    assert cli("resume", "api", "stale").exit_code == 0
    assert ("api", "stale") not in cli.limiter.holds()


# -- check ----------------------------------------------------------------------------------

BAD_FILE = """
settings:
  refresh: soon
  colour: blue
limits:
  api: {rate: 10/fortnight, on_error: maybe}
  github: {algorithm: gcrx, rate: 5000/h, burst: 0, max_wait: ten minutes, colour: red}
  tokens: {rate: 10/s, cost: 20}
  fine: {rate: 10/s}
queues:
  llm: [api, nope, fine, fine]
extra: 1
"""


def test_check_prints_every_error_with_its_place(tmp_path: Path) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(BAD_FILE)
    result = CliRunner().invoke(throttle, ["check", str(path)])
    assert result.exit_code == 1
    f = str(path)
    duration = "must be a duration >= 0: seconds, or a string such as '250ms', '30s', '10m', "
    duration += "'2h', '1d'"
    # the fields a limit may have (other fields come and go: not this test's point)
    fields = ", ".join((*config._LIMIT_FIELDS, *config._RULE_FIELDS, *ADAPTIVE_FIELDS))
    settings = ", ".join(SETTINGS_FIELDS)  # other settings come and go: not this test's point
    assert result.stdout.splitlines() == [
        f"{f}: field 'extra': unknown section; expected one of settings, limits, queues, "
        "tasks (got 1)",
        f"{f}: field 'settings.refresh': {duration} (got 'soon')",
        f"{f}: field 'settings.colour': unknown setting; expected one of {settings} (got 'blue')",
        f"{f}: limit 'api': field 'rate': unknown time unit 'fortnight'; use {UNIT_NAMES} "
        "(got '10/fortnight')",
        f"{f}: limit 'api': field 'on_error': must be 'keep' or 'refund' (got 'maybe')",
        f"{f}: limit 'github': field 'colour': unknown field; expected one of {fields} (got 'red')",
        f"{f}: limit 'github': field 'algorithm': unknown algorithm (did you mean 'gcra'?); "
        "expected one of "
        "token_bucket, gcra, sliding_window, fixed_window, concurrency (got 'gcrx')",
        f"{f}: limit 'github': field 'burst': must be a finite number > 0 (got 0)",
        f"{f}: limit 'github': field 'max_wait': {duration} (got 'ten minutes')",
        f"{f}: limit 'tokens': field 'cost': must be a number from 0 to the limit's capacity "
        "10: no task could ever run; give the limit a burst of at least 20 (got 20)",
        f"{f}: field 'queues.llm': unknown limit; the file defines api, fine, github, tokens "
        "(got 'nope')",
        f"{f}: field 'queues.llm': a limit listed twice (got 'fine')",
    ]
    assert result.stderr.strip() == f"12 errors in {f}"
    # the first is what the loader raises, in the same words
    with pytest.raises(ValueError) as caught:
        ThrottleConfig.load(path)
    assert str(caught.value) == result.stdout.splitlines()[0]


@pytest.mark.parametrize("name", ["limits.yaml", "demo.yaml"])
def test_check_passes_the_example_files(name: str) -> None:
    result = CliRunner().invoke(throttle, ["check", str(ROOT / "configs" / name)])
    assert result.exit_code == 0, result.output
    assert ": OK: " in result.output


def test_check_through_the_celery_program_without_an_app_warns_of_no_task(
    tmp_path: Path,
) -> None:
    # Without -A the celery program's app is Celery's default one, which registers none
    # of the tasks the example file maps: nothing to warn of
    example = ROOT / "configs" / "limits.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "celery", "throttle", "check", str(example)],
        cwd=tmp_path, text=True, capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.splitlines() == [f"{example}: OK: 9 limits, 2 queues, 3 tasks"]


def test_check_with_an_app_names_its_tasks_limits_the_file_lacks(cli: Cli) -> None:
    def ours(result: Result) -> list[str]:
        return [
            line
            for line in result.stdout.splitlines()
            if not _foreign(line.partition("task '")[2] or "-")
        ]

    complete = cli("check", str(cli.config_path))
    assert ours(complete) in (
        [],
        [f"{cli.config_path}: OK: {len(KNOWN) - 1} limits, 1 queue, 0 tasks"],
    )
    partial = cli.config_path.with_name("partial.yaml")
    partial.write_text("limits:\n  gate: {rate: 1/s}\n")
    result = cli("check", str(partial))
    assert result.exit_code == 1
    assert ours(result) == [
        f"{partial}: task 'tests.apps.cli_app.{task}' names a limit the file does not define; it "
        f"defines gate (got '{limit}')"
        for task, limit in (("busy", "busy"), ("orphan", "nowhere"))
    ]


def test_check_with_an_app_warns_of_a_task_it_does_not_register(cli: Cli) -> None:
    typo = cli.config_path.with_name("typo.yaml")
    typo.write_text(
        "limits:\n  gate: {rate: 1/s}\n  busy: {rate: 1/s}\n  nowhere: {rate: 1/s}\n"
        "tasks:\n  tests.apps.cli_app.bussy: [gate]\n"
    )
    result = cli("check", str(typo))
    lines = result.stdout.splitlines()
    # A file may serve several apps: a warning, not an error (in the full run, shared tasks
    # of other modules join the app and name limits this file lacks: errors of their own)
    errors = [line for line in lines if line.startswith(str(typo)) and "OK:" not in line]
    assert result.exit_code == (1 if errors else 0), result.output
    assert all(_foreign(line.partition("task '")[2] or "-") for line in errors), errors
    assert (
        f"warning: {typo}: tasks: names a task that app 'cli_tests' does not register "
        "(did you mean 'tests.apps.cli_app.busy'?): its limits apply to no task of it (got "
        "'tests.apps.cli_app.bussy')"
    ) in lines


# -- through the celery program -------------------------------------------------------------


def test_the_celery_program_runs_set_reset_and_check(cli: Cli, tmp_path: Path) -> None:
    # (status, pause and resume run through it below, with a worker and with --watch)
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_FILE)
    assert cli.limiter.acquire(cli.limit("api"), cost=5).allowed
    # Independent commands run side by side: each starts a Python with celery (~1 s).
    runs = {
        "set": cli.run("set", "shaper", "4/s"),
        "reset": cli.run("reset", "api", "--yes"),
        "check": cli.run("check", str(bad)),
    }
    done = {name: (*proc.communicate(timeout=30), proc.returncode) for name, proc in runs.items()}
    for name, expected in [("set", 0), ("reset", 0), ("check", 1)]:
        assert done[name][2] == expected, (name, done[name])
    assert RateBook(cli.limiter.client, cli.limiter.keyspace).overrides() == {
        "shaper": "4/s burst 1"
    }
    assert "reset limit 'api' (every key): 1 Redis key deleted" in done["reset"][0]
    assert cli.limiter.peek(cli.limit("api")).remaining == pytest.approx(5, abs=0.01)
    assert len(done["check"][0].splitlines()) == 12
    assert done["check"][1].strip() == f"12 errors in {bad}"


def test_status_watch_redraws_until_interrupted(cli: Cli) -> None:
    seen: list[str] = []
    deadline = time.monotonic() + 20

    def read(proc: subprocess.Popen[str]) -> None:
        assert time.monotonic() < deadline, seen
        assert proc.stdout is not None
        if select.select([proc.stdout], [], [], 1.0)[0]:
            seen.append(proc.stdout.readline())
        assert proc.poll() is None, (seen[-3:], proc.stderr.read() if proc.stderr else "")

    with cli.run("status", "--watch", "0.2", "--timeout", "0") as proc:
        try:
            while sum(line.startswith("celery throttle status") for line in seen) < 3:
                read(proc)
            # the limits are read again at each redraw
            cli.limiter.hold("api", None, None)
            while not any(line.startswith("api ") and "paused" in line for line in seen[-30:]):
                read(proc)
        finally:
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err


# -- a real worker --------------------------------------------------------------------------


@pytest.fixture
def worker(cli: Cli, private_redis: RedisServer, tmp_path: Path) -> Iterator[tuple[Celery, str]]:
    """One ``celery worker`` of tests.apps.cli_app (2 prefork children) on queue ``cli``, its
    broker and results in database 1 of the private redis-server; and a producer app."""
    broker = f"redis://127.0.0.1:{private_redis.port}/1"
    node = Worker(
        "cli", cli.env(CLI_BROKER_URL=broker), concurrency=2,
        queues="cli", app="tests.apps.cli_app", log=tmp_path / "worker.log",
    )  # fmt: skip
    producer = Celery("producer", broker=broker)  # results: the tasks count their runs
    try:
        node.start()
        wait_ready(producer, [node])
        yield producer, broker
    finally:
        node.stop()
        producer.close()
        # Database 1 of the session's own redis-server is this module's broker only.
        broker_db = private_redis.client(db=1)
        broker_db.flushdb()
        broker_db.close()


def test_pause_names_the_wait_the_broker_s_visibility_timeout_allows(cli: Cli) -> None:
    # A Redis broker redelivers an unacknowledged task after its visibility timeout: the
    # workers' lines hold a task at most half of it (less sleep_max and park_lead)
    cli_app.conf.broker_transport_options = {"visibility_timeout": 120}
    try:
        result = cli("pause", "api")
    finally:
        cli_app.conf.broker_transport_options = {}
    assert result.exit_code == 0, result.output
    assert "under the broker's visibility or consumer timeout" in result.output
    waited = re.search(r"up to (\S+),", result.output)
    assert waited is not None and parse_duration(waited.group(1), field="wait") < 60.0, (
        result.output
    )


def test_a_paused_limit_runs_nothing_until_resumed_then_every_task_once(
    cli: Cli, worker: tuple[Celery, str]
) -> None:
    producer, broker = worker
    # Given limit "gate" paused through the celery program
    with cli.run("pause", "gate") as paused:
        out, err = paused.communicate(timeout=30)
        assert paused.returncode == 0, err
    # its undo hint names the app, as the command was run
    assert "Undo: celery -A tests.apps.cli_app throttle resume gate" in out, out
    # When tasks under it are sent, and a task of limit "busy" occupies a pool child
    handles = [producer.send_task("tests.apps.cli_app.gated", (n,), queue="cli") for n in range(5)]
    running = producer.send_task("tests.apps.cli_app.busy", (4.0,), queue="cli")
    sent_at = time.monotonic()
    # Then the status (with the workers' replies) shows the pause and what is in flight:
    # busy runs under its own limit and under daily (every task of queue cli)
    status = cli.run("status", "--json", "--timeout", "1", CLI_BROKER_URL=broker)
    out, err = status.communicate(timeout=30)
    assert status.returncode == 0, err
    data = json.loads(out)
    rows = _rows(data)
    assert rows["gate"]["hold"] == {"paused": True, "held_s": None}
    assert data["workers"] == 1
    assert rows["busy"]["in_flight"] == 1
    # (a gated task is active for the moment it takes to defer itself)
    assert rows["daily"]["in_flight"] == 1 + rows["gate"]["in_flight"]
    # and while paused (more than one pause_recheck of 1 s), none of the tasks ran
    time.sleep(max(0.0, 2.5 - (time.monotonic() - sent_at)))
    assert [cli.runs(handle.id) for handle in handles] == [0] * 5
    # When resumed
    resumed_at = time.time()
    with cli.run("resume", "gate") as resumed:
        assert resumed.wait(30) == 0, resumed.communicate()
    # Then every task runs, once, after the resume
    deadline = time.monotonic() + 30
    while min(cli.runs(handle.id) for handle in [*handles, running]) == 0:
        assert time.monotonic() < deadline, [cli.runs(handle.id) for handle in handles]
        time.sleep(0.1)
    assert all(cli.started(handle.id) >= resumed_at for handle in handles)
    time.sleep(1.5)  # a second copy of a task would have run by now
    assert [cli.runs(handle.id) for handle in [*handles, running]] == [1] * 6


def test_ctrl_c_at_any_moment_ends_the_watch_cleanly(cli: Cli) -> None:
    # Ctrl-C lands wherever the watch is: drawing, in a Redis call, or asleep
    rng = random.Random(7)
    for _ in range(5):
        with cli.run("status", "--json", "--watch", "0.1", "--timeout", "0") as proc:
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("{")  # started, connected
            time.sleep(rng.uniform(0.0, 0.2))
            proc.send_signal(signal.SIGINT)
            # generous: the exit code is the point, not how fast a loaded host exits
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err


def test_status_of_an_app_without_limits_says_so() -> None:
    data = {
        "redis": "redis://localhost:6379/0", "prefix": "throttle", "namespace": "default",
        "config": None, "workers": None, "parked": 0, "releasing": 0, "minutes": 5,
        "limits": [], "clocks": [],
    }  # fmt: skip
    table = render_status(data, 0)
    assert table.splitlines()[1] == "(no limits: no limits file, and no task has inline limits)"
