"""The upstream's headers read: status code and headers in, an :class:`UpstreamSignal` out.

Pure and total: no I/O, no clock but the one passed (or ``time.time()``), and whatever the
header values, :func:`parse_upstream` gives a signal or None, never an exception. What the
signal asks of the limits is decided in :mod:`throttle.upstream.policy`.
"""

from __future__ import annotations

import email.utils
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timezone
from typing import Any

from throttle.errors import RequestError

__all__ = [
    "DEFAULT_HOLD_S",
    "MAX_HOLD_S",
    "MAX_WINDOW_S",
    "PREEMPT_MIN_S",
    "UpstreamSignal",
    "parse_upstream",
    "read_response",
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
