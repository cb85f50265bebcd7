"""Limit specs: what a limit allows, parsed from strings or config mappings.

A :class:`Limit` is immutable and validated when built; it knows nothing of Redis keys,
of Lua or of Celery. Strings read like the rate limits of public APIs::

    Limit.parse("50/s")                                   # token bucket, 50/s, burst 50
    Limit.parse("3500/m burst 100", name="openai")        # 3500 per minute, burst 100
    Limit.parse("20/s burst 1", algorithm="gcra")         # strict spacing: one call per 50 ms
    Limit.parse("10000/d", algorithm="fixed_window")      # a daily quota (UTC days)
    Limit.parse("8 concurrent")                           # at most 8 in flight
    Limit.from_mapping({"algorithm": "gcra", "rate": "20/s", "burst": 1}, name="github")
    Limit.parse("20/s", name="llm", fair=True, weights={"acme": 4})  # shared fairly by key

The burst defaults to the count of the rate ("50/s" may take 50 at once after an idle
second); write ``burst 1`` for strict spacing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from throttle.errors import ConfigError, did_you_mean
from throttle.units import real

__all__ = [
    "FAIR_CODE",
    "PLAN_SUFFIX",
    "SHADOW_SUFFIX",
    "Algorithm",
    "Limit",
    "check_fields",
    "check_name",
]

PLAN_SUFFIX = ".plan"
"""A keyed limit's *plan* (see :mod:`throttle.celery.plan`) is a twin limit of the same
numbers under its name + this suffix: its own state in Redis, which a reset clears too."""
SHADOW_SUFFIX = ".shadow"
"""A limit in shadow mode decides on a twin of the same numbers under its name + this
suffix (see :mod:`throttle.celery.shadow`): its own state, which a reset clears too."""


class Algorithm(str, Enum):
    """The algorithms a limit can use; the value is the name used in config files."""

    TOKEN_BUCKET = "token_bucket"
    """Bucket of ``burst`` tokens refilled at the rate: bursts up to ``burst``, then the rate."""
    GCRA = "gcra"
    """Leaky bucket / GCRA shaper: calls spaced by period/count, ``burst`` may come at once;
    can reserve the next free slot."""
    SLIDING_WINDOW = "sliding_window"
    """Sliding-window counter: about ``count`` per sliding period, estimated from two
    windows in O(1) memory (a burst at the end of a window can put up to nearly 2x ``count``
    in a true sliding period)."""
    FIXED_WINDOW = "fixed_window"
    """Fixed window aligned to the epoch (UTC): hour or day quotas."""
    CONCURRENCY = "concurrency"
    """At most ``count`` units in flight, held under an expiring lease."""

    @property
    def reserves(self) -> bool:
        """Whether a denied acquire may reserve the next free slot: token bucket and GCRA.

        The state runs into debt for the slot, and the caller waits for it (sleeps, or is
        re-published to arrive just before it) instead of asking again later, as a denial
        by a window or a concurrency limit does. These are also the algorithms whose
        capacity (``burst``) is apart from their rate, that may be ``fair``, and whose
        spacing the call-time guard keeps."""
        return self in (Algorithm.TOKEN_BUCKET, Algorithm.GCRA)

    @property
    def holds_units(self) -> bool:
        """Whether acquiring holds units until they are given back: a concurrency limit.

        Its units come back when the task settles, or when their lease ends. It has no
        rate: no period, no refill, no spacing, nothing to reserve, to learn (``adaptive``)
        or to share out among processes (``on_redis_down: local``)."""
        return self is Algorithm.CONCURRENCY


_ALIASES = {"leaky_bucket": Algorithm.GCRA, "token-bucket": Algorithm.TOKEN_BUCKET}
# Each algorithm's short name: in Redis key names, and in the scripts (ALGO[code]).
_CODES = {
    Algorithm.TOKEN_BUCKET: "tb",
    Algorithm.GCRA: "gcra",
    Algorithm.SLIDING_WINDOW: "sw",
    Algorithm.FIXED_WINDOW: "fw",
    Algorithm.CONCURRENCY: "conc",
}
_UNITS_S = {
    "ms": 0.001,
    "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}  # fmt: skip
UNIT_NAMES = (
    "ms, s (sec, second), m (min, minute), h (hr, hour) or d (day), or a plural (mins, hours)"
)
"""The time units a rate accepts, as an error message lists them."""
_NUMBER = r"\d+(?:\.\d+)?"
_RATE_RE = re.compile(
    rf"(?P<count>{_NUMBER})\s*/\s*(?P<mult>{_NUMBER})?\s*(?P<unit>[a-z]+)"
    rf"(?:\s+burst\s+(?P<burst>{_NUMBER}))?",
    re.IGNORECASE,
)
_CONCURRENT_RE = re.compile(rf"(?P<count>{_NUMBER})\s+concurrent", re.IGNORECASE)
_MAPPING_FIELDS = ("algorithm", "rate", "burst", "fair", "weights")
FAIR_CODE = "fair"
"""The code of every fair limit, whatever its algorithm (lua/fair.lua)."""


def check_fields(config: object, known: tuple[str, ...], *, limit: str, source: str | None) -> None:
    """A limit's config entry must be a mapping of known fields: an unknown one is an error
    (a typo must never silently change a limit), named with its place."""
    if not isinstance(config, Mapping):
        raise ConfigError(
            "a limit must be a mapping of fields", value=config, limit=limit, source=source
        )
    for key in config:
        if key not in known:
            raise ConfigError(
                f"unknown field{did_you_mean(key, known)}; expected one of {', '.join(known)}",
                field=str(key), value=config[key], limit=limit, source=source,
            )  # fmt: skip


def _algorithm(value: object, limit: str | None, source: str | None) -> Algorithm:
    if isinstance(value, Algorithm):
        return value
    if isinstance(value, str):
        name = value.strip().lower()
        if name in _ALIASES:
            return _ALIASES[name]
        for algorithm in Algorithm:
            if algorithm.value == name:
                return algorithm
    known = ", ".join(a.value for a in Algorithm)
    raise ConfigError(
        f"unknown algorithm{did_you_mean(value, [*(a.value for a in Algorithm), *_ALIASES])}; "
        f"expected one of {known}",
        field="algorithm", value=value, limit=limit, source=source,
    )  # fmt: skip


MAX_AMOUNT = 1e15
"""The largest count or burst of a limit: amounts are doubles in Redis, exact to a fraction
of a unit only well below 2**53 (9.007e15)."""
MIN_PERIOD_S = 1e-6
"""The shortest period, in s: the Redis clock counts microseconds."""
MAX_PERIOD_S = 1e10
"""The longest period, and the longest a limit may take to grant one unit, in s (about 317
years): Redis keys are kept at most that long (the TTL cap of lua/prelude.lua), so a longer
period would forget its state before it ends."""


_WHAT = {"period_s": "period in s", "count": "count", "burst": "burst"}


def _text_number_hint(value: object) -> str:
    """Why a number was read as text, when it was: YAML 1.1 (PyYAML's) reads an exponent
    without a dot and a sign (``1e12``) as a string."""
    if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
        number = float(value)
        if math.isfinite(number):
            return f" (YAML reads {value.strip()} as text; write {number:.1e} or {number:.0f})"
    return ""


_EXPONENT = re.compile(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+")


def _positive(
    value: object,
    what: str,
    limit: str | None,
    source: str | None,
    *,
    high: float = math.inf,
) -> float:
    number = real(value)
    if number is None:
        raise ConfigError(
            "must be a number" + _text_number_hint(value),
            field=what, value=value, limit=limit, source=source,
        )  # fmt: skip
    if not (0 < number < math.inf):
        raise ConfigError(
            "must be a finite number > 0", field=what, value=value, limit=limit, source=source
        )
    if number > high:
        raise ConfigError(
            f"the {_WHAT.get(what, what)} must be at most {high:g}",
            field=what, value=value, limit=limit, source=source,
        )  # fmt: skip
    return number


def check_name(name: object, *, field: str = "name", source: str | None = None) -> str:
    """A limit's name: a non-empty ``str`` of Unicode text (it is part of Redis keys, sent
    as UTF-8: a lone surrogate, which YAML's ``"\\ud800"`` can write, has no form there)."""
    if not isinstance(name, str):
        raise ConfigError(
            "a limit needs a non-empty name" if name is None
            else "a limit's name is text: quote it (YAML read this one as a number, a date "
            "or a boolean)",
            field=field, value=name, source=source,
        )  # fmt: skip
    if not name:
        raise ConfigError("a limit needs a non-empty name", field=field, value=name, source=source)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(
            f"a limit name must be Unicode text; it has a lone surrogate at index {exc.start}",
            field=field, value=name, source=source,
        ) from None  # fmt: skip
    return name


def _weights(
    fair: object, weights: object, algorithm: Algorithm, limit: str | None, source: str | None
) -> tuple[tuple[str, float], ...]:
    """A fair limit's weights as sorted (key, weight) pairs, checked with ``fair`` itself."""
    if not isinstance(fair, bool):
        raise ConfigError(
            "must be true or false", field="fair", value=fair, limit=limit, source=source
        )
    if fair and not algorithm.reserves:
        raise ConfigError(
            f"fair applies to token_bucket and gcra limits only, not {algorithm.value}",
            field="fair", value=fair, limit=limit, source=source,
        )  # fmt: skip
    if isinstance(weights, tuple) and all(
        isinstance(pair, tuple) and len(pair) == 2 for pair in weights
    ):
        weights = dict(weights)  # the pairs this class keeps (dataclasses.replace)
    if not isinstance(weights, Mapping):
        raise ConfigError(
            "must be a mapping of key values to weights, such as {enterprise: 4, free: 1}",
            field="weights", value=weights, limit=limit, source=source,
        )  # fmt: skip
    if weights and not fair:
        raise ConfigError(
            "weights apply to a fair limit only: add 'fair: true'",
            field="weights", value=dict(weights), limit=limit, source=source,
        )  # fmt: skip
    pairs = []
    for key, value in weights.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(
                "a weight's key must be a non-empty string (a value of the limit's key)",
                field="weights", value=key, limit=limit, source=source,
            )  # fmt: skip
        pairs.append((key, _positive(value, f"weights.{key}", limit, source, high=MAX_AMOUNT)))
    return tuple(sorted(pairs))


FAIR_NEAR_S = 0.5
"""The shortest near horizon of a fair limit, in s (:attr:`Limit.fair_horizon_s`)."""


@dataclass(frozen=True)
class Limit:
    """One limit: ``count`` per ``period_s`` seconds with a capacity of ``burst``.

    Parameters
    ----------
    name:
        Identifies the limit in keys, metrics and errors; unique within a namespace.
    algorithm:
        An :class:`Algorithm` (or its config name).
    count:
        Tokens per period; for ``concurrency``, the units that may be in flight (a whole
        number).
    period_s:
        The period in seconds (ignored for ``concurrency``).
    burst:
        Capacity in tokens: the most one instant may take. Defaults to ``count``. Only
        token bucket and GCRA accept another value; for windows and concurrency the
        capacity is ``count``.
    fair:
        Share the rate fairly among the keys active at the same time (``lua/fair.lua``):
        N keys that all want more than their share get about 1/N of the rate each (or
        their weight's share), one key alone gets all of it, and the total never exceeds
        the rate. Work conserving: a key's schedule may run the near horizon (0.5 s)
        ahead of now, so slots a key's late tasks leave go to the keys whose tasks are
        there, and a key asking less than its share leaves the rest to the others; the
        price is up to 0.5 s of calls beyond a share over short windows, and a newcomer's
        first slot up to 0.5 s away (docs/concepts.md, Fair limits). Token bucket and GCRA
        limits only; acquired with a key (the key names what the shares are of). A fair
        limit is a GCRA shaper whatever its algorithm: ``burst`` calls may come at once.
    weights:
        A fair limit's weight per key value (a mapping; finite numbers > 0); a key not
        listed weighs 1, or its plan's weight (``default_weight``). A key of weight 4
        among keys of weight 1 gets four times their share. Kept as sorted (key, weight)
        pairs.
    default_weight:
        The weight of a key that ``weights`` does not list (default 1): what a fair
        limit's plan gives the keys of its tasks (:class:`throttle.rules.Rule`, ``plans``).
    """

    name: str
    algorithm: Algorithm
    count: float
    period_s: float = 1.0
    burst: float | None = None
    fair: bool = False
    weights: Any = ()
    default_weight: float = 1.0
    code: str = field(init=False, repr=False, compare=False)
    """The algorithm's short name (``tb``, ``gcra``, ``fw``, ``sw``, ``conc``), as Redis key
    names and the scripts spell it."""
    codes: frozenset[str] = field(init=False, repr=False, compare=False)
    """``{code}``: the algorithms a script for this limit alone must carry."""
    _wire: Any = field(default=None, init=False, repr=False, compare=False)
    # Owned by throttle.redis.wire, which computes this limit's arguments to the scripts on
    # first use and keeps them here: they are read on every acquire, and a cache keyed by
    # the limit would hash its five fields each time. The Limit never reads it.
    _in_hand: Any = field(default=None, init=False, repr=False, compare=False)
    # (margin_s, the limit) of the last with_margin(): a worker asks it on every task.

    def __post_init__(self) -> None:
        name = check_name(self.name)
        algorithm = _algorithm(self.algorithm, name, None)
        count = _positive(self.count, "count", name, None, high=MAX_AMOUNT)
        period_s = 1.0
        if algorithm.holds_units and not count.is_integer():
            # A concurrency limit counts tasks in flight, and an upstream's limit of
            # connections or streams is a whole number: the half of "2.5 concurrent" would
            # only ever admit a task of cost 0.5, so a fraction is a mistake, refused.
            raise ConfigError(
                "the count of a concurrency limit must be a whole number (tasks in flight "
                "at once), such as '3 concurrent'",
                field="count", value=self.count, limit=name,
            )  # fmt: skip
        if not algorithm.holds_units:
            period_s = _positive(self.period_s, "period_s", name, None, high=MAX_PERIOD_S)
            if period_s < MIN_PERIOD_S:
                raise ConfigError(
                    f"the period must be at least {MIN_PERIOD_S:g} s (the Redis clock counts "
                    "microseconds)",
                    field="period_s", value=self.period_s, limit=name,
                )  # fmt: skip
            if period_s / count > MAX_PERIOD_S:
                raise ConfigError(
                    f"too slow: one unit per {period_s / count:g} s, more than {MAX_PERIOD_S:g} s",
                    field="count", value=self.count, limit=name,
                )  # fmt: skip
        burst = count
        if self.burst is not None:
            burst = _positive(self.burst, "burst", name, None, high=MAX_AMOUNT)
            if burst != count and not algorithm.reserves:
                raise ConfigError(
                    f"burst applies to token_bucket and gcra only, not {algorithm.value}",
                    field="burst", value=self.burst, limit=name,
                )  # fmt: skip
        object.__setattr__(self, "algorithm", algorithm)
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "period_s", period_s)
        object.__setattr__(self, "burst", burst)
        weights = _weights(self.fair, self.weights, algorithm, name, None)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "_weight_of", dict(weights))
        if self.default_weight != 1.0:
            default = _positive(self.default_weight, "default_weight", name, None, high=MAX_AMOUNT)
            if not self.fair:
                raise ConfigError(
                    "a default weight applies to a fair limit only",
                    field="default_weight", value=self.default_weight, limit=name,
                )  # fmt: skip
            object.__setattr__(self, "default_weight", default)
        object.__setattr__(self, "code", FAIR_CODE if self.fair else _CODES[algorithm])
        object.__setattr__(self, "codes", frozenset((self.code,)))

    def weight(self, key: str) -> float:
        """The weight of ``key`` in a fair limit: as listed in :attr:`weights`, else
        :attr:`default_weight` (1 unless a plan gives another)."""
        weight: float = self.__dict__["_weight_of"].get(key, self.default_weight)
        return weight

    @property
    def capacity(self) -> float:
        """The largest cost one acquisition may take: the burst (the count for windows)."""
        assert self.burst is not None  # set by __post_init__
        return self.burst

    def with_margin(self, margin_s: float) -> Limit:
        """This limit with ``margin_s`` seconds of its refill kept in hand: a burst of
        ``burst - margin_s x rate`` tokens, but never less than half of it beyond 1 (the
        burst also absorbs the late calls of a busy period: a high rate whose burst is a
        few ms of it keeps half). A limit without a burst beyond 1 (token bucket, GCRA),
        a fair limit, a window or a concurrency limit is returned as it is.

        An upstream that enforces the same bucket starts refilling at the first call it
        receives, not at the slot that call was given: when the first calls of a busy
        period arrive late (the time a worker takes to start them), the upstream's bucket
        runs that much behind for as long as the calls keep coming, and the call after
        the burst finds it a fraction of a token short. Kept in hand, the margin absorbs
        that lateness; it costs at most ``margin_s x rate`` tokens of the burst once per busy
        period, and nothing of the sustained rate."""
        burst = self.capacity
        if margin_s <= 0 or burst <= 1 or self.fair or not self.algorithm.reserves:
            return self
        kept = self._in_hand
        if kept is not None and kept[0] == margin_s:
            limit: Limit = kept[1]
            return limit
        limit = replace(self, burst=max(burst - margin_s * self.rate_per_s, (burst + 1) / 2))
        object.__setattr__(self, "_in_hand", (margin_s, limit))
        return limit

    @property
    def rate_per_s(self) -> float:
        """The sustained rate in tokens per second."""
        return self.count / self.period_s

    @property
    def fair_horizon_s(self) -> float:
        """A fair limit's near horizon, in s: how far ahead its algorithm lets a key due now
        take the total's next slot, and reserves at most: :data:`FAIR_NEAR_S`, or
        ``burst + 1`` turns of a slower limit (lua/fair.lua's ``horizon_us``)."""
        return max(FAIR_NEAR_S, (self.capacity + 1) / self.rate_per_s)

    @classmethod
    def parse(
        cls,
        spec: str,
        *,
        name: str = "",
        algorithm: Algorithm | str | None = None,
        source: str | None = None,
        field: str = "rate",
        fair: bool = False,
        weights: Mapping[str, float] | None = None,
    ) -> Limit:
        """Build a limit from a string such as ``"50/s"`` or ``"3500/m burst 100"``
        (``fair`` and ``weights``: see :class:`Limit`).

        Grammar: ``COUNT "/" [N] UNIT ["burst" B]`` with UNIT one of ms, s, m, h, d (or
        their long forms: sec, minute, hours, day...), or ``COUNT "concurrent"``.
        ``algorithm`` defaults to ``token_bucket`` for a rate and ``concurrency`` for
        ``N concurrent``; a rate with ``concurrency``, or ``N concurrent`` with another
        algorithm, is an error. ``name`` defaults to the spec itself. Errors name
        ``source``, the limit and ``field``.
        """
        limit = name or (spec if isinstance(spec, str) else None)
        if not isinstance(spec, str):
            raise ConfigError(
                "must be a string such as '50/s' or '3500/m burst 100'",
                field=field, value=spec, limit=limit, source=source,
            )  # fmt: skip
        text = spec.strip()
        algo = None if algorithm is None else _algorithm(algorithm, limit, source)
        concurrent = _CONCURRENT_RE.fullmatch(text)
        if concurrent:
            if algo not in (None, Algorithm.CONCURRENCY):
                raise ConfigError(
                    f"'N concurrent' is a concurrency limit, not {algo.value}; write a rate "
                    "such as '10/s'",
                    field=field, value=spec, limit=limit, source=source,
                )  # fmt: skip
            algo = Algorithm.CONCURRENCY
            count, period_s, burst = float(concurrent["count"]), 1.0, None
        elif algo is Algorithm.CONCURRENCY:
            raise ConfigError(
                "a concurrency limit is written 'N concurrent' (at most N in flight)",
                field=field, value=spec, limit=limit, source=source,
            )  # fmt: skip
        else:
            match = _RATE_RE.fullmatch(text)
            if not match:
                raise ConfigError(
                    "malformed rate; expected COUNT/[N]UNIT [burst B], e.g. '50/s', "
                    "'3500/m burst 100', '1/3h', or 'N concurrent'",
                    field=field, value=spec, limit=limit, source=source,
                )  # fmt: skip
            unit = match["unit"].lower()
            if unit not in _UNITS_S:
                raise ConfigError(
                    f"unknown time unit {match['unit']!r}{did_you_mean(unit, _UNITS_S)}; "
                    f"use {UNIT_NAMES}",
                    field=field, value=spec, limit=limit, source=source,
                )  # fmt: skip
            count = float(match["count"])
            period_s = float(match["mult"] or 1) * _UNITS_S[unit]
            burst = float(match["burst"]) if match["burst"] else None
            algo = algo or Algorithm.TOKEN_BUCKET
        try:
            return cls(limit or spec, algo, count, period_s, burst, fair, weights or {})
        except ConfigError as exc:
            # Re-raise with the place the value came from.
            own = exc.field in ("name", "fair") or (exc.field or "").startswith("weights")
            part = _WHAT.get(exc.field or "") if not own else None
            named = part is None or part in exc.problem or exc.problem.startswith("the ")
            raise ConfigError(
                exc.problem if named else f"its {part} {exc.problem}",
                field=exc.field if own else field,
                value=exc.value if own else spec,
                limit=limit if exc.field != "name" else None,
                source=source,
            ) from None

    @classmethod
    def from_mapping(
        cls, config: Mapping[str, Any], *, name: str, source: str | None = None
    ) -> Limit:
        """Build a limit from a config mapping (one entry of a limits file).

        Fields: ``rate`` (required; a rate string, which may carry ``burst``),
        ``algorithm`` (default ``token_bucket``, or ``concurrency`` for ``N concurrent``),
        ``burst`` (a number, overrides the one in ``rate``), ``fair`` (true or false) and
        ``weights`` (a mapping of key values to numbers > 0). Unknown fields are errors,
        so that a typo never goes unnoticed.
        """
        check_fields(config, _MAPPING_FIELDS, limit=name, source=source)
        if "rate" not in config:
            raise ConfigError("missing field", field="rate", limit=name, source=source)
        algorithm = config.get("algorithm")
        if algorithm is not None:
            algorithm = _algorithm(algorithm, name, source)
        limit = cls.parse(
            config["rate"], name=name, algorithm=algorithm, source=source, field="rate"
        )
        fair = config.get("fair", False)
        weights = config.get("weights", {})
        if weights is None:
            weights = {}
        _weights(fair, weights, limit.algorithm, name, source)  # errors name the file
        burst = limit.burst
        if "burst" in config:
            if isinstance(config["rate"], str) and "burst" in config["rate"].lower():
                raise ConfigError(
                    f"given twice: in 'rate' ({config['rate']!r}) and as 'burst'; keep one",
                    field="burst", value=config["burst"], limit=name, source=source,
                )  # fmt: skip
            burst = _positive(config["burst"], "burst", name, source, high=MAX_AMOUNT)
        try:
            return cls(
                limit.name, limit.algorithm, limit.count, limit.period_s, burst, fair, weights
            )
        except ConfigError as exc:
            raise ConfigError(
                exc.problem, field="burst", value=config["burst"], limit=name, source=source
            ) from None
