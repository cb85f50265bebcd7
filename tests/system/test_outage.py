"""Redis outages with real processes: the limiter's redis-server is killed in the middle of
a fleet run (2 ``celery worker`` x 2 children) and started again, empty, on the same port;
then the broker's. Three servers, so that each goes away alone: broker, limiter, and a
ledger (result backend, and a record of every execution of a task body).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.apps.outage_app import app, closed, local, opened, paced, plain
from tests.support.restart import kill, respawn
from tests.support.servers import RedisServer
from throttle import Limit, Limiter
from throttle.celery.outage import RECOVERY_S
from throttle.config import ThrottleConfig
from throttle.errors import ConfigError
from throttle.fallback import LocalBuckets
from workers.harness import Worker, running

CONFIG = """
settings:
  sleep_max: 0.5s
  park_after: 2.5s  # held in a worker at most 4 s: half the broker's visibility timeout
  park_lead: 1s
  jitter: 0.2s
limits:
  closed: {algorithm: gcra, rate: 50/s, on_redis_down: defer}
  opened: {algorithm: gcra, rate: 50/s, on_redis_down: "allow:3s"}
  local: {algorithm: gcra, rate: 8/s, burst: 1, on_redis_down: local}
  plain: {algorithm: gcra, rate: 20/s, burst: 1}
  paced: {algorithm: gcra, rate: 5/s, burst: 1}
  cold: {rate: 60/m, burst: 30, cold_start: empty}
  warm: {rate: 60/m, burst: 30}
"""
WORKERS, CHILDREN = 2, 2
LOCAL_RATE = 8.0  # the "local" limit: 2/s in each of the 4 processes while Redis is down
ALLOW_S = 3.0  # the "opened" limit's bound
UNREACHABLE = "throttle: Redis is unreachable"
BACK = "throttle: Redis is reachable again"
COLD = "throttle: Redis has no marker key"


@pytest.mark.parametrize(
    ("entry", "field", "problem"),
    [
        pytest.param({"on_redis_down": "allow:soon"}, "on_redis_down", "allow:DURATION",
                     id="bound"),
        pytest.param({"on_redis_down": "open"}, "on_redis_down", "'local'", id="unknown"),
        pytest.param({"rate": "3 concurrent", "on_redis_down": "local"}, "on_redis_down",
                     "needs a rate", id="local-concurrency"),
        pytest.param({"cold_start": "cold"}, "cold_start", "'empty'", id="cold-unknown"),
        pytest.param({"key": "{x}", "cold_start": "empty"}, "cold_start", "unkeyed",
                     id="cold-keyed"),
    ],
)  # fmt: skip
def test_bad_outage_fields_are_named(entry: dict[str, Any], field: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ThrottleConfig.from_mapping({"limits": {"api": {"rate": "5/s", **entry}}}, source="f.yaml")
    message = str(caught.value)
    assert message.startswith(f"f.yaml: limit 'api': field '{field}': ")
    assert problem in message


def test_outage_settings() -> None:
    config = ThrottleConfig.from_mapping(
        {
            "settings": {"fail_open_for": "30s", "fleet_workers": 3},
            "limits": {"a": {"rate": "5/s", "on_redis_down": "allow:10s"},
                       "b": {"rate": "5/s", "on_redis_down": "allow"}},
        }
    )  # fmt: skip
    assert config.settings.fail_open_for_s == 30.0
    assert config.settings.fleet_workers == 3
    assert config.rules["a"].fail_open_s == 10.0
    assert config.rules["b"].fail_open_s is None  # the setting applies
    assert ThrottleConfig().settings.fail_open_for_s == 60.0
    with pytest.raises(ConfigError, match=r"settings\.fleet_workers.*whole number"):
        ThrottleConfig.from_mapping({"settings": {"fleet_workers": 0}})


def test_local_buckets_split_the_rate() -> None:
    """Four processes' share of 8/s burst 4: 2/s, one call of capacity; all or nothing."""
    fast, slow = Limit.parse("8/s burst 4", name="fast"), Limit.parse("1/s", name="slow")
    buckets = LocalBuckets()
    assert buckets.take([(fast, None, 1.0)], 4, now=0.0) == 0.0
    assert buckets.take([(fast, None, 1.0)], 4, now=0.0) == pytest.approx(0.5)
    assert buckets.take([(fast, None, 1.0)], 4, now=0.5) == 0.0
    # slow (1/s shared by 4: 0.25/s, capacity 1) admits; fast does not yet: nothing taken.
    assert buckets.take([(fast, None, 1.0), (slow, None, 1.0)], 4, now=0.6) == pytest.approx(0.4)
    assert buckets.take([(slow, None, 1.0)], 4, now=0.6) == 0.0
    admitted = sum(buckets.take([(fast, "k", 1.0)], 4, now=t / 100) == 0.0 for t in range(1000))
    assert admitted == 1 + 19  # one at once (the capacity), then one every 0.5 s to 9.99 s


class Fleet:
    def __init__(self, broker: RedisServer, limiter: RedisServer, ledger: RedisServer,
                 tmp: Path) -> None:  # fmt: skip
        self.broker, self.limiter_redis, self.ledger_redis = broker, limiter, ledger
        config = tmp / "limits.yaml"
        config.write_text(CONFIG)
        self.config = ThrottleConfig.load(config)
        env = {
            "OUTAGE_BROKER_URL": broker.url,
            "OUTAGE_LEDGER_URL": ledger.url,
            "THROTTLE_REDIS_URL": limiter.url,
            "THROTTLE_CONFIG": str(config),
        }
        self.workers = [
            Worker(f"out{i}", env, concurrency=CHILDREN, queues="outage",
                   app="tests.apps.outage_app", log=tmp / f"out{i}.log")
            for i in range(1, WORKERS + 1)
        ]  # fmt: skip
        self.ledger = ledger.client()

    def calls(self) -> list[tuple[str, float, int, str, str]]:
        rows = [row.decode().split() for row in self.ledger.lrange("calls", 0, -1)]
        return [(p, float(at), int(pid), host, tid) for p, at, pid, host, tid in rows]

    def runs(self, task_id: str) -> int:
        return int(self.ledger.get(f"runs:{task_id}") or 0)

    def logs(self, needle: str) -> list[int]:
        """How many lines of each worker's log contain ``needle``."""
        counts = []
        for worker in self.workers:
            assert worker.log is not None
            counts.append(worker.log.read_text(errors="replace").count(needle))
        return counts


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("outage")
    broker_dir = tmp / "broker"
    broker_dir.mkdir()
    # The broker persists every write, so that its restart loses no message.
    persist = ("--appendonly", "yes", "--appendfsync", "always", "--dir", str(broker_dir))
    with RedisServer(persist) as broker, RedisServer() as limiter, RedisServer() as ledger:
        fleet = Fleet(broker, limiter, ledger, tmp)
        app.conf.broker_url = broker.url
        app.conf.result_backend = ledger.url
        with running(app, fleet.workers):
            yield fleet


def _results(results: list[Any], timeout_s: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    return [r.get(timeout=max(deadline - time.monotonic(), 0.1)) for r in results]


def test_limiter_redis_killed_and_restarted_empty(fleet: Fleet) -> None:
    """Given a fleet with a limit of each policy and a Redis that knows its marker key,
    when the limiter's Redis is killed mid-run and comes back empty 7 s later,
    then every task runs once; defer runs nothing while Redis is down, allow runs within
    its 3 s bound and defers after it, local runs at about its rate / 4 processes; each
    worker warns once that Redis is gone and once that it is back; the cold_start: empty
    limit comes back drained, the default one full."""
    cold, warm = fleet.config.rules["cold"].limit, fleet.config.rules["warm"].limit
    assert fleet.limiter_redis.client().exists("throttle:{default}:alive")  # worker start

    kill(fleet.limiter_redis)
    down_at = time.time()
    sent = [opened.delay(i) for i in range(8)]
    sent += [closed.delay(i) for i in range(8)]
    sent += [local.delay(i) for i in range(80)]  # more than the 7 s down can admit
    time.sleep(ALLOW_S + 1.0 - (time.time() - down_at))
    late = [opened.delay(100 + i) for i in range(6)]  # past the bound: must wait for Redis
    time.sleep(7.0 - (time.time() - down_at))
    respawn(fleet.limiter_redis)
    up_at = time.time()

    results = _results(sent + late, 40)
    by_id = {r.id: res for r, res in zip(sent + late, results, strict=True)}
    assert all(res["runs"] == 1 for res in results)
    calls = fleet.calls()
    assert sorted(tid for *_, tid in calls) == sorted(by_id)  # each once, none lost
    assert all(fleet.runs(tid) == 1 for tid in by_id)
    at = collections.defaultdict(list)
    for policy, when, pid, _, tid in calls:
        at[policy].append((when, pid, tid))

    # defer (fail closed): nothing while Redis was down.
    assert min(when for when, _, _ in at["closed"]) >= up_at - 0.05
    # allow:3s: the first batch ran during the outage, within the bound; the late one after.
    # Judged on when calls ran, not on which batch they came from: on a loaded host a task
    # of the first batch may reach its gate after the bound, and must then wait too.
    early = [when for when, _, tid in at["opened"] if tid not in {r.id for r in late}]
    after = [when for when, _, tid in at["opened"] if tid in {r.id for r in late}]
    assert any(when < up_at for when in early)  # allowed while down
    bound_at = down_at + ALLOW_S + 0.5  # the bound, plus a decision-to-body margin
    assert not [w for w, _, _ in at["opened"] if bound_at < w < up_at - 0.05]
    assert min(after) >= up_at - 0.05
    # local: about 8/s over the fleet while down (a start of one call per process).
    during = [(when, pid) for when, pid, _ in at["local"] if when < up_at]
    span = up_at - down_at
    bound = WORKERS * CHILDREN + LOCAL_RATE * span
    print(f"local: {len(during)} calls in {span:.1f} s down (bound {bound:.1f})")
    assert len(during) <= bound
    # Not failing closed: a good part of the local rate ran (a third: the children spend
    # ~2 s on other tasks first, and a loaded host runs them late).
    assert len(during) >= 0.33 * LOCAL_RATE * (span - 2.5)
    per_pid = collections.Counter(pid for _, pid in during)
    assert max(per_pid.values()) <= 1 + LOCAL_RATE / (WORKERS * CHILDREN) * span

    # One warning per outage per worker, and one "back". An outage ends once Redis has
    # taken a worker's writes for RECOVERY_S: a worker says so with a task after that,
    # and one whose last tasks ran within it has not yet (tasks until each has said it).
    assert fleet.logs(UNREACHABLE) == [1] * WORKERS
    deadline = time.monotonic() + 30.0
    while fleet.logs(BACK) != [1] * WORKERS and time.monotonic() < deadline:
        time.sleep(RECOVERY_S)
        _results([opened.delay(1000 + i) for i in range(2 * WORKERS * CHILDREN)], 20)
    assert fleet.logs(BACK) == [1] * WORKERS
    assert fleet.logs(UNREACHABLE) == [1] * WORKERS
    # The restarted Redis had no marker: one process of the fleet drained "cold" (plus the
    # drain when the fleet first started on a new Redis).
    assert sum(fleet.logs(COLD)) == 2
    client = fleet.limiter_redis.client()
    drained_at = float(client.get("throttle:{default}:alive") or 0)  # when it was written
    assert drained_at > down_at  # written again after the restart
    refilled = (time.time() - drained_at) * 1.0 + 1.0  # "cold" refills at 60/m
    assert Limiter(client).peek(cold).remaining <= min(refilled, 29.0)
    assert Limiter(client).peek(warm).remaining == 30  # untouched: a fresh, full bucket


def test_broker_killed_and_restarted(fleet: Fleet) -> None:
    """Given a backlog of which part is deferred (5/s) and part shaped at 20/s, when the
    broker (persisting every write) is killed mid-run and comes back 3 s later on the same
    port, then every task runs exactly once: those the workers held when it died come back
    after the visibility timeout (8 s here), those that ran meanwhile are not run again."""
    calls_before = len(fleet.calls())
    # 5/s: 4 children reserve slots up to 0.8 s ahead, beyond sleep_max: re-published,
    # some of them while the broker is down.
    sent = [paced.delay(i) for i in range(25)]
    sent += [plain.delay(i) for i in range(40)]  # 2 s of work at 20/s
    time.sleep(1.0)
    kill(fleet.broker)
    down_at = time.time()
    time.sleep(3.0)
    respawn(fleet.broker)
    up_at = time.time()

    deadline = time.monotonic() + 50
    while time.monotonic() < deadline and not all(r.ready() for r in sent):
        time.sleep(0.5)
    calls = fleet.calls()[calls_before:]
    ran = collections.Counter(tid for *_, tid in calls)
    lost = [r.id for r in sent if r.id not in ran]
    states = collections.Counter(r.state for r in sent)
    during = [when for _, when, *_ in calls if down_at < when < up_at]
    last = max(when for _, when, *_ in calls) - up_at
    print(f"broker down {up_at - down_at:.1f} s: {len(during)} calls meanwhile, the last "
          f"{last:.1f} s after it came back; states {dict(states)}")  # fmt: skip
    assert not lost, f"{len(lost)} tasks never ran: {lost} ({dict(states)})"
    assert max(ran.values()) == 1  # none ran twice
    assert states == {"SUCCESS": len(sent)}
    # Nothing left for a later redelivery (kombu's Redis transport keeps the messages a
    # worker holds unacked in the hash "unacked"; they come back after the visibility
    # timeout, and would run a second time).
    assert fleet.broker.client().hlen("unacked") == 0
    # The releasers could not publish while the broker was away: one warning per worker and
    # failure streak (not a traceback per poll), and each streak said when it ended.
    began = fleet.logs("the releaser cannot release parked tasks (")
    ended = fleet.logs("the releaser releases parked tasks again")
    print(f"releaser failure streaks per worker: {began}")
    assert all(n <= 1 for n in began) and began == ended
    assert fleet.logs("throttle: the releaser") == [
        b + e for b, e in zip(began, ended, strict=True)
    ]
