"""The providers' own rate-limit headers, read per dimension.

Many APIs limit more than one thing at once and say so per dimension: OpenAI counts
requests and tokens, Anthropic requests, input and output tokens, GitHub each resource
(``core``, ``search``, ``graphql``...) on its own, Stripe names the limit that refused a
call, Discord tells a route's bucket from its global limit. Each reader here turns one
provider's headers into :class:`Reading` s, one per dimension it reports; a limit that
follows a dimension (``upstream: tokens`` in a limits file) is then steered by that
dimension's reading only (:meth:`throttle.upstream.headers.UpstreamSignal.follow`).

The readers are pure and total, like the rest of the parser: header text in (names
lower-cased, :func:`throttle.upstream.values.normalize`), readings out, never an exception.

- OpenAI: ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` (reset a Go duration,
  ``6m0s``): ``requests``, ``tokens``, per minute or per day as the reset tells
  (:func:`openai_window`).
- Anthropic: ``anthropic-ratelimit-{dimension}-{limit,remaining,reset}`` (reset an RFC 3339
  time): ``requests``, ``tokens``, ``input-tokens``, ``output-tokens``.
- GitHub: ``x-ratelimit-{limit,remaining,used,reset}`` with ``x-ratelimit-resource``: the
  resource (``core``, ``search``, ``graphql``...).
- Stripe: ``stripe-rate-limited-reason`` on a 429: the reason (``global-rate``...).
- Discord: ``x-ratelimit-{limit,remaining,reset,reset-after}`` with
  ``x-ratelimit-bucket``, ``-scope``, ``-global``: ``route``, ``global``, ``shared``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from throttle.upstream import values

__all__ = [
    "DAY_FACTOR",
    "GITHUB_SECONDARY_S",
    "MAX_COUNT",
    "MIN_QUOTA",
    "NAMED_DIMENSIONS",
    "PER_DAY_S",
    "PER_MINUTE_S",
    "Reading",
    "credit_spent",
    "dimension_name",
    "github_secondary",
    "openai_window",
    "readings",
    "should_retry",
]

PER_MINUTE_S = 60.0
"""The window of OpenAI's and Anthropic's stated limits, in s: both publish their limits
per minute (requests, tokens per minute) and state the count only, not the window."""
PER_DAY_S = 86400.0
"""The window of OpenAI's daily limits (requests or tokens per day: some models and tiers
are limited per day, and ``x-ratelimit-limit-requests`` then states the day's count)."""
DAY_FACTOR = 8.0
"""An OpenAI limit whose implied window (:func:`openai_window`) is a day within this
factor (3 h to 8 days) is read as per day: concurrent calls make ``remaining`` and the
reset disagree a little, never by a factor of 1,440."""
GITHUB_SECONDARY_S = 60.0
"""The hold after GitHub's secondary rate limit when it gives no ``Retry-After``, in s:
"wait for at least one minute before retrying", say GitHub's docs."""
MAX_COUNT = 1e15
"""The largest limit or remaining count taken from a header; a larger one is ignored."""
MIN_QUOTA = 1e-6
"""The smallest stated limit that states a rate (a millionth of a call or token per
window); a smaller one is no rate anyone means, and is not stored (rate specs carry six
decimals)."""

_DIMENSION = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
_OPENAI = ("requests", "tokens")
_ANTHROPIC = ("requests", "tokens", "input-tokens", "output-tokens")
NAMED_DIMENSIONS = (*_ANTHROPIC, "route", "global", "shared")
"""The dimensions the OpenAI, Anthropic and Discord readers name themselves; GitHub's
resources and Stripe's reasons are whatever their headers say, so no list holds them all."""
_SECONDARY_TEXT = "secondary rate limit"
_CREDIT_TEXT = '"insufficient_quota"'
"""OpenAI's error code (and type) for a spent credit, as its JSON error body spells it."""
_BODY_CHARS = 4096


@dataclass(frozen=True)
class Reading:
    """What one response says of one dimension of the upstream's limit.

    Attributes
    ----------
    dimension:
        Its name, lower-case (``requests``, ``tokens``, a GitHub resource, a Stripe reason,
        Discord's ``route``, ``global`` or ``shared``): what ``upstream:`` of a limit names.
    limit, remaining:
        The stated quota and what is left of it, in the dimension's units (None: not said).
    reset_s:
        Seconds from the response until the dimension is replenished (None: not said).
    window_s:
        The window the quota is per, in s, when the provider's limits have a known one
        (Anthropic: a minute; OpenAI: a minute or a day, :func:`openai_window`); None
        otherwise (then the quota states no rate).
    spent:
        The upstream says this dimension is spent: ``remaining`` 0, or it is named as the
        reason of a refusal (Stripe's reason, Discord's scope).
    hold_s:
        How long to hold a limit that follows this dimension, in s (0: no hold): set by
        :func:`throttle.upstream.headers.parse_upstream` for a spent dimension.
    source:
        The header the reset or the blame came from, for messages.
    """

    dimension: str
    limit: float | None = None
    remaining: float | None = None
    reset_s: float | None = None
    window_s: float | None = None
    spent: bool = False
    hold_s: float = 0.0
    source: str = ""

    @property
    def rate_per_s(self) -> float | None:
        """The stated quota's sustained rate, units per second, or None."""
        if self.limit is None or self.window_s is None or self.limit < MIN_QUOTA:
            return None
        return self.limit / self.window_s


def dimension_name(text: object) -> str | None:
    """A dimension's name as limits and readings spell it (lower-case letters, digits,
    ``_``, ``-``, ``.``; up to 64 characters), or None for anything else."""
    if not isinstance(text, str):
        return None
    name = text.strip().lower()
    return name if _DIMENSION.fullmatch(name) else None


def _count(text: str | None) -> float | None:
    """A count header (its first member): a non-negative number below :data:`MAX_COUNT`."""
    if text is None:
        return None
    value = values.seconds(values.split(text, ",")[0])
    return value if value is not None and value < MAX_COUNT else None


def _reading(
    dimension: str,
    limit: float | None,
    remaining: float | None,
    reset_s: float | None,
    window_s: float | None,
    source: str,
) -> Reading | None:
    """A reading of what was said, or None when nothing was."""
    if limit is None and remaining is None and reset_s is None:
        return None
    if limit is None or limit < MIN_QUOTA:
        window_s = None  # no quota stated: no rate
    return Reading(dimension, limit, remaining, reset_s, window_s, remaining == 0.0, 0.0, source)


def openai_window(limit: float | None, remaining: float | None, reset_s: float | None) -> float:
    """The window of an OpenAI limit, in s: a minute, or a day.

    OpenAI states a limit's count, not its window, and most limits are per minute; but
    some models and tiers are limited per day, and ``x-ratelimit-limit-requests`` then
    states the day's count (10,000 a day read as per minute is 1,440 times too fast).
    The reset tells them apart: OpenAI's limits refill continuously, and
    ``x-ratelimit-reset-*`` is the time until the quota is whole again, so the used part
    (limit - remaining) comes back in ``reset`` and the whole in ``limit x reset /
    used``: about 60 s for a per-minute limit, about 86,400 for a daily one (10,000 a
    day, one used: ``8.64s``; 200 a day: ``7m12s``). An implied window within a factor
    :data:`DAY_FACTOR` of a day is a day. Anything else is a minute, as OpenAI's limits
    mostly are: a response that says too little to tell (nothing used yet, no reset),
    and one whose numbers fit neither (OpenAI's own documented example, 16 of 150,000
    tokens used and ``6m0s``, implies 39 days): a reset alone decides nothing."""
    if reset_s is None or not reset_s > 0:
        return PER_MINUTE_S
    if limit is None or remaining is None or not limit > remaining:
        return PER_MINUTE_S
    implied = reset_s * limit / (limit - remaining)
    if PER_DAY_S / DAY_FACTOR <= implied <= PER_DAY_S * DAY_FACTOR:
        return PER_DAY_S
    return PER_MINUTE_S


def _openai(fields: Mapping[str, str]) -> list[Reading]:
    found = []
    for dimension in _OPENAI:
        reset_name = f"x-ratelimit-reset-{dimension}"
        reset_text = fields.get(reset_name)
        limit = _count(fields.get(f"x-ratelimit-limit-{dimension}"))
        remaining = _count(fields.get(f"x-ratelimit-remaining-{dimension}"))
        reset = None if reset_text is None else values.go_duration(reset_text)
        reading = _reading(
            dimension, limit, remaining, reset, openai_window(limit, remaining, reset),
            values.title(reset_name),
        )  # fmt: skip
        if reading is not None:
            found.append(reading)
    return found


def _anthropic(fields: Mapping[str, str], now: float) -> list[Reading]:
    found = []
    for dimension in _ANTHROPIC:
        base = f"anthropic-ratelimit-{dimension}-"
        reset_text = fields.get(base + "reset")
        stamp = None if reset_text is None else values.rfc3339(reset_text)
        reading = _reading(
            dimension,
            _count(fields.get(base + "limit")),
            _count(fields.get(base + "remaining")),
            None if stamp is None else max(stamp - now, 0.0),
            PER_MINUTE_S,
            values.title(base + "reset"),
        )
        if reading is not None:
            found.append(reading)
    return found


def _github(fields: Mapping[str, str], now: float) -> list[Reading]:
    resource = dimension_name(fields.get("x-ratelimit-resource"))
    if resource is None:
        return []
    limit = _count(fields.get("x-ratelimit-limit"))
    remaining = _count(fields.get("x-ratelimit-remaining"))
    used = _count(fields.get("x-ratelimit-used"))
    if remaining is None and limit is not None and used is not None:
        remaining = max(limit - used, 0.0)
    reset_text = fields.get("x-ratelimit-reset")
    reset = None if reset_text is None else values.reset_s(values.split(reset_text, ",")[0], now)
    # GitHub states no window (core is per hour, search per minute...): no rate.
    reading = _reading(resource, limit, remaining, reset, None, "X-RateLimit-Reset")
    return [] if reading is None else [reading]


def _stripe(fields: Mapping[str, str]) -> list[Reading]:
    reason = dimension_name(fields.get("stripe-rate-limited-reason"))
    if reason is None:
        return []
    return [Reading(reason, spent=True, source="Stripe-Rate-Limited-Reason")]


def _discord(fields: Mapping[str, str], now: float) -> list[Reading]:
    scope = dimension_name(fields.get("x-ratelimit-scope"))
    is_global = fields.get("x-ratelimit-global", "").strip().lower() == "true"
    if "x-ratelimit-bucket" not in fields and scope is None and not is_global:
        return []  # the generic X-RateLimit-* reader speaks for it
    found = []
    reset: float | None = None
    source = "X-RateLimit-Reset-After"
    after = fields.get("x-ratelimit-reset-after")
    if after is not None:
        reset = values.seconds(values.split(after, ",")[0])
    if reset is None and "x-ratelimit-reset" in fields:
        reset = values.reset_s(values.split(fields["x-ratelimit-reset"], ",")[0], now)
        source = "X-RateLimit-Reset"
    route = _reading(
        "route",
        _count(fields.get("x-ratelimit-limit")),
        _count(fields.get("x-ratelimit-remaining")),
        reset,
        None,  # Discord states a bucket's count, not its window
        source,
    )
    if scope == "user":  # a 429 of the route's own limit: it is to blame
        route = replace(route or Reading("route", source="X-RateLimit-Scope"), spent=True)
    if route is not None:
        found.append(route)
    if is_global or scope == "global":
        found.append(Reading("global", spent=True, source="X-RateLimit-Global"))
    if scope == "shared":
        found.append(Reading("shared", spent=True, source="X-RateLimit-Scope"))
    return found


def readings(fields: Mapping[str, str], now: float) -> list[Reading]:
    """Every dimension the response reports, in every dialect it speaks (a response
    rarely speaks two, but nothing stops a proxy from adding its own). ``now``: the
    response's time, epoch s (its ``Date``), for resets given as times."""
    return [
        *_openai(fields),
        *_anthropic(fields, now),
        *_github(fields, now),
        *_stripe(fields),
        *_discord(fields, now),
    ]


def _is_github(fields: Mapping[str, str]) -> bool:
    return "x-ratelimit-resource" in fields or "x-github-request-id" in fields


def _github_quota_left(fields: Mapping[str, str]) -> bool:
    """A response from GitHub whose primary quota is not spent (``remaining`` is not 0)."""
    return _is_github(fields) and not values.is_zero(fields.get("x-ratelimit-remaining"))


def wants_body(status: int, fields: Mapping[str, str]) -> bool:
    """Whether the body decides what the response is: a GitHub 403 with quota left and no
    ``Retry-After`` is a secondary rate limit, or a plain "forbidden", and only its message
    tells which; a 429 may be OpenAI's ``insufficient_quota`` (:func:`credit_spent`),
    which only its error body says."""
    if status == 429:
        return True
    return status == 403 and "retry-after" not in fields and _github_quota_left(fields)


def credit_spent(status: int, body: str | bytes | None) -> bool:
    """Whether a 429 is OpenAI's ``insufficient_quota`` (``{"error": {"code":
    "insufficient_quota", ...}}``, "You exceeded your current quota, please check your
    plan and billing details"): the account's credit or monthly budget is used up. No
    wait ends it (someone must pay), so the call is not to be made again: re-running the
    task after each such 429 would loop for ever, one refused call a second."""
    if status != 429 or body is None:
        return False
    text = body[:_BODY_CHARS]
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return _CREDIT_TEXT in text


def github_secondary(status: int, fields: Mapping[str, str], body: str | bytes | None) -> bool:
    """Whether a response is GitHub's secondary rate limit without ``Retry-After``: a 429
    from GitHub with quota left, or a 403 whose body says so. (A 403 or 429 with
    ``remaining`` 0 is the primary limit spent; one with ``Retry-After`` says its time.)"""
    if status == 429:
        return "retry-after" not in fields and _github_quota_left(fields)
    if body is None or not wants_body(status, fields):
        return False
    text = body[:_BODY_CHARS]
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return _SECONDARY_TEXT in text.lower()


def github_secondary_timed(status: int, fields: Mapping[str, str]) -> bool:
    """Whether a response is GitHub's secondary rate limit with its ``Retry-After``: a 403
    or 429 from GitHub with quota left and the time to wait (the primary limit spent says
    ``remaining`` 0; a plain "forbidden" gives no ``Retry-After``)."""
    return status in (403, 429) and "retry-after" in fields and _github_quota_left(fields)


def should_retry(fields: Mapping[str, str]) -> bool | None:
    """Stripe's ``Stripe-Should-Retry`` (``true``/``false``), or None when absent or other."""
    text = fields.get("stripe-should-retry", "").strip().lower()
    return True if text == "true" else False if text == "false" else None
