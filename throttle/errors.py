"""Exceptions raised by celery-throttled.

Every error the package raises derives from :class:`ThrottleError`; driver exceptions
(redis-py) never reach the caller raw, they are wrapped once at the Redis boundary::

    ThrottleError
     ├── ConfigError (ValueError)        a limit spec or config value is malformed
     ├── RequestError (ValueError)       an acquire/settle argument is invalid
     │    └── CostExceedsCapacity        the cost can never be admitted by a limit
     ├── BackendError                    Redis answered with an error
     │    └── BackendUnavailable         Redis could not be reached (connection, timeout)
     ├── Throttled                       a limit denied; carries ``retry_after_s``
     ├── ThrottleTimeout                 a task's throttle deadline passed before its slot
     └── UpstreamFinal                   the upstream refused a call and said not to retry it
"""

from __future__ import annotations

import difflib
import math
import reprlib
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "ConfigError",
    "CostExceedsCapacity",
    "RequestError",
    "ThrottleError",
    "ThrottleTimeout",
    "Throttled",
    "UpstreamFinal",
]


class _Shown(reprlib.Repr):
    """The value shown in a ConfigError: short values as repr() shows them, long or deep
    ones cut (a YAML alias bomb expands to billions of items in a plain repr, a 10 MB key
    to 10 MB of message); a value whose own __repr__ raises is shown by its type."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxother = 200
        self.maxlong = 60
        self.maxlist = self.maxtuple = self.maxset = self.maxdict = 10

    def repr_int(self, x: int, level: int) -> str:
        try:
            return super().repr_int(x, level)
        except ValueError:  # more digits than Python converts to text
            return f"<int of {x.bit_length()} bits>"

    def shown(self, value: object) -> str:
        try:
            text = self.repr(value)
        except Exception:
            return f"<{type(value).__name__}>"
        # Each level is cut, but levels multiply: 10 x 10 x 10 items is still 5 kB.
        return text if len(text) <= 500 else text[:497] + "..."


_shown = _Shown()


def did_you_mean(given: object, known: Iterable[str]) -> str:
    """`` (did you mean 'X'?)`` when ``given`` is a near miss of one of ``known`` (a typo:
    ``on_eror``, ``refrsh``), else an empty string; to put in an error's problem."""
    if not isinstance(given, str):
        return ""
    close = difflib.get_close_matches(given.lower(), list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


class ThrottleError(Exception):
    """Base class of every error raised by this package."""


_NO_VALUE: Any = object()
"""No offending value to show (:class:`ConfigError`)."""


class ConfigError(ThrottleError, ValueError):
    """A limit spec or config value is malformed.

    The message names where the problem is (``source``: a file or other origin, ``limit``:
    the limit's name, ``field``) and the offending ``value``.
    """

    def __init__(
        self,
        problem: str,
        *,
        field: str | None = None,
        value: object = _NO_VALUE,
        limit: str | None = None,
        source: str | None = None,
    ) -> None:
        self.problem = problem
        self.field = field
        self.value = None if value is _NO_VALUE else value
        self.limit = limit
        self.source = source
        place = [
            part
            for part in (
                source,
                f"limit {limit!r}" if limit else None,
                f"field {field!r}" if field else None,
            )
            if part
        ]
        message = f"{': '.join(place)}: {problem}" if place else problem
        if value is not _NO_VALUE:  # None too: a null in YAML, an argument left None
            message += f" (got {_shown.shown(value)})"
        super().__init__(message)


class RequestError(ThrottleError, ValueError):
    """An argument of an acquire or settle call is invalid (cost, key, wait, lease)."""


class CostExceedsCapacity(RequestError):
    """The cost is larger than a limit's capacity: it could never be admitted.

    Raised at once rather than denied, so that a caller never reschedules forever.
    """

    def __init__(self, limit: str, cost: float, capacity: float) -> None:
        self.limit = limit
        self.cost = cost
        self.capacity = capacity
        super().__init__(
            f"cost {cost:g} exceeds the capacity {capacity:g} of limit {limit!r}: "
            "it can never be admitted"
        )


class BackendError(ThrottleError):
    """Redis answered a limiter call with an error."""


class BackendUnavailable(BackendError):
    """Redis could not be reached (connection refused or lost, timeout)."""


class Throttled(ThrottleError):
    """A limit denied the acquisition; try again in ``retry_after_s`` seconds."""

    from_upstream: bool = False
    """Raised by an upstream hook (``report_upstream(..., retry=True)``) for a call its
    upstream refused. The task's runner brings the task back for it when it finds it in
    the chain of the body's exception (:func:`throttle.celery.comeback.come_back_if_refused`),
    also where the running task's record of the refusal does not show it: a call made from
    a thread of the body that does not carry its context (a ``ThreadPoolExecutor``'s), or
    a record that another call of the same body answered since (a fan-out: two calls at
    once, one refused, the other served after it)."""

    def __init__(self, retry_after_s: float, denied_by: Sequence[str] = ()) -> None:
        self.retry_after_s = retry_after_s
        self.denied_by = tuple(denied_by)
        # args are the constructor's, so that Celery's result backend can rebuild the error.
        super().__init__(retry_after_s, list(self.denied_by))

    def __str__(self) -> str:
        who = f" by {', '.join(self.denied_by)}" if self.denied_by else ""
        return f"throttled{who}: retry after {self.retry_after_s:.3f} s"

    def __repr__(self) -> str:
        # Flower's task list shows repr() of a Retry's exception: name the limits and the
        # wait, e.g. Throttled(limit='upstream', wait=3.2s), not the raw constructor args.
        wait = self.retry_after_s
        if wait == math.inf:
            shown = "inf"  # a paused limit
        else:
            shown = f"{wait:.1f}s" if wait >= 0.1 or wait == 0 else f"{wait:.3f}s"
        if len(self.denied_by) == 1:
            who = f"limit={self.denied_by[0]!r}, "
        elif self.denied_by:
            who = f"limits={list(self.denied_by)!r}, "
        else:
            who = ""
        return f"Throttled({who}wait={shown})"


def throttled_in(exc: BaseException) -> Throttled | None:
    """The :class:`Throttled` that ``exc`` is, or was raised from or during, if any: an SDK
    that wraps the exceptions of its HTTP client still carries an upstream hook's word
    (``anthropic`` raises ``APIConnectionError`` from the hook's ``Throttled``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, Throttled):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class ThrottleTimeout(ThrottleError):
    """A task could not get its slot before its throttle deadline (``max_wait`` or
    ``expires``): it fails with this error instead of waiting forever."""

    def __init__(self, limits: Sequence[str], needed_s: float, left_s: float) -> None:
        self.limits = tuple(limits)
        self.needed_s = needed_s
        self.left_s = left_s
        super().__init__(list(self.limits), needed_s, left_s)

    def __str__(self) -> str:
        names = ", ".join(self.limits) or "the limits"
        if not math.isfinite(self.needed_s):
            # A pause, or a concurrency unit: nothing says when it ends.
            return (
                f"throttle deadline: {names} did not admit the task by its deadline "
                f"({self.left_s:.3f} s away), and no time is known when they will (a pause "
                "ends when resumed, a concurrency unit comes back when a task ends)"
            )
        return (
            f"throttle deadline: {names} would admit the task in {self.needed_s:.3f} s, but "
            f"its deadline is {self.left_s:.3f} s away"
        )


class UpstreamFinal(ThrottleError):
    """The upstream failed a call and said it must not be made again
    (``Stripe-Should-Retry: false``), or refused it for a quota that no wait restores
    (OpenAI's ``insufficient_quota``: the account's credit or budget is used up):
    :func:`throttle.upstream.report_upstream` with ``retry=True`` raises this instead of
    :class:`Throttled`, and the task is not re-run for it (it fails, unless its body
    handles the error). Retrying would fail the same way, or, for a write, do it twice.
    ``why`` says which (default: ``HEADER: false``)."""

    def __init__(
        self, status: int | None, header: str = "Stripe-Should-Retry", why: str | None = None
    ) -> None:
        self.status = status
        self.header = header
        self.why = f"{header}: false" if why is None else why
        # All three in args: a result backend rebuilds the exception from them.
        super().__init__(status, header, why)

    def __str__(self) -> str:
        status = "" if self.status is None else f" {self.status}"
        return f"the upstream's{status} answer says not to retry the call ({self.why})"
