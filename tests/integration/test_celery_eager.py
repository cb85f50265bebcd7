"""Eager mode, direct calls and the in-process API of throttle.celery (no worker needed)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Any

import pytest
import redis
from celery import Celery

from tests.support.clock import redis_now_s
from tests.support.eager import close_throttler
from tests.support.publishes import script_calls as served_scripts
from tests.support.servers import RedisServer
from throttle import BackendUnavailable, ConfigError, Limit, Limiter, Throttled, ThrottleTimeout
from throttle.celery import ThrottledTask, Throttler, report_cost, slot_time, throttled
from throttle.celery.execution import current_ticket
from throttle.celery.runtime import unknown_limits
from throttle.config import ThrottleConfig
from throttle.limiter import DEFAULT_LEASE_S
from throttle.testing import upstream_response
from throttle.upstream import report_upstream


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery("eager", set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        task_always_eager=True,
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {
                "five": {"algorithm": "gcra", "rate": "5/s", "burst": 1},
                "hourly": {"algorithm": "gcra", "rate": "1/h", "burst": 1, "max_wait": "1s"},
                "budget": {"rate": "1000/d", "key": "{tenant}", "cost": "estimate"},
                "pair": {"rate": "2 concurrent"},
                "minute": {"rate": "100/m", "key": "{tenant}", "cost": "estimate"},
            },
            "tasks": {"eager.mapped": ["five"]},
        },
    )
    yield app
    close_throttler(app)


def count_acquires(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = Limiter.acquire_many

    def spy(self: Limiter, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Limiter, "acquire_many", spy)
    return calls


def test_eager_tasks_wait_for_their_slot_without_spinning(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.task(shared=False)
    @throttled("five")
    def ping(x: int) -> int:
        return x

    calls = count_acquires(monkeypatch)
    started = time.monotonic()
    assert [ping.delay(i).get() for i in range(6)] == list(range(6))
    elapsed = time.monotonic() - started
    # 5/s burst 1: the 6th call comes 1 s after the first, and each call asked Redis once
    # (a reservation and one sleep), not in a loop.
    assert elapsed >= 0.95
    assert calls[0] == 6


def test_a_deadline_in_eager_mode_raises_throttle_timeout(app: Celery) -> None:
    @app.task(shared=False)
    @throttled("hourly")
    def once(x: int) -> int:
        return x

    assert once.delay(1).get() == 1
    started = time.monotonic()
    with pytest.raises(ThrottleTimeout, match="hourly would admit the task in") as caught:
        once.delay(2).get()
    assert time.monotonic() - started < 0.5  # known at once: the slot is an hour away
    # the limit's own wait (about an hour), not the pause_recheck it is slept in steps of
    assert caught.value.needed_s > 3000


@pytest.mark.parametrize("max_wait", [None, "10s"])
def test_an_eager_task_denied_a_concurrency_unit_runs_when_one_comes_back(
    redis_url: str, prefix: str, max_wait: str | None
) -> None:
    # Given 2 concurrent units beside a 5/s limit (a unit's lease names 360 s), and three
    # eager calls at once that each hold a unit 0.5 s
    units: dict[str, Any] = {"rate": "2 concurrent"}
    if max_wait is not None:
        units["max_wait"] = max_wait
    app = Celery("eager-units", set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        task_always_eager=True,
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {"units": units, "five": {"algorithm": "gcra", "rate": "5/s"}},
        },
    )

    @app.task(shared=False)
    @throttled("five", "units")
    def hold(x: int) -> float:
        time.sleep(0.5)
        return redis_now_s(redis.Redis.from_url(redis_url))

    try:
        with ThreadPoolExecutor(3) as pool:
            started = redis_now_s(redis.Redis.from_url(redis_url))
            results = list(pool.map(lambda i: hold.apply((i,)).result, range(3)))
        assert all(isinstance(end, float) for end in results), results  # no ThrottleTimeout
        ends = sorted(results)
        # Then the third runs once a unit comes back (looked for from 50 ms, doubling),
        # not after pause_recheck (30 s), and is not timed out for the lease's 360 s
        assert ends[1] - started < 1.5, (started, ends)
        assert ends[2] - ends[0] < 2.0, (started, ends)
    finally:
        close_throttler(app)


def test_an_eager_task_that_waits_for_a_unit_past_its_deadline_names_no_made_up_time(
    app: Celery,
) -> None:
    done = threading.Event()

    @app.task(shared=False)
    @throttled("pair", max_wait=0.3)
    def hold(x: int) -> int:
        done.wait(30)
        return x

    # Given both units of "pair" (2 concurrent) held, a third call with 0.3 s to wait
    # times out, and says that no time is known (not the 1 s it rechecks every)
    pair = Throttler.of(app).config.rule("pair").limit
    with ThreadPoolExecutor(2) as pool:
        holders = [pool.submit(lambda i=i: hold.apply((i,)).result) for i in range(2)]
        try:
            deadline = time.monotonic() + 30
            while Throttler.of(app).limiter.peek(pair).remaining > 0:  # both bodies started
                assert time.monotonic() < deadline, "the two holders never took the units"
                time.sleep(0.01)
            with pytest.raises(
                ThrottleTimeout, match="pair did not admit the task by its deadline"
            ):
                hold.apply((3,), throw=True).get()
        finally:
            done.set()
        assert sorted(h.result() for h in holders) == [0, 1]


def test_an_eager_task_on_a_paused_limit_waits_to_its_deadline_for_a_resume(app: Celery) -> None:
    @app.task(shared=False)
    @throttled("five", max_wait=1.5)
    def call(x: int) -> int:
        return x

    limiter = Throttler.of(app).limiter
    # Given a paused limit (no end known), a task whose deadline is 1.5 s away fails at
    # its deadline, not at once
    limiter.hold("five")
    started = time.monotonic()
    with pytest.raises(ThrottleTimeout, match="no time is known when they will"):
        call.delay(1).get()
    assert time.monotonic() - started >= 1.4
    # and one whose limit is resumed meanwhile runs
    threading.Timer(0.3, limiter.unhold, ("five",)).start()
    assert call.delay(2).get() == 2


def test_direct_calls_and_task_names_mapped_in_the_file(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not decorated: the file's `tasks:` maps this task's name to limit "five".
    @app.task(name="eager.mapped", shared=False)
    def mapped(x: int) -> int:
        return x

    calls = count_acquires(monkeypatch)
    assert mapped(1) == 1  # a direct call goes through the limiter too
    assert mapped.apply((2,)).get() == 2
    assert calls[0] == 2


def test_report_cost_settles_the_estimate(
    app: Celery, redis_url: str, prefix: str, client: redis.Redis
) -> None:
    @app.task(shared=False)
    @throttled("budget")
    def call(tenant: str, estimate: int, used: int) -> float | None:
        report_cost(used)
        return slot_time()

    started = redis_now_s(client)
    assert call.delay("acme", 300, 120).get() == pytest.approx(time.time(), abs=1)
    limiter = Throttler.of(app).limiter
    budget = Throttler.of(app).config.rule("budget").limit
    remaining = limiter.acquire(budget, "acme", cost=0).remaining
    # 880 plus what 1000/d refilled meanwhile, on the Redis clock (0.01 per second: more
    # than approx's tolerance after 76 ms, which a loaded host can take)
    refilled = (redis_now_s(client) - started) * 1000 / 86400
    assert 880 - 1e-3 <= remaining <= 880 + refilled + 1e-3


def test_report_cost_settles_a_direct_call_and_names_what_it_refuses(
    app: Celery, client: redis.Redis
) -> None:
    @app.task(shared=False)
    @throttled("budget")
    def call(tenant: str, estimate: int, used: float, limit: str | None = None) -> float:
        report_cost(used, limit=limit)
        return used

    limiter = Throttler.of(app).limiter
    budget = Throttler.of(app).config.rule("budget").limit
    started = redis_now_s(client)
    # A direct call settles its estimate too
    assert call("direct", 300, 120) == 120
    remaining = limiter.acquire(budget, "direct", cost=0).remaining
    refilled = (redis_now_s(client) - started) * 1000 / 86400
    assert 880 - 1e-3 <= remaining <= 880 + refilled + 1e-3
    # Any real number: a Decimal (a price), a Fraction
    from decimal import Decimal  # noqa: PLC0415
    from fractions import Fraction  # noqa: PLC0415

    assert call("exact", 300, Decimal("120.5")) == Decimal("120.5")
    assert call("exact", 300, Fraction(1, 2)) == Fraction(1, 2)
    # A misspelt limit, a cost no limit could settle: the body fails, naming them
    with pytest.raises(ValueError, match="no limit 'budgt'; its limits: 'budget'"):
        call.apply(("acme", 10, 1), {"limit": "budgt"}).get()
    with pytest.raises(ValueError, match="of limit 'budget' needs a number from 0 to 1e"):
        call.apply(("acme", 10, 1e30), {"limit": "budget"}).get()


def test_a_cost_the_limiter_refuses_is_settled_as_reserved_and_frees_its_unit(
    app: Celery,
) -> None:
    @app.task(shared=False)
    @throttled("pair", "budget")
    def call(tenant: str, estimate: int) -> str:
        ticket = current_ticket()
        assert ticket is not None
        ticket.reported["budget"] = 1e30  # past report_cost's own check
        return "done"

    # The body's result stands, and the concurrency unit comes back at once: the next
    # two calls find both units free (not one, until the lease ended)
    assert call.apply(("acme", 10)).get() == "done"
    pair = Throttler.of(app).config.rule("pair").limit
    assert Throttler.of(app).limiter.peek(pair).remaining == 2


def test_a_refused_cost_leaves_the_other_limits_reports_settled(
    app: Celery, client: redis.Redis
) -> None:
    @app.task(shared=False)
    @throttled("budget", "minute")
    def call(tenant: str, estimate: int) -> str:
        ticket = current_ticket()
        assert ticket is not None
        ticket.reported["budget"] = 1e30  # past report_cost's own check: refused
        ticket.reported["minute"] = 10  # a refund of 40: taken
        return "done"

    started = redis_now_s(client)
    assert call.apply(("refused", 50)).get() == "done"
    throttler = Throttler.of(app)
    budget = throttler.config.rule("budget").limit
    minute = throttler.config.rule("minute").limit
    # budget settled as reserved (50 of 1000), minute at what was reported (10 of 100),
    # give or take what each refilled since (on the Redis clock)
    elapsed = redis_now_s(client) - started
    budget_left = throttler.limiter.peek(budget, "refused").remaining
    minute_left = throttler.limiter.peek(minute, "refused").remaining
    assert 950 - 1e-3 <= budget_left <= 950 + elapsed * 1000 / 86400 + 1e-3
    assert 90 - 1e-3 <= minute_left <= 90 + elapsed * 100 / 60 + 1e-3


def test_base_class_with_its_own_limits(app: Celery) -> None:
    class Shaped(ThrottledTask):  # type: ignore[misc]
        throttle = ("2/s burst 1",)

    @app.task(base=Shaped, shared=False)
    def shaped(x: int) -> int:
        return x

    started = time.monotonic()
    assert [shaped.delay(i).get() for i in range(3)] == [0, 1, 2]
    assert time.monotonic() - started >= 0.95  # 2/s burst 1: the third at +1 s


def test_outside_a_task_the_function_is_plain_and_report_cost_is_a_no_op() -> None:
    @throttled("10/s")
    def plain(x: int) -> int:
        report_cost(5)
        return x * 2

    assert plain(21) == 42
    assert slot_time() is None
    with pytest.raises(ValueError, match="a number from 0 to 1e"):
        report_cost(-1)
    # Not a bool (True is no cost of 1), nor a Fraction beyond a float (ValueError, not
    # OverflowError)
    with pytest.raises(ValueError, match="a number from 0 to 1e"):
        report_cost(True)
    with pytest.raises(ValueError, match="a number from 0 to 1e"):
        report_cost(Fraction(10**400))


def test_throttled_above_app_task_is_refused_at_import() -> None:
    # Above @app.task it would wrap the task object: the task would run unthrottled
    app = Celery("order")
    for finalized in (False, True):
        if finalized:
            app.finalize()

        def double(x: int) -> int:
            return 2 * x

        task = app.task(double, name=f"order.double{finalized}")
        with pytest.raises(ConfigError, match=r"goes under @app\.task"):
            throttled("10/s")(task)


def test_throttled_without_parentheses_is_refused_at_import() -> None:
    # Bare, the function comes as a limit, and @app.task would register the decorator's
    # inner function under its name ("decorate"), failing at the first call
    app = Celery("bare", set_as_current=False)
    with pytest.raises(ConfigError, match=r"in parentheses: @throttled\('api'\)") as caught:

        @app.task(shared=False)
        @throttled
        def bare(x: int) -> int:
            return x

    assert "bare" in str(caught.value)
    assert not [name for name in app.tasks if name.endswith("decorate")]


def test_celerys_own_tasks_under_an_app_wide_throttled_task_need_no_limiter() -> None:
    # Given task_cls=ThrottledTask, and no Redis for the limiter anywhere (a memory
    # broker; the env's THROTTLE_REDIS_URL left out)
    app = Celery("nourl", set_as_current=False, task_cls=ThrottledTask, broker="memory://")
    app.conf.update(task_always_eager=True, throttle_config={"limits": {}})
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("THROTTLE_REDIS_URL", raising=False)

        # Then Celery's own tasks run: celery.ping, what a test worker's start checks
        # (as celery.contrib.testing.tasks defines it)
        @app.task(name="celery.ping", shared=False)
        def ping() -> str:
            return "pong"

        assert ping.delay().get() == "pong"
        assert app.tasks["celery.backend_cleanup"].delay().get() is None

        # and so do the app's tasks that no limit can apply to (none declared, none in
        # the file by name or queue)
        @app.task(shared=False)
        def own() -> int:
            return 1

        assert own.delay().get() == 1

        # while a task with a limit still says what is missing
        @app.task(shared=False)
        @throttled("2/s")
        def limited() -> int:
            return 2

        with pytest.raises(ConfigError, match="no Redis for the limiter"):
            limited.delay().get()
    close_throttler(app)


def test_keys_and_costs_from_callables_and_argument_errors(app: Celery) -> None:
    seen: list[str] = []

    def tenant_of(order: dict[str, Any], **_: Any) -> str:
        seen.append(order["tenant"])
        return order["tenant"]

    @app.task(shared=False)
    @throttled("3/h burst 3", key=tenant_of, cost=lambda order, **_: len(order["items"]))
    def place(order: dict[str, Any]) -> int:
        return len(order["items"])

    assert place.delay({"tenant": "acme", "items": [1, 2]}).get() == 2
    assert place.delay({"tenant": "globex", "items": [1, 2, 3]}).get() == 3
    assert seen == ["acme", "globex"]
    limiter = Throttler.of(app).limiter
    rule = _rule_of(place)
    assert limiter.acquire(rule, "acme", cost=0).remaining == pytest.approx(1, abs=0.01)
    assert limiter.acquire(rule, "globex", cost=0).remaining == pytest.approx(0, abs=0.01)

    @app.task(shared=False)
    @throttled("budget")  # key "{tenant}": this task has no such argument
    def keyless(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match=r"limit 'budget': field 'key': the task has no "
                       r"argument 'tenant' for the key template"):  # fmt: skip
        keyless.delay(1).get()


def _rule_of(task: Any) -> Limit:
    spec = task.run.__throttle__
    return spec.rules[0].limit


def test_on_redis_down_allow_runs_and_defer_raises(prefix: str) -> None:
    from tests.support.servers import free_port  # noqa: PLC0415

    app = Celery("down", set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        task_always_eager=True,
        throttle_redis_url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {
                "open": {"rate": "5/s", "on_redis_down": "allow"},
                "closed": {"rate": "5/s"},
            },
        },
    )

    @app.task(shared=False)
    @throttled("open")
    def fail_open(x: int) -> int:
        return x

    @app.task(shared=False)
    @throttled("closed")
    def fail_closed(x: int) -> int:
        return x

    @app.task(shared=False)
    @throttled("open")
    def refused() -> None:
        # What a client makes of the hook's exception while the limiter fails open: the
        # task still comes back for the refusal (eager mode: Throttled), not fail with it.
        try:
            report_upstream(upstream_response(retry_after_s=3.0), retry=True)
        except Throttled as exc:
            raise RuntimeError("the client's own error") from exc

    assert fail_open.delay(7).get() == 7
    with pytest.raises(Throttled, match=r"retry after 3\.000 s"):
        refused.delay().get()
    with pytest.raises(BackendUnavailable, match="Redis is unreachable"):
        fail_closed.delay(7).get()
    close_throttler(app)


def test_waits_held_by_workers_must_stay_under_the_visibility_timeout(app: Celery) -> None:
    # The default settings hold a task up to park_after 1 s + park_lead 0.5 s + sleep_max 1 s
    app.conf.broker_transport_options = {"visibility_timeout": 4}
    with pytest.raises(ConfigError, match=r"held 2.5 s in a worker .* visibility_timeout \(4 s\)"):
        Throttler.from_app(app).check_visibility()
    app.conf.broker_transport_options = {"visibility_timeout": 3600}
    Throttler.from_app(app).check_visibility()


def test_shared_tasks_are_throttled_too(redis_url: str, prefix: str) -> None:
    from celery import shared_task  # noqa: PLC0415
    from celery._state import get_current_app  # noqa: PLC0415

    # A shared task runs on whichever app is current: make a fresh one current.
    previous = get_current_app()
    app = Celery("shared", task_cls=ThrottledTask)
    app.conf.update(throttle_redis_url=redis_url, throttle_config={"settings": {"prefix": prefix}})
    app.set_current()
    try:

        @shared_task(name="eager.shared")
        @throttled("5/s burst 1", algorithm="gcra")
        def shared(x: int) -> int:
            return x

        started = time.monotonic()
        assert [shared.apply((i,)).get() for i in range(3)] == [0, 1, 2]
        assert time.monotonic() - started >= 0.35  # 5/s burst 1: the third at +0.4 s
    finally:
        previous.set_current()
        close_throttler(app)


# -- round trips: one per admitted task, a settle only when there is something to settle


def script_calls(server: RedisServer) -> int:
    """The limiter's calls the private server has executed so far."""
    client = server.client()
    try:
        return served_scripts(client)
    finally:
        client.close()


@pytest.fixture
def counted(private_redis: RedisServer, prefix: str) -> Iterator[Celery]:
    """An eager app whose limiter is the private server: its INFO commandstats count this
    test's script calls alone."""
    app = Celery("counted", set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        task_always_eager=True,
        throttle_redis_url=private_redis.url,
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {
                "loose": {"rate": "1000/s"},
                "spaced": {
                    "algorithm": "gcra",
                    "rate": "1000/s",
                    "burst": 1,
                    "spacing_guard": False,
                },
                "guarded": {"algorithm": "gcra", "rate": "1000/s", "burst": 1},
                "budget": {"rate": "100000/d", "key": "{tenant}", "cost": "estimate"},
                "refunded": {"rate": "1000/s", "on_error": "refund"},
                "slots": {"algorithm": "concurrency", "rate": "4 concurrent"},
            },
        },
    )
    yield app
    close_throttler(app)


def calls_of_one_run(server: RedisServer, task: Any, *args: Any) -> int:
    """The script calls of one execution of ``task``, after a first one (which loads the
    scripts: a first EVALSHA answered NOSCRIPT, SCRIPT LOAD, EVALSHA again)."""
    task.delay(*args).get()
    before = script_calls(server)
    task.delay(*args).get()
    return script_calls(server) - before


def test_a_fixed_cost_task_makes_one_round_trip(
    counted: Celery, private_redis: RedisServer
) -> None:
    @counted.task(shared=False)
    @throttled("loose", "spaced")
    def fixed(x: int) -> int:
        report_cost(7)  # for every estimated cost: these are fixed, so it changes nothing
        return x

    @counted.task(shared=False)
    @throttled("budget")
    def estimated_kept(tenant: str, estimate: int) -> int:
        return estimate

    # Then one script call each: the acquire, no settle (nothing would change)
    assert calls_of_one_run(private_redis, fixed, 1) == 1
    assert calls_of_one_run(private_redis, estimated_kept, "acme", 5) == 1
    # and the lease record, left unsettled, ends with its lease (+ the slot, here now)
    handle = fixed.delay(2)
    handle.get()
    lease = Throttler.of(counted).limiter.keyspace.lease_key(handle.id)
    redis_client = private_redis.client()
    try:
        assert redis_client.hget(lease, "s") == b"1"
        ttl_s = redis_client.pttl(lease) / 1000
    finally:
        redis_client.close()
    lease_s = DEFAULT_LEASE_S + 60  # deadlines.lease_s without a time limit
    assert lease_s - 5 < ttl_s <= lease_s


def test_the_spacing_guard_costs_one_round_trip(
    counted: Celery, private_redis: RedisServer
) -> None:
    """A burst-1 limit has the call-time spacing guard by default: the acquire, then the
    stamp (lua/space.lua) just before the call; a second such limit adds nothing."""

    @counted.task(shared=False)
    @throttled("guarded")
    def guarded(x: int) -> int:
        return x

    @counted.task(shared=False)
    @throttled("guarded", "spaced", "loose")
    def two(x: int) -> int:
        return x

    assert calls_of_one_run(private_redis, guarded, 1) == 2
    assert calls_of_one_run(private_redis, two, 1) == 2
    stamp = Throttler.of(counted).limiter.keyspace.space_key(
        Throttler.of(counted).config.rules["guarded"].limit, None
    )
    redis_client = private_redis.client()
    try:
        assert redis_client.exists(stamp)
        assert not redis_client.exists(stamp.replace(":guarded:", ":spaced:"))
    finally:
        redis_client.close()


def test_a_reported_cost_a_refund_or_a_concurrency_unit_is_settled_in_one_more(
    counted: Celery, private_redis: RedisServer
) -> None:
    @counted.task(shared=False)
    @throttled("budget")
    def reported(tenant: str, estimate: int) -> int:
        report_cost(estimate / 2)
        return estimate

    @counted.task(shared=False)
    @throttled("loose")
    def named(x: int) -> int:
        report_cost(3, limit="loose")  # by name: applies to a fixed cost too
        return x

    @counted.task(shared=False)
    @throttled("slots", "loose")
    def bounded(x: int) -> int:
        return x

    @counted.task(shared=False)
    @throttled("refunded")
    def failing(x: int) -> int:
        raise ValueError(x)

    @counted.task(shared=False)
    @throttled("loose")
    def failing_kept(x: int) -> int:
        raise ValueError(x)

    assert calls_of_one_run(private_redis, reported, "acme", 100) == 2
    assert calls_of_one_run(private_redis, named, 1) == 2
    assert calls_of_one_run(private_redis, bounded, 1) == 2
    # A body that raised is settled (a refund; or, keeping its cost, to close its record:
    # a retry under the same id must pay for its own call)
    for task in (failing, failing_kept):
        task.apply((0,))
        before = script_calls(private_redis)
        assert task.apply((1,)).failed()
        assert script_calls(private_redis) - before == 2


@pytest.mark.parametrize(
    ("limits", "tolerance_s"),
    [
        pytest.param(["guarded"], 0.05, id="guarded-one-spacing"),
        pytest.param(["guarded", "roomy"], 0.05, id="two-guarded-limits-the-tightest"),
        pytest.param(["guarded", "unguarded"], 0.02, id="one-reserving-limit-unguarded"),
        pytest.param(["bursty"], 0.2, id="burst-above-1-unguarded-its-slack"),  # 4 x 50 ms
        pytest.param(["minutely"], 0.5, id="slow-limit-half-a-sleep-max"),
        pytest.param(["fast"], 0.02, id="spacing-below-late-tolerance"),
        pytest.param(["units"], 0.02, id="concurrency-only-never-too-late"),
    ],
)
def test_a_task_under_guarded_limits_only_keeps_a_slot_up_to_one_spacing_late(
    redis_url: str, prefix: str, limits: list[str], tolerance_s: float
) -> None:
    # Given limits with and without the spacing guard (on by default at burst 1)
    from throttle.celery.gate import Gate  # noqa: PLC0415
    from throttle.rules import targets  # noqa: PLC0415

    app = Celery("tolerance", set_as_current=False, task_cls=ThrottledTask)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix, "late_tolerance": "20ms", "sleep_max": "1s"},
            "limits": {
                "guarded": {"algorithm": "gcra", "rate": "20/s", "burst": 1},
                "roomy": {"algorithm": "gcra", "rate": "10/s", "burst": 1},
                "unguarded": {
                    "algorithm": "gcra", "rate": "20/s", "burst": 1, "spacing_guard": False,
                },
                "bursty": {"rate": "20/s", "burst": 5},
                "minutely": {"algorithm": "gcra", "rate": "1/m", "burst": 1},
                "fast": {"algorithm": "gcra", "rate": "100/s", "burst": 1},
                "units": {"rate": "3 concurrent"},
            },
            "tasks": {"tolerance.call": limits},
        },
    )  # fmt: skip

    @app.task(name="tolerance.call", shared=False)
    def call() -> None: ...

    try:
        # When the gate of an execution of the task weighs how late it may reach its slot
        call.push_request(id="t1")
        try:
            gate = Gate(call, None, call.run, (), {})
            execution = gate.execution
            execution.targets = targets(
                execution.rules, call.run, (), {}, execution.throttler.rates.current
            )
            # Then a task whose reserving limits are all guarded keeps a slot up to one
            # spacing (of the tightest; at most half a sleep_max; at least late_tolerance)
            # late; any other, late_tolerance
            assert gate.late_tolerance() == pytest.approx(tolerance_s)
            # and a task under concurrency limits alone is never too late: a unit has no
            # slot (given up, it would go to a waiting task, and this one be sent back)
            assert gate._too_late(10.0) is (limits != ["units"])
        finally:
            call.pop_request()
    finally:
        close_throttler(app)


def test_a_named_limit_without_any_limits_file_says_that_no_file_is_configured() -> None:
    app = Celery("nofile", set_as_current=False)

    @app.task(shared=False)
    @throttled("github")
    def fetch() -> None: ...

    def of_fetch(config: ThrottleConfig) -> list[ConfigError]:  # shared tasks join any app
        return [error for error in unknown_limits(app, config) if fetch.name in str(error)]

    (error,) = of_fetch(ThrottleConfig())
    assert str(error) == (
        f"task {fetch.name!r} names a limit, but no limits file is configured "
        "(app.conf.throttle_config, or the THROTTLE_CONFIG environment variable) (got 'github')"
    )
    defining = ThrottleConfig.from_source({"limits": {"gh": {"rate": "1/s"}}})
    (error,) = of_fetch(defining)
    assert "names a limit the file does not define; it defines gh" in str(error)
