"""Stocks (throttle/celery/stock.py): while a task's limits have plenty of room, a worker
process takes the units of several tasks in one round trip and its next tasks draw from
them; what they do not use goes back. A real redis-server; the tasks run as a pool child
runs them (not eager, no consumer's decision)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis
from celery import Celery, signals
from celery.exceptions import Ignore, Retry

from tests.support.eager import close_throttler
from tests.support.publishes import script_calls
from tests.support.waits import wait_for
from throttle.celery import report_cost, stock, throttled
from throttle.celery.runtime import Throttler
from throttle.celery.stock import KEYS_MAX
from throttle.testing import upstream_response
from throttle.upstream import report_upstream

BURST = 10_000


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    # A task sent back goes to an in-memory broker.
    app = Celery("stock", broker="memory://", set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            # Roomy, and refilling slowly enough that what was taken can be read back (0.01
            # and 0.1 token a second); an hour of that refill kept in hand (stocks fit in
            # it).
            "settings": {"prefix": prefix, "burst_margin": "1h"},
            "limits": {
                "api": {"algorithm": "gcra", "rate": f"{BURST // 10}/d", "burst": BURST},
                "tokens": {"rate": f"{BURST}/d", "key": "{tenant}", "cost": "tokens"},
                "tight": {"algorithm": "gcra", "rate": "1000/s", "burst": 2},
            },
        },
    )  # fmt: skip
    yield app
    close_throttler(app)


def run(task: object, task_id: str, *args: object, redelivered: bool = False) -> None:
    """Run ``task`` as a pool child runs a message's task."""
    delivery = {"redelivered": True} if redelivered else {}
    task.push_request(  # type: ignore[attr-defined]
        id=task_id, headers={}, delivery_info=delivery, called_directly=False
    )
    try:
        task(*args)  # type: ignore[operator]
    finally:
        task.pop_request()  # type: ignore[attr-defined]


@pytest.fixture
def patient(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stocks that a slow host cannot let lapse: a decision's room, and a stock's units,
    stay usable for 30 s instead of 50 ms (the tests that count round trips)."""
    monkeypatch.setattr(stock, "FRESH_S", 30.0)
    monkeypatch.setattr(Throttler.of(app).stocks, "draw_s", 30.0)


def taken(app: Celery, name: str, key: str | None = None) -> float:
    """What ``name`` has taken now (its capacity less what it has left)."""
    throttler = Throttler.of(app)
    limit = throttler.limiter.limits[name]
    return limit.capacity - throttler.limiter.peek(name, key).remaining


def spent(app: Celery, name: str, key: str | None = None) -> float:
    """What ``name`` has taken once every open stock of this process was given back (as
    it is when the process exits)."""
    Throttler.of(app).stocks.close_all()
    return taken(app, name, key)


def without_stocks(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every task acquires on its own (no margin: no stock fits in it)."""
    monkeypatch.setattr(Throttler.of(app).stocks, "margin_s", 0.0)


def test_roomy_limits_serve_most_tasks_from_a_stock_and_take_exactly_what_ran(
    app: Celery, client: redis.Redis, monkeypatch: pytest.MonkeyPatch, patient: None
) -> None:
    @app.task(name="stock.call", shared=False)
    @throttled("api", "tokens")
    def call(tenant: str, tokens: int) -> None: ...

    before = script_calls(client)
    for i in range(100):
        run(call, f"t{i}", "acme", 7)
    calls = script_calls(client) - before
    # Without stocks, 100 round trips; with them, one a stock (2, 4, 8, 16, 32 tasks...).
    assert calls <= 25, calls
    assert spent(app, "api") == pytest.approx(100, abs=0.5)
    # The same tasks of another tenant, each acquiring on its own, take as much.
    with monkeypatch.context() as patched:
        without_stocks(app, patched)
        before = script_calls(client)
        for i in range(100):
            run(call, f"c{i}", "control", 7)
        assert script_calls(client) - before == 100
    assert spent(app, "tokens", "acme") == pytest.approx(spent(app, "tokens", "control"), abs=1)


def test_what_a_drawn_task_reports_is_what_its_stock_is_settled_at(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.task(name="stock.reported", shared=False)
    @throttled("api", "tokens")
    def reported(tenant: str, tokens: int) -> None:
        report_cost(tokens // 2, limit="tokens")

    for i in range(60):
        run(reported, f"r{i}", "acme", 10)
    # What the last stock's tasks did not draw goes back when its time ends (50 ms)
    wait_for(lambda: taken(app, "api") == pytest.approx(60, abs=0.5), timeout_s=10)
    with monkeypatch.context() as patched:
        without_stocks(app, patched)
        for i in range(60):
            run(reported, f"c{i}", "control", 10)
    assert spent(app, "tokens", "acme") == pytest.approx(spent(app, "tokens", "control"), abs=1)


def test_threads_drawing_from_one_stock_take_each_unit_once(app: Celery) -> None:
    @app.task(name="stock.threads", shared=False)
    @throttled("api")
    def call() -> None:
        time.sleep(0.001)

    def worker(n: int) -> None:
        for i in range(40):
            run(call, f"w{n}-{i}")

    # The task is built on first use (a proxy until the app is finalized): built here, not
    # by eight threads at once, one of which could find it half bound (no request stack).
    app.finalize()
    assert call.request_stack is not None
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert spent(app, "api") == pytest.approx(320, abs=0.5)


def test_a_binding_limit_and_a_redelivered_task_ask_redis_for_each_task(
    app: Celery, client: redis.Redis, patient: None
) -> None:
    @app.task(name="stock.tight", shared=False)
    @throttled("tight")
    def tight() -> None: ...

    @app.task(name="stock.again", shared=False)
    @throttled("api")
    def again() -> None: ...

    before = script_calls(client)
    for i in range(5):
        time.sleep(0.003)  # slots of 1,000/s pass: every task runs at once
        run(tight, f"s{i}")
    assert script_calls(client) - before == 5  # a burst of 2 never has room for a stock

    run(again, "a0")  # leaves room: the next task would take a stock
    before = script_calls(client)
    for i in range(5):
        run(again, f"a{i + 1}", redelivered=True)
    assert script_calls(client) - before == 5


def test_a_hold_this_process_places_ends_its_stock_of_the_limit(
    app: Celery, client: redis.Redis, patient: None
) -> None:
    @app.task(name="stock.refused", shared=False)
    @throttled("api")
    def refused(status: int) -> None:
        if status != 200:
            report_upstream(upstream_response(status=status, retry_after_s=600.0))

    # The first acquires; the second takes a stock of 2, the fourth one of 4.
    for i in range(4):
        run(refused, f"ok{i}", 200)
    before = script_calls(client)
    run(refused, "ok4", 200)
    assert script_calls(client) == before  # drawn from the stock
    run(refused, "no", 429)
    assert Throttler.of(app).limiter.holds()[("api", None)] > 500
    # The next task asks Redis (and is denied), where the stock would have let it run.
    before = script_calls(client)
    with pytest.raises((Retry, Ignore)):  # denied, it comes back after the hold
        run(refused, "after", 200)
    assert script_calls(client) > before


def test_many_keys_seen_once_do_not_grow_what_a_process_remembers(app: Celery) -> None:
    @app.task(name="stock.keys", shared=False)
    @throttled("tokens")
    def keyed(tenant: str, tokens: int) -> None: ...

    for i in range(KEYS_MAX + 100):
        run(keyed, f"k{i}", f"tenant-{i}", 1)
    stocks = Throttler.of(app).stocks
    assert 0 < len(stocks._room) <= KEYS_MAX
    assert len(stocks._size) <= KEYS_MAX


def test_a_process_exiting_gives_its_open_stocks_back(app: Celery, patient: None) -> None:
    @app.task(name="stock.exiting", shared=False)
    @throttled("api")
    def call() -> None: ...

    stocks = Throttler.of(app).stocks  # open until the process exits (patient)
    for i in range(5):  # the first acquires; then stocks of 2 and of 4 (one left)
        run(call, f"e{i}")
    assert stocks._stocks  # one is open, with units not drawn
    # When the pool child exits (as a prefork child sends it; a worker sends
    # worker_shutdown), what was not drawn goes back at once
    signals.worker_process_shutdown.send(sender=None, pid=0, exitcode=0)
    assert not stocks._stocks
    assert taken(app, "api") == pytest.approx(5, abs=0.5)


def test_a_process_exiting_waits_for_the_stock_its_closing_thread_is_settling(
    app: Celery, patient: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    @app.task(name="stock.closing", shared=False)
    @throttled("api")
    def call() -> None: ...

    stocks = Throttler.of(app).stocks
    for i in range(4):  # the first acquires; then two stocks of 2 (one left in the second)
        run(call, f"s{i}")
    assert stocks._stocks
    # Given the closing thread settling a stock that ended (taken out of the book, its
    # round trip not made yet)
    settling, release = threading.Event(), threading.Event()
    real = stocks.limiter.settle

    def slow(*args: object, **kwargs: object) -> object:
        if threading.current_thread().name == "throttle-stocks":
            settling.set()
            release.wait(10)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stocks.limiter, "settle", slow)
    monkeypatch.setattr(stocks, "draw_s", 0.0)
    with stocks._lock:
        for _, open_stock in stocks._ending:
            open_stock.until = 0.0  # ended: the closing thread closes it now
        stocks._wake.notify()
    assert settling.wait(10)
    assert not stocks._stocks
    # When the process exits meanwhile, its exit waits for that settle: the daemon thread
    # would die with the process before its round trip, and the units not drawn with it
    exited = threading.Event()
    threading.Thread(target=lambda: (stocks.close_all(), exited.set()), daemon=True).start()
    assert not exited.wait(0.3)
    release.set()
    assert exited.wait(10)
    assert taken(app, "api") == pytest.approx(4, abs=0.5)
