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

__all__ = ["parse_duration", "real"]

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


def parse_duration(
    value: object, *, field: str, limit: str | None = None, source: str | None = None
) -> float:
    """Seconds from a number (seconds) or a string such as ``"250ms"``, ``"30s"``, ``"10m"``,
    ``"2h"``, ``"1d"``; finite and >= 0."""
    seconds = real(value)
    if isinstance(value, str):
        match = _DURATION_RE.fullmatch(value.strip())
        if match:
            seconds = float(match["n"]) * _DURATION_UNITS[match["unit"].lower()]
    if seconds is None or not (0 <= seconds < math.inf):
        raise ConfigError(
            "must be a duration >= 0: seconds, or a string such as '250ms', '30s', '10m', "
            "'2h', '1d'",
            field=field, value=value, limit=limit, source=source,
        )  # fmt: skip
    return seconds
