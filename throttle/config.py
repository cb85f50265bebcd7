"""Limits files: named limits with their key, cost and deadline, mapped to queues and tasks.

A limits file (YAML) is read only here, validated as a whole, and turned into immutable
objects; every error names the file, the limit and the field::

    settings:                  # all optional
      redis_url: redis://localhost:6379/0   # default: THROTTLE_REDIS_URL, then the broker
      namespace: default
    limits:
      openai-tokens:
        rate: 90000/m          # required (see throttle.spec)
        algorithm: token_bucket
        key: "{tenant_id}"     # a template over the task's arguments; none = one global state
        cost: tokens           # a number (default 1) or the name of an argument
        max_wait: 10m          # throttle deadline: past it, on_timeout applies
        on_timeout: fail       # fail (ThrottleTimeout) | dead_letter:QUEUE
        on_error: keep         # the body raised: keep the reserved cost | refund it
        on_redis_down: defer   # defer (fail closed) | allow[:60s] (fail open, bounded) | local
        cold_start: full       # Redis came back empty: full (a fresh burst) | empty
        fair: false            # true: share the rate fairly among the keys active at once
        weights: {acme: 4}     # a fair limit's weight per key value (default 1)
        spacing_guard: true    # space actual calls (default: on for burst-1 gcra/token_bucket)
        adaptive: false        # learn the upstream's rate from its 429s (throttle.adaptive)
        floor: 100/m           # ... never below this (default: a tenth of the rate)
        decrease: 0.8          # ... a refusal episode multiplies the rate by this
        recover: 10s           # ... successes climb back to the refused rate in this time
        upstream: tokens       # the upstream's dimension it follows (throttle.upstream.dialects)
        plan: "{plan}"         # each key's rate from its task's plan (a template, as key)
        plans: {free: 10/s burst 5, pro: 100/s}   # plan -> rate; others get `rate`
        mode: enforce          # shadow: record what it would do, delay nothing
    queues:
      llm: [openai-tokens]     # every task consumed from queue "llm"
    tasks:
      proj.tasks.send_mail: [mail-daily]

See ``configs/limits.yaml`` for an annotated example. Rules given inline to the
``@throttled`` decorator use the same fields (:class:`Rule`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from throttle.adaptive import ADAPTIVE_FIELDS, parse_adaptive
from throttle.errors import ConfigError, did_you_mean
from throttle.redis.keys import KeySpace, text_error
from throttle.redis.urls import check_form
from throttle.rules import Rule
from throttle.spec import MAX_AMOUNT, Algorithm, Limit, check_fields, check_name
from throttle.units import parse_duration
from throttle.upstream.dialects import NAMED_DIMENSIONS

__all__ = [
    "CONFIG_ENV",
    "ConfigSource",
    "Settings",
    "ThrottleConfig",
]

CONFIG_ENV = "THROTTLE_CONFIG"
"""The environment variable naming the limits file when ``app.conf.throttle_config`` is unset."""
MAPPING_SOURCE = "<mapping>"
"""What errors name as their place when the config is a mapping (``throttle_config``)."""

ConfigSource = str | os.PathLike[str] | Mapping[str, Any]

_LIMIT_FIELDS = ("rate", "algorithm", "burst", "fair", "weights")
_RULE_FIELDS = (
    "key", "cost", "max_wait", "on_timeout", "on_error", "on_redis_down", "cold_start",
    "spacing_guard", "upstream", "plan", "plans", "mode",
)  # fmt: skip
_PLAN_FIELDS = ("plan", "plans")
"""Checked together, once the limit and its key are (:func:`_plan_options`)."""
_SETTINGS_FIELDS = {
    "redis_url": "str",
    "redis_own_connections": "bool",
    "prefix": "str",
    "namespace": "str",
    "refresh": "duration",
    "sleep_max": "duration",
    "park_after": "duration",
    "line_max": "duration",
    "reserve_ahead": "duration",
    "park_lead": "duration",
    "late_tolerance": "duration",
    "burst_margin": "duration",
    "jitter": "duration",
    "pause_recheck": "duration",
    "fail_open_for": "duration",
    "fleet_workers": "count",
    "lanes": "bool",
    "metrics": "bool",
    "metrics_port": "port",
    "metrics_dir": "str",
    "refusals_max": "count",
    "refusals_for": "duration",
    "mode": "mode",
}
_TOP_FIELDS = ("settings", "limits", "queues", "tasks")
MIN_REFRESH_S = 0.1
"""The shortest ``refresh``, in s: each process re-reads the rates, modes and learned rates
set at run time once per refresh (a Redis round trip), and a worker's consumer reads its
waiting tasks' adaptive limits as often (up to 100 round trips: ``call_repeatedly``); 0
would make the first a round trip per task and the second a busy loop in the consumer."""
MIN_SLEEP_MAX_S = 0.05
"""The shortest ``sleep_max``, in s: a rescheduled task arrives up to three quarters of it
before its slot, the rest covers Redis round trips (see :mod:`throttle.celery.arrival`)."""
MIN_RESERVE_AHEAD_S = 0.05
"""The shortest ``reserve_ahead``, in s: a task is handed to the pool 20 ms before its slot,
and the consumer's loop must get there on time."""


# The loader raises the first error it meets; ThrottleConfig.check passes a list instead, and
# the loader notes each error there and goes on with the next field, limit or section, so
# that one run reports every error of a file.
Errors = list[ConfigError] | None


def _report(errors: Errors, error: ConfigError) -> None:
    """Raise ``error``, or note it when every error is wanted (``errors`` is a list)."""
    if errors is None:
        raise error
    errors.append(error)


@contextlib.contextmanager
def _noted(errors: Errors) -> Iterator[None]:
    """A ConfigError raised inside goes to :func:`_report`: raised, or noted and skipped."""
    try:
        yield
    except ConfigError as exc:
        _report(errors, exc)


def _rule(config: object, name: str, source: str | None, errors: Errors) -> Rule | None:
    """One entry of ``limits:`` as a Rule. With ``errors``, every error of the entry is noted
    (each field is checked on its own) and None returned if there was any."""
    known = (*_LIMIT_FIELDS, *_RULE_FIELDS, *ADAPTIVE_FIELDS)
    if not isinstance(config, Mapping):
        with _noted(errors):
            check_fields(config, known, limit=name, source=source)  # raises: not a mapping
        return None
    found = len(errors) if errors is not None else 0
    for key in config:  # each unknown field is an error of its own
        with _noted(errors):
            check_fields({key: config[key]}, known, limit=name, source=source)
    limit = _limit({k: v for k, v in config.items() if k in _LIMIT_FIELDS}, name, source, errors)
    # The rule's fields are checked each against the limit; against a stand-in of unbounded
    # capacity when the limit itself is bad (a cost then cannot exceed it).
    probe = limit or Limit(name, Algorithm.TOKEN_BUCKET, MAX_AMOUNT)
    if probe.fair:
        # Alone, any field of a fair limit but its key would read as "fair without a key":
        # that is judged once, on the whole entry.
        probe = replace(probe, fair=False, weights=())
    options: dict[str, Any] = {}
    for key in _RULE_FIELDS:
        if key in config and key not in _PLAN_FIELDS:
            with _noted(errors):
                options.update(_rule_option(probe, key, config[key], source))
    if limit is not None and any(k in config for k in _PLAN_FIELDS):
        with _noted(errors):
            options.update(_plan_options(limit, config, options, source))
    learning = {k: config[k] for k in ADAPTIVE_FIELDS if k in config}
    if learning and limit is not None:
        with _noted(errors):
            options["adaptive"] = parse_adaptive(learning, limit, source=source)
    if limit is None or (errors is not None and len(errors) > found):
        return None
    with _noted(errors):
        try:
            return Rule(limit, **options)
        except ConfigError as exc:  # fields that contradict each other (key, cold_start)
            raise ConfigError(
                exc.problem, field=exc.field, value=exc.value, limit=name, source=source
            ) from None
    return None


def _limit(fields: dict[str, Any], name: str, source: str | None, errors: Errors) -> Limit | None:
    """The limit of an entry (rate, algorithm, burst); with ``errors``, after an error the
    bad field is left out and the rest checked again (a burst cannot be judged without a
    valid rate)."""
    while True:
        try:
            return Limit.from_mapping(fields, name=name, source=source)
        except ConfigError as exc:
            _report(errors, exc)
            if exc.field == "rate" or exc.field not in fields:
                return None
            del fields[exc.field]


def _plan_options(
    limit: Limit, config: Mapping[str, Any], options: Mapping[str, Any], source: str | None
) -> dict[str, Any]:
    """``plan`` and ``plans`` of a limits file's entry, checked together against the limit,
    its key and its cost: ``{Rule argument: value}``."""
    if "key" in config and "key" not in options:
        return {}  # a bad key, reported on its own
    plans = {k: config[k] for k in _PLAN_FIELDS if k in config}
    try:
        Rule(limit, key=options.get("key"), cost=options.get("cost", 1.0), **plans)
    except ConfigError as exc:
        if exc.field == "fair":  # a fair limit without a key: the plan table needs one
            raise ConfigError(
                "plans set each key's rate (a fair limit's: its weight): give the limit a "
                "key, such as '{tenant_id}'",
                field="plans", value=config.get("plans"), limit=limit.name, source=source,
            ) from None  # fmt: skip
        raise ConfigError(
            exc.problem, field=exc.field, value=exc.value, limit=limit.name, source=source
        ) from None
    return plans


def _rule_option(limit: Limit, key: str, value: Any, source: str | None) -> dict[str, Any]:
    """One rule field of a limits file's entry, validated: ``{Rule argument: value}``."""
    name = limit.name
    if key == "max_wait":
        if value is None:
            return {}
        return {"max_wait_s": parse_duration(value, field=key, limit=name, source=source)}
    if key == "key" and not isinstance(value, str):
        raise ConfigError(
            "must be a template string such as '{tenant_id}'",
            field="key", value=value, limit=name, source=source,
        )  # fmt: skip
    try:
        Rule(limit, **{key: value})
    except ConfigError as exc:
        raise ConfigError(
            exc.problem, field=exc.field, value=exc.value, limit=name, source=source
        ) from None
    return {key: value}


@dataclass(frozen=True)
class Settings:
    """How the throttler runs (durations in seconds); the ``settings:`` of a limits file.

    Parameters
    ----------
    redis_url:
        The limiter's Redis. ``None``: ``THROTTLE_REDIS_URL``, else the broker's URL when
        the broker is Redis.
    redis_own_connections:
        The limiter calls Redis on connections it keeps from its client's pool, about half
        the client's CPU per call (``throttle.redis.direct``). ``false``: every call
        through redis-py's ``Redis.execute_command``, where an instrumentation of
        redis-py's commands (OpenTelemetry's, say) sees it.
    prefix, namespace:
        Where the keys live (:class:`throttle.redis.keys.KeySpace`).
    refresh_s:
        How often a process re-reads rates changed at run time: the fleet follows a
        change within this time. At least :data:`MIN_REFRESH_S` (100 ms).
    sleep_max_s:
        A slot at most this far ahead is waited for in the worker; beyond, the task is
        rescheduled (or, in a worker's consumer, waits in its line: ``line_max``). In the
        consumer (not in a pool slot: :mod:`throttle.celery.waiting`) a task reserves its
        slot at most ``reserve_ahead`` ahead, or ``sleep_max`` if shorter; where
        the pool decides, a slot within ``sleep_max`` is slept in the pool slot (within
        50 ms for a task without ``acks_late``, whose message is acknowledged when it
        starts, and within a tenth of a task's time limit, which the sleep would spend:
        a longer wait goes back through the broker). A
        rescheduled task is sent to arrive shortly before its slot (at most three quarters
        of ``sleep_max`` before it) and wait the rest. Long: more tasks held in workers'
        memory, unacknowledged. At least :data:`MIN_SLEEP_MAX_S` (50 ms).
    park_after_s:
        A wait longer than this is parked in Redis and sent back on the Redis clock; a
        shorter one (beyond ``sleep_max``) is re-published as a Celery ETA message, which
        is due on the publishing worker's clock and held by the receiving worker until its
        own clock says so: workers whose clocks disagree then miss slots. The default (1 s,
        the default ``sleep_max``) parks every wait that is not slept.
    line_max_s:
        A task whose limits cannot admit it within ``reserve_ahead`` waits this long at most
        in its worker's line (:mod:`throttle.celery.waiting`): it reserves nothing, its
        message stays unacknowledged, and it runs as soon as capacity appears (a refund,
        a rate raised, a hold ending); beyond, it is rescheduled (re-published or parked,
        as ``park_after`` says). Capped by half the broker's visibility timeout (Redis,
        SQS) or RabbitMQ's ``consumer_timeout``; 0 turns the line off.
    reserve_ahead_s:
        How far ahead a task waiting in a worker's consumer reserves its slot (at most
        ``sleep_max``): the near horizon. A task its limits cannot admit within it waits in
        the line, reserving nothing. Slots are taken in order, so what is reserved ahead
        every later task waits behind (another tenant's task behind a flood on a shared
        limit, a refund that should reach a waiting task), and a worker that falls behind
        (its consumer starved of CPU) loses the slots it reserved; too short, and the
        consumer's timer and loop cannot hand a task over on time. At least
        :data:`MIN_RESERVE_AHEAD_S` (50 ms).
    park_lead_s:
        A parked task with a reserved slot is sent back to the broker this long before
        it (at most half of ``sleep_max``), and sleeps the rest in the worker.
    late_tolerance_s:
        A task that reaches its reserved slot later than this gives the slot up and takes
        a new one: a late batch must not call the API at once. A task whose reserving
        limits all have the spacing guard (``spacing_guard``) keeps a slot it is late for
        by up to one spacing of the tightest of them (at most half a ``sleep_max``): the
        guard pushes the next calls back instead of letting them bunch.
    burst_margin_s:
        How much of a bursty limit's refill workers keep in hand, in s: a token bucket or
        GCRA limit whose burst exceeds 1 lets a worker's tasks take ``burst -
        burst_margin x rate`` at once, never less than half the burst beyond 1 nor the
        task's cost (:meth:`throttle.Limit.with_margin`). The first calls of a busy
        period reach the upstream later than their slots (the time a worker takes to
        start them: tens of ms on a loaded host), and an upstream whose bucket was full
        starts refilling only when they arrive; without the margin, the calls after the
        burst find its bucket short and are refused (one or two per busy period, against
        an upstream that enforces exactly the same limit). It costs at most
        ``burst_margin x rate`` tokens of the burst, once per busy period, and nothing of
        the sustained rate. 0: the whole burst. Eager mode and direct calls, which call
        as soon as they are admitted, take the whole burst. Half the margin is also how
        long a pool child may draw units it took ahead while its limits have plenty of
        room (:mod:`throttle.celery.stock`; 0: it takes none ahead).
    jitter_s:
        The most random delay added to a retry after a denial that reserved nothing
        (windows, concurrency), so that denied tasks do not return together.
    pause_recheck_s:
        How often a task of a paused limit (``celery throttle pause``) comes back to look
        (plus up to half as much again of jitter): after ``resume``, paused tasks return
        within this time. Shorter means a quicker resume, and more re-publishing of a
        paused backlog.
    lanes:
        Re-publish deferred tasks to the queue's lane, ``QUEUE.throttled``, which every
        worker consuming QUEUE also consumes (``install``), rather than to QUEUE itself,
        where a task due now would wait behind the whole backlog. Assumes that a queue's
        routing key is its name (Celery's default); turn off otherwise.
    fail_open_for_s:
        How long ``on_redis_down: allow`` lets tasks run without the limiter, counted from
        the start of the outage as this worker saw it; then they are deferred until Redis
        answers (``allow:DURATION`` sets a rule's own bound).
    fleet_workers:
        How many ``celery worker`` instances share the limits, for ``on_redis_down: local``
        (each process gets rate / (fleet_workers x its worker's pool size)). ``None``: count
        them with ``app.control.ping`` through the broker when an outage starts (once per
        outage and process, 0.5 s); if the broker does not answer either, ``local`` limits
        defer. A fixed count needs no broker, and is wrong while the fleet scales.
    metrics:
        Count decisions, waits, reschedules, timeouts, refunds and Redis errors in every
        worker (Prometheus, :mod:`throttle.metrics`; needs ``celery-throttled[metrics]``).
        Implied by ``metrics_port``.
    metrics_port:
        Serve the worker's metrics on this port from its main process (``None``: not
        served by the worker; Flower's ``/metrics`` still shows them on the same host).
        ``THROTTLE_METRICS_PORT`` overrides it per worker, for several workers per host.
    metrics_dir:
        Where workers keep their metric files (one directory per worker below it; Flower
        reads them all). ``None``: ``throttle-metrics-PREFIX-NAMESPACE`` in the temp dir.
    refusals_max:
        The refusals the upstream reported that are kept per limit, fleet-wide, in Redis
        (:mod:`throttle.refusals`, ``celery throttle refusals``): the last this many.
    refusals_for_s:
        Refusals older than this are never shown, and are dropped when the next one of
        the limit is recorded (``None``: kept until ``refusals_max`` pushes them out).
        Needs Redis 6.2.
    mode:
        The ``mode`` of every limit that does not set its own: ``enforce`` or ``shadow``
        (see the limit field; concurrency limits are always enforced).
    """

    redis_url: str | None = None
    redis_own_connections: bool = True
    prefix: str = "throttle"
    namespace: str = "default"
    refresh_s: float = 2.0
    sleep_max_s: float = 1.0
    park_after_s: float = 1.0
    line_max_s: float = 300.0
    reserve_ahead_s: float = 0.25
    park_lead_s: float = 0.5
    late_tolerance_s: float = 0.02
    burst_margin_s: float = 0.1
    jitter_s: float = 1.0
    pause_recheck_s: float = 30.0
    fail_open_for_s: float = 60.0
    fleet_workers: int | None = None
    lanes: bool = True
    metrics: bool = False
    metrics_port: int | None = None
    metrics_dir: str | None = None
    refusals_max: int = 1000
    refusals_for_s: float | None = None
    mode: str = "enforce"

    def __post_init__(self) -> None:
        if self.metrics_port is not None:
            object.__setattr__(self, "metrics", True)  # a port serves metrics: count them

    @classmethod
    def from_mapping(cls, config: object, *, source: str | None, errors: Errors = None) -> Settings:
        """The ``settings:`` of a limits file. With ``errors``, every bad setting is noted
        there and left at its default."""
        if config is None:
            return cls()
        if not isinstance(config, Mapping):
            _report(
                errors,
                ConfigError("must be a mapping", field="settings", value=config, source=source),
            )
            return cls()
        values: dict[str, Any] = {}
        bad: set[object] = set()  # reported, and left at their defaults (which pass below)
        for key, value in config.items():
            found = len(errors) if errors is not None else 0
            with _noted(errors):
                values.update(_setting(key, value, source))
            if errors is not None and len(errors) > found:
                bad.add(key)
        if "metrics_port" in values and values.get("metrics") is False:
            _report(
                errors,
                ConfigError(
                    "metrics: false contradicts metrics_port (a port serves metrics)",
                    field="settings.metrics_port", value=values["metrics_port"], source=source,
                ),
            )  # fmt: skip
            values.pop("metrics_port")
        settings = cls(**values)
        if settings.refresh_s < MIN_REFRESH_S:
            _report(
                errors,
                ConfigError(
                    f"refresh must be at least {MIN_REFRESH_S:g} s: each process re-reads "
                    f"the rates set at run time once per refresh, and a worker's consumer "
                    f"re-reads its adaptive limits' learned rates as often; with less, that "
                    f"is a Redis round trip on every task and a consumer that never idles",
                    field="settings.refresh", value=config.get("refresh"), source=source,
                ),
            )  # fmt: skip
        if settings.sleep_max_s < MIN_SLEEP_MAX_S:
            _report(
                errors,
                ConfigError(
                    f"sleep_max must be at least {MIN_SLEEP_MAX_S:g} s: a rescheduled task "
                    f"arrives shortly before its slot and sleeps the rest, up to sleep_max; "
                    f"with less, it would be sent back again and again until its slot",
                    field="settings.sleep_max", value=config.get("sleep_max"), source=source,
                ),
            )  # fmt: skip
        if settings.reserve_ahead_s < MIN_RESERVE_AHEAD_S:
            _report(
                errors,
                ConfigError(
                    f"reserve_ahead must be at least {MIN_RESERVE_AHEAD_S:g} s: a task is "
                    f"handed to the pool shortly before its slot, and the consumer's loop "
                    f"must get there on time",
                    field="settings.reserve_ahead", value=config.get("reserve_ahead"),
                    source=source,
                ),
            )  # fmt: skip
        if settings.refusals_for_s is not None and settings.refusals_for_s <= 0:
            _report(
                errors,
                ConfigError(
                    "refusals_for must be longer than 0 s: refusals older than it are "
                    "dropped as each new one is recorded, so 0 would keep none (leave it "
                    "out to keep the last refusals_max)",
                    field="settings.refusals_for", value=config.get("refusals_for"),
                    source=source,
                ),
            )  # fmt: skip
        # park_lead against park_after only when both are valid.
        if not bad & {"park_lead", "park_after"} and settings.park_lead_s >= settings.park_after_s:
            _report(
                errors,
                ConfigError(
                    f"park_lead ({settings.park_lead_s:g} s) must be shorter than park_after "
                    f"({settings.park_after_s:g} s)",
                    field="settings.park_lead" if "park_lead" in config else "settings.park_after",
                    value=config.get("park_lead", config.get("park_after")), source=source,
                ),
            )  # fmt: skip
        return settings


def _setting(key: object, value: object, source: str | None) -> dict[str, Any]:
    """One entry of ``settings:``, validated: ``{Settings argument: value}``."""
    if not isinstance(key, str) or key not in _SETTINGS_FIELDS:
        raise ConfigError(
            f"unknown setting{did_you_mean(key, _SETTINGS_FIELDS)}; "
            f"expected one of {', '.join(_SETTINGS_FIELDS)}",
            field=f"settings.{key}", value=value, source=source,
        )  # fmt: skip
    kind = _SETTINGS_FIELDS[key]
    if kind == "duration":
        return {f"{key}_s": parse_duration(value, field=f"settings.{key}", source=source)}
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(
                "must be true or false", field=f"settings.{key}", value=value, source=source
            )
        return {key: value}
    if kind == "count":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                "must be a whole number >= 1", field=f"settings.{key}", value=value,
                source=source,
            )  # fmt: skip
        return {key: value}
    if kind == "mode":
        if value not in ("enforce", "shadow"):
            raise ConfigError(
                "must be 'enforce' or 'shadow'", field=f"settings.{key}", value=value,
                source=source,
            )  # fmt: skip
        return {key: value}
    if kind == "port":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
            raise ConfigError(
                "must be a port number from 1 to 65535", field=f"settings.{key}", value=value,
                source=source,
            )  # fmt: skip
        return {key: value}
    if not isinstance(value, str) or not value:
        raise ConfigError(
            "must be a non-empty string", field=f"settings.{key}", value=value, source=source
        )
    # A NUL cannot be in a path or URL, a lone surrogate cannot be sent to Redis.
    problem = "a NUL character" if "\x00" in value else text_error(value)
    if problem is not None:
        raise ConfigError(
            f"must be Unicode text; it has {problem}", field=f"settings.{key}", value=value,
            source=source,
        )  # fmt: skip
    if key == "redis_url":
        try:
            check_form(value)
        except ConfigError as exc:
            raise ConfigError(
                exc.problem, field=f"settings.{key}", value=exc.value, source=source
            ) from None
    if key in ("prefix", "namespace"):
        try:
            KeySpace(**{key: value})
        except ConfigError as exc:  # braces would move the Redis Cluster hash tag
            raise ConfigError(
                exc.problem, field=f"settings.{key}", value=value, source=source
            ) from None
    return {key: value}


def _names(
    value: object, *, field: str, defined: Collection[str], source: str | None, errors: Errors
) -> tuple[str, ...]:
    """A ``queues:`` or ``tasks:`` entry: names of limits the file defines (``defined``:
    every name of ``limits:``, valid or not, so that a bad limit is reported once)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence) or isinstance(value, str):
        _report(
            errors,
            ConfigError("must be a list of limit names", field=field, value=value, source=source),
        )
        return ()
    names: list[str] = []
    for item in value:
        if item not in defined:
            _report(
                errors,
                ConfigError(
                    f"unknown limit; the file defines {', '.join(sorted(defined)) or 'none'}",
                    field=field, value=item, source=source,
                ),
            )  # fmt: skip
        elif item in names:
            _report(
                errors,
                ConfigError("a limit listed twice", field=field, value=item, source=source),
            )
        else:
            names.append(item)
    return tuple(names)


@dataclass(frozen=True)
class ThrottleConfig:
    """A validated limits file: named rules, and which queues and tasks they apply to."""

    rules: Mapping[str, Rule] = field(default_factory=dict)
    queues: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    tasks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    settings: Settings = field(default_factory=Settings)
    source: str | None = None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ThrottleConfig:
        """Read and validate a YAML limits file; a :class:`ConfigError` names the place of
        the first error (:meth:`check` finds them all)."""
        return cls.from_mapping(_read(path), source=str(path))

    @classmethod
    def check(cls, path: str | os.PathLike[str]) -> list[ConfigError]:
        """Every error of a limits file, in the file's order, each naming its place as
        :meth:`load` would (empty: the file is valid). What ``celery throttle check`` prints.

        A file that cannot be read or parsed is one error; otherwise each section, limit,
        field and list item is checked on its own (a limit's ``burst`` only once its
        ``rate`` is valid; ``park_lead`` against ``park_after`` once both are).
        """
        errors: list[ConfigError] = []
        with _noted(errors):
            _build(_read(path), str(path), errors)
        return errors

    @classmethod
    def check_mapping(cls, document: object, *, source: str | None = None) -> list[ConfigError]:
        """Every error of a parsed limits document, as :meth:`check` finds a file's."""
        errors: list[ConfigError] = []
        with _noted(errors):
            _build(document, source, errors)
        return errors

    @classmethod
    def from_mapping(cls, document: object, *, source: str | None = None) -> ThrottleConfig:
        """Validate a parsed limits document (the YAML's top-level mapping)."""
        config = _build(document, source, None)
        assert config is not None  # without an error list, the first error was raised
        return config

    @classmethod
    def from_source(cls, source: ConfigSource | None) -> ThrottleConfig:
        """A config from a path, a mapping, or (``None``) the file named by
        :data:`CONFIG_ENV`; no file at all is an empty config (inline rules only)."""
        if source is None:
            source = os.environ.get(CONFIG_ENV) or None
        if source is None:
            return cls()
        if isinstance(source, Mapping):
            return cls.from_mapping(source, source=MAPPING_SOURCE)
        if not isinstance(source, str | os.PathLike):  # an int would be read as a file descriptor
            raise ConfigError(
                "must be the path of a limits file or a mapping",
                field="throttle_config", value=source,
            )  # fmt: skip
        return cls.load(source)

    def warnings(self) -> list[ConfigError]:
        """What is valid but most likely a typo, as ConfigErrors that ``celery throttle
        check`` prints as warnings and a worker logs at start: a limit's ``upstream`` that
        is a near miss of a dimension OpenAI, Anthropic or Discord name (``tokenz``,
        ``input_tokens``). Dimensions stay open-ended (a GitHub resource, a Stripe reason:
        whatever the headers say), so a name close to none is not warned of."""
        found = []
        for name, rule in self.rules.items():
            if rule.upstream is None or rule.upstream in NAMED_DIMENSIONS:
                continue
            hint = did_you_mean(rule.upstream, NAMED_DIMENSIONS)
            if not hint:
                continue
            warning = ConfigError(
                f"a dimension OpenAI, Anthropic and Discord do not name{hint}: unless the "
                "upstream's headers name it (a GitHub resource, a Stripe reason), no "
                "response will set this limit's rate, and only refusals that blame no "
                "dimension will hold it",
                field="upstream", value=rule.upstream, limit=name, source=self.source,
            )  # fmt: skip
            found.append(warning)
        return found

    def rules_for(self, task_name: str, queue: str | None) -> tuple[Rule, ...]:
        """The configured rules of a task consumed from ``queue``: the task's, then the
        queue's (each limit once)."""
        names = list(self.tasks.get(task_name, ()))
        if queue is not None:
            names += [name for name in self.queues.get(queue, ()) if name not in names]
        return tuple(self.rules[name] for name in names)

    def rule(self, name: str) -> Rule:
        """The rule named ``name``; a ConfigError lists the names this file defines."""
        try:
            return self.rules[name]
        except KeyError:
            raise ConfigError(
                f"unknown limit; {self.source or 'the limits config'} defines "
                f"{', '.join(sorted(self.rules)) or 'none'}",
                value=name,
                source=self.source,
            ) from None


# A limits file is a few kB. Bounds that no real one nears keep a hostile or mistaken file
# (THROTTLE_CONFIG naming a log, /dev/zero, a generated bomb) from costing more than a
# moment: PyYAML (pure Python: its C loader crashes the process on deep nesting) takes
# seconds per 100 kB, and recurses once per level of nesting.
_MAX_BYTES = 1 << 20
_MAX_DEPTH = 50
"""Nesting levels of [...] / {...}, and of indentation, in a limits file."""
_MAX_MERGED = 100_000
"""Entries copied by merge keys in all: `<<: [*a, *a, *a]` copies, and PyYAML flattens a
merge again for every alias of it, so 25 lines can ask for 3**20 copies."""


def _loader() -> type:
    """yaml.SafeLoader with nesting and merge keys bounded (a ScannerError or
    ConstructorError past :data:`_MAX_DEPTH` or :data:`_MAX_MERGED`)."""
    import yaml  # noqa: PLC0415

    def too_deep(loader: Any) -> Exception:
        return yaml.scanner.ScannerError(
            None, None, f"nested more than {_MAX_DEPTH} levels deep", loader.get_mark()
        )

    class Loader(yaml.SafeLoader):
        merged = 0

        def fetch_flow_collection_start(self, token_class: Any) -> None:
            if self.flow_level >= _MAX_DEPTH:
                raise too_deep(self)
            super().fetch_flow_collection_start(token_class)

        def add_indent(self, column: int) -> bool:
            if len(self.indents) >= _MAX_DEPTH:
                raise too_deep(self)
            added: bool = super().add_indent(column)
            return added

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            # A key given twice in one mapping (a limit defined twice, `rate:` twice):
            # PyYAML keeps the last, so a typo would silently change a limit. Keys merged
            # in with `<<` may be overridden, as YAML means them to.
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, Any] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.setdefault(key, key_node)
                    except TypeError:  # an unhashable key: PyYAML refuses it itself
                        continue
                    if first is not key_node:
                        raise yaml.constructor.ConstructorError(
                            None, None,
                            f"{key!r} appears twice in one mapping (line "
                            f"{first.start_mark.line + 1}, column {first.start_mark.column + 1}"
                            "): the second would replace the first",
                            key_node.start_mark,
                        )  # fmt: skip
            return super().construct_mapping(node, deep)

        def flatten_mapping(self, node: Any) -> None:
            super().flatten_mapping(node)
            self.merged += len(node.value)
            if self.merged > _MAX_MERGED:
                raise yaml.constructor.ConstructorError(
                    None, None,
                    f"merge keys ('<<') expand to more than {_MAX_MERGED} entries",
                    node.start_mark,
                )  # fmt: skip

    return Loader


def _read(path: str | os.PathLike[str]) -> object:
    """The parsed YAML document of a limits file (an empty file is an empty mapping).

    Whatever the bytes, the result is a document or a :class:`ConfigError` naming the file:
    over 1 MiB, not UTF-8, not YAML, nested too deeply, an integer of more digits than
    Python converts, an impossible date, a merge-key bomb."""
    import yaml  # noqa: PLC0415  (only the loader reads files; yaml loads lazily)

    source = str(path)
    try:
        with open(path, "rb") as file:
            data = file.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"cannot read the limits file {os.path.abspath(path)!r}: {exc.strerror}",
            source=source,
        ) from None
    if len(data) > _MAX_BYTES:
        raise ConfigError(f"larger than {_MAX_BYTES >> 20} MiB: not a limits file", source=source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start}", source=source
        ) from None
    try:
        document = yaml.load(text, Loader=_loader())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        # Where the parser stopped may be far from the mistake (a quote left open is
        # found at the end of the file): its context says where the construct began.
        context, began = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and began is not None:
            problem += f" ({context} at line {began.line + 1}, column {began.column + 1})"
        raise ConfigError(f"not valid YAML{where}: {problem}", source=source) from None
    except RecursionError:
        raise ConfigError("not a limits file: YAML nested too deeply", source=source) from None
    except Exception as exc:
        # PyYAML's constructors raise what they meet on values they parsed but cannot build:
        # ValueError for an int of more than 4300 digits or a date such as 2024-13-45,
        # AttributeError for `!!timestamp ''`, TypeError for other explicit tags on the
        # wrong kind of node.
        raise ConfigError(
            f"not a valid YAML value ({type(exc).__name__}): {str(exc)[:200]}", source=source
        ) from None
    return document if document is not None else {}


def _build(document: object, source: str | None, errors: Errors) -> ThrottleConfig | None:
    """A limits document as a ThrottleConfig. With ``errors``, every error is noted there
    (sections, limits and their fields each checked on their own) and None returned if
    there was any; without, the first error is raised."""
    if not isinstance(document, Mapping):
        _report(
            errors,
            ConfigError(
                "a limits file must be a mapping with limits:, queues:, tasks:, settings:",
                value=document, source=source,
            ),
        )  # fmt: skip
        return None
    for key in document:
        if key not in _TOP_FIELDS:
            _report(
                errors,
                ConfigError(
                    f"unknown section{did_you_mean(key, _TOP_FIELDS)}; "
                    f"expected one of {', '.join(_TOP_FIELDS)}",
                    field=str(key), value=document[key], source=source,
                ),
            )  # fmt: skip
    settings = Settings.from_mapping(document.get("settings"), source=source, errors=errors)
    entries = document.get("limits") or {}
    if not isinstance(entries, Mapping):
        _report(
            errors,
            ConfigError("must be a mapping of named limits", field="limits", source=source),
        )
        entries = {}
    rules: dict[str, Rule] = {}
    for name, entry in entries.items():
        try:
            check_name(name, field="limits", source=source)
        except ConfigError as exc:
            _report(errors, exc)
            continue
        rule = _rule(entry, name, source, errors)
        if rule is not None:
            rules[name] = rule
    defined = [name for name in entries if isinstance(name, str) and name and not text_error(name)]
    maps: dict[str, dict[str, tuple[str, ...]]] = {}
    for section in ("queues", "tasks"):
        mapping = document.get(section) or {}
        if not isinstance(mapping, Mapping):
            _report(
                errors,
                ConfigError(
                    "must map names to lists of limits", field=section, value=mapping,
                    source=source,
                ),
            )  # fmt: skip
            mapping = {}
        maps[section] = {}
        for name, value in mapping.items():
            if not isinstance(name, str) or not name:
                what = "queue" if section == "queues" else "task"
                _report(
                    errors,
                    ConfigError(
                        f"a {what} name must be a non-empty string", field=section, value=name,
                        source=source,
                    ),
                )  # fmt: skip
                continue
            maps[section][name] = _names(
                value, field=f"{section}.{name}", defined=defined, source=source, errors=errors
            )
    if errors:
        return None
    return ThrottleConfig(rules, maps["queues"], maps["tasks"], settings, source)
