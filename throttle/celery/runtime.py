"""The throttler of one Celery app in one process: config, limiter, rates, parking, reporters.

:class:`Throttler` is built lazily in each process (no connection at import, none shared
across a fork) by :meth:`Throttler.of`, and resolves the rules of a task: what the task
declares (``@throttled``, ``ThrottledTask.throttle``) and what the limits file maps to its
name and queue.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

from celery import Celery, Task
from celery.utils.collections import ConfigurationView, DictAttribute

from throttle.adaptive import LearnedRates
from throttle.celery.estimates import Estimates
from throttle.celery.observe import Observers, TaskTrailReporter, default_observers
from throttle.celery.outage import WORKER_ENV, Breaker, OutageWatch, ping_fleet
from throttle.celery.routing import check_routing, has_consumer_tags
from throttle.celery.ruleset import RuleSet
from throttle.celery.stock import Stocks
from throttle.config import CONFIG_ENV, Settings, ThrottleConfig
from throttle.errors import BackendError, ConfigError, did_you_mean
from throttle.limiter import Limiter
from throttle.parking import ParkingLot
from throttle.rates import RateBook
from throttle.redis.client import wrap_errors
from throttle.redis.clock import RedisClock
from throttle.redis.urls import redact
from throttle.refusals import RefusalBook
from throttle.rules import Declared, Rule
from throttle.stats import StatsBook

logger = logging.getLogger("throttle")

RABBITMQ_CONSUMER_TIMEOUT_S = 1800.0
"""RabbitMQ's default ``consumer_timeout`` (30 min), assumed on an AMQP broker unless
``broker_transport_options["consumer_timeout"]`` says otherwise."""

RELEASER_STEP = "throttle"
"""The label of the worker bootstep that runs the releaser of parked tasks (install())."""

MEMORY_URL = "memory://"
"""``throttle_redis_url`` of the in-memory limiter (:mod:`throttle.testing`): one process,
no Redis; for eager tests."""

_OFF = ("0", "false", "no", "off")


def throttling_enabled(app: Celery) -> bool:
    """Whether ``app``'s tasks are throttled: ``app.conf.throttle_enabled`` (Django:
    ``CELERY_THROTTLE_ENABLED`` through ``config_from_object(..., namespace="CELERY")``),
    else the environment's ``THROTTLE_ENABLED``; on unless one of them says ``False``,
    ``0``, ``false``, ``no`` or ``off``. Off, tasks run unthrottled and nothing reaches
    Redis: no limiter is built, the worker's steps do nothing."""
    value = _setting(app.conf, "throttle_enabled")
    if value is None:
        value = _environment("THROTTLE_ENABLED")
        if value is None:
            return True
    if isinstance(value, str):
        return value.strip().lower() not in _OFF
    return bool(value)


_LOADED = (dict, DictAttribute)
"""The maps of a loaded Celery configuration: its changes and defaults, and the object it
was configured from."""

_SPELLINGS: dict[tuple[Any, ...], tuple[str, ...]] = {}
"""The keys a setting is looked up by, per name and configuration's spelling rules."""


def _setting(conf: Any, name: str) -> Any:
    """``conf.get(name)`` (None when not set) as Celery's configuration view looks it up
    (each map in order, the name and its old and new spellings), without the KeyError it
    raises and catches for each map and spelling that lacks it: read once per task, a
    setting left unset cost 4-5 µs that way, about a tenth of the throttler's own time."""
    maps = getattr(conf, "maps", None) if isinstance(conf, ConfigurationView) else None
    if not maps:
        return conf.get(name)  # not loaded yet (a pending configuration loads on a read)
    spelt = (name, conf.prefix, conf.key_t, conf._keys)
    keys = _SPELLINGS.get(spelt)
    if keys is None:
        keys = tuple(dict.fromkeys(conf._key(spelling) for spelling in conf._to_keys(name)))
        _SPELLINGS[spelt] = keys
    for mapping in maps:
        if type(mapping) not in _LOADED:
            return conf.get(name)  # a map of another kind: Celery's own lookup
        for found in keys:
            if found in mapping:
                return mapping[found]
    return None


_ENCODED: dict[str, Any] = {}
"""The names of environment variables as ``os.environ`` keeps them (bytes on POSIX)."""


def _environment(name: str) -> str | None:
    """``os.environ.get(name)``, without the ``KeyError`` that ``Mapping.get`` raises and
    catches when the variable is not set (1 µs, on every task for ``THROTTLE_ENABLED``).
    Read from the mapping ``os.environ`` keeps, which every change to it updates;
    through ``get`` where it has none (``os.environ`` replaced by another mapping)."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if type(environ) is not os._Environ or type(data) is not dict:
        return environ.get(name)
    key = _ENCODED.get(name)
    if key is None:
        key = _ENCODED[name] = environ.encodekey(name)
    raw = data.get(key)
    return None if raw is None else environ.decodevalue(raw)


def task_rules(
    config: ThrottleConfig, name: str, declared: Declared | None, queue: str | None
) -> tuple[Rule, ...]:
    """The rules of task ``name`` consumed from ``queue`` (None: its own and the file's
    for its name only): what it declares (inline, then named, with its overrides), then
    the file's for its name and queue, each limit once. A named limit the file does not
    define raises ConfigError."""
    found: dict[str, Rule] = {}
    if declared is not None:
        for rule in declared.rules:
            found.setdefault(rule.name, rule)
        for limit in declared.names:
            rule = config.rule(limit)
            if declared.overrides:
                rule = dataclasses.replace(rule, **declared.overrides)
            found.setdefault(limit, rule)
    # Celery's own tasks (chord_unlock, backend_cleanup...) are never throttled by the
    # file: a limit on the default queue must not stall a chord's bookkeeping.
    if not name.startswith("celery."):
        for rule in config.rules_for(name, queue):
            found.setdefault(rule.name, rule)
    return tuple(found.values())


def unknown_limits(app: Celery, config: ThrottleConfig) -> list[ConfigError]:
    """Each limit a task of ``app`` names (``@throttled("name")``, ``ThrottledTask``) that
    ``config`` does not define, naming the task: a worker refuses to start on the first,
    ``celery throttle check -A`` lists them all."""
    if config.source is None and not config.rules:
        where = (
            ", but no limits file is configured (app.conf.throttle_config, or the "
            f"{CONFIG_ENV} environment variable)"
        )
    else:
        defined = ", ".join(sorted(config.rules)) or "none"
        where = f" the file does not define; it defines {defined}"
    errors = []
    for task in sorted(app.tasks.values(), key=lambda task: str(task.name)):
        declared = declared_by(task)
        for name in declared.names if declared is not None else ():
            if name not in config.rules:
                errors.append(
                    ConfigError(
                        f"task {task.name!r} names a limit{where}",
                        value=name,
                        source=config.source,
                    )
                )
    return errors


def unknown_tasks(app: Celery, config: ThrottleConfig) -> list[ConfigError]:
    """Each task name of ``config``'s ``tasks:`` that ``app`` does not register (a typo
    would leave the task it meant unthrottled, silently). Warnings, not errors: a limits
    file may serve several apps, each with its own tasks; a worker logs them at start,
    ``celery throttle check -A`` prints them. Call after the app's task modules are
    imported."""
    registered = [name for name in app.tasks if not name.startswith("celery.")]
    return [
        ConfigError(
            f"tasks: names a task that app {app.main!r} does not register"
            f"{did_you_mean(name, registered)}: its limits apply to no task of it",
            value=name,
            source=config.source,
        )
        for name in sorted(config.tasks)
        if name not in app.tasks
    ]


def declared_by(task: Task) -> Declared | None:
    """The limits a task declares: ``@throttled`` on its function, or the ``throttle``
    attribute of its ThrottledTask class; None for a task that declares none."""
    declared: Declared | None = getattr(task.run, "__throttle__", None)
    if declared is None:
        of_class = getattr(type(task), "declared_limits", None)  # ThrottledTask
        if of_class is not None:
            declared = of_class()
    return declared


class Throttler:
    """The throttler of one Celery app in one process: config, limiter, rates, parking."""

    def __init__(
        self,
        app: Celery,
        config: ThrottleConfig,
        limiter: Limiter,
        url_origin: str | None = None,
    ) -> None:
        self.app = app
        self.config = config
        self.settings: Settings = config.settings
        self.limiter = limiter
        self.url_origin = config.source if url_origin is None else url_origin
        """Where the limiter's Redis URL came from (the limits file, ``app.conf``, the
        environment, the broker URL): what an error about it names."""
        keyspace = limiter.keyspace
        self.rates = RateBook(limiter.client, keyspace, refresh_s=self.settings.refresh_s)
        self.estimates = Estimates(limiter.client, keyspace, refresh_s=self.settings.refresh_s)
        """The share of their estimate the calls of each limit use, in this process."""
        self.learned = LearnedRates(limiter.client, keyspace, refresh_s=self.settings.refresh_s)
        self.parking = ParkingLot(limiter.client, keyspace)
        self.clock = RedisClock(limiter.client)
        self.stocks = Stocks(limiter, self.settings.burst_margin_s)
        self.stats = StatsBook(limiter.client, keyspace, clock=self.clock.now)
        self.refusals = RefusalBook(
            limiter.client, keyspace, max_entries=self.settings.refusals_max,
            keep_s=self.settings.refusals_for_s, clock=self.clock.now,
        )  # fmt: skip
        trail = TaskTrailReporter(limiter.client, keyspace, self.clock.now)
        self.observer: Observers = default_observers(self.stats, trail)
        self.task_time_limit: float | None = app.conf.task_time_limit
        """The app's ``task_time_limit`` (s), read once: a lookup in the app's settings
        costs more than the rest of the lease's computation, on every task."""
        self.task_soft_time_limit: float | None = app.conf.task_soft_time_limit
        """The app's ``task_soft_time_limit`` (s), read once likewise."""
        self.breaker = Breaker()
        """Whether this process's gates ask Redis at all
        (:class:`~throttle.celery.outage.Breaker`)."""
        self.watch = OutageWatch(
            self.settings, on_recovery=self.check_cold_start, count_fleet=lambda: ping_fleet(app)
        )
        self._resolved: dict[tuple[str, str | None, int], RuleSet] = {}
        self._split: dict[tuple[str, str | None, int, frozenset[str]], RuleSet] = {}
        # Per rule set (by id), the modes it was last split by and the split: until the
        # modes are read again (every refresh_s), a task's rule set is one lookup.
        self._in_modes: dict[int, tuple[RuleSet, Mapping[str, str], RuleSet]] = {}
        # Parked tasks need releasers: install() adds one to every worker of the app. Without
        # it a long wait stays an ETA message (with the risks parking avoids) rather than be
        # parked for ever.
        # peek("name") as hold("name"): the file's limits by name (inline ones: see
        # known_limits).
        limiter.limits.update({name: rule.limit for name, rule in config.rules.items()})
        self.in_memory = getattr(limiter, "server", None) is not None
        """The limiter is the in-memory one (``memory://``, :mod:`throttle.testing`): it
        never parks (no releaser in a one-process worker)."""
        self.releasing = not self.in_memory and any(
            getattr(step, "label", None) == RELEASER_STEP for step in app.steps["worker"]
        )
        if os.environ.get(WORKER_ENV) and not self.in_memory:
            # In a worker, tasks sleep to reserved slots up to sleep_max (and call up to
            # late_tolerance after them): a Redis that loses its data must not hand out
            # new slots among those (see Limiter.fence_s). A guarded task may call later
            # (up to half a sleep_max), but its guard stamps the call in that Redis, which
            # reads a lost guard state as a call at the fence's end.
            limiter.fence_s = self.settings.sleep_max_s + self.settings.late_tolerance_s
        if not self.releasing and not self.in_memory:
            logger.warning(
                "throttle: install(app) was not called: long waits stay ETA messages in "
                "workers instead of being parked in Redis"
            )

    @classmethod
    def of(cls, app: Celery) -> Throttler:
        """The throttler of ``app`` in this process (created on first call).

        Kept on the app with the pid that built it, so that a forked pool child builds
        its own connections. No lock: a lock held by the releaser thread at the moment
        the pool forks would stay locked forever in the child; two threads racing here
        build one spare throttler at worst.
        """
        cached = getattr(app, "_throttler", None)
        pid = os.getpid()
        if cached is None or cached[0] != pid:
            cached = (pid, cls.from_app(app))
            app._throttler = cached
        throttler: Throttler = cached[1]
        return throttler

    @classmethod
    def from_app(cls, app: Celery) -> Throttler:
        """Build from ``app.conf.throttle_config`` (a path or mapping; else the file named by
        ``THROTTLE_CONFIG``) and ``app.conf.throttle_redis_url`` (else the file's
        ``settings.redis_url``, ``THROTTLE_REDIS_URL``, or the broker when it is Redis).

        The URL may name a master behind Sentinel (``redis+sentinel://``, see
        :mod:`throttle.redis.urls`). A malformed URL raises :class:`ConfigError` showing it
        without its password. Keep a password out of ``app.conf`` (use the environment or
        the limits file): ``celery inspect conf`` and ``celery report`` censor only keys
        that look secret, and ``throttle_redis_url`` does not.

        ``memory://`` (:data:`MEMORY_URL`) builds the in-memory limiter of eager tests
        (:class:`throttle.testing.MemoryLimiter`): no Redis, this process only."""
        config = ThrottleConfig.from_source(app.conf.get("throttle_config"))
        # Where the URL came from: what an error about it names.
        found = [
            (app.conf.get("throttle_redis_url"), "app.conf.throttle_redis_url"),
            (config.settings.redis_url, config.source),
            (os.environ.get("THROTTLE_REDIS_URL"), "THROTTLE_REDIS_URL"),
        ]
        url, origin = next(((u, o) for u, o in found if u), (None, config.source))
        if not url:
            broker = str(app.conf.broker_url or "")
            if broker.startswith(("redis://", "rediss://", "unix://")):
                url, origin = broker, "the broker URL"
        if not url:
            raise ConfigError(
                "no Redis for the limiter: set app.conf.throttle_redis_url, settings.redis_url "
                "in the limits file or THROTTLE_REDIS_URL",
                field="redis_url", source=config.source,
            )  # fmt: skip
        settings = config.settings
        if url.startswith(MEMORY_URL):
            from throttle.memory import MemoryLimiter  # noqa: PLC0415 (tests only)

            memory = MemoryLimiter(prefix=settings.prefix, namespace=settings.namespace)
            return cls(app, config, memory, url_origin=origin)
        try:
            limiter = Limiter.from_url(
                url,
                prefix=settings.prefix,
                namespace=settings.namespace,
                own_connections=settings.redis_own_connections,
            )
        except ValueError as exc:
            if isinstance(exc, ConfigError):  # a malformed Sentinel or Cluster URL, redacted
                raise ConfigError(
                    exc.problem, field=exc.field, value=exc.value, source=origin
                ) from None
            # redis-py's message may quote a piece of the URL, password included.
            raise ConfigError(
                "the limiter's Redis URL cannot be parsed: use redis://, rediss://, unix://, "
                "redis+sentinel:// or redis+cluster://, and percent-encode '/', '@', ':', "
                "'?' and '#' in user names and passwords",
                field="redis_url", value=redact(url), source=origin,
            ) from None  # fmt: skip
        return cls(app, config, limiter, url_origin=origin)

    def rules(self, task: Task, declared: Declared | None, queue: str | None) -> tuple[Rule, ...]:
        """The task's rules: its own (inline, then named), then the file's for its name and
        queue, each limit once (those in shadow mode too)."""
        return self._all_rules(task, declared, queue).rules

    def mode_of(self, rule: Rule) -> str:
        """The mode in force of ``rule``: set at run time (``celery throttle enforce`` /
        ``shadow``, followed within ``settings.refresh``), else its own, else
        ``settings.mode``; a concurrency limit is always enforced."""
        return self._mode(rule, self._run_time_modes())

    def _run_time_modes(self) -> Mapping[str, str]:
        """The modes set at run time (limit name -> mode), re-read every refresh_s; with
        Redis down, the last ones read (the gate meets the outage)."""
        breaker = self.breaker
        # Read before a task's gate asks anything (in the consumer too): not while Redis
        # fails call after call (outage.Breaker), which a hung Redis would make a socket
        # timeout per task. Not the probe either: most reads come from the cache.
        if breaker.is_open():
            return self.rates.cached_modes()
        asked_at = time.monotonic()
        try:
            return self.rates.modes_in_force()
        except BackendError:
            breaker.failed(asked_at)
            return self.rates.cached_modes()

    def _mode(self, rule: Rule, modes: Mapping[str, str]) -> str:
        if rule.limit.algorithm.holds_units:
            return "enforce"
        return modes.get(rule.name) or rule.mode or self.settings.mode

    def rule_set(self, task: Task, declared: Declared | None, queue: str | None) -> RuleSet:
        """The task's rules (:meth:`rules`) and what the gate derives from them, resolved
        once per task name, declaration and queue; the limits in shadow mode split out
        (:attr:`RuleSet.shadow`), as their modes stand now."""
        every = self._all_rules(task, declared, queue)
        if not every.rules:
            return every
        modes = self._run_time_modes()
        if not modes and not every.shadow_declared and self.settings.mode != "shadow":
            return every  # every limit enforced: no mode to look up per rule
        seen = self._in_modes.get(id(every))
        if seen is not None and seen[0] is every and seen[1] is modes:
            return seen[2]  # the modes read then are the cache itself: none changed
        split = self._split_by(every, task, queue, declared, modes)
        self._in_modes[id(every)] = (every, modes, split)
        return split

    def _split_by(
        self,
        every: RuleSet,
        task: Task,
        queue: str | None,
        declared: Declared | None,
        modes: Mapping[str, str],
    ) -> RuleSet:
        """``every`` with its limits in shadow mode under ``modes`` split out."""
        shadowed = frozenset(r.name for r in every.rules if self._mode(r, modes) == "shadow")
        if not shadowed:
            return every
        cache_key = (task.name, queue, id(declared), shadowed)
        split = self._split.get(cache_key)
        if split is None:
            split = self._split[cache_key] = RuleSet.of(
                [r for r in every.rules if r.name not in shadowed],
                shadow=[r for r in every.rules if r.name in shadowed],
            )
        return split

    def _all_rules(self, task: Task, declared: Declared | None, queue: str | None) -> RuleSet:
        """Every rule of the task, in whatever mode."""
        cache_key = (task.name, queue, id(declared))
        resolved = self._resolved.get(cache_key)
        if resolved is None:
            rules = task_rules(self.config, task.name, declared, queue)
            resolved = self._resolved[cache_key] = RuleSet.of(rules)
        return resolved

    def declared(self) -> Iterator[Declared]:
        """What each task of the app declares (tasks that declare nothing left out)."""
        for task in list(self.app.tasks.values()):
            declared = declared_by(task)
            if declared is not None:
                yield declared

    def outage(self, exc: BaseException | None) -> None:
        """Note that Redis failed (``exc``) or answered (``None``): see
        :meth:`OutageWatch.note`."""
        self.watch.note(exc)

    def cold_start_rules(self) -> list[Rule]:
        """The rules with ``cold_start: empty``: the file's, then inline ones."""
        found = {r.name: r for r in self.config.rules.values() if r.cold_start == "empty"}
        for declared in self.declared():
            for rule in declared.rules:
                if rule.cold_start == "empty":
                    found.setdefault(rule.name, rule)
        return list(found.values())

    def check_cold_start(self) -> list[str]:
        """Drain the ``cold_start: empty`` limits if Redis has lost its data.

        The throttler keeps a marker key (``PREFIX:{NAMESPACE}:alive``, no TTL) in Redis.
        Missing, Redis is new or restarted empty: every limit's state is gone, so a bucket
        would be full and hand a whole burst to the fleet at once. The process that writes
        the marker again (``SET NX``: one in the fleet) takes each such limit's whole
        capacity once, through the limit's own script: a token bucket is then empty and
        refills at its rate, a GCRA limit's next slot is a burst away, a window counts as
        spent until it ends (for a daily quota, the rest of the day: the safe reading of
        "we no longer know what was spent"). Not a hold: after a hold, the missing state
        would still be a full bucket. Run at worker start, by the releaser, and when Redis
        answers again after an outage (:class:`OutageWatch`). Returns the names of the
        limits drained."""
        rules = self.cold_start_rules()
        if not rules:
            return []
        limiter = self.limiter
        client = limiter.client
        marker = limiter.keyspace.alive_key()
        if not wrap_errors(lambda: client.set(marker, repr(time.time()), nx=True)):
            return []
        for rule in rules:
            limit = self.rates.current(rule.limit)
            # Reserved as far ahead as it takes: within the restart fence a missing state of
            # a token bucket or GCRA limit reads as in debt until the fence's end, and must be
            # drained all the same (windows admit or deny now).
            refill_s = limit.capacity * limit.period_s / limit.count
            limiter.acquire(
                limit, None, cost=limit.capacity, max_wait_s=limiter.fence_s + refill_s + 1.0
            )
        names = [rule.name for rule in rules]
        logger.warning(
            "throttle: Redis has no marker key (new, or restarted without its data): "
            "limits %s start empty (cold_start: empty)",
            ", ".join(names),
        )
        return names

    def validate(self) -> None:
        """Check at worker start what can only be checked against the app: every named
        limit of its tasks exists in the file, no wait the throttler keeps in a worker
        (a sleep, an ETA message) can outlive the broker's visibility timeout (kombu#337:
        the message would be delivered again, the task run twice) or RabbitMQ's consumer
        timeout, and the worker can tell which queue each task came from."""
        self.check_visibility()
        check_routing(self.app, self.config.source)
        for error in unknown_limits(self.app, self.config):
            raise error

    def check_visibility(self) -> None:
        """Refuse settings that hold a task in a worker for more than half the broker's
        visibility timeout (when the transport has one: Redis, SQS), or than half
        RabbitMQ's ``consumer_timeout`` (a server setting, 30 min by default: past it the
        server closes the channel and delivers its unacked messages again; tell the
        worker yours with ``broker_transport_options["consumer_timeout"]``, in s)."""
        settings = self.settings
        options: dict[str, Any] = self.app.conf.broker_transport_options or {}
        held = settings.park_after_s + settings.park_lead_s + settings.sleep_max_s
        limits: list[tuple[str, Any]] = [("visibility_timeout", options.get("visibility_timeout"))]
        consumer_timeout = options.get("consumer_timeout")
        if consumer_timeout is None and has_consumer_tags(self.app):  # RabbitMQ
            consumer_timeout = RABBITMQ_CONSUMER_TIMEOUT_S
        limits.append(("consumer_timeout", consumer_timeout))
        for name, timeout in limits:
            number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
            if number and held > timeout / 2:
                raise ConfigError(
                    f"a task may be held {held:g} s in a worker (park_after + park_lead + "
                    f"sleep_max), more than half the broker's {name} ({timeout:g} s): "
                    f"lower park_after",
                    field="settings.park_after", value=settings.park_after_s,
                    source=self.config.source,
                )  # fmt: skip
