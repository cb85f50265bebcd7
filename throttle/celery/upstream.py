"""The upstream's word from inside a throttled task: :func:`report_upstream` and
:func:`upstream_hook`.

The Celery binding of :mod:`throttle.upstream`: it finds the running task's limits (its
ticket), applies the signal to them (:func:`throttle.upstream.policy.apply_signal`), and
with ``retry=True`` records a refusal on the ticket and raises :class:`Throttled`: the
task is re-published once its body exits (:func:`throttle.celery.task.run`, through
:func:`~throttle.celery.comeback.defer_task`), never from inside the HTTP client or SDK.
Users import these from :mod:`throttle.upstream`, as before::

    from throttle.upstream import report_upstream, upstream_hook
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from celery._state import get_current_task

from throttle.celery.execution import Refusal, current_ticket
from throttle.celery.runtime import Throttler
from throttle.celery.shadow import hold_twins, shadow_limit
from throttle.errors import BackendError, Throttled
from throttle.refusals import Refusal as RefusalEntry
from throttle.rules import Rule
from throttle.rules import Target as RuleTarget
from throttle.spec import Limit
from throttle.upstream.answers import answer_of
from throttle.upstream.headers import DEFAULT_HOLD_S, UpstreamSignal, read_response, wants_body
from throttle.upstream.policy import Target, apply_signal, learn
from throttle.upstream.values import normalize, seconds

__all__ = ["report_upstream", "upstream_hook"]

logger = logging.getLogger("throttle")


def _release(response: Any) -> None:
    """Give a refused response's connection back before the task leaves it. Hooks run
    before the body is read, and a socket closed with its body unread is reset (the upstream
    sees a broken connection, the client's pool loses it): read the (short) 429 body, then
    close."""
    try:
        if hasattr(response, "iter_content"):  # requests
            _ = response.content
        elif getattr(response, "is_stream_consumed", True) is False:  # httpx
            response.read()
        close = getattr(response, "close", None)
        if callable(close):
            close()
    except Exception as exc:  # best effort (an AsyncClient's response refuses a sync read)
        logger.debug("throttle: could not release an upstream response: %s", exc)


def _retried_by_client(response: Any) -> int:
    """How many times the client had already sent this request (``x-stainless-retry-count``,
    which the ``openai`` and ``anthropic`` SDKs send): 0 for a first attempt, or unknown."""
    try:
        request = getattr(response, "request", None)
        value = request.headers.get("x-stainless-retry-count", "0") if request is not None else 0
        return int(value)
    except Exception:  # not an SDK request, or no request at all: a first attempt
        return 0


_warned: set[str] = set()
"""Task names warned of in this process about calls made again inside the task."""
_unknown: set[tuple[str, str | None]] = set()
"""(task name, limit) named by report_upstream that the task does not have, warned of."""


def _warn_retried(task: Any, why: str) -> None:
    """Once per task name and process: a call was made again inside the task (an SDK's
    retry, or a call after a refusal). Such a call takes no slot of the limit (the task
    already holds its one): the limiter never sees it."""
    name = getattr(task, "name", "?")
    if name in _warned:
        return
    _warned.add(name)
    logger.warning(
        "throttle: task %s called the upstream again inside its body (%s): such calls "
        "take no slot of the limit. Create the SDK's client with max_retries=0 (openai, "
        "anthropic; stripe: max_network_retries=0; PyGithub: retry=None) and let "
        "upstream_hook(retry=True) run the task again for its next slot",
        name, why,
    )  # fmt: skip


def _warn_unknown_limit(task: Any, name: str | None, names: list[str]) -> None:
    """Once per task name, limit and process: ``report_upstream`` (``upstream_hook``) named
    a limit the task does not have."""
    seen = (getattr(task, "name", "?"), name)
    if seen in _unknown:
        return
    _unknown.add(seen)
    logger.error(
        "throttle: report_upstream: task %s has no limit %r (it has %s): the upstream's "
        "answers go to all its limits; name one of them, or none",
        seen[0], name, ", ".join(repr(each) for each in names),
    )  # fmt: skip


def report_upstream(
    response: Any, *, limit: str | Limit | None = None, retry: bool = False
) -> UpstreamSignal | None:
    """Hand the upstream's answer to the throttler, from inside a throttled task.

    ``response`` is a ``requests.Response``, an ``httpx`` or ``httpx2`` response, or the
    exception an SDK raised for one: ``openai``'s and ``anthropic``'s ``APIStatusError``
    (``RateLimitError``), ``stripe``'s ``RateLimitError``, PyGithub's ``GithubException``
    (anything with a status code and headers: :func:`throttle.upstream.answers.answer_of`);
    see :func:`throttle.upstream.headers.parse_upstream` for what is read.

    * **Hold**: the task's limits (``limit``: only the one of this name) are held for the
      upstream's time, fleet-wide: a keyed limit for the task's key only, a limit without
      key as a whole. Reserved slots that fall inside the hold are voided when their tasks
      reach them, so the fleet stops at once, not after the slots already handed out.
      A refusal holds only when the upstream says its quota is spent (a hold longer than
      :data:`~throttle.upstream.headers.PREEMPT_MIN_S` and
      :data:`~throttle.upstream.policy.SPENT_SPACINGS` spacings:
      :func:`~throttle.upstream.policy.quota_spent`),
      when the limit is faster than the policy the upstream states, or when refusals
      *persist*: the refusals of the limit (and key), counted fleet-wide on the
      Redis clock, reach half of the calls the limit makes at its rate in a window of a
      second (or ten spacings, when longer), and at least three
      (:meth:`throttle.adaptive.LearnedRates.persist_for`). Any other refusal is one
      that the limiter's schedule explains (a call a few ms early or late: jitter): the
      refused task alone comes back (with ``retry=True``) and the fleet goes on.
      A response that is no refusal but says the quota is spent holds as before.
    * **Learn** (``adaptive: true`` limits, :mod:`throttle.adaptive`): a refusal lowers the
      limit's learned rate once per episode, every other answer lets it probe up, a stated
      policy replaces it.
    * **Rate**: when the upstream states a policy slower than a held limit's rate, the
      limit's run-time rate is lowered to it, fleet-wide, within ``settings.refresh``
      (``RateBook.set``). Only for limits without key that charge one unit per call (a
      token budget counts other units than the upstream's requests) and are not adaptive
      (their learned rate takes the stated one, down and back up); never above the
      configured rate, and never raised again by this function: when the upstream's limit
      is back up, an operator goes back to the configured rate with
      ``RateBook(client, keyspace).clear(name)`` (a warning in the worker's log names the
      limit when it is lowered).
    * **Retry** (``retry=True``): when the upstream refused the call, this raises
      :class:`Throttled` (the hold, the limits), and the task runs again after the hold:
      when its body exits with an exception, whichever (the ``Throttled``, or what the
      SDK made of it), it is re-published once, with the same id, arguments, options and
      links, through the queue's lane, without spending ``max_retries``
      (:func:`throttle.celery.comeback.defer_task`). Never from inside the HTTP client: an
      SDK that wraps the exception, retries the request or meets a 429 again in its own
      retry loop publishes no second copy. A later answer in the same body that is not a
      refusal (the SDK's retry was served) cancels it, and a body that returns normally
      is not run again.
      A refusal that held nothing re-publishes it at once, to take the limit's next free
      slot: its ``Retry-After`` (whole seconds, rounded up) says no more than "within
      rounding", and the limit's spacing keeps it from the calls before it.
      The task's ``max_wait`` or ``expires`` still bounds it (ThrottleTimeout, or
      ``on_timeout``); an upstream that refuses for ever is otherwise retried for ever.
      In eager mode, direct calls, and tasks that are not throttled, the task raises
      :class:`Throttled` with the hold instead.
    * **Shadow mode**: a limit in shadow mode (:mod:`throttle.celery.shadow`) is answered
      as enforced on its twin: the refusal recorded under the limit's name, its hold on the
      twin (no rate set or learned), and with ``retry=True`` the task back after the
      upstream's time (no slot to take).
      A call made again inside the body (an SDK's own retry, or any call after a
      refusal) logs a warning once per task: create the SDK's client with
      ``max_retries=0``.
    * **Stripe-Should-Retry** (with ``retry=True``): ``false`` on an error answer means
      the call must not be made again: this raises :class:`~throttle.errors.UpstreamFinal`
      instead of :class:`Throttled`, and the task is not re-run for it (it fails, unless
      the body handles the error; the limits are held as for any refusal). ``true`` on an
      error that is no refusal for the rate (a 409 lock timeout, a 500) re-runs the task
      after its ``Retry-After`` (else :data:`~throttle.upstream.headers.DEFAULT_HOLD_S`),
      without holding the limits. As Stripe's own SDK decides its retries.

    Outside a throttled task this holds nothing (like ``report_cost``). Redis errors are
    logged, not raised: the call is made already. Returns what the response said (None:
    nothing to act on).
    """
    answer = answer_of(response)
    if answer is not None:
        response = answer  # an SDK's exception: its HTTP response (released below)
    elif isinstance(response, BaseException):
        # An SDK's error that carries no answer (stripe's or openai's APIConnectionError,
        # or what an SDK made of the hook's Throttled): nothing the upstream said, so
        # nothing to act on, and a refusal recorded earlier in the body still stands.
        return None
    signal = read_response(response)
    ticket = current_ticket()
    if ticket is None or (ticket.acquisition is None and not ticket.shadow):
        if signal is not None and retry and signal.final:
            _release(response)
            raise signal.final_error(_status(response))
        if signal is not None and retry and signal.comes_back:
            _release(response)
            later = signal.hold_s if signal.refused else _retry_after_s(response)
            throttled = Throttled(DEFAULT_HOLD_S if later is None else later)
            # Seen by no ticket: a thread of a throttled task's body that does not carry
            # its context (a ThreadPoolExecutor's): the task comes back for it when its
            # body exits by this, or by what a client made of it (come_back_if_refused).
            throttled.from_upstream = True
            raise throttled
        return signal
    name = limit.name if isinstance(limit, Limit) else limit
    acquisition = ticket.acquisition
    rules = {rule.name: rule for rule in ticket.rules}
    picked = [
        (current, key, cost, rules.get(current.name))
        for (current, key), cost in (
            zip(acquisition.targets, acquisition.costs, strict=True) if acquisition else ()
        )
        if name is None or current.name == name
    ]
    shadowed = [
        (rule, target) for rule, target in ticket.shadow if name is None or rule.name == name
    ]
    if not picked and not shadowed:
        # A name the task does not have (misspelt, or another task's): logged, and the
        # answer goes to all the task's limits, as without a name. Raising here would
        # fail the call after the upstream served it, and an SDK that retries what its
        # hook raised would make it again.
        names = [current.name for current, _ in acquisition.targets] if acquisition else []
        names += [rule.name for rule, _ in ticket.shadow]
        _warn_unknown_limit(ticket.task, name, names)
        picked = [
            (current, key, cost, rules.get(current.name))
            for (current, key), cost in (
                zip(acquisition.targets, acquisition.costs, strict=True) if acquisition else ()
            )
        ]
        shadowed = list(ticket.shadow)
    # The ticket's task: the body may call from another thread (asyncio.to_thread), where
    # Celery's current task (kept per thread) is None.
    task = ticket.task if ticket.task is not None else get_current_task()
    request = ticket.request if ticket.request is not None else task.request
    again = _retried_by_client(response)
    if again or ticket.refusal is not None:
        _warn_retried(task, f"retry {again} of the client" if again else "after a refusal")
    if signal is None or not signal.comes_back:
        ticket.refusal = None  # this call was served (or is final): an earlier refusal is answered
    adaptive = any(rule is not None and rule.adaptive for *_, rule in picked)
    if signal is None and not adaptive:
        return None
    throttler = Throttler.of(task.app)
    held = True  # Redis failing: the task comes back after the upstream's time
    targets: list[Target] = []
    recorded: list[Target] = []
    holds: dict[int, float] | None = None
    """The holds placed on ``recorded`` (by index; None: not known, Redis failing)."""
    try:
        for current, key, cost, rule in picked:
            configured = current if rule is None else rule.limit
            ceiling = throttler.rates.current(configured)
            learning = None if rule is None else rule.adaptive
            dimension = None if rule is None else rule.upstream
            targets.append(
                Target(current, configured, key, cost == 1.0, learning, ceiling, dimension, cost)
            )
        recorded = list(targets)
        if signal is None:
            for target in targets:
                learn(throttler.learned, None, target)
        else:
            holds = apply_signal(
                throttler.limiter, throttler.rates, signal, targets, throttler.learned
            )
            held = bool(holds)
            if holds:  # this process's stocks of them end now, not up to STOCK_S later
                throttler.stocks.drop({targets[i].current.name for i in holds})
            # Limits in shadow mode: their twins are held as the limits would be (what the
            # twins' looks report then includes the hold), and no rate is set or learned.
            twins = [_shadow_target(rule, target) for rule, target in shadowed]
            recorded += [
                Target(limit, limit, key, False, cost=cost) for _, (limit, key, cost) in shadowed
            ]
            if twins:  # recorded as not held: the fleet does not wait for them
                hold_twins(throttler, signal, twins)
    except BackendError as exc:
        throttler.outage(exc)
    if signal is not None and signal.refused and not throttler.in_memory:
        _record(throttler, task, request, response, signal, recorded, holds)
    if signal is None:
        return None
    if retry and signal.final:
        # The provider says the call must not be made again: no come-back, whatever the
        # body does with this (Stripe-Should-Retry: false; Stripe's SDK does not retry it
        # either). The limits were held above as for any refusal.
        _release(response)
        raise signal.final_error(_status(response))
    if retry and signal.comes_back and not signal.refused:
        # An error the provider says to retry (Stripe-Should-Retry: true on a 409 lock
        # timeout, a 500): not the rate's doing, so no hold; the task comes back after
        # Retry-After, else DEFAULT_HOLD_S, as Stripe's SDK would retry it.
        _release(response)
        countdown = _retry_after_s(response) or DEFAULT_HOLD_S
        ticket.refusal = Refusal(countdown, ())
        raise _from_upstream(Throttled(countdown))
    if retry and signal.refused:
        _release(response)
        # A refusal that held nothing is one the limit's schedule explains (jitter), and
        # its Retry-After (whole seconds, rounded up) says no more than "within rounding":
        # the task takes the limit's next free slot at once. Waiting out the rounded
        # second instead idles the limit at the end of a backlog (eager mode and direct
        # calls, which have no slot to take, are told the upstream's time).
        eager = request.is_eager or request.called_directly
        # With only limits in shadow mode there is no slot to take: the upstream's time.
        countdown = signal.hold_s if held or eager or not targets else 0.0
        limits = tuple(target.current.name for target in recorded)
        # Recorded, not published: the task comes back when its body exits (run()).
        ticket.refusal = Refusal(countdown, limits)
        # Marked: a body that exits by it comes back even when another call of the body
        # (a fan-out's, served after this one) cleared the ticket's record meanwhile.
        raise _from_upstream(Throttled(countdown, limits))
    return signal


def _from_upstream(throttled: Throttled) -> Throttled:
    """``throttled``, marked as the hook's answer to a refusal (``from_upstream``)."""
    throttled.from_upstream = True
    return throttled


def _shadow_target(rule: Rule, target: RuleTarget) -> Target:
    """The shadow twin of a limit in shadow mode, as an upstream's answer is applied to
    it (:func:`~throttle.upstream.policy.apply_signal`): held, never learning (an
    adaptive limit in shadow keeps its configured rate)."""
    limit, key, cost = target
    twin = shadow_limit(limit)
    return Target(twin, twin, key, cost == 1.0, None, None, rule.upstream, cost)


def _status(response: Any) -> int | None:
    status = getattr(response, "status_code", getattr(response, "status", None))
    return status if isinstance(status, int) else None


def _retry_after_s(response: Any) -> float | None:
    """A response's ``Retry-After`` in delta seconds, or None (an error that is no
    refusal has no hold to read it from)."""
    try:
        value = normalize(response.headers).get("retry-after")
    except Exception:  # headers of no known shape: none
        return None
    return None if value is None else seconds(value)


def _record(
    throttler: Throttler,
    task: Any,
    request: Any,
    response: Any,
    signal: UpstreamSignal,
    targets: list[Target],
    holds: dict[int, float] | None,
) -> None:
    """Keep the refusal in the fleet's record (:mod:`throttle.refusals`), one entry per
    limit it speaks for, each with the hold placed on it (``holds``, by index), or
    marked not held with the upstream's time; with ``holds`` None (Redis failed while
    holding), every entry is marked held for the upstream's time, as the task comes
    back after it. A Redis error loses the entry, not the task."""
    status = getattr(response, "status_code", getattr(response, "status", None))
    refusals = [
        RefusalEntry(
            limit=target.current.name,
            key=target.key,
            task_id=getattr(request, "id", None),
            task=getattr(task, "name", None),
            status=status if isinstance(status, int) else None,
            header=signal.source,
            hold_s=signal.hold_s if holds is None else holds.get(index, signal.hold_s),
            held=holds is None or index in holds,
        )
        for index, target in enumerate(targets)
    ]
    try:
        throttler.refusals.record(refusals)
    except BackendError as exc:
        logger.warning("throttle: the refusal of task %s was not recorded: %s", task, exc)


def _is_async(response: Any) -> bool:
    """Whether ``response`` came from an ``httpx``/``httpx2`` ``AsyncClient``: its stream
    iterates only asynchronously (a sync client's, or a response built in memory, also
    iterates synchronously)."""
    stream = getattr(response, "stream", None)
    return hasattr(stream, "__aiter__") and not hasattr(stream, "__iter__")


async def _report_async(response: Any, limit: str | Limit | None, retry: bool) -> None:
    """:func:`report_upstream` for a response of an ``AsyncClient``: a refusal's (short)
    body is read and the response closed by awaiting, before the task leaves it; so is a
    GitHub 403 whose message tells a secondary limit (:func:`wants_body`), with or without
    ``retry``, which :func:`report_upstream` cannot read from an async response itself.
    The Redis calls block the event loop briefly, as the rest of a Celery task's do."""
    if (retry and response.status_code >= 400) or wants_body(response):  # short bodies
        await response.aread()
    try:
        report_upstream(response, limit=limit, retry=retry)
    except Throttled:
        await response.aclose()
        raise


def upstream_hook(
    *, limit: str | Limit | None = None, retry: bool = False
) -> Callable[..., Coroutine[Any, Any, None] | None]:
    """A response hook that calls :func:`report_upstream` on every response::

        session.hooks["response"].append(upstream_hook(retry=True))          # requests
        httpx.Client(event_hooks={"response": [upstream_hook(retry=True)]})  # httpx
        httpx2.AsyncClient(event_hooks={"response": [upstream_hook(retry=True)]})
        OpenAI(max_retries=0, http_client=DefaultHttpxClient(event_hooks=...))  # an SDK

    The same hook serves ``requests``, ``httpx`` and ``httpx2``, sync and async clients
    (for an ``AsyncClient``'s response it returns the awaitable the client awaits).
    With ``retry=True`` a refused call never returns to the task body: it raises
    :class:`Throttled`, and the task is re-published for after the hold when the body
    exits (see :func:`report_upstream`); give an SDK ``max_retries=0`` (its retries would
    call the upstream again without a slot). The hook returns None for a sync client,
    which requests needs (a value would replace the response). For ``httpx.AsyncClient``
    outside Celery: :func:`throttle.aio.upstream_hook`.
    """

    def hook(response: Any, *args: Any, **kwargs: Any) -> Coroutine[Any, Any, None] | None:
        if _is_async(response):
            return _report_async(response, limit, retry)
        report_upstream(response, limit=limit, retry=retry)
        return None

    return hook
