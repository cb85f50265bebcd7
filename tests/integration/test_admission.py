"""The pool child runs a task the worker's consumer decided on the consumer's evaluation of
its rules (:meth:`throttle.celery.gate.Gate.evaluated`, carried in the
:class:`~throttle.celery.execution.Admission`), unless a rate was set at run time since or
the rules it finds are not the ones the consumer evaluated."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context

import throttle.celery.gate as gate_module
from tests.support.eager import close_throttler
from throttle.celery.execution import Admission
from throttle.celery.gate import Gate
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
            },
            "tasks": {"adm.call": ["requests", "tokens"]},
        },
    )  # fmt: skip

    @app.task(name="adm.call", shared=False)
    def call(tenant: str, tokens: int) -> None: ...

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
