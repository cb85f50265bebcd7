"""The upstream's headers read: status code and headers in, an :class:`UpstreamSignal` out.

Pure and total: no I/O, no clock but the one passed (or ``time.time()``), and whatever the
header values, :func:`parse_upstream` gives a signal or None, never an exception. What the
signal asks of the limits is decided in :mod:`throttle.upstream.policy`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from throttle.errors import RequestError, UpstreamFinal
from throttle.upstream import dialects, values
from throttle.upstream.answers import answer_of
from throttle.upstream.dialects import Reading

__all__ = [
    "DEFAULT_HOLD_S",
    "MAX_HOLD_S",
    "MAX_WINDOW_S",
    "PREEMPT_MIN_S",
    "Reading",
    "UpstreamSignal",
    "parse_upstream",
    "read_response",
    "wants_body",
]

MAX_HOLD_S = 86400.0
"""The longest hold the upstream's headers can impose, in s (one day: a daily quota's
reset). Longer values (a typo, a reset in epoch milliseconds read as seconds, a hostile
upstream) are clamped to it; an operator's pause (``Limiter.hold(..., None)``) has no bound."""
DEFAULT_HOLD_S = 1.0
"""The hold after a 429 that says nothing of when to come back, in s."""
PREEMPT_MIN_S = 2.0
"""A response that is not a refusal but says the quota is spent (``remaining`` 0) holds the
limit only when its reset is more than this many s away. Integer-second headers are up to
2 s off (a delta rounded up; an epoch against a ``Date`` rounded down), so a nearer reset
says no more than "the next call is within rounding": the limit's own shaping handles
that, and a hold there would void the reserved slots of the next calls. Beyond it (a
minute, an hour, a daily quota spent by another client of the same key), holding before
the 429 is what the headers are for."""
MAX_WINDOW_S = 31 * 86400.0
"""The longest policy window taken from the headers, in s (a monthly quota); a longer one
is ignored rather than lowering a rate for ever on a typo."""
_REFUSALS = (403, 429, 503)
"""Statuses that refuse a call for its rate: 429 always; 403 (GitHub's primary and secondary
limits) and 503 only with ``Retry-After`` or a spent quota in the headers."""


@dataclass(frozen=True)
class UpstreamSignal:
    """What one response says about the upstream's limit.

    Attributes
    ----------
    refused:
        The upstream refused the call for its rate (429; 403 or 503 with ``Retry-After`` or
        a spent quota): the call was not served and may be made again later.
    hold_s:
        How long to admit nothing of the limit, in s, from when the response is read (0: no
        hold). At most :data:`MAX_HOLD_S`. For a limit that follows no dimension: the
        longest of what the response says of any dimension.
    source:
        The header the hold came from (``Retry-After``, ``X-RateLimit-Reset``, ...), or
        ``default`` for a bare 429 (:data:`DEFAULT_HOLD_S`), or ``""`` without a hold.
    quota, window_s:
        The upstream's stated policy, ``quota`` units per ``window_s`` seconds (the slowest
        when it states several), or None. Read from the generic headers
        (``RateLimit-Policy``, ``X-RateLimit-Limit`` with a window): in the upstream's
        requests, unless ``dimension`` says otherwise.
    readings:
        What the response says per dimension, in the providers' own headers
        (:class:`~throttle.upstream.dialects.Reading`, :mod:`throttle.upstream.dialects`);
        empty for a response in the generic headers only.
    should_retry:
        Stripe's ``Stripe-Should-Retry``: whether the provider says the call may be made
        again (None: it does not say).
    dimension:
        The dimension ``quota`` and ``window_s`` are in, for a signal as a limit following
        a dimension sees it (:meth:`follow`) when that dimension states its quota; None
        otherwise (the response as a whole, or a dimension that states no rate).
    blamed:
        A refusal that names this signal's dimension (spent, or left with less than the
        call took): for a limit following a dimension (:meth:`follow`), the upstream's
        explicit word, which holds the limit rather than being judged as jitter.
    error:
        The response's status is an error (400 or above), whether or not for its rate:
        what ``should_retry`` speaks of (:attr:`comes_back`, :attr:`final`).
    insists:
        A refusal that the provider says is no jitter, whatever its length: GitHub's
        secondary rate limit (its ``Retry-After`` must be waited out, or the integration
        may be blocked). It holds the limit rather than being judged.
    credit_spent:
        A refusal for a quota that no wait restores: OpenAI's ``insufficient_quota`` (the
        account's credit or budget is used up), told by its body
        (:func:`~throttle.upstream.dialects.credit_spent`). It is :attr:`final`.
    """

    refused: bool
    hold_s: float
    source: str = ""
    quota: float | None = None
    window_s: float | None = None
    readings: tuple[Reading, ...] = ()
    should_retry: bool | None = None
    dimension: str | None = None
    blamed: bool = False
    error: bool = False
    insists: bool = False
    credit_spent: bool = False

    @property
    def comes_back(self) -> bool:
        """Whether the call is to be made again later (``upstream_hook(retry=True)``
        re-runs the task): a refusal for the rate, unless the provider says not to retry
        it (``Stripe-Should-Retry: false``) or its quota is one no wait restores
        (:attr:`credit_spent`); any other error the provider says to retry
        (``Stripe-Should-Retry: true``: a lock timeout's 409, a 500), as Stripe's own
        SDK does."""
        if self.credit_spent:
            return False
        if self.error and self.should_retry is not None:
            return self.should_retry
        return self.refused

    @property
    def final(self) -> bool:
        """Whether the failed call must not be made again: the provider says so
        (``Stripe-Should-Retry: false`` on an error), or refused it for a spent credit
        (:attr:`credit_spent`): retrying it would fail the same way, or do what the call
        did once more."""
        return self.credit_spent or (self.error and self.should_retry is False)

    def final_error(self, status: int | None) -> UpstreamFinal:
        """The :class:`~throttle.errors.UpstreamFinal` that ``retry=True`` raises for a
        :attr:`final` answer of ``status``, saying why."""
        if self.credit_spent:
            why = "insufficient_quota: the account's credit or budget is used up"
            return UpstreamFinal(status, "insufficient_quota", why)
        return UpstreamFinal(status)

    @property
    def rate_per_s(self) -> float | None:
        """The stated policy's sustained rate, units per second, or None."""
        if self.quota is None or self.window_s is None:
            return None
        return self.quota / self.window_s

    def reading(self, dimension: str) -> Reading | None:
        """The reading of ``dimension``, or None when the response does not report it."""
        for reading in self.readings:
            if reading.dimension == dimension:
                return reading
        return None

    def follow(self, dimension: str | None, blamed: frozenset[str] | None = None) -> UpstreamSignal:
        """The signal as a limit that follows ``dimension`` sees it.

        ``blamed``: the dimensions the refusal is for (default: the spent readings; the
        policy adds those left with less than a call's cost,
        :func:`throttle.upstream.policy.seen_by`). A limit following no dimension, or a
        response without per-dimension readings, sees the whole signal (as before
        dimensions). Otherwise the limit sees: a refusal only when its dimension is
        blamed, or when no dimension is (the refusal's cause is unknown: it is everyone's);
        its own dimension's hold (a spent dimension), else the refusal's hold when it is
        refused; and its own dimension's stated quota, in that dimension's units.
        """
        if dimension is None or not self.readings:
            return self
        if blamed is None:
            blamed = frozenset(reading.dimension for reading in self.readings if reading.spent)
        own = self.reading(dimension)
        refused = self.refused and (dimension in blamed or not blamed)
        hold_s, source = 0.0, ""
        if own is not None and own.hold_s > 0:
            hold_s, source = own.hold_s, own.source
        elif refused:
            hold_s, source = self.hold_s, self.source
        named = refused and dimension in blamed
        if own is None or own.rate_per_s is None:  # its dimension states no rate here
            return UpstreamSignal(
                refused, hold_s, source, should_retry=self.should_retry, blamed=named,
                error=self.error, insists=refused and self.insists,
            )  # fmt: skip
        return UpstreamSignal(
            refused, hold_s, source, own.limit, own.window_s, (), self.should_retry, dimension,
            named, self.error, refused and self.insists,
        )  # fmt: skip


# -- the parser: pure, never raises ------------------------------------------------------


def _spent(headers: Mapping[str, str], now: float) -> tuple[float, str] | None:
    """When a header says the quota is spent (remaining 0): (seconds to its reset, the
    header), the longest when several say so; (nan, header) when no reset is given."""
    found: list[tuple[float, str]] = []
    # The IETF draft: RateLimit: "default";r=0;t=3 (several policies: each may be spent);
    # its earlier dictionary form: RateLimit: limit=100, remaining=0, reset=3.
    value = headers.get("ratelimit")
    if value is not None:
        members = values.members(value)
        fields = {}
        for item, params in members:
            name, is_pair, number = item.partition("=")
            if is_pair:
                fields[name.strip().lower()] = number.strip()
            remaining = values.seconds(params.get("r", ""))
            if remaining == 0.0:
                reset = values.seconds(params.get("t", ""))
                found.append((math.nan if reset is None else reset, "RateLimit"))
        if values.seconds(fields.get("remaining", "")) == 0.0:
            reset = values.seconds(fields.get("reset", ""))
            found.append((math.nan if reset is None else reset, "RateLimit"))
    for prefix, resets in (
        ("ratelimit-", ("ratelimit-reset",)),
        # Discord's fractional delta first: the most precise.
        ("x-ratelimit-", ("x-ratelimit-reset-after", "x-ratelimit-reset")),
    ):
        if values.is_zero(headers.get(prefix + "remaining")):
            for name in resets:
                text = headers.get(name)
                reset = None if text is None else values.reset_s(values.split(text, ",")[0], now)
                if reset is not None:
                    found.append((reset, values.title(name)))
                    break
            else:
                found.append((math.nan, values.title(prefix + "remaining")))
    return _longest(found)


def _any_reset(headers: Mapping[str, str], now: float) -> tuple[float, str] | None:
    """A reset header without a spent quota (a 429 that gives only its reset)."""
    for name in ("x-ratelimit-reset-after", "x-ratelimit-reset", "ratelimit-reset"):
        text = headers.get(name)
        if text is not None:
            reset = values.reset_s(values.split(text, ",")[0], now)
            if reset is not None:
                return reset, values.title(name)
    return None


def _policy(headers: Mapping[str, str]) -> tuple[float, float] | None:
    """The stated policy (quota, window s), the slowest of those stated, or None.

    ``RateLimit-Policy: "default";q=100;w=60`` (IETF draft; its earlier form ``100;w=60``),
    else ``X-RateLimit-Limit`` / ``RateLimit-Limit`` members that state a window
    (``100, 100;w=60``). A bare count (``X-RateLimit-Limit: 5000``) states no window.
    """
    found: list[tuple[float, float]] = []
    for name in ("ratelimit-policy", "x-ratelimit-limit", "ratelimit-limit"):
        value = headers.get(name)
        if value is None:
            continue
        for item, params in values.members(value):
            quota = values.seconds(params.get("q", "")) if "q" in params else values.seconds(item)
            window = values.seconds(params.get("w", ""))
            if (
                quota is not None
                and window is not None
                and dialects.MIN_QUOTA <= quota < 1e12
                and 1e-3 <= window <= MAX_WINDOW_S
            ):
                found.append((quota, window))
        if found:
            break  # the IETF header wins over the older ones
    if not found:
        return None
    return min(found, key=lambda policy: policy[0] / policy[1])


def _retry_after(fields: Mapping[str, str], reference: float) -> tuple[float, str] | None:
    """The refusal's own time: ``retry-after-ms`` (OpenAI, Anthropic: the precise one),
    else ``Retry-After`` (delta seconds, or an HTTP-date), or None."""
    delay_ms = values.seconds(fields.get("retry-after-ms", ""))
    if delay_ms is not None:
        return delay_ms / 1000.0, "Retry-After-Ms"
    text = fields.get("retry-after", "")
    delta = values.seconds(text)
    if delta is None and text:
        stamp = values.http_date(text)
        delta = None if stamp is None else max(stamp - reference, 0.0)
    return None if delta is None else (delta, "Retry-After")


def _longest(found: Sequence[tuple[float, str]]) -> tuple[float, str] | None:
    """The longest of several (reset s, header) of spent quotas; (nan, header) when none
    gives its reset."""
    if not found:
        return None
    timed = [item for item in found if not math.isnan(item[0])]
    return max(timed) if timed else found[0]


def parse_upstream(
    status: int,
    headers: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    now: float | None = None,
    body: str | bytes | None = None,
) -> UpstreamSignal | None:
    """Read a response's status code and headers: how long to hold, and the stated policy.

    Pure and total: any header values give a signal or None, never an exception.

    The hold, in this order:

    * a refusal (429; 403 or 503 with ``Retry-After`` or a spent quota; a GitHub 403
      whose ``body`` says it is the secondary rate limit): ``retry-after-ms``, else
      ``Retry-After`` (delta seconds, or an HTTP-date), else GitHub's secondary limit
      (:data:`~throttle.upstream.dialects.GITHUB_SECONDARY_S`), else the reset of a spent
      quota, else (429 only) any reset header, else :data:`DEFAULT_HOLD_S`;
    * any other status: the reset of a spent quota (``remaining`` 0), when it is more than
      :data:`PREEMPT_MIN_S` away (see there why not nearer).

    A spent quota is ``RateLimit: "p";r=0;t=3`` (IETF draft), ``RateLimit-Remaining: 0``
    with ``RateLimit-Reset``, or ``X-RateLimit-Remaining: 0`` with
    ``X-RateLimit-Reset-After`` (fractional delta, Discord) or ``X-RateLimit-Reset``, or a
    provider's dimension with nothing left (:mod:`throttle.upstream.dialects`). Reset
    values below 1e9 are delta seconds; from 1e9, epoch seconds (GitHub); from 1e12, epoch
    milliseconds. Several spent quotas: the longest reset. Holds are clamped to
    :data:`MAX_HOLD_S`.

    Each dimension the response reports in a provider's own headers is a
    :class:`~throttle.upstream.dialects.Reading` of :attr:`UpstreamSignal.readings`; a
    spent one gets its own hold (a refusal's time, else its reset), which limits
    following that dimension see (:meth:`UpstreamSignal.follow`).

    Dates and epochs are read against the response's ``Date`` header when it has one (the
    upstream's own clock: worker clock skew does not enter), else ``now`` (epoch s, default
    ``time.time()``). ``body`` (text or bytes, optional) is read only to tell GitHub's
    secondary rate limit from a plain 403, and OpenAI's ``insufficient_quota`` from a 429
    for the rate (:func:`read_response` passes it when needed).

    An error answer (400 or above) with Stripe's ``Stripe-Should-Retry`` says whether
    the call may be made again (:attr:`UpstreamSignal.comes_back`,
    :attr:`UpstreamSignal.final`), whatever its status.

    Returns None when the response says nothing to act on (no refusal, no hold, no
    policy, no word on retrying an error).
    """
    try:
        fields = values.normalize(headers)
    except (TypeError, ValueError, AttributeError):
        return None  # not headers at all: nothing to read
    clock = time.time() if now is None else now
    date = values.http_date(fields["date"]) if "date" in fields else None
    reference = clock if date is None else date
    readings = dialects.readings(fields, reference)
    secondary = dialects.github_secondary(status, fields, body)
    generic = _spent(fields, reference)
    spent = _longest(
        [
            *([] if generic is None else [generic]),
            *[
                (math.nan if reading.reset_s is None else reading.reset_s, reading.source)
                for reading in readings
                if reading.spent
            ],
        ]
    )
    retry = _retry_after(fields, reference)
    refused = status == 429 or (
        status in _REFUSALS and (retry is not None or spent is not None or secondary)
    )
    hold: tuple[float, str] | None = None
    if refused:
        if retry is not None:
            hold = retry
        elif secondary:
            hold = (dialects.GITHUB_SECONDARY_S, "GitHub secondary limit")
        elif spent is not None and not math.isnan(spent[0]):
            hold = spent
        elif status == 429:
            hold = _any_reset(fields, reference) or (DEFAULT_HOLD_S, "default")
        else:
            hold = (DEFAULT_HOLD_S, "default")
    elif spent is not None and not math.isnan(spent[0]) and spent[0] > PREEMPT_MIN_S:
        hold = spent
    policy = _policy(fields)
    hold_s, source = hold if hold is not None else (0.0, "")
    hold_s = min(hold_s, MAX_HOLD_S)
    readings = [_held(reading, refused, retry, hold_s) for reading in readings]
    should_retry = dialects.should_retry(fields)
    error = isinstance(status, int) and status >= 400
    if (
        not refused
        and hold is None
        and policy is None
        and not any(reading.hold_s > 0 or reading.rate_per_s for reading in readings)
        and not (error and should_retry is not None)
    ):
        return None
    quota, window_s = policy if policy is not None else (None, None)
    insists = refused and (secondary or dialects.github_secondary_timed(status, fields))
    return UpstreamSignal(
        refused, hold_s, source, quota, window_s, tuple(readings), should_retry, error=error,
        insists=insists, credit_spent=dialects.credit_spent(status, body),
    )  # fmt: skip


def _held(
    reading: Reading, refused: bool, retry: tuple[float, str] | None, hold_s: float
) -> Reading:
    """``reading`` with its hold: a spent dimension of a refusal, the refusal's time (else
    the dimension's reset, else the refusal's hold); of any other response, its reset
    when more than :data:`PREEMPT_MIN_S` away."""
    if not reading.spent:
        return reading
    own: tuple[float, str] | None = None
    if refused:
        if retry is not None:
            own = retry
        elif reading.reset_s is not None:
            own = (reading.reset_s, reading.source)
        else:
            own = (hold_s, reading.source)
    elif reading.reset_s is not None and reading.reset_s > PREEMPT_MIN_S:
        own = (reading.reset_s, reading.source)
    if own is None:
        return reading
    return replace(reading, hold_s=min(own[0], MAX_HOLD_S), source=own[1])


def wants_body(response: Any) -> bool:
    """Whether :func:`read_response` reads ``response``'s body: a GitHub 403 with quota
    left and no ``Retry-After`` (its message tells the secondary rate limit from a plain
    "forbidden"), and a 429 (its error body tells OpenAI's ``insufficient_quota``, which
    no wait ends). Such bodies are short. An asyncio caller reads such a body first
    (``await response.aread()``), as :mod:`throttle.aio.upstream` does."""
    status = getattr(response, "status_code", None)
    if status not in (403, 429):
        return False
    try:
        return dialects.wants_body(status, values.normalize(response.headers))
    except (TypeError, ValueError, AttributeError):
        return False


def _body(response: Any) -> str | None:
    """The (short) body of a refused response, read if it can be, else None: a hook runs
    before a client reads the body; reading it there is what requests and httpx allow
    (an async response not read yet refuses: then None)."""
    try:
        if getattr(response, "is_stream_consumed", True) is False:
            response.read()
        text = response.text
    except Exception:  # a closed or async stream: no body, a plain 403
        return None
    return text if isinstance(text, str) else None


def read_response(response: Any, *, now: float | None = None) -> UpstreamSignal | None:
    """:func:`parse_upstream` of a ``requests.Response`` or ``httpx.Response`` (anything with
    ``status_code`` and ``headers``), or of the exception an SDK raised for a refused call
    (:func:`throttle.upstream.answers.answer_of`: ``openai``, ``anthropic``, ``stripe``,
    PyGithub). The body is read only when it decides the answer (:func:`wants_body`)."""
    answer = answer_of(response)
    if answer is not None:
        response = answer
    status = getattr(response, "status_code", None)
    headers = getattr(response, "headers", None)
    if not isinstance(status, int) or headers is None:
        raise RequestError(
            f"an upstream response needs status_code and headers, as requests' and httpx's "
            f"have (got {type(response).__name__})"
        )
    body = _body(response) if wants_body(response) else None
    return parse_upstream(status, headers, now=now, body=body)
