"""Adaptive limits: the rate of an upstream that does not announce it, learned from its
answers; and refusals answered in proportion.

Many APIs answer ``429 Retry-After: 1`` and nothing else. A limit with ``adaptive: true``
keeps, fleet-wide in Redis, a *learned rate* between its ``floor`` and its configured rate
(the ceiling), updated atomically (``lua/adapt.lua``, on the Redis clock) by the workers
that see the answers:

* a refusal lowers it by the factor ``decrease`` (default 0.8), once per refusal
  *episode*: the refusals that follow a decrease within :data:`EPISODE_S` plus how far
  ahead the limit had handed out slots (at most :data:`MAX_EPISODE_S`) are of calls
  scheduled at the old rate (in flight, or holding slots reserved before it) and are no
  new evidence;
* successes let it probe back up, CUBIC-style (RFC 9438): quickly at first, flat near the
  rate that was refused (reached after ``recover``, default 10 s of successes), then ever
  faster above it, in case the upstream raised its limit;
* a rate the upstream states (``RateLimit-Policy``...) replaces it: stated headers win.

The learned rate feeds the limiter as a run-time rate does (:mod:`throttle.rates`): the
rate in force is the lower of the two, never above the configured rate, never below the
floor. Each process caches it for ``settings.refresh``, and every answer it reports
refreshes the cache with the fleet's current value (one round trip per call of an
adaptive limit below its ceiling: the price of learning; none for a success while the
rate is at its ceiling).

Every refusal, adaptive or not, is counted per limit (and key), so that the upstream hook
(:func:`throttle.upstream.report_upstream`) can tell refusals that *persist* (half of the
calls the limit makes in a window of a second or ten spacings, at least three, on the
Redis clock, fleet-wide: :meth:`LearnedRates.persist_for`) from those that jitter
explains; see :func:`throttle.upstream.report_upstream` for what each gets.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from throttle.errors import ConfigError
from throttle.redis.client import RedisClient, run_script, wrap_errors
from throttle.redis.keys import KeySpace, decode_hold_field
from throttle.redis.scripts import operation_source
from throttle.spec import Limit
from throttle.units import MAX_DURATION_S, parse_duration, real

__all__ = [
    "ADAPTIVE_FIELDS",
    "EPISODE_S",
    "MAX_EPISODE_S",
    "PERSIST_COUNT",
    "PERSIST_S",
    "PERSIST_SHARE",
    "PERSIST_SPACINGS",
    "Adaptive",
    "Learned",
    "LearnedRates",
    "LearnedRatesBase",
    "learned_limit",
    "parse_adaptive",
]

EPISODE_S = 1.0
"""The shortest refusal episode, in s: after a decrease, refusals this long are of the same
episode and do not decrease the rate again. The hook makes it longer by the limit's
reservation depth when the first 429 came (the slots already handed out at the old rate,
up to :data:`MAX_EPISODE_S`): those calls were scheduled before the decrease, their
refusals are no new evidence."""
MAX_EPISODE_S = 10.0
"""The longest refusal episode, in s: a backlog that reserved slots further ahead at the
old rate meets its refusals while the rate stays put (and holds, when they persist)."""
PERSIST_SHARE = 0.5
"""Refusals *persist* when, within a window, they reach this share of the calls the limit
makes in it at its rate in force (and at least :data:`PERSIST_COUNT`): the upstream
refuses half of what the limit sends, the rate is wrong. Scheduling jitter against a
strict upstream refuses calls a few ms early, 13-32 % of them on a loaded 2-core host
(measured: ``bench/adaptive.py``, docs/benchmarks/adaptive.md), each alone, and holding
for them would only idle the fleet."""
PERSIST_COUNT = 3
"""The fewest refusals that persist (a slow limit makes few calls in a window)."""
PERSIST_S = 1.0
"""The shortest window, in s; it is :data:`PERSIST_SPACINGS` spacings of the limit when
that is longer. A window opens at the first refusal after the last one ended, fleet-wide
on the Redis clock."""
PERSIST_SPACINGS = 10.0
"""The window in spacings of the limit (1 / its rate), when longer than PERSIST_S."""
STATE_TTL_S = 86400.0
"""A learned state is forgotten after a day without an answer (the rate starts again from
the configured one)."""
GAP_S = 1.0
"""Probing time counts successes' gaps up to this long: an idle fleet learns nothing
(``GAP_US`` in lua/adapt.lua)."""
ADAPTIVE_FIELDS = ("adaptive", "floor", "decrease", "recover")
"""The fields of a limits file's entry that make and tune an adaptive limit."""


@dataclass(frozen=True)
class Adaptive:
    """How a limit learns its rate: the ``adaptive: true`` fields of a limits file.

    Parameters
    ----------
    floor_per_s:
        The learned rate never goes below this (per s). ``None``: a tenth of the limit's
        configured rate.
    decrease:
        The factor a refusal episode multiplies the rate by (0 < f < 1). Lower reacts
        faster to a drop and wastes more of the upstream's rate after each refusal.
    recover_s:
        Seconds of successes to climb back to the rate that was refused. Longer: fewer
        refusals while the upstream is steady (about one per ``recover`` s), slower to
        follow a rise.
    """

    floor_per_s: float | None = None
    decrease: float = 0.8
    recover_s: float = 10.0

    def __post_init__(self) -> None:
        if self.floor_per_s is not None and not (0 < self.floor_per_s < math.inf):
            raise ConfigError("must be a rate > 0", field="floor", value=self.floor_per_s)
        if not (0 < self.decrease < 1):
            raise ConfigError(
                "must be a number between 0 and 1 (exclusive)",
                field="decrease", value=self.decrease,
            )  # fmt: skip
        if not (0 < self.recover_s <= MAX_DURATION_S):
            raise ConfigError(
                f"must be a duration > 0 and at most {MAX_DURATION_S / 86400:g}d (ten years)",
                field="recover", value=self.recover_s,
            )  # fmt: skip

    def floor_for(self, limit: Limit) -> float:
        """The floor for ``limit`` (per s)."""
        return limit.rate_per_s / 10 if self.floor_per_s is None else self.floor_per_s

    def check(self, limit: Limit) -> None:
        """This learning applied to ``limit``: a ConfigError for a concurrency limit (it
        has no rate) or a floor above the configured rate."""
        if limit.algorithm.holds_units:
            raise ConfigError(
                "a concurrency limit has no rate to learn", field="adaptive", value=True,
                limit=limit.name,
            )  # fmt: skip
        if self.floor_per_s is not None and self.floor_per_s > limit.rate_per_s:
            raise ConfigError(
                f"the floor ({self.floor_per_s:g}/s) is above the limit's rate, its ceiling "
                f"({limit.rate_per_s:g}/s)",
                field="floor", value=self.floor_per_s, limit=limit.name,
            )  # fmt: skip


def parse_adaptive(
    config: Mapping[str, Any], limit: Limit, *, source: str | None = None
) -> Adaptive | None:
    """The adaptive fields of a limits file's entry (:data:`ADAPTIVE_FIELDS`), validated
    against ``limit``; None when the entry is not adaptive. ``floor`` is a rate (``"2/s"``),
    ``decrease`` a number, ``recover`` a duration; any of them without ``adaptive: true``
    is an error (it would silently do nothing)."""
    name = limit.name

    def bad(problem: str, field: str) -> ConfigError:
        return ConfigError(problem, field=field, value=config[field], limit=name, source=source)

    flag = config.get("adaptive", False)
    if not isinstance(flag, bool):
        raise bad("must be true or false", "adaptive")
    if not flag:
        for field in ADAPTIVE_FIELDS[1:]:
            if field in config:
                raise bad("applies only with adaptive: true", field)
        return None
    options: dict[str, float] = {}
    if "floor" in config:
        floor = config["floor"]
        if not isinstance(floor, str):
            raise bad("must be a rate such as '2/s'", "floor")
        options["floor_per_s"] = Limit.parse(
            floor, name=name, source=source, field="floor"
        ).rate_per_s
        if Limit.parse(floor, name=name).algorithm.holds_units:
            raise bad("must be a rate such as '2/s'", "floor")
    if "decrease" in config:
        number = real(config["decrease"])
        if number is None or not (0 < number < 1):
            raise bad("must be a number between 0 and 1 (exclusive), such as 0.8", "decrease")
        options["decrease"] = number
    if "recover" in config:
        seconds = parse_duration(config["recover"], field="recover", limit=name, source=source)
        if seconds <= 0:
            raise bad("must be a duration > 0, such as '10s'", "recover")
        options["recover_s"] = seconds
    adaptive = Adaptive(**options)
    try:
        adaptive.check(limit)
    except ConfigError as exc:
        raise ConfigError(
            exc.problem, field=exc.field, value=config.get(exc.field or "", exc.value),
            limit=name, source=source,
        ) from None  # fmt: skip
    return adaptive


def learned_limit(limit: Limit, rate_per_s: float) -> Limit:
    """``limit`` at ``rate_per_s`` when that is lower than its rate (same algorithm,
    period and burst: the upstream's tolerance of bunched calls is not what was learned);
    ``limit`` itself otherwise."""
    if rate_per_s >= limit.rate_per_s * (1 - 1e-9):
        return limit
    # replace(): a fair limit stays fair, with its weights.
    return dataclasses.replace(limit, count=rate_per_s * limit.period_s)


class Learned(NamedTuple):
    """What :class:`LearnedRates` answered about one limit (and key)."""

    rate_per_s: float
    """The learned rate (the limit's rate in force, for a limit that is not adaptive)."""
    decreased: bool
    """This refusal started an episode: the rate was lowered."""
    persist: bool
    """The refusals persist (:data:`PERSIST_COUNT` within :data:`PERSIST_S`)."""
    refusals: int
    """Refusals counted in the current window."""


def _learned(raw: Any) -> Learned:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    rate, decreased, persist, count = text.split()
    return Learned(float(rate), decreased == "1", persist == "1", int(count))


_MAX_CACHED = 4096


class LearnedRatesBase:
    """The pure part of :class:`LearnedRates` and of :class:`throttle.aio.LearnedRates`:
    the script's arguments and reply, the episode and persistence of a refusal, the cache;
    the subclasses only send the calls (blocking or awaited)."""

    def __init__(
        self,
        keyspace: KeySpace,
        *,
        refresh_s: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
        clock_us: Callable[[], int] | None = None,
        episode_s: float = EPISODE_S,
        persist_count: int = PERSIST_COUNT,
        persist_s: float = PERSIST_S,
    ) -> None:
        self.keyspace = keyspace
        self.refresh_s = refresh_s
        self.episode_s = episode_s
        self.persist_count = persist_count
        self.persist_s = persist_s
        self._monotonic = monotonic
        self._clock_us = clock_us
        self._cache: dict[tuple[str, str | None], tuple[float, float]] = {}

    def _request(
        self,
        event: str,
        limit: Limit,
        key: str | None,
        adaptive: Adaptive | None,
        stated: float | None = None,
        episode_s: float | None = None,
        persist: tuple[int, float] | None = None,
    ) -> tuple[list[str], list[Any]]:
        """The KEYS and ARGV of one call of lua/adapt.lua."""
        now = b"" if self._clock_us is None else self._clock_us()
        episode = self.episode_s if episode_s is None else episode_s
        persist_count, persist_s = persist or (self.persist_count, self.persist_s)
        learning = adaptive or Adaptive()
        args = [
            now, event, repr(limit.rate_per_s), "1" if adaptive else "0",
            repr(learning.floor_for(limit)), repr(learning.decrease),
            round(learning.recover_s * 1e6), round(episode * 1e6),
            persist_count, round(persist_s * 1e6),
            "" if stated is None else repr(stated), round(STATE_TTL_S * 1000),
        ]  # fmt: skip
        return [self.keyspace.learned_key(limit.name, key)], args

    def _remember(
        self, limit: Limit, key: str | None, adaptive: Adaptive | None, raw: Any
    ) -> Learned:
        """A reply of the script, cached for an adaptive limit."""
        learned = _learned(raw)
        if adaptive is not None:
            if len(self._cache) >= _MAX_CACHED:
                self._cache.clear()
            self._cache[(limit.name, key)] = (learned.rate_per_s, self._monotonic())
        return learned

    def _cached(self, limit: Limit, key: str | None, adaptive: Adaptive) -> float | None:
        """The cached learned rate, None when due for a re-read."""
        cached = self._cache.get((limit.name, key))
        if cached is None or self._monotonic() - cached[1] >= self.refresh_s:
            return None
        return max(cached[0], adaptive.floor_for(limit))

    def _idle_success(self, limit: Limit, key: str | None) -> Learned | None:
        """A success need not be reported while this process knows, fresh, that the rate is
        at its ceiling (the upstream has not refused, or the rate has climbed back): there
        is nothing to probe, and the round trip is saved. None: report it."""
        cached = self._cache.get((limit.name, key))
        if cached is None or self._monotonic() - cached[1] >= self.refresh_s:
            return None
        if cached[0] < limit.rate_per_s * (1 - 1e-9):
            return None
        return Learned(cached[0], False, False, 0)

    def persist_for(self, rate_per_s: float) -> tuple[int, float]:
        """When refusals of a limit at ``rate_per_s`` persist: (count, within s)."""
        window = max(self.persist_s, PERSIST_SPACINGS / rate_per_s)
        count = max(self.persist_count, math.ceil(PERSIST_SHARE * rate_per_s * window - 1e-9))
        return count, window

    def _refusal(self, limit: Limit, rate_per_s: float | None, reserved_s: float) -> dict[str, Any]:
        """The episode and persistence of a refusal (see :meth:`LearnedRates.refused`)."""
        reserved = reserved_s if math.isfinite(reserved_s) and reserved_s > 0 else 0.0
        episode = min(self.episode_s + reserved, max(MAX_EPISODE_S, self.episode_s))
        persist = self.persist_for(limit.rate_per_s if rate_per_s is None else rate_per_s)
        return {"episode_s": episode, "persist": persist}

    def _prefix_len(self) -> int:
        return len(self.keyspace.base) + len("learned:")


class LearnedRates(LearnedRatesBase):
    """The learned states of one namespace (``lua/adapt.lua``), and each process's cache of
    the learned rates, refreshed every ``refresh_s`` and by every answer reported.

    ``limit`` arguments are the limit in force before learning (the configured one, or a
    rate set at run time): the ceiling. ``adaptive`` None counts refusals only.
    """

    def __init__(self, client: RedisClient, keyspace: KeySpace, **options: Any) -> None:
        super().__init__(keyspace, **options)
        self.client = client
        self._script = client.register_script(operation_source("adapt"))

    def _call(
        self, event: str, limit: Limit, key: str | None, adaptive: Adaptive | None,
        stated: float | None = None, **options: Any,
    ) -> Learned:  # fmt: skip
        keys, args = self._request(event, limit, key, adaptive, stated, **options)
        return self._remember(
            limit, key, adaptive, run_script(self.client, self._script, keys, args)
        )

    def refused(
        self,
        limit: Limit,
        key: str | None,
        adaptive: Adaptive | None,
        *,
        rate_per_s: float | None = None,
        reserved_s: float = 0.0,
    ) -> Learned:
        """The upstream refused a call of ``limit`` (``key``): count it, against
        :meth:`persist_for` the rate the call was made at (``rate_per_s``, default the
        limit's); an adaptive limit lowers its rate when this starts an episode, which then
        lasts ``episode_s`` + ``reserved_s`` (how far ahead slots are reserved now), at most
        :data:`MAX_EPISODE_S`."""
        options = self._refusal(limit, rate_per_s, reserved_s)
        return self._call("refuse", limit, key, adaptive, **options)

    def succeeded(self, limit: Limit, key: str | None, adaptive: Adaptive) -> Learned:
        """The upstream served a call of an adaptive limit: probe up (no round trip while
        this process knows the rate is at its ceiling, within ``refresh_s``)."""
        idle = self._idle_success(limit, key)
        return idle if idle is not None else self._call("success", limit, key, adaptive)

    def stated(
        self, limit: Limit, key: str | None, adaptive: Adaptive, rate_per_s: float
    ) -> Learned:
        """The upstream stated its rate: the learned rate is that (within floor and
        ceiling), and probing starts from it."""
        return self._call("state", limit, key, adaptive, rate_per_s)

    def read(self, limit: Limit, key: str | None, adaptive: Adaptive) -> Learned:
        """The learned rate, read afresh."""
        return self._call("read", limit, key, adaptive)

    def current(self, limit: Limit, key: str | None, adaptive: Adaptive) -> Limit:
        """``limit`` at its learned rate (re-read every ``refresh_s``)."""
        rate = self._cached(limit, key, adaptive)
        if rate is None:
            rate = self.read(limit, key, adaptive).rate_per_s
        return learned_limit(limit, rate)

    def states(self) -> dict[tuple[str, str | None], float]:
        """The learned rates stored in the namespace: (limit, key or None) -> rate per s
        (only states of adaptive limits that have learned something). For ``celery
        throttle status`` and the metrics."""
        found: dict[tuple[str, str | None], float] = {}
        prefix = self._prefix_len()
        if not hasattr(self.client, "scan_iter"):
            return found  # the in-memory limiter (memory://): not listed

        def scan() -> None:
            for name in self.client.scan_iter(match=self.keyspace.learned_pattern(), count=500):
                text = name.decode() if isinstance(name, bytes) else str(name)
                rate = self.client.hget(name, "r")
                if rate is not None:
                    found[decode_hold_field(text[prefix:])] = float(rate)

        wrap_errors(scan)
        return found
