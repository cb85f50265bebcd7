"""Numbers and durations as users write them: the one place that decides what counts as one.

Every number that comes from a user (a limits file, a decorator, a cost reported by a task,
a header of a message, an argument of the limiter) is read by :func:`real`: an ``int`` or a
``float`` (subclasses too), never a ``bool`` (an ``int`` to Python, never a count to a
person), with an ``int`` too large for a float read as infinite rather than raising. Each
caller then states its own bounds and raises its own error (a :class:`ConfigError` for a
limits file, a :class:`RequestError` for a limiter call), naming what was wrong.
"""

from __future__ import annotations

import math
import re

from throttle.errors import ConfigError

__all__ = ["MAX_DURATION_S", "parse_duration", "real", "spelt_s"]

MAX_DURATION_S = 10 * 365 * 86400.0
"""The longest duration accepted, in s (ten years): the limiter's ``max_wait_s``,
``lease_s`` and hold, and every duration of a limits file or a rule
(:func:`parse_duration`), so that a file refuses what the limiter would. Beyond, a typo (a
unit mixed up, digits repeated), not a wait anyone means."""

_DURATION_RE = re.compile(r"(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h|d)", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def real(value: object) -> float | None:
    """``value`` as a float when it is a real number (``int`` or ``float``, not ``bool``),
    else None. An ``int`` beyond a float's range reads as ``inf``; NaN stays NaN: callers
    compare with bounds (``0 <= x < inf``), which NaN fails."""
    if type(value) is float:  # the common case, first
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        return math.inf


def spelt_s(value: object) -> float | None:
    """The seconds ``value`` spells as a duration (a number of seconds, or a string such as
    ``"30s"``), bounds unchecked; None when it is neither (:func:`parse_duration` checks)."""
    if isinstance(value, str):
        match = _DURATION_RE.fullmatch(value.strip())
        return float(match["n"]) * _DURATION_UNITS[match["unit"].lower()] if match else None
    return real(value)


def parse_duration(
    value: object, *, field: str, limit: str | None = None, source: str | None = None
) -> float:
    """Seconds from a number (seconds) or a string such as ``"250ms"``, ``"30s"``, ``"10m"``,
    ``"2h"``, ``"1d"``; finite, >= 0 and at most :data:`MAX_DURATION_S` (ten years)."""
    seconds = spelt_s(value)
    if seconds is None or not (0 <= seconds < math.inf):
        raise ConfigError(
            "must be a duration >= 0: seconds, or a string such as '250ms', '30s', '10m', "
            "'2h', '1d'",
            field=field, value=value, limit=limit, source=source,
        )  # fmt: skip
    if seconds > MAX_DURATION_S:
        raise ConfigError(
            f"must be a duration of at most {MAX_DURATION_S / 86400:g}d (ten years, the "
            "longest the limiter accepts): a longer one is a typo",
            field=field, value=value, limit=limit, source=source,
        )  # fmt: skip
    return seconds
