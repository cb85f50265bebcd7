"""The pool child runs a task the worker's consumer decided on the consumer's evaluation of
its rules (:meth:`throttle.celery.gate.Gate.evaluated`, carried in the
:class:`~throttle.celery.execution.Admission`), unless a rate was set at run time since or
the rules it finds are not the ones the consumer evaluated; and a task that waited in the
consumer's line is evaluated again when it asks (the rates in force then)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context
from celery.worker import state
from celery.worker.request import Request
from kombu import Message
from kombu.utils.json import dumps

import throttle.celery.comeback as comeback_module
import throttle.celery.gate as gate_module
from tests.support.eager import close_throttler
from throttle.celery import throttled
from throttle.celery.execution import ADMISSION_KEY, Admission
from throttle.celery.gate import Gate
from throttle.celery.runtime import Throttler
from throttle.celery.steps import ThrottleStep
from throttle.celery.waiting import Undecided, Waiting, WaitingLine
from throttle.rates import RateBook
from throttle.spec import Limit

ARGS = ("acme", 500)


@pytest.fixture
def app(redis_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery("adm", set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {
                "requests": {"algorithm": "gcra", "rate": "100/s", "burst": 10},
                "tokens": {"rate": "1000000/d", "key": "{tenant}", "cost": "tokens"},
                "strict": {"algorithm": "gcra", "rate": "2/s", "burst": 1},
            },
            "tasks": {"adm.call": ["requests", "tokens"], "adm.strict": ["strict"]},
        },
    )  # fmt: skip

    @app.task(name="adm.call", shared=False)
    def call(tenant: str, tokens: int) -> None: ...

    @app.task(name="adm.strict", shared=False)
    def strict() -> None: ...

    yield app
    close_throttler(app)


def request_of(task_id: str) -> dict[str, Any]:
    return {"id": task_id, "headers": {}, "delivery_info": {}, "called_directly": False,
            "is_eager": False}  # fmt: skip


def consumer_admission(app: Celery, task_id: str) -> Admission:
    """What the consumer carries to the pool child (as ``Waiting.ask`` builds it)."""
    call = app.tasks["adm.call"]
    request = Context(request_of(task_id))
    gate = Gate(call, None, call.run, ARGS, {}, request=request)
    gate.evaluate()
    decision = gate.admit(near_s=0.25)
    assert decision.allowed
    return Admission(task_id, decision, time.time(), False, *gate.evaluated())


def pool_targets(app: Celery, admission: Admission) -> list[Any]:
    """The targets the pool child's gate runs the task on, entered with ``admission``."""
    call = app.tasks["adm.call"]
    call.push_request(**request_of(admission.task_id))
    try:
        gate = Gate(call, None, call.run, ARGS, {})
        ticket = gate.enter(admission)
        assert ticket is not None and ticket.acquisition == admission.decision.acquisition
        return gate.execution.targets
    finally:
        call.pop_request()


@pytest.fixture
def evaluations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times a gate evaluated rules (``throttle.rules.targets`` calls)."""
    calls: list[int] = []
    real = gate_module.targets

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(gate_module, "targets", counted)
    return calls


def test_the_pool_child_takes_the_consumers_targets(app: Celery, evaluations: list[int]) -> None:
    admission = consumer_admission(app, "t1")
    assert admission.targets is not None
    (requests, _, one), (tokens, key, cost) = admission.targets
    assert (requests.name, one, tokens.name, key, cost) == ("requests", 1.0, "tokens", "acme", 500)
    assert len(evaluations) == 1  # the consumer's
    assert pool_targets(app, admission) == list(admission.targets)
    assert len(evaluations) == 1  # not again in the pool child


def test_a_rate_set_since_the_decision_is_evaluated_again(
    app: Celery, evaluations: list[int]
) -> None:
    admission = dataclasses.replace(consumer_admission(app, "t2"), rates_changed=True)
    assert pool_targets(app, admission)[1][1:] == ("acme", 500)
    assert len(evaluations) == 2


def test_targets_of_other_rules_are_not_taken(app: Celery, evaluations: list[int]) -> None:
    admission = consumer_admission(app, "t3")
    assert admission.targets is not None
    other = Limit.parse("5/s", name="elsewhere")
    changed = dataclasses.replace(admission, targets=((other, None, 1.0), admission.targets[1]))
    found = pool_targets(app, changed)
    assert [limit.name for limit, _, _ in found] == ["requests", "tokens"]
    assert len(evaluations) == 2


def test_a_hold_placed_while_the_consumer_held_the_task_is_looked_for_however_late_the_pool(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a task the consumer admitted about 500 ms ahead of its slot (2/s burst 1, the
    # burst taken) while it did not listen for holds (no line: holds_clear None)
    strict = app.tasks["adm.strict"]
    decided: list[Admission] = []
    for task_id in ("first", "second"):
        request = Context(request_of(task_id))
        gate = Gate(strict, None, strict.run, (), {}, request=request)
        gate.evaluate()
        decided_at = time.time()
        decision = gate.admit(near_s=1.0)
        decided.append(Admission(task_id, decision, decided_at, False, *gate.evaluated()))
    admission = decided[1]
    assert admission.holds_clear is None
    assert admission.decision.wait_s > gate_module.RECHECK_LEAD_S
    # When the upstream's word holds the limit while the consumer holds the task, and the
    # pool starts it only 4 ms before its slot (the hand-over took the rest of the lead)
    Throttler.of(app).limiter.hold("strict", None, 5.0)
    late = dataclasses.replace(
        admission, decided_at=time.time() - (admission.decision.wait_s - 0.004)
    )
    sent_back: list[Any] = []

    def come_back(execution: Any, decision: Any, **_: Any) -> None:
        sent_back.append(decision)
        raise RuntimeError("sent back")

    monkeypatch.setattr(gate_module, "come_back", come_back)
    strict.push_request(**request_of("second"))
    try:
        with pytest.raises(RuntimeError, match="sent back"):
            Gate(strict, None, strict.run, (), {}).enter(late)
    finally:
        strict.pop_request()
    # Then the pool child looked again before the slot: the hold voided it, and the task
    # goes back to wait for the hold's end instead of calling inside it
    assert len(sent_back) == 1 and not sent_back[0].allowed
    assert sent_back[0].retry_after_s > 4.0


class Consumer:
    """The parts of a worker's consumer that :class:`Waiting` uses: a timer that keeps its
    entries (the test serves the line itself), the prefetch count, the hand-over to the
    pool (recorded)."""

    def __init__(self) -> None:
        self.handed: list[Any] = []
        self.timer = self
        self.qos = self
        self.entries: list[Any] = []

    def call_at(self, eta: float, fn: Any, args: Any = (), priority: int = 0) -> Any:
        self.entries.append((eta, fn, args))
        return self.entries[-1]

    def cancel(self, entry: Any) -> None:
        if entry in self.entries:
            self.entries.remove(entry)

    def increment_eventually(self) -> None: ...

    def decrement_eventually(self) -> None: ...

    def on_task_request(self, request: Any) -> None:
        self.handed.append(request)


def received(app: Celery, name: str, args: tuple[Any, ...]) -> Request:
    """A request as the worker's consumer builds it from a message."""
    task_id = f"line-{len(args)}-{time.monotonic_ns()}"
    sent = app.amqp.as_task_v2(task_id, name, args, {})
    message = Message(
        body=dumps(sent.body), headers=sent.headers,
        properties={"correlation_id": task_id, "reply_to": "", "priority": 0},
        delivery_info={"exchange": "", "routing_key": "celery", "redelivered": False},
        content_type="application/json", content_encoding="utf-8",
    )  # fmt: skip
    return Request(message, app=app, hostname="line@test", task=app.tasks[name])


def test_a_task_served_from_the_line_asks_on_the_rates_in_force_then(
    redis_url: str, prefix: str
) -> None:
    app = Celery("line", set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix, "refresh": "0.1s"},
            "limits": {"api": {"algorithm": "gcra", "rate": "1/s", "burst": 1}},
        },
    )  # fmt: skip

    @app.task(name="line.call", shared=False)
    @throttled("api")
    def call(n: int) -> None: ...

    consumer = Consumer()
    line = WaitingLine(consumer, max_wait_s=60.0)
    waiting = Waiting(app.tasks["line.call"], consumer, Undecided(consumer), line)
    requests = [received(app, "line.call", (n,)) for n in range(3)]
    try:
        # Given a task admitted at once, a second denied (its slot 1 s away, beyond the
        # near horizon of 0.25 s) waiting in the line, and a third behind it without asking
        for request in requests:
            waiting.admit(request)
        assert consumer.handed == requests[:1]
        assert len(line.line) == 2
        # When the limit is raised to 100/s while they wait, and the line is served once
        # its block is over (the rate read from the rates' cache, not announced)
        throttler = Throttler.of(app)
        limiter = throttler.limiter
        RateBook(limiter.client, limiter.keyspace).set(throttler.config.rule("api").limit, "100/s")
        time.sleep(1.1)  # past the second one's slot: its block (until 0.25 s before) is over
        line._run()
        # Then both ask on the new rate, and reach the pool with its targets
        assert consumer.handed == requests
        for request in requests[1:]:
            _, admission = request.request_dict[ADMISSION_KEY]
            ((found, _, _),) = admission.targets
            assert found.rate_per_s == 100.0
    finally:
        for request in requests:
            state.reserved_requests.discard(request)
            state.requests.pop(request.id, None)
        close_throttler(app)


def test_a_task_sent_on_from_the_line_comes_back_for_the_lines_wait(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = Celery("sent", set_as_current=False)
    app.conf.update(
        throttle_redis_url=redis_url,
        throttle_config={
            "settings": {"prefix": prefix},
            "limits": {"api": {"algorithm": "gcra", "rate": "1/s", "burst": 1}},
        },
    )  # fmt: skip

    # As install(app) runs it: a long wait is parked, not capped at the line's budget.
    app.steps["worker"].add(ThrottleStep)

    @app.task(name="sent.call", shared=False)
    @throttled("api")
    def call(n: int) -> None: ...

    consumer = Consumer()
    line = WaitingLine(consumer, max_wait_s=0.8)
    waiting = Waiting(app.tasks["sent.call"], consumer, Undecided(consumer), line)
    requests = [received(app, "sent.call", (n,)) for n in range(2)]
    deferred: list[tuple[float, float]] = []

    def defer(execution: Any, countdown_s: float, wait_s: float, *_: Any, **__: Any) -> None:
        deferred.append((countdown_s, wait_s))
        raise RuntimeError("sent back")

    monkeypatch.setattr(comeback_module, "defer", defer)
    try:
        # Given a task admitted at once, and a second denied (its slot 1 s away) that
        # waits in the line
        for request in requests:
            waiting.admit(request)
        assert consumer.handed == requests[:1] and len(line.line) == 1
        # When it has waited as long as the line may hold it (0.8 s), and is sent on
        # behind a task of the same limit sent on a moment ago for 5 s
        time.sleep(0.85)
        line.sent_until[("api", None)] = time.monotonic() + 5.0
        line._run()
        assert consumer.handed == requests
        # Then the pool child's gate sends it back for the line's wait (a spacing after
        # the one before it: 6 s), not for what the limit said when it last asked (1 s
        # then, its slot since)
        sent = requests[1]
        _, admission = sent.request_dict[ADMISSION_KEY]
        task = app.tasks["sent.call"]
        task.push_request(**request_of(sent.id))
        try:
            with pytest.raises(RuntimeError, match="sent back"):
                Gate(task, task.run.__throttle__, call.__wrapped__, (1,), {}).enter(admission)
        finally:
            task.pop_request()
        ((_, wait_s),) = deferred
        assert 5.5 < wait_s <= 6.0
    finally:
        for request in requests:
            state.reserved_requests.discard(request)
            state.requests.pop(request.id, None)
        close_throttler(app)
