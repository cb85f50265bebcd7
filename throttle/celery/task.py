"""The public faces of the Celery layer: ``@throttled``, ``ThrottledTask``, and what a
running task may call (:func:`report_cost`, :func:`slot_time`; ``defer_task`` is
:mod:`throttle.celery.comeback`'s).

Every throttled execution goes through :func:`run`: the gate decides (run, sleep to the
slot, or come back later), the body runs on its ticket, then the acquisition is settled.
A body that exits by an exception after its upstream refused a call (recorded on the
ticket by :func:`throttle.upstream.report_upstream`) comes back once, from here
(:func:`throttle.celery.comeback.come_back_if_refused`).
"""

from __future__ import annotations

import decimal
import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from celery import Celery, Task
from celery._state import get_current_task
from celery.exceptions import Reject
from celery.local import Proxy

from throttle.celery.comeback import come_back_if_refused
from throttle.celery.execution import (
    Execution,
    current_ticket,
    enter_ticket,
    leave_ticket,
    take_admission,
)
from throttle.celery.gate import Gate
from throttle.celery.message import restore_delivery
from throttle.celery.runtime import Throttler, task_rules, throttling_enabled
from throttle.celery.settle import settle
from throttle.config import ThrottleConfig
from throttle.errors import ConfigError
from throttle.rules import UNSET, Declared, Rule, declare
from throttle.rules import argument_errors as rule_argument_errors
from throttle.spec import MAX_AMOUNT, Algorithm, Limit
from throttle.units import real

F = TypeVar("F", bound=Callable[..., Any])


def run(
    task: Task,
    declared: Declared | None,
    fn: Callable[..., Any],
    call: Callable[[], Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """One execution of ``task``: the gate, then ``call()`` (the body), then the settle."""
    if not throttling_enabled(task.app):
        return call()  # switched off (tests): no limiter, no ticket
    gate = Gate(task, declared, fn, args, kwargs)
    execution = gate.execution
    admission = take_admission(execution.request)
    if admission is not None and admission.rates_changed:
        # The consumer decided on a rate announced since (celery throttle set): the pool
        # child's own cache of the rates (up to refresh_s old) must not space the call
        # by the old one.
        execution.throttler.rates.refresh_soon()
    ticket = gate.enter(admission)
    # The gate decided on this message's own delivery; the body sees the producer's.
    restore_delivery(execution.request)
    if ticket is None:
        return call()
    ticket.task, ticket.request = task, execution.request
    if ticket.acquisition is not None:  # else nothing to settle (limits in shadow mode)
        ticket.settler = functools.partial(
            settle, execution.throttler, ticket, estimates=execution.estimates
        )
    token = enter_ticket(ticket)
    failed = True
    settles = True
    try:
        result = call()
        failed = False
        return result
    except Exception as exc:
        settles = not requeued(execution, exc)
        come_back_if_refused(ticket, exc)  # the upstream refused the call: re-published here
        raise
    finally:
        leave_ticket(token)
        if settles:
            ticket.settle_once(failed)  # unless a copy sent from the body settled it
        elif ticket.draw is not None:  # given back to the broker: its share stays used
            ticket.draw.done(())


def requeued(execution: Execution, exc: Exception) -> bool:
    """Whether the body gave its message back to the broker (celery's
    ``Reject(requeue=True)`` from a task with ``acks_late``; without it the message was
    acknowledged when the task started, and the reject changes nothing): the broker
    delivers it again, and that delivery is this execution again.

    Its acquisition is then left unsettled: the redelivered copy acquires with the same
    id (the task id), finds the slot this one reserved ("held"), and runs on it at once,
    as a copy redelivered after its worker died does (a redelivered task keeps a slot it
    is late for). Settled here, it would take a new slot, be deferred when that is beyond
    ``sleep_max``, and come back as a new message, which the broker does not mark
    ``redelivered``. The slot's concurrency units stay held until the redelivered copy
    settles (or the lease ends); its cost is paid once for both deliveries."""
    return (
        isinstance(exc, Reject)
        and bool(exc.requeue)
        and bool(execution.task.acks_late)
        and not execution.eager
    )


def gated_call(
    task: Task, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[Declared, Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None:
    """What the gate of ``task`` evaluates its rules on when the task is called with
    ``args`` and ``kwargs`` (a message's): ``(declared, fn, args, kwargs)`` as
    :func:`throttled`'s wrapper or :meth:`ThrottledTask.__call__` pass them to :func:`run`
    (a bound task's ``self`` first); None for a task that neither declares limits nor
    is a ThrottledTask (nothing throttles it)."""
    body: Callable[..., Any] = task.run
    function: Callable[..., Any] = getattr(body, "__func__", body)
    bound = function is not body
    declared: Declared | None = getattr(body, "__throttle__", None)
    if declared is not None:  # @throttled: the wrapper gates the function it wraps
        fn: Callable[..., Any] = getattr(function, "__wrapped__", function)
    elif isinstance(task, ThrottledTask):
        declared, fn = type(task).declared_limits(), function
    else:
        return None
    return declared, fn, ((task, *args) if bound else tuple(args)), kwargs


def argument_errors(app: Celery, config: ThrottleConfig) -> list[ConfigError]:
    """The rules of ``app``'s tasks whose key template, plan template or cost names an
    argument their task's function does not have (:func:`throttle.rules.argument_errors`),
    each rule of each task once; a worker logs each at start (an error: a shared task of
    another module may be in the app without ever running there), ``celery throttle check
    -A`` counts them as errors. Rules
    of a queue (``queues:``) are not checked: which tasks a queue gets is the routing's."""
    errors: list[ConfigError] = []
    for task in sorted(app.tasks.values(), key=lambda task: str(task.name)):
        gated = gated_call(task, (), {})
        declared, fn = (gated[0], gated[1]) if gated is not None else (None, task.run)
        try:
            rules = task_rules(config, task.name, declared, None)
        except ConfigError:  # a named limit the file lacks: reported on its own
            continue
        for rule in rules:
            errors += rule_argument_errors(rule, fn, task.name, config.source)
    return errors


def throttled(
    *limits: Limit | Rule | str,
    key: Any = UNSET,
    cost: Any = UNSET,
    max_wait: Any = UNSET,
    on_timeout: Any = UNSET,
    on_error: Any = UNSET,
    on_redis_down: Any = UNSET,
    algorithm: Algorithm | str | Any = UNSET,
    plan: Any = UNSET,
    plans: Any = UNSET,
    mode: Any = UNSET,
) -> Callable[[F], F]:
    """Throttle a task: put it under ``@app.task`` or ``@shared_task``.

    Parameters
    ----------
    *limits:
        Names of limits in the config file (``"github"``), inline rates (``"20/s burst 1"``,
        ``"8 concurrent"``), :class:`Limit` or :class:`Rule` objects. All apply at once.
    key, cost, max_wait, on_timeout, on_error, on_redis_down, plan, plans, mode:
        As the fields of :class:`throttle.rules.Rule` (``max_wait`` in seconds or a
        duration string; ``mode="shadow"`` decides and records without delaying); for
        inline limits, and overriding a named limit's own.
    algorithm:
        The algorithm of inline rates (default token bucket).
    """
    for item in limits:
        if callable(item) and not isinstance(item, Limit | Rule | str):
            # Bare @throttled: the function came as a limit, and the task registered
            # would be the decorator's own inner function.
            raise ConfigError(
                "@throttled takes its limits in parentheses: @throttled('api') for a limit "
                "of the config file, @throttled('20/s') for an inline rate",
                value=getattr(item, "__qualname__", item), source="@throttled",
            )  # fmt: skip
    options = {
        "key": key, "cost": cost, "max_wait_s": max_wait, "on_timeout": on_timeout,
        "on_error": on_error, "on_redis_down": on_redis_down, "algorithm": algorithm,
        "plan": plan, "plans": plans, "mode": mode,
    }  # fmt: skip

    def decorate(fn: F) -> F:
        # type(), not isinstance(): a task not yet bound is a Proxy that isinstance would
        # evaluate (and finalize the app).
        if issubclass(type(fn), (Task, Proxy)):
            raise ConfigError(
                "@throttled goes under @app.task (or @shared_task), on the function: above "
                "it, it would wrap the task object and the task would run unthrottled",
                value=fn, source="@throttled",
            )  # fmt: skip
        owner = f"{fn.__module__}.{fn.__qualname__}"
        declared = declare(limits, owner, options)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            task = get_current_task()
            if task is None:
                return fn(*args, **kwargs)  # called outside Celery: a plain function
            return run(task, declared, fn, lambda: fn(*args, **kwargs), args, kwargs)

        wrapper.__throttle__ = declared  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


class ThrottledTask(Task):  # type: ignore[misc]
    """A Task base applying the config file's limits for the task's name and queue, plus
    those of its ``throttle`` attribute (as the arguments of :func:`throttled`).

    Use ``Celery(..., task_cls=ThrottledTask)`` for every task of an app (per-queue limits
    without decorating each task), or ``@app.task(base=ThrottledTask)`` for one.
    """

    throttle: ClassVar[Sequence[Limit | Rule | str]] = ()
    _throttle_declared: ClassVar[Declared | None] = None

    @classmethod
    def declared_limits(cls) -> Declared:
        """What the class's ``throttle`` attribute declares (built once per class)."""
        if cls.__dict__.get("_throttle_declared") is None:
            cls._throttle_declared = declare(tuple(cls.throttle), cls.__qualname__, {})
        assert cls._throttle_declared is not None
        return cls._throttle_declared

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        body: Callable[..., Any] = self.run
        if getattr(body, "__throttle__", None) is not None:
            return super().__call__(*args, **kwargs)  # @throttled gates inside run
        declared = type(self).declared_limits()
        if not (declared.rules or declared.names) and _unlimited(self):
            return super().__call__(*args, **kwargs)
        fn: Callable[..., Any] = getattr(body, "__func__", body)
        call_args = (self, *args) if fn is not body else args
        return run(
            self,
            declared,
            fn,
            lambda: super(ThrottledTask, self).__call__(*args, **kwargs),
            call_args,
            kwargs,
        )


def _unlimited(task: Task) -> bool:
    """Whether no limit can apply to ``task`` (a ThrottledTask declaring none) and so it
    needs no limiter: one of Celery's own tasks (celery.ping, chord_unlock...: the file
    never limits them, :func:`task_rules`), or, where no limiter can be built for lack of
    a Redis URL, a task the limits file maps to no limit by its name or any queue (a test
    app under an app-wide ``task_cls`` with nothing configured). The throttler is built
    once per process: this costs a lookup per call."""
    if task.name.startswith("celery."):
        return True
    if not throttling_enabled(task.app):
        return False  # run() calls the body, building nothing
    try:
        Throttler.of(task.app)
    except ConfigError as exc:
        if exc.field != "redis_url":
            return False  # run() raises it
        config = ThrottleConfig.from_source(task.app.conf.get("throttle_config"))
        return not config.queues and not config.tasks.get(task.name)
    return False


def report_cost(actual: float, limit: str | None = None) -> None:
    """Report what one call of the running task really cost, to settle its reserved
    estimate.

    ``limit`` names one limit; ``None`` applies to every limit whose cost is an estimate
    (an argument or a callable; fixed costs, such as 1 request, stay). The reports add
    up (per limit name, and for all): a task that makes several calls under one estimate
    reports each call's cost, and is settled on their sum. The difference is refunded or
    charged when the task returns. Outside a throttled task this does nothing.

    ``actual`` is any real number (``int``, ``float``, ``Decimal``, ``Fraction``, a NumPy
    number). Raises ValueError for a cost that is not a number from 0 to 1e15, and for a
    ``limit`` the running task does not have (a misspelt name would lose the refund).
    """
    number = real(actual)
    if (
        number is None
        and isinstance(actual, numbers.Real | decimal.Decimal)
        and not isinstance(actual, bool)  # refused by real(): True is no cost of 1
    ):
        try:
            number = float(actual)  # a Fraction, a Decimal (a price), a NumPy integer
        except OverflowError:  # a Fraction beyond a float's range
            number = math.inf
    if number is None or not 0 <= number <= MAX_AMOUNT:
        of = "" if limit is None else f" of limit {limit!r}"
        raise ValueError(
            f"report_cost{of} needs a number from 0 to {MAX_AMOUNT:g} (got {actual!r})"
        )
    ticket = current_ticket()
    if ticket is None:
        return
    if limit is not None and all(rule.name != limit for rule in ticket.rules):
        names = [rule.name for rule in ticket.rules] + [rule.name for rule, _ in ticket.shadow]
        if limit not in names:
            raise ValueError(
                f"report_cost: the running task has no limit {limit!r}; its limits: "
                + (", ".join(map(repr, names)) or "none")
            )
    ticket.reported[limit] = ticket.reported.get(limit, 0.0) + number


def slot_time() -> float | None:
    """When the running task's slot came (epoch s, this worker's clock), or None outside a
    throttled task: ``time.time() - slot_time()`` is how late the call is behind its slot."""
    ticket = current_ticket()
    return None if ticket is None else ticket.slot_at
