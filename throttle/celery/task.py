"""The public faces of the Celery layer: ``@throttled``, ``ThrottledTask``, and what a
running task may call (:func:`report_cost`, :func:`slot_time`, :func:`defer_task`).

Every throttled execution goes through :func:`run`: the gate decides (run, sleep to the
slot, or come back later), the body runs on its ticket, then the acquisition is settled.
A body that exits by an exception after its upstream refused a call (recorded on the
ticket by :func:`throttle.upstream.report_upstream`) comes back once, from here
(:func:`come_back_if_refused`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from celery import Task
from celery._state import get_current_task
from celery.exceptions import Ignore, Reject, Retry
from celery.local import Proxy

from throttle.celery.execution import (
    Execution,
    Ticket,
    current_ticket,
    enter_ticket,
    leave_ticket,
    take_admission,
)
from throttle.celery.gate import Gate, set_deadlines
from throttle.celery.reschedule import defer, time_out
from throttle.celery.runtime import Throttler, throttling_enabled
from throttle.celery.settle import settle
from throttle.decision import Decision, LimitState
from throttle.errors import ConfigError, Throttled
from throttle.rules import UNSET, Declared, Rule, declare
from throttle.spec import Algorithm, Limit
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
    ticket = gate.enter(take_admission(gate.execution.request))
    if ticket is None:
        return call()
    token = enter_ticket(ticket)
    failed = True
    try:
        result = call()
        failed = False
        return result
    except Exception as exc:
        come_back_if_refused(ticket, exc)  # the upstream refused the call: re-published here
        raise
    finally:
        leave_ticket(token)
        settle(gate.execution.throttler, ticket, failed, gate.execution.estimates)


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
) -> Callable[[F], F]:
    """Throttle a task: put it under ``@app.task`` or ``@shared_task``.

    Parameters
    ----------
    *limits:
        Names of limits in the config file (``"github"``), inline rates (``"20/s burst 1"``,
        ``"8 concurrent"``), :class:`Limit` or :class:`Rule` objects. All apply at once.
    key, cost, max_wait, on_timeout, on_error, on_redis_down, plan, plans:
        As the fields of :class:`throttle.rules.Rule` (``max_wait`` in seconds or a
        duration string); for inline limits, and overriding a named limit's own.
    algorithm:
        The algorithm of inline rates (default token bucket).
    """
    options = {
        "key": key, "cost": cost, "max_wait_s": max_wait, "on_timeout": on_timeout,
        "on_error": on_error, "on_redis_down": on_redis_down, "algorithm": algorithm,
        "plan": plan, "plans": plans,
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
        fn: Callable[..., Any] = getattr(body, "__func__", body)
        call_args = (self, *args) if fn is not body else args
        return run(
            self,
            type(self).declared_limits(),
            fn,
            lambda: super(ThrottledTask, self).__call__(*args, **kwargs),
            call_args,
            kwargs,
        )


def report_cost(actual: float, limit: str | None = None) -> None:
    """Report what the running task's call really cost, to settle its reserved estimate.

    ``limit`` names one limit; ``None`` applies to every limit whose cost is an estimate
    (an argument or a callable; fixed costs, such as 1 request, stay). The difference is
    refunded or charged when the task returns. Outside a throttled task this does nothing.
    """
    number = real(actual)
    if number is None or not 0 <= number < math.inf:
        raise ValueError(f"report_cost needs a finite number >= 0 (got {actual!r})")
    ticket = current_ticket()
    if ticket is not None:
        ticket.reported[limit] = number


def slot_time() -> float | None:
    """When the running task's slot came (epoch s, this worker's clock), or None outside a
    throttled task: ``time.time() - slot_time()`` is how late the call is behind its slot."""
    ticket = current_ticket()
    return None if ticket is None else ticket.slot_at


def defer_task(countdown_s: float, limits: Sequence[str] = ()) -> None:
    """Run the running throttled task again in ``countdown_s`` seconds, as the throttler
    re-runs a denied task: the same id, arguments, options, headers, links and chord, through
    its queue's lane (parked in Redis beyond ``park_after``), without spending
    ``max_retries``; past its deadline (``max_wait``, ``expires``), ``on_timeout`` applies.
    Raises celery's ``Retry``: let it propagate. For a task that its upstream told to come
    back later (:func:`throttle.upstream.report_upstream`); ``limits`` names the limits that
    wait (default: all the task's), as the reason shown. In eager mode and direct calls,
    where there is no queue, raises :class:`Throttled` instead."""
    task, ticket = get_current_task(), current_ticket()
    if task is None or ticket is None:
        raise RuntimeError("defer_task() is for the body of a running throttled task")
    countdown_s = max(float(countdown_s), 0.0)
    names = tuple(limits) or tuple(rule.name for rule in ticket.rules)
    if task.request.is_eager or task.request.called_directly:
        raise Throttled(countdown_s, names)
    execution = Execution(task, Throttler.of(task.app), ticket.rules, task.run)
    set_deadlines(execution)
    states = tuple(LimitState(name, False, 0.0, countdown_s, 0.0) for name in names)
    denied = Decision(False, 0.0, countdown_s, 0.0, 0.0, states)
    if execution.deadline is not None:
        now = execution.throttler.clock.now()
        if now + countdown_s > execution.deadline:
            time_out(execution, now, countdown_s, denied)
    defer(execution, countdown_s, countdown_s, denied)


def come_back_if_refused(ticket: Ticket, exc: Exception) -> None:
    """The body of ``ticket``'s task raised ``exc``: when the upstream refused its last call
    (``report_upstream(..., retry=True)`` recorded it), the task comes back now, once, with
    :func:`defer_task` (raises celery's ``Retry``, or :class:`Throttled` in eager mode).

    The refusal is answered here, after control has left the HTTP client and the SDK
    around it, and not in the hook that saw the 429: an SDK that wraps the hook's
    exception, retries the request itself, or meets a 429 again in its own retry loop
    cannot make the task come back twice, nor run on after its copy was published
    (``anthropic`` wraps any exception of its HTTP client as ``APIConnectionError`` and
    retries it). ``exc`` may be the hook's :class:`Throttled` or whatever the SDK made of
    it. A body that ended with celery's ``Retry``, ``Ignore`` or ``Reject`` has decided
    already (``self.retry()``, :func:`defer_task`): nothing more is published."""
    refusal = ticket.refusal
    if refusal is None or isinstance(exc, (Retry, Ignore, Reject)):
        return
    ticket.refusal = None
    try:
        defer_task(refusal.countdown_s, refusal.limits)
    except Throttled as throttled:  # eager mode: no queue to come back through
        raise throttled from exc
