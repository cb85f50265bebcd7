"""The upstream's word: 429 / Retry-After and RateLimit headers, handed to the throttler.

When the third-party API answers 429 with ``Retry-After``, or says in its rate-limit headers
that the quota is spent, one call hands that to the throttler and the whole fleet holds the
limit until the upstream's reset (:meth:`Limiter.hold`, atomic in Redis), instead of every
worker finding out by its own 429. When the upstream states its policy (``RateLimit-Policy``,
or ``X-RateLimit-Limit`` with a window) and it is slower than the limit, the fleet's run-time
rate is lowered to it (:class:`throttle.rates.RateBook`). Inside a task::

    import requests
    from throttle.celery import throttled
    from throttle.upstream import report_upstream, upstream_hook

    session = requests.Session()
    session.hooks["response"].append(upstream_hook(retry=True))     # one line, every call

    @app.task
    @throttled("github")
    def fetch(url):
        return session.get(url).json()   # a 429 re-runs the task after the upstream's reset

    # or with httpx: httpx.Client(event_hooks={"response": [upstream_hook(retry=True)]})
    # or by hand:    report_upstream(response, retry=True)

Without Celery, :func:`apply_upstream` does the same for a :class:`Limiter` and a limit::

    response = requests.get(url)
    apply_upstream(limiter, response, github, rates=RateBook(limiter.client, limiter.keyspace))

:func:`parse_upstream` is the pure part: status code and headers in, an
:class:`UpstreamSignal` (or None) out; it never raises, whatever the header values.
"""

from __future__ import annotations

import email.utils
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timezone
from typing import Any

from throttle.adaptive import Adaptive, Learned, LearnedRates
from throttle.errors import BackendError, RequestError, Throttled
from throttle.limiter import Limiter
from throttle.rates import RateBook
from throttle.spec import Limit

__all__ = [
    "DEFAULT_HOLD_S",
    "MAX_HOLD_S",
    "MAX_WINDOW_S",
    "PREEMPT_MIN_S",
    "UpstreamSignal",
    "apply_upstream",
    "parse_upstream",
    "read_response",
    "report_upstream",
    "upstream_hook",
]

logger = logging.getLogger("throttle")

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
SPENT_SPACINGS = 2.0
"""A refusal whose hold is longer than this many spacings of the limit (and than
:data:`PREEMPT_MIN_S`) says the upstream's quota is spent (:func:`quota_spent`)."""
MAX_WINDOW_S = 31 * 86400.0
"""The longest policy window taken from the headers, in s (a monthly quota); a longer one
is ignored rather than lowering a rate for ever on a typo."""
_EPOCH_S = 1e9
"""Reset values from this on are epoch seconds (2001-09-09 onwards), as GitHub sends; below,
delta seconds. A delta that large (31 years) could not be meant."""
_EPOCH_MS = 1e12
"""Reset values from this on are epoch milliseconds."""
_REFUSALS = (403, 429, 503)
"""Statuses that refuse a call for its rate: 429 always; 403 (GitHub's primary and secondary
limits) and 503 only with ``Retry-After`` or a spent quota in the headers."""

_DECIMAL = re.compile(r"\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*")


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
        hold). At most :data:`MAX_HOLD_S`.
    source:
        The header the hold came from (``Retry-After``, ``X-RateLimit-Reset``, ...), or
        ``default`` for a bare 429 (:data:`DEFAULT_HOLD_S`), or ``""`` without a hold.
    quota, window_s:
        The upstream's stated policy, ``quota`` units per ``window_s`` seconds (the slowest
        when it states several), or None.
    """

    refused: bool
    hold_s: float
    source: str = ""
    quota: float | None = None
    window_s: float | None = None

    @property
    def rate_per_s(self) -> float | None:
        """The stated policy's sustained rate, units per second, or None."""
        if self.quota is None or self.window_s is None:
            return None
        return self.quota / self.window_s


# -- the parser: pure, never raises ------------------------------------------------------


def _seconds(text: str) -> float | None:
    """A non-negative decimal number (delta seconds), or None."""
    match = _DECIMAL.fullmatch(text)
    return float(match[1]) if match else None


def _http_date(text: str) -> float | None:
    """An HTTP-date (``Wed, 21 Oct 2015 07:28:00 GMT``) as epoch seconds, or None."""
    try:
        stamp = email.utils.parsedate_to_datetime(text)
        if stamp.tzinfo is None:  # "-0000": UTC, says RFC 5322
            stamp = stamp.replace(tzinfo=timezone.utc)
        return stamp.timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _split(value: str, separator: str) -> list[str]:
    """Split on ``separator`` outside double-quoted strings (structured fields, RFC 8941)."""
    parts: list[str] = []
    current: list[str] = []
    quoted = escaped = False
    for char in value:
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == separator and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts


def _members(value: str) -> list[tuple[str, dict[str, str]]]:
    """A structured-field list, leniently: each member's item and its ``;key=value``
    parameters (a key without a value is ``?1``, true). Nothing here raises."""
    members = []
    for raw in _split(value, ","):
        parts = _split(raw, ";")
        item = parts[0].strip().strip('"')
        params: dict[str, str] = {}
        for part in parts[1:]:
            name, has_value, param = part.partition("=")
            params[name.strip().lower()] = param.strip().strip('"') if has_value else "?1"
        members.append((item, params))
    return members


def _reset_s(text: str, now: float) -> float | None:
    """A reset header as seconds from now: delta seconds, or epoch seconds (from 1e9) or
    epoch milliseconds (from 1e12), or None. A reset in the past is 0."""
    value = _seconds(text)
    if value is None:
        return None
    if value >= _EPOCH_MS:
        value = value / 1000.0 - now
    elif value >= _EPOCH_S:
        value -= now
    return max(value, 0.0)


def _is_zero(text: str | None) -> bool:
    if text is None:
        return False
    value = _seconds(_split(text, ",")[0])  # "0" or "0, 0;w=60": the first member
    return value == 0.0


def _spent(headers: Mapping[str, str], now: float) -> tuple[float, str] | None:
    """When a header says the quota is spent (remaining 0): (seconds to its reset, the
    header), the longest when several say so; (nan, header) when no reset is given."""
    found: list[tuple[float, str]] = []
    # The IETF draft: RateLimit: "default";r=0;t=3 (several policies: each may be spent);
    # its earlier dictionary form: RateLimit: limit=100, remaining=0, reset=3.
    value = headers.get("ratelimit")
    if value is not None:
        members = _members(value)
        fields = {}
        for item, params in members:
            name, is_pair, number = item.partition("=")
            if is_pair:
                fields[name.strip().lower()] = number.strip()
            remaining = _seconds(params.get("r", ""))
            if remaining == 0.0:
                reset = _seconds(params.get("t", ""))
                found.append((math.nan if reset is None else reset, "RateLimit"))
        if _seconds(fields.get("remaining", "")) == 0.0:
            reset = _seconds(fields.get("reset", ""))
            found.append((math.nan if reset is None else reset, "RateLimit"))
    for prefix, resets in (
        ("ratelimit-", ("ratelimit-reset",)),
        # Discord's fractional delta first: the most precise.
        ("x-ratelimit-", ("x-ratelimit-reset-after", "x-ratelimit-reset")),
    ):
        if _is_zero(headers.get(prefix + "remaining")):
            for name in resets:
                text = headers.get(name)
                reset = None if text is None else _reset_s(_split(text, ",")[0], now)
                if reset is not None:
                    found.append((reset, _title(name)))
                    break
            else:
                found.append((math.nan, _title(prefix + "remaining")))
    if not found:
        return None
    timed = [item for item in found if not math.isnan(item[0])]
    return max(timed) if timed else found[0]


def _any_reset(headers: Mapping[str, str], now: float) -> tuple[float, str] | None:
    """A reset header without a spent quota (a 429 that gives only its reset)."""
    for name in ("x-ratelimit-reset-after", "x-ratelimit-reset", "ratelimit-reset"):
        text = headers.get(name)
        if text is not None:
            reset = _reset_s(_split(text, ",")[0], now)
            if reset is not None:
                return reset, _title(name)
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
        for item, params in _members(value):
            quota = _seconds(params.get("q", "")) if "q" in params else _seconds(item)
            window = _seconds(params.get("w", ""))
            if (
                quota is not None
                and window is not None
                and 0 < quota < 1e12
                and 1e-3 <= window <= MAX_WINDOW_S
            ):
                found.append((quota, window))
        if found:
            break  # the IETF header wins over the older ones
    if not found:
        return None
    return min(found, key=lambda policy: policy[0] / policy[1])


def _title(name: str) -> str:
    """A header's usual spelling, for messages: ``x-ratelimit-reset`` -> ``X-RateLimit-Reset``."""
    parts = name.split("-")
    return "-".join("RateLimit" if part == "ratelimit" else part.title() for part in parts)


def _normalize(headers: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Header names lower-cased (requests keeps their case, httpx lowers them); repeated
    headers joined with ", " as HTTP allows; bytes read as latin-1."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    normalized: dict[str, str] = {}
    for name, value in items:
        key = (name.decode("latin-1") if isinstance(name, bytes) else str(name)).strip().lower()
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        normalized[key] = f"{normalized[key]}, {text}" if key in normalized else text
    return normalized


def parse_upstream(
    status: int,
    headers: Mapping[str, Any] | Iterable[tuple[str, Any]],
    *,
    now: float | None = None,
) -> UpstreamSignal | None:
    """Read a response's status code and headers: how long to hold, and the stated policy.

    Pure and total: any header values give a signal or None, never an exception.

    The hold, in this order:

    * a refusal (429; 403 or 503 with ``Retry-After`` or a spent quota): ``Retry-After``
      (delta seconds, or an HTTP-date), else the reset of a spent quota, else (429 only) any
      reset header, else :data:`DEFAULT_HOLD_S`;
    * any other status: the reset of a spent quota (``remaining`` 0), when it is more than
      :data:`PREEMPT_MIN_S` away (see there why not nearer).

    A spent quota is ``RateLimit: "p";r=0;t=3`` (IETF draft), ``RateLimit-Remaining: 0``
    with ``RateLimit-Reset``, or ``X-RateLimit-Remaining: 0`` with
    ``X-RateLimit-Reset-After`` (fractional delta, Discord) or ``X-RateLimit-Reset``. Reset
    values below 1e9 are delta seconds; from 1e9, epoch seconds (GitHub); from 1e12, epoch
    milliseconds. Several spent quotas: the longest reset. Holds are clamped to
    :data:`MAX_HOLD_S`.

    Dates and epochs are read against the response's ``Date`` header when it has one (the
    upstream's own clock: worker clock skew does not enter), else ``now`` (epoch s, default
    ``time.time()``).

    Returns None when the response says nothing to act on (no refusal, no hold, no policy).
    """
    try:
        fields = _normalize(headers)
    except (TypeError, ValueError, AttributeError):
        return None  # not headers at all: nothing to read
    clock = time.time() if now is None else now
    date = _http_date(fields["date"]) if "date" in fields else None
    reference = clock if date is None else date
    spent = _spent(fields, reference)
    refused = status == 429 or (
        status in _REFUSALS and ("retry-after" in fields or spent is not None)
    )
    hold: tuple[float, str] | None = None
    if refused:
        text = fields.get("retry-after", "")
        delta = _seconds(text)
        if delta is None and text:
            stamp = _http_date(text)
            delta = None if stamp is None else max(stamp - reference, 0.0)
        if delta is not None:
            hold = (delta, "Retry-After")
        elif spent is not None and not math.isnan(spent[0]):
            hold = spent
        elif status == 429:
            hold = _any_reset(fields, reference) or (DEFAULT_HOLD_S, "default")
        else:
            hold = (DEFAULT_HOLD_S, "default")
    elif spent is not None and not math.isnan(spent[0]) and spent[0] > PREEMPT_MIN_S:
        hold = spent
    policy = _policy(fields)
    if not refused and hold is None and policy is None:
        return None
    hold_s, source = hold if hold is not None else (0.0, "")
    hold_s = min(hold_s, MAX_HOLD_S)
    quota, window_s = policy if policy is not None else (None, None)
    return UpstreamSignal(refused, hold_s, source, quota, window_s)


def read_response(response: Any, *, now: float | None = None) -> UpstreamSignal | None:
    """:func:`parse_upstream` of a ``requests.Response`` or ``httpx.Response`` (anything with
    ``status_code`` and ``headers``)."""
    status = getattr(response, "status_code", None)
    headers = getattr(response, "headers", None)
    if not isinstance(status, int) or headers is None:
        raise RequestError(
            f"an upstream response needs status_code and headers, as requests' and httpx's "
            f"have (got {type(response).__name__})"
        )
    return parse_upstream(status, headers, now=now)


# -- acting on it ------------------------------------------------------------------------


def _rate_text(number: float) -> str:
    """A number for a rate spec: plain decimal, no exponent (``Limit.parse`` reads no 'e')."""
    return f"{number:.6f}".rstrip("0").rstrip(".")


def _lowered(current: Limit, configured: Limit, signal: UpstreamSignal) -> str | None:
    """The rate spec to store when the upstream states a slower rate than ``current`` (and
    than ``configured``: never above it), or None."""
    stated = signal.rate_per_s
    if stated is None or signal.quota is None or signal.window_s is None:
        return None
    if current.algorithm.holds_units:
        return None
    if not (stated < current.rate_per_s and stated <= configured.rate_per_s):
        return None
    spec = f"{_rate_text(signal.quota)}/{_rate_text(signal.window_s)}s"
    if current.algorithm.reserves:
        # Keep the shape (a burst-1 shaper stays strict) but never more than the quota.
        burst = min(current.capacity, max(signal.quota, 1.0))
        spec += f" burst {_rate_text(burst)}"
    return spec


@dataclass(frozen=True)
class _Target:
    current: Limit  # the limit as acquired (with its run-time or learned rate)
    configured: Limit
    key: str | None
    per_call: bool  # charged one unit per call: its units are the upstream's requests
    adaptive: Adaptive | None = None
    ceiling: Limit | None = None  # the rate in force before learning (default: configured)


def _plan(
    signal: UpstreamSignal, targets: Sequence[_Target], rates: bool
) -> list[tuple[_Target, str | None]]:
    """What ``signal`` asks of each target: the target, and the rate spec to store for it
    (None: none; always None without a rate book). Whether to hold is ``signal.hold_s``.
    The pure part of :func:`_apply` and of its awaited twin in :mod:`throttle.aio`."""
    plan: list[tuple[_Target, str | None]] = []
    for target in targets:
        spec = None
        # One rate per limit for all its keys: a keyed limit's key speaks for itself only.
        if rates and target.key is None and target.per_call:
            spec = _lowered(target.current, target.configured, signal)
        plan.append((target, spec))
    return plan


def _log_hold(signal: UpstreamSignal, target: _Target) -> None:
    logger.info(
        "throttle: upstream %s: holding %s%s for %.3f s",
        signal.source, target.current.name, f" key {target.key!r}" if target.key else "",
        signal.hold_s,
    )  # fmt: skip


def _log_rate(signal: UpstreamSignal, target: _Target, spec: str) -> None:
    name = target.current.name
    logger.warning(
        "throttle: upstream states %s; rate of %s lowered from %g/s to %s "
        "(RateBook.clear(%r) goes back)",
        f"{_rate_text(signal.quota or 0)} per {_rate_text(signal.window_s or 0)} s",
        name, target.current.rate_per_s, spec, name,
    )  # fmt: skip


def quota_spent(signal: UpstreamSignal, limit: Limit) -> bool:
    """Whether a refusal says the upstream's quota is spent, rather than that one call
    came early: its hold is longer than :data:`PREEMPT_MIN_S` (integer-second headers are
    that much off: a shorter one says "the next call is within rounding") and than
    :data:`SPENT_SPACINGS` spacings of ``limit`` (a slow limit's next slot is far anyway)."""
    spacing = 1.0 / limit.rate_per_s
    return signal.hold_s > max(PREEMPT_MIN_S, SPENT_SPACINGS * spacing)


def _reserved_s(target: _Target) -> bool:
    """Whether a refusal of ``target`` asks how far ahead its slots are handed out (an
    adaptive limit's episode lasts as long as them: one extra round trip, on refusals)."""
    return target.adaptive is not None


def _judge(signal: UpstreamSignal, target: _Target, answer: Learned) -> bool:
    """Whether a refusal of ``target``, counted fleet-wide as ``answer``, holds the whole
    limit (its key): when the refusals persist, the quota is spent, or the limit is faster
    than the upstream's stated policy. Otherwise the refused call is one that the limiter's
    schedule explains (early or late by jitter): the refused task alone comes back for the
    limit's next free slot, and the fleet goes on (an adaptive limit at its lowered rate).
    The pure part of :func:`_answer` and of its awaited twin in :mod:`throttle.aio`."""
    where = f" key {target.key!r}" if target.key else ""
    if answer.decreased:
        ceiling = target.ceiling or target.configured
        logger.info(
            "throttle: upstream refused %s%s: learned rate lowered to %.3f/s (ceiling %g/s)",
            target.current.name, where, answer.rate_per_s, ceiling.rate_per_s,
        )  # fmt: skip
    stated = signal.rate_per_s
    if stated is not None and target.current.rate_per_s > stated * (1 + 1e-9):
        return True  # the limit is above the upstream's word: not jitter, a wrong rate
    if answer.persist or quota_spent(signal, target.current):
        return True
    logger.debug(
        "throttle: upstream refused %s%s (%d in the window): no hold, the call comes back",
        target.current.name, where, answer.refusals,
    )  # fmt: skip
    return False


def _answer(
    limiter: Limiter, learned: LearnedRates, signal: UpstreamSignal, target: _Target
) -> bool:
    """Count a refusal of ``target`` fleet-wide (an adaptive limit learns from it), and
    decide whether it holds the whole limit (:func:`_judge`)."""
    reserved_s = 0.0
    if _reserved_s(target):
        reserved_s = limiter.peek(target.current, target.key).reset_after_s
    answer = learned.refused(
        target.ceiling or target.configured, target.key, target.adaptive,
        rate_per_s=target.current.rate_per_s, reserved_s=reserved_s,
    )  # fmt: skip
    return _judge(signal, target, answer)


def _stated_for(signal: UpstreamSignal | None, target: _Target) -> float | None:
    """The rate an answer that is no refusal states for ``target`` (None: a success)."""
    return None if signal is None or not target.per_call else signal.rate_per_s


def _learn(learned: LearnedRates, signal: UpstreamSignal | None, target: _Target) -> None:
    """An answer that is not a refusal, for an adaptive target: a stated rate replaces
    the learned one; otherwise a success lets it probe up."""
    if target.adaptive is None:
        return
    ceiling = target.ceiling or target.configured
    stated = _stated_for(signal, target)
    if stated is not None:
        learned.stated(ceiling, target.key, target.adaptive, stated)
    else:
        learned.succeeded(ceiling, target.key, target.adaptive)


def _apply(
    limiter: Limiter,
    rates: RateBook | None,
    signal: UpstreamSignal,
    targets: Sequence[_Target],
    learned: LearnedRates | None = None,
) -> bool:
    """Act on ``signal`` for each target; returns whether it held any of them."""
    held = False
    for target, spec in _plan(signal, targets, rates is not None):
        hold = signal.hold_s > 0
        if learned is not None:
            if signal.refused:
                hold = _answer(limiter, learned, signal, target) and hold
            else:
                _learn(learned, signal, target)
        if hold:
            limiter.hold(target.current.name, target.key, signal.hold_s)
            _log_hold(signal, target)
            held = True
        if rates is not None and spec is not None:
            rates.set(target.configured, spec)
            _log_rate(signal, target, spec)
    return held


def _expect_limit(limit: object) -> None:
    """The limit argument of :func:`apply_upstream` (and of its twins) checked."""
    if not isinstance(limit, Limit):
        raise RequestError(f"expected a Limit, e.g. Limit.parse('50/s') (got {limit!r})")


def apply_upstream(
    limiter: Limiter,
    response: Any,
    limit: Limit,
    key: str | None = None,
    *,
    rates: RateBook | None = None,
    learned: LearnedRates | None = None,
    adaptive: Adaptive | None = None,
    now: float | None = None,
) -> UpstreamSignal | None:
    """Without Celery: hold ``limit`` (of ``key`` only, when given) for the upstream's time,
    and with ``rates``, lower its run-time rate to the upstream's stated one when slower.

    ``limit`` is the configured limit; ``rates`` the book the fleet reads (the rate is
    lowered only for a limit without key, and never raised: ``rates.clear(limit.name)``
    goes back to the configured rate). With ``learned``, a refusal is answered in
    proportion, as by :func:`report_upstream` (a hold only when refusals persist or the
    quota is spent), and with ``adaptive`` the limit learns its rate
    (``learned.current(limit, key, adaptive)`` is then the limit to acquire). Returns
    what the response said (None: nothing). Raises :class:`BackendError` when Redis
    fails. For asyncio code: :func:`throttle.aio.apply_upstream`.
    """
    _expect_limit(limit)
    ceiling = limit if rates is None else rates.current(limit)
    current = ceiling
    if learned is not None and adaptive is not None:
        current = learned.current(ceiling, key, adaptive)
    target = _Target(current, limit, key, True, adaptive, ceiling)
    signal = read_response(response, now=now)
    if signal is None:
        if learned is not None:
            _learn(learned, None, target)
        return None
    _apply(limiter, rates, signal, [target], learned)
    return signal


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


def report_upstream(
    response: Any, *, limit: str | Limit | None = None, retry: bool = False
) -> UpstreamSignal | None:
    """Hand the upstream's answer to the throttler, from inside a throttled task.

    ``response`` is a ``requests.Response`` or an ``httpx.Response`` (anything with
    ``status_code`` and ``headers``); see :func:`parse_upstream` for what is read.

    * **Hold**: the task's limits (``limit``: only the one of this name) are held for the
      upstream's time, fleet-wide: a keyed limit for the task's key only, a limit without
      key as a whole. Reserved slots that fall inside the hold are voided when their tasks
      reach them, so the fleet stops at once, not after the slots already handed out.
      A refusal holds only when the upstream says its quota is spent (a hold longer than
      :data:`PREEMPT_MIN_S` and :data:`SPENT_SPACINGS` spacings: :func:`quota_spent`),
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
      token budget counts other units than the upstream's requests); never above the
      configured rate, and never raised again by this function: when the upstream's limit
      is back up, an operator goes back to the configured rate with
      ``RateBook(client, keyspace).clear(name)`` (a warning in the worker's log names the
      limit when it is lowered).
    * **Retry** (``retry=True``): when the upstream refused the call, the task is run again
      after the hold: re-published with the same id, arguments, options and links, through
      the queue's lane, without spending ``max_retries`` (:func:`throttle.celery.defer_task`).
      A refusal that held nothing re-publishes it at once, to take the limit's next free
      slot: its ``Retry-After`` (whole seconds, rounded up) says no more than "within
      rounding", and the limit's spacing keeps it from the calls before it.
      This raises celery's ``Retry``: let it propagate. The task's ``max_wait`` or
      ``expires`` still bounds it (ThrottleTimeout, or ``on_timeout``); an upstream that
      refuses for ever is otherwise retried for ever. In eager mode, direct calls, and
      tasks that are not throttled, it raises :class:`Throttled` with the hold instead.

    Outside a throttled task this holds nothing (like ``report_cost``). Redis errors are
    logged, not raised: the call is made already. Returns what the response said (None:
    nothing to act on).
    """
    signal = read_response(response)
    # Imported here: the parser and the plain form need no Celery.
    from throttle.celery import Throttler, defer_task  # noqa: PLC0415
    from throttle.celery.execution import current_ticket  # noqa: PLC0415

    ticket = current_ticket()
    if ticket is None or ticket.acquisition is None:
        if signal is not None and retry and signal.refused:
            _release(response)
            raise Throttled(signal.hold_s)
        return signal
    name = limit.name if isinstance(limit, Limit) else limit
    acquisition = ticket.acquisition
    rules = {rule.name: rule for rule in ticket.rules}
    picked = [
        (current, key, cost, rules.get(current.name))
        for (current, key), cost in zip(acquisition.targets, acquisition.costs, strict=True)
        if name is None or current.name == name
    ]
    if not picked:  # checked on every response: a misspelt name fails on the first call
        names = ", ".join(repr(current.name) for current, _ in acquisition.targets)
        raise RequestError(f"report_upstream: the task has no limit {name!r} (it has {names})")
    adaptive = any(rule is not None and rule.adaptive for *_, rule in picked)
    if signal is None and not adaptive:
        return None
    from celery._state import get_current_task  # noqa: PLC0415

    task = get_current_task()
    throttler = Throttler.of(task.app)
    held = True  # Redis failing: the task comes back after the upstream's time
    try:
        targets = []
        for current, key, cost, rule in picked:
            configured = current if rule is None else rule.limit
            ceiling = throttler.rates.current(configured)
            learning = None if rule is None else rule.adaptive
            targets.append(_Target(current, configured, key, cost == 1.0, learning, ceiling))
        if signal is None:
            for target in targets:
                _learn(throttler.learned, None, target)
        else:
            held = _apply(throttler.limiter, throttler.rates, signal, targets, throttler.learned)
    except BackendError as exc:
        throttler.outage(exc)
    if signal is None:
        return None
    if retry and signal.refused:
        _release(response)
        # A refusal that held nothing is one the limit's schedule explains (jitter), and
        # its Retry-After (whole seconds, rounded up) says no more than "within rounding":
        # the task takes the limit's next free slot at once. Waiting out the rounded
        # second instead idles the limit at the end of a backlog (eager mode and direct
        # calls, which have no slot to take, are told the upstream's time).
        eager = task.request.is_eager or task.request.called_directly
        countdown = signal.hold_s if held or eager else 0.0
        defer_task(countdown, [target.current.name for target in targets])
    return signal


def upstream_hook(*, limit: str | Limit | None = None, retry: bool = False) -> Callable[..., None]:
    """A response hook that calls :func:`report_upstream` on every response::

        session.hooks["response"].append(upstream_hook(retry=True))          # requests
        httpx.Client(event_hooks={"response": [upstream_hook(retry=True)]})  # httpx

    With ``retry=True`` a refused call never returns to the task body: the task is
    re-published for after the hold (see :func:`report_upstream`). The hook returns None,
    which requests needs (a value would replace the response). For ``httpx.AsyncClient``
    outside Celery: :func:`throttle.aio.upstream_hook`.
    """

    def hook(response: Any, *args: Any, **kwargs: Any) -> None:
        report_upstream(response, limit=limit, retry=retry)

    return hook
