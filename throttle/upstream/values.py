"""Header values read, leniently and totally: numbers, dates, durations, structured-field
lists. Every function here takes text and gives a value or None; none raises, whatever the
text (the dialects of :mod:`throttle.upstream.dialects` and the generic reader of
:mod:`throttle.upstream.headers` are built on them)."""

from __future__ import annotations

import email.utils
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

__all__ = [
    "EPOCH_MS",
    "EPOCH_S",
    "go_duration",
    "http_date",
    "is_zero",
    "members",
    "normalize",
    "reset_s",
    "rfc3339",
    "seconds",
    "split",
    "title",
]

EPOCH_S = 1e9
"""Reset values from this on are epoch seconds (2001-09-09 onwards), as GitHub sends; below,
delta seconds. A delta that large (31 years) could not be meant."""
EPOCH_MS = 1e12
"""Reset values from this on are epoch milliseconds."""
_DECIMAL = re.compile(r"\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*")


def seconds(text: str) -> float | None:
    """A non-negative decimal number (delta seconds), or None."""
    match = _DECIMAL.fullmatch(text)
    return float(match[1]) if match else None


def http_date(text: str) -> float | None:
    """An HTTP-date (``Wed, 21 Oct 2015 07:28:00 GMT``) as epoch seconds, or None."""
    try:
        stamp = email.utils.parsedate_to_datetime(text)
        if stamp.tzinfo is None:  # "-0000": UTC, says RFC 5322
            stamp = stamp.replace(tzinfo=timezone.utc)
        return stamp.timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def split(value: str, separator: str) -> list[str]:
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


def members(value: str) -> list[tuple[str, dict[str, str]]]:
    """A structured-field list, leniently: each member's item and its ``;key=value``
    parameters (a key without a value is ``?1``, true). Nothing here raises."""
    members = []
    for raw in split(value, ","):
        parts = split(raw, ";")
        item = parts[0].strip().strip('"')
        params: dict[str, str] = {}
        for part in parts[1:]:
            name, has_value, param = part.partition("=")
            params[name.strip().lower()] = param.strip().strip('"') if has_value else "?1"
        members.append((item, params))
    return members


def reset_s(text: str, now: float) -> float | None:
    """A reset header as seconds from now: delta seconds, or epoch seconds (from 1e9) or
    epoch milliseconds (from 1e12), or None. A reset in the past is 0."""
    value = seconds(text)
    if value is None:
        return None
    if value >= EPOCH_MS:
        value = value / 1000.0 - now
    elif value >= EPOCH_S:
        value -= now
    return max(value, 0.0)


def is_zero(text: str | None) -> bool:
    if text is None:
        return False
    value = seconds(split(text, ",")[0])  # "0" or "0, 0;w=60": the first member
    return value == 0.0


def title(name: str) -> str:
    """A header's usual spelling, for messages: ``x-ratelimit-reset`` -> ``X-RateLimit-Reset``."""
    parts = name.split("-")
    return "-".join("RateLimit" if part == "ratelimit" else part.title() for part in parts)


def normalize(headers: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Header names lower-cased (requests keeps their case, httpx lowers them); repeated
    headers joined with ", " as HTTP allows; bytes read as latin-1."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    normalized: dict[str, str] = {}
    for name, value in items:
        key = (name.decode("latin-1") if isinstance(name, bytes) else str(name)).strip().lower()
        text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
        normalized[key] = f"{normalized[key]}, {text}" if key in normalized else text
    return normalized


_GO_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_GO_PART = re.compile(r"([0-9]{1,20}(?:\.[0-9]{1,20})?)(ms|us|µs|ns|h|m|s)")
_GO_DURATION = re.compile(r"(?:[0-9]{1,20}(?:\.[0-9]{1,20})?(?:ms|us|µs|ns|h|m|s)){1,8}")


def go_duration(text: str) -> float | None:
    """A Go ``time.Duration`` string as seconds (``20ms``, ``1.5s``, ``6m0s``,
    ``1h2m3.5s``), as OpenAI's ``x-ratelimit-reset-*`` headers send it; a bare decimal
    number is seconds. None for anything else (a sign, an exponent, an unknown unit)."""
    text = text.strip()
    plain = seconds(text)
    if plain is not None:
        return plain
    if _GO_DURATION.fullmatch(text) is None:
        return None
    return sum(float(number) * _GO_UNITS[unit] for number, unit in _GO_PART.findall(text))


_RFC3339 = re.compile(
    r"\s*([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]{1,30})?"
    r"(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))\s*"
)


def rfc3339(text: str) -> float | None:
    """An RFC 3339 timestamp (``2025-11-22T02:00:30Z``, ``...30.5+01:00``) as epoch
    seconds, as Anthropic's ``anthropic-ratelimit-*-reset`` headers send it; None for
    anything else (no offset, an impossible date). Read by hand: ``datetime.fromisoformat``
    of Python 3.10 reads no ``Z``."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(match[i]) for i in range(1, 7))
    fraction = float(match[7]) if match[7] else 0.0
    offset = timedelta(0)
    if match[9]:
        offset = timedelta(hours=int(match[10]), minutes=int(match[11]))
        if match[9] == "-":
            offset = -offset
    try:
        stamp = datetime(year, month, day, hour, minute, min(second, 59), tzinfo=timezone.utc)
        return (stamp - offset).timestamp() + fraction + max(second - 59, 0)
    except (ValueError, OverflowError):
        return None
