"""Shadow mode on a real Redis: a limit that records what it would do and delays nothing,
switched to enforce at run time."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import requests
import yaml
from celery import Celery
from celery._state import _task_stack
from celery.worker import state

from tests.support.clock import redis_now_s
from tests.support.eager import close_throttler
from tests.support.events import EventLog
from tests.support.waits import wait_for
from throttle.celery import install, shadow, throttled
from throttle.celery.events import EVERY_S
from throttle.celery.execution import enter_ticket, leave_ticket
from throttle.celery.gate import Gate
from throttle.celery.message import H_DEFERRALS, H_NOT_BEFORE, H_SENT
from throttle.celery.observe import FleetStatsReporter
from throttle.celery.runtime import Throttler
from throttle.celery.shadow import BATCH_S, looks_of, shadow_limit
from throttle.celery.task import gated_call
from throttle.celery.waiting import Undecided, Waiting
from throttle.config import ThrottleConfig
from throttle.decision import Decision
from throttle.errors import ConfigError, Throttled
from throttle.rules import Declared
from throttle.spec import Limit
from throttle.stats import StatsBook
from throttle.upstream import report_upstream

REFRESH_S = 0.2


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    # the Redis as broker too: the shadow's events go there, not to the machine's RabbitMQ
    app = Celery("shadow", broker=redis_url, set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix, "refresh": f"{REFRESH_S}s"},
            "limits": {
                "api": {"algorithm": "gcra", "rate": "10/s", "burst": 1, "mode": "shadow"},
                "other": {"rate": "1000/s"},
            },
            "tasks": {"shadow.call": ["api", "other"], "shadow.only": ["api"]},
        },
    )  # fmt: skip
    yield app
    close_throttler(app)


def enter(app: Celery, task_id: str, headers: dict[str, object] | None = None) -> Gate:
    call = app.tasks["shadow.call"]
    call.push_request(id=task_id, headers=headers or {}, delivery_info={}, called_directly=False)
    try:
        gate = Gate(call, None, call.run, (), {})
        gate.enter()
        return gate
    finally:
        call.pop_request()


def recorded(throttler: Throttler) -> dict[str, dict[str, Any]]:
    """What the fleet stats say of the limits in shadow mode, once this process has sent
    its looks (within shadow.BATCH_S in a worker) and written what it gathered (about once
    a second). Read over the current minute and the one before: a test's looks written
    before a minute's turn are in the bucket of the minute before (each test has a
    namespace of its own, so nothing older is there)."""
    looks_of(throttler).flush()
    for observer in throttler.observer.observers:
        if isinstance(observer, FleetStatsReporter):
            observer.tally.flush()
    return StatsBook(throttler.limiter.client, throttler.limiter.keyspace).shadow(2)


def test_a_limit_in_shadow_records_the_waits_it_would_impose_and_delays_nothing(
    app: Celery,
) -> None:
    @app.task(name="shadow.call", shared=False)
    def call() -> None: ...

    throttler = Throttler.of(app)
    # Given a 10/s burst-1 limit in shadow mode, when 30 tasks arrive at once
    started = redis_now_s(throttler.limiter.client)
    for i in range(30):
        gate = enter(app, f"t{i}")
        # the task waits only for its enforced limit (a roomy one): not for the shadow
        assert [rule.name for rule in gate.execution.rules] == ["other"]
    elapsed = redis_now_s(throttler.limiter.client) - started
    assert elapsed < 1.0  # 30 tasks of a 10/s limit: enforced, 2.9 s at least
    # Then status's numbers say: 29 of 30 would have waited, 0.1 s apart (p50 1.5 s,
    # p95 2.8 s, less the time the loop took, within the buckets' 5 %)
    seen = recorded(throttler)["api"]
    assert (seen["tasks"], seen["delayed"]) == (30, 29)
    assert seen["p50_s"] == pytest.approx(1.5 - elapsed / 2, rel=0.07)
    assert seen["p95_s"] == pytest.approx(2.8 - elapsed, rel=0.07)
    # and the limit's own state was never touched: a task enforced now runs at once
    assert throttler.limiter.peek(throttler.config.rules["api"].limit).remaining == 1.0
    # A task that an enforced limit sent back is not looked at twice
    enter(app, "t0", {H_DEFERRALS: 1})
    assert recorded(throttler)["api"]["tasks"] == 30


def test_an_inline_limit_in_shadow_mode_from_the_decorator(app: Celery) -> None:
    @app.task(name="shadow.inline", shared=False)
    @throttled("10/s burst 1", algorithm="gcra", mode="shadow")
    def inline() -> None: ...

    declared, fn, args, kwargs = gated_call(inline, (), {}) or pytest.fail("not gated")
    throttler = Throttler.of(app)
    # Given @throttled(..., mode="shadow"), when 5 tasks arrive at once, none waits for it
    started = redis_now_s(throttler.limiter.client)
    for i in range(5):
        inline.push_request(id=f"i{i}", headers={}, delivery_info={}, called_directly=False)
        try:
            gate = Gate(inline, declared, fn, args, kwargs)
            gate.enter()
            assert gate.execution.rules == ()
        finally:
            inline.pop_request()
    assert redis_now_s(throttler.limiter.client) - started < 0.3  # enforced: 0.4 s at least
    # and it recorded that 4 of the 5 would have waited
    (rule,) = declared.rules
    assert rule.mode == "shadow"
    seen = recorded(throttler)[rule.name]
    assert (seen["tasks"], seen["delayed"]) == (5, 4)


def test_the_decorator_refuses_a_mode_it_does_not_know() -> None:
    with pytest.raises(ConfigError, match="mode"):
        throttled("10/s", mode="dry-run")(lambda: None)


@pytest.mark.parametrize("algorithm", ["sliding_window", "fixed_window"])
def test_a_window_in_shadow_counts_a_backlog_s_place_not_only_the_window_s_opening(
    redis_url: str, prefix: str, algorithm: str
) -> None:
    """A window cannot reserve: each look it denies was told when the window frees (at
    most a period or two away), so a backlog read as delayed by under 2 s whatever its
    length. Enforced, the backlog drains at the window's rate."""
    app = Celery("shadow", broker=redis_url, set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix, "refresh": f"{REFRESH_S}s"},
            "limits": {
                "api": {"algorithm": algorithm, "rate": "10/s", "mode": "shadow"},
                "other": {"rate": "1000/s"},
            },
            "tasks": {"shadow.call": ["api", "other"]},
        },
    )  # fmt: skip
    try:

        @app.task(name="shadow.call", shared=False)
        def call() -> None: ...

        throttler = Throttler.of(app)
        # Given a 10/s window in shadow mode, when 100 tasks arrive at once
        started = redis_now_s(throttler.limiter.client)
        for i in range(100):
            enter(app, f"t{i}")
        elapsed = redis_now_s(throttler.limiter.client) - started
        # Then status says what enforcement would do: the window's 10 (20 if the arrivals
        # straddle a fixed window's edge) run at once, the others in turn at 10/s, the
        # last about 9 s later (p50 of the delayed about 4.5 s, p95 about 8.5 s, less the
        # time the loop took), not the under 2 s of the window's next opening
        seen = recorded(throttler)["api"]
        assert seen["tasks"] == 100
        assert 75 <= seen["delayed"] <= 90
        assert seen["p50_s"] is not None and seen["p95_s"] is not None
        assert 3.5 - elapsed <= seen["p50_s"] <= 5.5
        assert 7.0 - elapsed <= seen["p95_s"] <= 9.5
    finally:
        close_throttler(app)


def test_a_window_in_shadow_delays_nothing_its_window_admits() -> None:
    """A look the window twin admits counts no wait, whatever the pacing twin says: a
    fixed window admits its count again at each edge, at once. A fair limit's look
    counts the later of its twins' answers, admitted or not."""
    window = Limit.parse("10/s", name="w", algorithm="fixed_window")
    fair = Limit.parse("10/s", name="f", fair=True)
    admitted = Decision(True, 0.0, 0.0, 1.0, 0.0, ())
    paced = Decision(True, 0.0, 0.0, 1.0, 0.9, ())
    denied = Decision(False, 0.0, 0.4, 1.0, 0.0, ())
    assert shadow._would_wait(window, [admitted, paced]) == 0.0
    assert shadow._would_wait(window, [denied, paced]) == 0.9
    assert shadow._would_wait(window, [denied, admitted]) == 0.4
    assert shadow._would_wait(fair, [admitted, paced]) == 0.9
    assert shadow._would_wait(fair, [denied, admitted]) == 0.4
    gcra = Limit.parse("10/s", name="g", algorithm="gcra")
    assert shadow._would_wait(gcra, [paced]) == 0.9
    assert [twin.algorithm.value for twin in shadow.twins_of(window)] == ["fixed_window", "gcra"]
    assert [twin.fair for twin in shadow.twins_of(fair)] == [True, False]
    assert len(shadow.twins_of(gcra)) == 1


def test_a_fair_limit_in_shadow_counts_a_flood_s_turn_beyond_its_plan_s_reach(
    redis_url: str, prefix: str
) -> None:
    """A fair limit books nothing beyond its near horizon and sends a key's waiting tasks
    back at most about 3 s ahead: a look at its twin alone read a flood of one tenant as
    delayed by at most that. Enforced, the flood drains at the limit's rate."""
    app = Celery("shadow", broker=redis_url, set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix, "refresh": f"{REFRESH_S}s"},
            "limits": {
                "api": {
                    "rate": "20/s", "key": "{tenant}", "fair": True, "mode": "shadow",
                    "plan": "{plan}", "plans": {"free": 1, "pro": 4},
                },
            },
            "tasks": {"shadow.tenant": ["api"]},
        },
    )  # fmt: skip
    try:

        @app.task(name="shadow.tenant", shared=False)
        def tenant_task(tenant: str, plan: str) -> None: ...

        throttler = Throttler.of(app)
        # Given a 20/s fair limit in shadow mode, when one tenant sends 200 tasks at once
        started = redis_now_s(throttler.limiter.client)
        for i in range(200):
            tenant_task.push_request(
                id=f"f{i}", headers={}, delivery_info={}, called_directly=False
            )
            try:
                Gate(tenant_task, None, tenant_task.run, ("acme", "pro"), {}).enter()
            finally:
                tenant_task.pop_request()
        elapsed = redis_now_s(throttler.limiter.client) - started
        # Then status says what enforcement would do: its burst of 20 at once, the others
        # in turn at 20/s, the last about 9 s later (enforced, measured on a worker: p50
        # 4.2 s, p95 8.6 s), not at most the 3 s of the fair plan's reach
        seen = recorded(throttler)["api"]
        assert seen["tasks"] == 200
        assert seen["delayed"] >= 170
        assert seen["p50_s"] is not None and seen["p95_s"] is not None
        assert 3.5 - elapsed <= seen["p50_s"] <= 5.5
        assert 7.0 - elapsed <= seen["p95_s"] <= 9.5
    finally:
        close_throttler(app)


def test_a_task_does_not_wait_for_its_look_which_a_thread_sends_soon_after(
    app: Celery,
) -> None:
    @app.task(name="shadow.call", shared=False)
    def call() -> None: ...

    throttler = Throttler.of(app)
    client = throttler.limiter.client
    twin = shadow_limit(throttler.config.rules["api"].limit)
    twin_key = throttler.limiter.keyspace.state_keys(twin, None)[0]
    with looks_of(throttler)._writing:  # the timer cannot send while the tasks arrive
        # Given 5 tasks of the limit in shadow mode
        for i in range(5):
            enter(app, f"w{i}")
        # Then none of them sent its look (the twin's state is not in Redis yet)
        assert not client.exists(twin_key)
    # and the gatherer's own thread sends them, BATCH_S after the first, with no flush by
    # hand (the Redis clock bounds the wait, generously: a thread on a busy host)
    started = redis_now_s(client)
    while not client.exists(twin_key):
        assert redis_now_s(client) - started < 100 * BATCH_S
        time.sleep(0.005)
    assert recorded(throttler)["api"]["tasks"] == 5


def test_a_look_whose_key_cannot_be_made_is_lost_not_the_task(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """The key is evaluated off the task's path: a call without the key's argument enters
    (as it would fail enforced, the look is lost, logged), and the good looks of the same
    batch are sent."""

    @app.task(name="shadow.keyed", shared=False)
    def keyed(tenant: str = "") -> None: ...

    throttler = Throttler.of(app)
    rule = dataclasses.replace(throttler.config.rules["api"], key="{account}")
    declared = Declared((rule,))
    gates = []
    for i, tenant in enumerate(("acme", "globex")):
        keyed.push_request(id=f"k{i}", headers={}, delivery_info={}, called_directly=False)
        try:
            gate = Gate(keyed, declared, keyed.run, (), {"account": tenant})
            gates.append(gate.enter())
        finally:
            keyed.pop_request()
    keyed.push_request(id="k-bad", headers={}, delivery_info={}, called_directly=False)
    try:  # no "account" argument: the key cannot be made
        bad = Gate(keyed, declared, keyed.run, (), {"tenant": "x"}).enter()
    finally:
        keyed.pop_request()
    assert bad is not None and all(ticket is not None for ticket in gates)
    with caplog.at_level("WARNING", logger="throttle"):
        assert recorded(throttler)["api"]["tasks"] == 2
    assert any("shadow look of task k-bad" in r.getMessage() for r in caplog.records)
    assert bad.shadow == ()
    assert [key for _, (_, key, _) in gates[0].shadow] == ["acme"]


def test_a_task_with_only_limits_in_shadow_goes_to_the_pool_without_waiting_for_a_slot(
    app: Celery,
) -> None:
    @app.task(name="shadow.only", shared=False)
    def only() -> None: ...

    @app.task(name="shadow.call", shared=False)
    def call() -> None: ...

    class Request(SimpleNamespace):  # celery's reserved requests are a WeakSet
        __hash__ = object.__hash__

    # Given a worker's consumer whose one pool slot is taken
    handed: list[Any] = []
    timed: list[tuple[float, Any, tuple[Any, ...]]] = []
    timer = SimpleNamespace(
        call_after=lambda *args, **kwargs: object(),
        call_at=lambda at, fn, args, **kwargs: timed.append((at, fn, args)),
    )
    qos = SimpleNamespace(increment_eventually=lambda: None, decrement_eventually=lambda: None)
    consumer = SimpleNamespace(
        pool=SimpleNamespace(num_processes=1), on_task_request=handed.append, timer=timer,
        qos=qos,
    )  # fmt: skip
    undecided = Undecided(consumer)
    busy = Request(id="busy")
    back = Request(id="back", delivery_info={"routing_key": "celery"}, revoked=lambda: False)
    state.reserved_requests.add(busy)
    try:
        for task in (only, call):
            request = Request(
                id=task.name, delivery_info={"routing_key": "celery"}, request_dict={}
            )
            Waiting(task, consumer, undecided).on_request(request)
        # Then the task whose one limit is in shadow mode went to the pool at once (the
        # pool child's gate looks for it), and the task with a limit in force waits for
        # the slot
        assert [request.id for request in handed] == ["shadow.only"]
        assert [request.id for _, request in undecided.waiting] == ["shadow.call"]
        # When a task with only limits in shadow mode comes back from an upstream's
        # refusal before its time (a parked copy is released up to a poll early)
        before = time.monotonic()
        back.request_dict = {H_NOT_BEFORE: Throttler.of(app).clock.now() + 0.3}
        Waiting(only, consumer, undecided).on_request(back)
        after = time.monotonic()
        # Then the consumer holds it until then, as an ETA task, not the pool
        assert [request.id for request in handed] == ["shadow.only"]
        ((at, release, args),) = timed
        # (the Redis clock runs on this process's monotonic clock: judged on it, exactly)
        assert before + 0.3 - 0.01 <= at <= after + 0.3 + 0.01 and args == (back,)
        release(*args)
        assert [request.id for request in handed] == ["shadow.only", "back"]
    finally:
        state.reserved_requests.difference_update([busy, *handed])
        state.scheduled_requests.discard(back)
        state.requests.pop("back", None)


def test_a_refusal_reported_under_a_limit_in_shadow_holds_its_twin_and_is_recorded(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.task(name="shadow.call", shared=False)
    def call() -> None: ...

    throttler = Throttler.of(app)
    refused = requests.Response()
    refused.status_code, refused.headers["Retry-After"] = 429, "5"
    # (the twins' hold comes 2 s after the refusal here, not 60 ms: a loaded host may take
    # longer than 60 ms between two lines of this test)
    monkeypatch.setattr(shadow, "HOLD_AFTER_S", 2.0)
    # Given another process (a throttler of its own) that gathered the look of a task
    # that arrived just before the refusal, and has not sent it yet
    other_app = Celery("shadow", broker=app.conf.broker_url, set_as_current=False)
    other_app.conf.update(throttle_redis_url=app.conf.throttle_redis_url,
                          throttle_config=app.conf.throttle_config)  # fmt: skip

    @other_app.task(name="shadow.call", shared=False)
    def other_call() -> None: ...

    other = Throttler.of(other_app)
    enter(other_app, "t-before")
    # and a task with a limit in force and one in shadow mode, running on its ticket
    call.push_request(id="t-429", headers={}, delivery_info={}, called_directly=False)
    _task_stack.push(call)
    try:
        ticket = Gate(call, None, call.run, (), {}).enter()
        assert ticket is not None and [rule.name for rule, _ in ticket.shadow] == ["api"]
        token = enter_ticket(ticket)
        try:
            # When the body reports a 429 for the limit in shadow mode
            with pytest.raises(Throttled):
                report_upstream(refused, limit="api", retry=True)
        finally:
            leave_ticket(token)
    finally:
        _task_stack.pop()
        call.pop_request()
    # Then the task is to come back after the API's 5 s (no slot of the limit to take)
    assert ticket.refusal is not None
    assert (ticket.refusal.countdown_s, ticket.refusal.limits) == (5.0, ("api",))
    # and the other process's look, sent after the refusal, counts the limit's spacing
    # (10/s burst 1: this task's look, sent first, took the twin's slot), not the
    # upstream's 5 s: the twin's hold is placed once every process has sent the looks it
    # gathered before it
    assert ("api.shadow", None) not in throttler.limiter.holds()
    try:
        seen = recorded(other)["api"]
        assert seen["tasks"] == 1 and (seen["p95_s"] or 0.0) < 1.0, seen
    finally:
        close_throttler(other_app)
    # then its shadow twin is held as the limit would be, the limit itself not, until the
    # upstream's time from the refusal
    holds = wait_for(throttler.limiter.holds, timeout_s=10)
    assert ("api.shadow", None) in holds and not any(name == "api" for name, _ in holds)
    assert 0.0 < holds[("api.shadow", None)] <= 3.0 + 0.01  # 5 s from the refusal
    # and the refusal is in the record under the limit's name, with the task's id
    (entry,) = throttler.refusals.read("api")
    assert (entry.task_id, entry.status, entry.held) == ("t-429", 429, False)
    # and of the two looks, one counts the other's spacing, none the upstream's time
    seen = recorded(throttler)["api"]
    assert (seen["tasks"], seen["delayed"]) == (2, 1) and seen["p95_s"] < 1.0, seen


def test_shadow_events_reach_an_event_receiver_in_one_message(app: Celery) -> None:
    @app.task(name="shadow.call", shared=False)
    def call() -> None: ...

    log = EventLog(app, "task-shadowed")
    client = Throttler.of(app).limiter.client
    try:
        # Given 30 tasks at once of a 10/s burst-1 limit in shadow mode
        started = redis_now_s(client)
        for i in range(30):
            enter(app, f"e{i}")
        elapsed = redis_now_s(client) - started
    finally:
        # Then the 29 it would have delayed sent one task-shadowed event each, which
        # Celery's receiver reads one by one (events of other tests' tasks may come too:
        # the broker is shared)
        ours = log.wait_for(29, where=lambda event: event["uuid"].startswith("e"))
    assert sorted(event["uuid"] for event in ours) == sorted(f"e{i}" for i in range(1, 30))
    # out of one message, a batch sent within EVERY_S of its first event (one more per
    # EVERY_S the 30 tasks took, on a slow host)
    carriers = [
        body for body in log.messages
        if any(e["uuid"].startswith("e") for e in (body if isinstance(body, list) else [body]))
    ]  # fmt: skip
    assert len(carriers) <= 1 + int(elapsed / EVERY_S)
    assert all(isinstance(body, list) for body in carriers)
    event = ours[-1]
    assert (event["name"], event["limits"]) == ("shadow.call", ["api"])
    assert event["waits"][0] > 0 and event["pid"] and event["clock"]


def test_a_would_be_wait_counts_from_the_send_on_the_redis_clock(app: Celery) -> None:
    @app.task(name="shadow.call", shared=False)
    def call() -> None: ...

    throttler = Throttler.of(app)
    # Given 10 tasks sent 4 s ago (Redis clock) that a worker takes only now
    sent = redis_now_s(throttler.limiter.client) - 4.0
    started = redis_now_s(throttler.limiter.client)
    for i in range(10):
        enter(app, f"s{i}", {H_SENT: sent})
    elapsed = redis_now_s(throttler.limiter.client) - started
    seen = recorded(throttler)["api"]
    # Then the first, whose slot is free, would not have waited (its 4 s in the queue are
    # not the limit's); the other 9 would have run 0.1 s apart from the first's arrival,
    # which is 4 s after their send, plus up to the loop's time: p50 4 + 0.5, p95 4 + 0.9
    # (within the buckets' 5 %)
    assert (seen["tasks"], seen["delayed"]) == (10, 9)
    assert 4.5 * 0.95 <= seen["p50_s"] <= (4.5 + elapsed) * 1.05
    assert 4.9 * 0.95 <= seen["p95_s"] <= (4.9 + elapsed) * 1.05


def test_a_producer_stamps_its_tasks_with_the_send_time_on_the_redis_clock(
    app: Celery, redis_url: str
) -> None:
    # Given an installed app whose broker is a Redis
    app.conf.broker_url = redis_url
    install(app)

    @app.task(name="shadow.call", shared=False)
    def call() -> None: ...

    queue = f"shadow-stamp-{time.monotonic_ns()}"
    client = redis.Redis.from_url(redis_url)
    try:
        # When a task is sent, and one that carries a send time already (re-published)
        before = redis_now_s(client)
        call.apply_async(queue=queue)
        call.apply_async(queue=queue, headers={H_SENT: 12.5})
        after = redis_now_s(client)
        stamped = [json.loads(raw)["headers"][H_SENT] for raw in client.lrange(queue, 0, -1)]
        client.delete(queue)
    finally:
        client.close()
        app.close()  # the producer's broker connections
    # Then the first is stamped with the Redis clock at the send, the second kept its own
    assert sorted(stamped) == [
        12.5,
        pytest.approx((before + after) / 2, abs=(after - before) / 2 + 0.05),
    ]


def test_enforce_at_run_time_reaches_the_workers_within_refresh(app: Celery) -> None:
    @app.task(name="shadow.call", shared=False)
    def call() -> None: ...

    throttler = Throttler.of(app)
    assert [r.name for r in enter(app, "a").rule_set.shadow] == ["api"]
    operator = Throttler.of(app).rates.__class__(
        throttler.limiter.client, throttler.limiter.keyspace
    )
    operator.set_mode("api", "enforce")
    time.sleep(REFRESH_S + 0.05)
    gate = enter(app, "b")
    assert gate.rule_set.shadow == ()
    assert [rule.name for rule in gate.execution.rules] == ["api", "other"]
    assert operator.modes() == {"api": "enforce"}
    operator.set_mode("api", None)  # back to the file's: shadow
    time.sleep(REFRESH_S + 0.05)
    assert [r.name for r in enter(app, "c").rule_set.shadow] == ["api"]


@pytest.mark.parametrize(
    ("document", "where"),
    [
        ({"limits": {"pool": {"rate": "3 concurrent", "mode": "shadow"}}},
         "limit 'pool': field 'mode': a concurrency limit cannot run in shadow"),
        ({"limits": {"api": {"rate": "3/s", "mode": "dry-run"}}},
         "limit 'api': field 'mode': must be 'enforce'"),
        ({"settings": {"mode": "off"}}, "field 'settings.mode': must be 'enforce' or 'shadow'"),
    ],
)  # fmt: skip
def test_a_bad_mode_names_its_place(tmp_path: Path, document: object, where: str) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(yaml.safe_dump(document))
    (error,) = ThrottleConfig.check(path)
    assert str(error).startswith(f"{path}: {where}")
