"""Fleet-wide rate limits for Celery tasks, enforced on the worker when a task is about to run.

Producer side: nothing changes (``.delay``, ``apply_async``, canvas, beat). Worker side::

    from celery import Celery
    from throttle.celery import ThrottledTask, install, report_cost, throttled

    app = Celery("proj", broker="redis://localhost:6379/0", task_cls=ThrottledTask)
    app.conf.throttle_config = "configs/limits.yaml"   # or THROTTLE_CONFIG=...
    install(app)    # worker start: validates the file, consumes the lanes, runs the releaser

    @app.task(bind=True)
    @throttled("openai-requests", "openai-tokens")     # limits named in the file
    def complete(self, tenant_id, prompt, max_tokens):
        reply = call_the_api(prompt, max_tokens)
        report_cost(reply.usage.total_tokens, limit="openai-tokens")  # settle the estimate
        return reply.text

    @app.task
    @throttled("20/s burst 1", algorithm="gcra", key="{account}")   # an inline limit
    def charge(account, amount): ...

``task_cls=ThrottledTask`` makes every task of the app apply the limits the file maps to
its name or to the queue it was consumed from (``queues:`` / ``tasks:``), so per-queue limits
need no decorator. ``@throttled`` (under ``@app.task`` or ``@shared_task``) adds limits to
one task; ``base=ThrottledTask`` with a ``throttle = [...]`` attribute does the same.

What happens to a task (all of it inside the task's execution, so retries, chains, chords,
groups, beat and replays pass through it):

1. Its rules are resolved: key and cost from its arguments, the rate from Redis when an
   operator changed it at run time (:class:`throttle.rates.RateBook`).
2. One :meth:`Limiter.acquire_many` with the task id as acquisition id: a redelivered task
   does not pay twice. Token bucket and GCRA limits *reserve* the next free slot.
3. Admitted now, or within ``sleep_max`` (the pool slot sleeps until the slot): the body
   runs, then the acquisition is settled with the actual cost (:func:`report_cost`), or
   refunded if the body raised and the rule says ``on_error: refund``.
4. Otherwise the same task (same id, arguments, options, headers, links, chord) is
   re-published for the moment its reserved slot comes, without spending ``max_retries``,
   through its queue's lane ``QUEUE.throttled`` (served in turn with QUEUE, so that it does
   not wait behind QUEUE's backlog); waits longer than ``park_after`` are parked in Redis
   (:mod:`throttle.parking`) and sent back to the broker shortly before they are due. A
   task late for its slot (busy workers) gives it up and takes a new one. A denial that
   reserved nothing (windows, concurrency) retries when the limit says it could admit, plus
   a random jitter.
5. Past the task's deadline (``max_wait``, or its ``expires``), the task fails with
   :class:`ThrottleTimeout`, or is sent to a dead-letter queue (``on_timeout``).

Eager mode (``task_always_eager``, ``Task.apply``) and direct calls block the caller until
the slot comes (one sleep per denial, never a busy loop), or raise ThrottleTimeout.

Monitoring: each deferral sends a ``task-throttled`` event and raises Celery's ``Retry``
carrying :class:`Throttled`, so Flower lists the waiting task as RETRY with
``Throttled(limit='upstream', wait=3.2s)``; it adds to the fleet-wide counts of
:class:`throttle.stats.StatsBook`, and with ``settings.metrics`` to the worker's Prometheus
counters (:mod:`throttle.metrics`), served on ``settings.metrics_port`` and on Flower's
``/metrics``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import logging
import math
import os
import random
import string
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from celery import Celery, Task, bootsteps, signals
from celery._state import get_current_task
from celery.exceptions import Ignore, Retry
from kombu.serialization import dumps, loads

from throttle import metrics
from throttle.config import Rule, Settings, ThrottleConfig
from throttle.decision import Acquisition, Decision
from throttle.errors import (
    BackendError,
    ConfigError,
    Throttled,
    ThrottleTimeout,
)
from throttle.fallback import LocalBuckets
from throttle.keys import encode_part, text_error
from throttle.limiter import DEFAULT_LEASE_S, Limiter, wrap_errors
from throttle.parking import Claimed, ParkingLot
from throttle.rates import RateBook
from throttle.spec import Algorithm, Limit
from throttle.stats import StatsBook
from throttle.urls import redact

__all__ = [
    "ThrottledTask",
    "Throttler",
    "install",
    "register_metrics",
    "report_cost",
    "slot_time",
    "throttled",
]

logger = logging.getLogger("throttle")

# Headers the throttler adds to a re-published task (kept by Celery across retries).
H_DEADLINE = "throttle_deadline"  # epoch s: past it, on_timeout applies
H_DEFERRALS = "throttle_deferrals"  # how many times throttling re-published the task
H_PARKED = "throttle_parked"  # the parking token of a task released from the lot
H_PUBLISH = "throttle_publish"  # the publish id of that release
H_DEAD = "throttle_dead_letter"  # the dead-letter queue a timed-out task was sent to

MAX_RESERVE_S = 86400.0
"""The farthest ahead a slot is reserved, in s; a task that would wait longer is denied and
comes back when the limit says (a rate changed at run time applies to it then)."""
EARLY_S = 0.1
"""A rescheduled task is published to arrive this long before its slot and sleeps the rest:
the slot is kept to the millisecond, whatever the precision of ETA messages."""
LANE_SUFFIX = ".throttled"
"""A queue's lane: where deferred tasks of QUEUE come back (see ``Settings.lanes``)."""
BACKEND_RETRY_S = 5.0
"""How long a task deferred because Redis is unreachable waits before trying again, in s."""
RECHECK_LEAD_S = 0.01
"""A task sleeping to its slot looks at Redis again this long before it (for holds placed
meanwhile), then sleeps the rest: the round trip must not make the call late."""
WORKER_ENV = "THROTTLE_WORKER_ID"
"""Set by a worker's main process before its pool forks: its pool children and it share
one outage marker file, so that the worker logs one warning per outage, not one per child."""
POOL_ENV = "THROTTLE_POOL_SIZE"
"""The worker's pool size, for the share of ``on_redis_down: local``."""
PING_TIMEOUT_S = 0.5
"""How long ``app.control.ping`` collects replies when ``local`` counts the fleet, in s."""
COLD_CHECK_S = 5.0
"""How often the releaser looks for the marker key of ``cold_start: empty``, in s."""
PUBLISH_WAIT_S = 60.0
"""How long a re-publish waits for a broker that went away, in s (retries 1 s apart)."""
PUBLISH_RETRY = {
    "max_retries": int(PUBLISH_WAIT_S),
    "interval_start": 0.2,
    "interval_step": 0.2,
    "interval_max": 1.0,
}

STREAK_REMINDER_S = 60.0
"""While a repeated operation keeps failing, how often (s) a warning says it still does."""

F = TypeVar("F", bound=Callable[..., Any])
_UNSET: Any = object()


# -- the rules of a task -----------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """What ``@throttled`` or ``ThrottledTask.throttle`` names: inline rules, and names of
    rules in the config file (resolved when the worker starts), with overrides."""

    rules: tuple[Rule, ...] = ()
    names: tuple[str, ...] = ()
    overrides: Mapping[str, Any] = field(default_factory=dict)


def _spec(items: Sequence[Limit | Rule | str], owner: str, options: Mapping[str, Any]) -> _Spec:
    rules: list[Rule] = []
    names: list[str] = []
    rule_options = {k: v for k, v in options.items() if v is not _UNSET and k != "algorithm"}
    algorithm = options.get("algorithm", _UNSET)
    for i, item in enumerate(items):
        if isinstance(item, Rule):
            rules.append(item)
        elif isinstance(item, Limit):
            rules.append(Rule(item, **rule_options))
        elif isinstance(item, str) and ("/" in item or "concurrent" in item):
            name = owner if len(items) == 1 else f"{owner}#{i + 1}"
            algo = None if algorithm is _UNSET else algorithm
            limit = Limit.parse(item, name=name, algorithm=algo, source=owner)
            rules.append(Rule(limit, **rule_options))
        elif isinstance(item, str) and item:
            names.append(item)
        else:
            raise ConfigError(
                "a throttled limit is a rate such as '20/s', the name of a limit in the "
                "config file, a Limit or a Rule",
                value=item, source=owner,
            )  # fmt: skip
    return _Spec(tuple(rules), tuple(names), rule_options)


# inspect.signature costs tens of us; a task's function never changes.
_signature = functools.lru_cache(maxsize=1024)(inspect.signature)


def _arguments(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The task's arguments by name (positional ones bound to the function's parameters)."""
    try:
        signature = _signature(fn)
        bound = signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return dict(kwargs)
    named = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and parameter.name in named:
            named.update(named.pop(parameter.name))
    return named


_FORMATTER = string.Formatter()


def _key_text(rule: Rule, value: object, what: str) -> str:
    """One value of a key as text. Only ``str`` and ``int`` qualify: an int is the same
    key as its decimal string (``42`` and ``"42"`` are one tenant, as JSON producers may
    send either). Anything else (None, bool, float, bytes, lists, objects) is refused
    rather than passed through ``str()``: ``None`` would share the bucket of a tenant named
    "None", and an object's ``__str__`` or ``__format__`` may return the same text for
    distinct values. A ``str`` subclass is read as the plain string it holds."""
    if isinstance(value, str):
        text = str.__str__(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            text = int.__repr__(value)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise ConfigError(
                f"{what} is an integer too long for a key", field="key", value=value,
                limit=rule.name,
            ) from None  # fmt: skip
    else:
        raise ConfigError(
            f"{what} is {type(value).__name__}, not text or an integer: it cannot name a "
            "bucket",
            field="key", value=value, limit=rule.name,
        )  # fmt: skip
    problem = text_error(text)
    if problem is not None:
        raise ConfigError(
            f"{what} is not Unicode text (it has {problem})", field="key", value=text,
            limit=rule.name,
        )  # fmt: skip
    return text


def _key(
    rule: Rule, named: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """The key of ``rule`` for these arguments: distinct arguments give distinct keys, or
    a ConfigError (see :func:`_key_text` and :func:`throttle.config.parse_key_template`)."""
    key = rule.key
    if key is None:
        return None
    if callable(key):
        value = _key_text(rule, key(*args, **kwargs), "the key function's result")
    else:
        template = rule.key_template
        assert template is not None  # a str key is parsed by Rule
        missing = [name for name in rule.key_fields if name not in named]
        if missing:
            raise ConfigError(
                f"the task has no argument {', '.join(map(repr, missing))} for the key template",
                field="key", value=key, limit=rule.name,
            )  # fmt: skip
        texts = []
        for path in template.paths:
            try:
                found = _FORMATTER.get_field(path, (), named)[0]
            except Exception as exc:  # a missing attribute or index, or a hostile __getattr__
                raise ConfigError(
                    f"cannot read {{{path}}} of the task's arguments for the key template "
                    f"({type(exc).__name__}: {str(exc)[:100]})",
                    field="key", value=key, limit=rule.name,
                ) from None  # fmt: skip
            texts.append(_key_text(rule, found, f"{{{path}}}"))
        if len(texts) > 1:
            # Each value without the template's separators, so the key reads back one way.
            texts = [encode_part(text) for text in texts]
        literals = template.literals
        value = literals[0] + "".join(t + lit for t, lit in zip(texts, literals[1:], strict=True))
    if not value:
        raise ConfigError(
            "the key is empty for this task's arguments", field="key", value=key, limit=rule.name
        )
    return value


def _cost(
    rule: Rule, named: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> float:
    cost = rule.cost
    if isinstance(cost, float):
        return cost
    if isinstance(cost, str):
        if cost not in named:
            raise ConfigError(
                "the task has no argument of this name", field="cost", value=cost,
                limit=rule.name,
            )  # fmt: skip
        value = named[cost]
    else:
        value = cost(*args, **kwargs)
    number = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            number = math.inf
    if not 0 <= number < math.inf:
        raise ConfigError(
            "the cost of this task is not a finite number >= 0", field="cost", value=value,
            limit=rule.name,
        )  # fmt: skip
    return number


# -- the per-process runtime -------------------------------------------------------------


class Throttler:
    """The throttler of one Celery app in one process: config, limiter, rates, parking.

    Built lazily on first use in each process (no connection at import, none shared
    across a fork), by :meth:`of`.
    """

    def __init__(self, app: Celery, config: ThrottleConfig, limiter: Limiter) -> None:
        self.app = app
        self.config = config
        self.settings: Settings = config.settings
        self.limiter = limiter
        keyspace = limiter.keyspace
        self.rates = RateBook(limiter.client, keyspace, refresh_s=self.settings.refresh_s)
        self.parking = ParkingLot(limiter.client, keyspace)
        self.stats = StatsBook(limiter.client, keyspace)
        self._resolved: dict[tuple[str, str | None, int], tuple[Rule, ...]] = {}
        self.local = LocalBuckets()
        self._outage_since: float | None = None  # epoch s, as this worker saw it
        self._share: int | None = None  # processes of the fleet; 0: could not count
        self._outage_file: tuple[str | None, Path | None] = ("", None)
        # Parked tasks need releasers: install() adds one to every worker of the app. Without
        # it a long wait stays an ETA message (with the risks parking avoids) rather than be
        # parked for ever.
        self.releasing = ThrottleStep in app.steps["worker"]
        if not self.releasing:
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
        :mod:`throttle.urls`). A malformed URL raises :class:`ConfigError` showing it
        without its password. Keep a password out of ``app.conf`` (use the environment or
        the limits file): ``celery inspect conf`` and ``celery report`` censor only keys
        that look secret, and ``throttle_redis_url`` does not."""
        config = ThrottleConfig.from_source(app.conf.get("throttle_config"))
        url = (
            app.conf.get("throttle_redis_url")
            or config.settings.redis_url
            or os.environ.get("THROTTLE_REDIS_URL")
        )
        if not url:
            broker = str(app.conf.broker_url or "")
            if broker.startswith(("redis://", "rediss://", "unix://")):
                url = broker
        if not url:
            raise ConfigError(
                "no Redis for the limiter: set app.conf.throttle_redis_url, settings.redis_url "
                "in the limits file or THROTTLE_REDIS_URL",
                field="redis_url", source=config.source,
            )  # fmt: skip
        try:
            limiter = Limiter.from_url(
                url, prefix=config.settings.prefix, namespace=config.settings.namespace
            )
        except ValueError as exc:
            if isinstance(exc, ConfigError):  # a malformed Sentinel or Cluster URL, redacted
                raise
            # redis-py's message may quote a piece of the URL, password included.
            raise ConfigError(
                "the limiter's Redis URL cannot be parsed: use redis://, rediss://, unix://, "
                "redis+sentinel:// or redis+cluster://, and percent-encode '/', '@', ':', "
                "'?' and '#' in user names and passwords",
                field="redis_url", value=redact(url), source=config.source,
            ) from None  # fmt: skip
        return cls(app, config, limiter)

    def rules(self, task: Task, spec: _Spec | None, queue: str | None) -> tuple[Rule, ...]:
        """The task's rules: its own (inline, then named), then the file's for its name and
        queue, each limit once."""
        cache_key = (task.name, queue, id(spec))
        rules = self._resolved.get(cache_key)
        if rules is None:
            found: dict[str, Rule] = {}
            if spec is not None:
                for rule in spec.rules:
                    found.setdefault(rule.name, rule)
                for name in spec.names:
                    rule = self.config.rule(name)
                    if spec.overrides:
                        rule = dataclasses.replace(rule, **spec.overrides)
                    found.setdefault(name, rule)
            # Celery's own tasks (chord_unlock, backend_cleanup...) are never throttled by
            # the file: a limit on the default queue must not stall a chord's bookkeeping.
            if not task.name.startswith("celery."):
                for rule in self.config.rules_for(task.name, queue):
                    found.setdefault(rule.name, rule)
            rules = self._resolved[cache_key] = tuple(found.values())
        return rules

    def outage(self, exc: BaseException | None) -> None:
        """Note that Redis failed (``exc``) or answered (``None``).

        One warning per outage per worker, not per task nor per pool child: the worker's
        processes share a marker file (named after the worker's main process, see
        :data:`WORKER_ENV`) holding when the outage began. The process that creates it
        warns; the one that removes it, when Redis answers again, says so (and checks
        whether Redis lost its data: :meth:`check_cold_start`). A successful call costs a
        ``stat`` of that file; a failed one an attempt to create it.
        """
        path = self.outage_file
        if exc is not None:
            now = time.time()
            started = self._outage_since is None
            if path is not None:
                tmp = path.with_name(f"{path.name}.{os.getpid()}")
                try:
                    tmp.write_text(repr(now))
                    os.link(tmp, path)  # atomic and exclusive: one process starts the outage
                    started = True
                except FileExistsError:
                    started = False
                except OSError as exc2:  # no temp dir to share: warn per process instead
                    logger.debug("throttle: cannot write %s: %s", path, exc2)
                finally:
                    tmp.unlink(missing_ok=True)
            if started:
                since = now
            elif path is not None:
                since = self._read_outage_start(now)
            else:
                since = self.outage_since()
            if since != self._outage_since:
                # A new outage for this process: count the fleet again, fresh buckets.
                self._outage_since = since
                self._share = None
                self.local.clear()
            if started:
                logger.warning(
                    "throttle: Redis is unreachable (%s); applying on_redis_down until it "
                    "answers (one warning per outage and worker)",
                    exc,
                )
            return
        if self._outage_since is None and (path is None or not path.exists()):
            return
        since = self._read_outage_start(self.outage_since())
        self._outage_since = None
        if path is not None:
            try:
                path.unlink()
            except FileNotFoundError:
                return  # another process of this worker said it first
        logger.warning(
            "throttle: Redis is reachable again after %.1f s; limiting resumes",
            time.time() - since,
        )
        try:
            self.check_cold_start()
        except BackendError as exc3:
            logger.debug("throttle: cannot check the marker key: %s", exc3)

    @property
    def outage_file(self) -> Path | None:
        """The file the processes of this worker share about an outage; None outside a
        worker (a producer, eager calls: each process warns for itself). Read from the
        environment each time: a throttler may be built before ThrottleStep sets it."""
        worker = os.environ.get(WORKER_ENV)
        if worker != self._outage_file[0]:
            path = None
            if worker:
                name = f"throttle-outage-{self.settings.prefix}-{self.settings.namespace}"
                path = Path(tempfile.gettempdir()) / f"{name}-{worker}"
            self._outage_file = (worker, path)
        return self._outage_file[1]

    def _read_outage_start(self, default: float) -> float:
        """The start written in the outage file (``default`` if it is gone or unreadable:
        another process of the worker may have just said that Redis is back)."""
        if self.outage_file is None:
            return default
        try:
            return float(self.outage_file.read_text() or default)
        except (OSError, ValueError):
            return default

    def outage_since(self) -> float:
        """When the current outage began (epoch s), as this worker saw it."""
        return self._outage_since if self._outage_since is not None else time.time()

    def share(self) -> int | None:
        """The processes among which ``on_redis_down: local`` splits a limit: the fleet's
        workers (``settings.fleet_workers``, else counted once per outage by a ping through
        the broker, which needs no Redis of the limiter) times this worker's pool size.
        None: the fleet could not be counted (the broker is down too)."""
        if self._share is None:
            workers = self.settings.fleet_workers
            if workers is None:
                try:
                    replies = self.app.control.ping(timeout=PING_TIMEOUT_S) or []
                except Exception as exc:  # the broker is down too
                    logger.warning("throttle: cannot count the fleet for 'local': %s", exc)
                    replies = []
                workers = len(replies)
            pool = os.environ.get(POOL_ENV, "")
            self._share = workers * (int(pool) if pool.isdigit() and int(pool) > 0 else 1)
            if self._share:
                logger.info("throttle: local fallback shared by %d processes", self._share)
        return self._share or None

    def cold_start_rules(self) -> list[Rule]:
        """The rules with ``cold_start: empty``: the file's, then inline ones."""
        found = {r.name: r for r in self.config.rules.values() if r.cold_start == "empty"}
        for task in list(self.app.tasks.values()):
            spec = _task_spec(task)
            if spec is not None:
                for rule in spec.rules:
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
        would still be a full bucket. Returns the names of the limits drained."""
        rules = self.cold_start_rules()
        if not rules:
            return []
        client = self.limiter.client
        marker = self.limiter.keyspace.base + "alive"
        if not wrap_errors(lambda: client.set(marker, repr(time.time()), nx=True)):
            return []
        for rule in rules:
            limit = self.rates.current(rule.limit)
            self.limiter.acquire(limit, None, cost=limit.capacity)
        names = [rule.name for rule in rules]
        logger.warning(
            "throttle: Redis has no marker key (new, or restarted without its data): "
            "limits %s start empty (cold_start: empty)",
            ", ".join(names),
        )
        return names

    def validate(self) -> None:
        """Check at worker start what can only be checked against the app: every named
        limit of its tasks exists in the file, and no wait the throttler keeps in a worker
        (a sleep, an ETA message) can outlive the broker's visibility timeout (kombu#337:
        the message would be delivered again, the task run twice)."""
        self.check_visibility()
        for task in list(self.app.tasks.values()):
            spec = _task_spec(task)
            if spec is not None:
                for name in spec.names:
                    self.config.rule(name)

    def check_visibility(self) -> None:
        """Refuse settings that hold a task in a worker for more than half the broker's
        visibility timeout (when the transport has one: Redis, SQS)."""
        settings = self.settings
        options = self.app.conf.broker_transport_options or {}
        visibility = options.get("visibility_timeout")
        held = settings.park_after_s + settings.park_lead_s + settings.sleep_max_s
        if isinstance(visibility, int | float) and held > visibility / 2:
            raise ConfigError(
                f"a task may be held {held:g} s in a worker (park_after + park_lead + "
                f"sleep_max), more than half the broker's visibility_timeout "
                f"({visibility:g} s): lower park_after",
                field="settings.park_after", value=settings.park_after_s,
                source=self.config.source,
            )  # fmt: skip


def _task_spec(task: Task) -> _Spec | None:
    spec = getattr(task.run, "__throttle__", None)
    if spec is None and isinstance(task, ThrottledTask):
        spec = type(task)._class_spec()
    return spec


# -- one execution -----------------------------------------------------------------------


@dataclass
class _Ticket:
    """What one execution holds: the acquisition to settle, the costs the body reported."""

    acquisition: Acquisition | None
    rules: tuple[Rule, ...]
    slot_at: float
    """When the slot came, in epoch s of this worker's clock."""
    reported: dict[str | None, float] = field(default_factory=dict)


_ticket: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar(
    "throttle_ticket", default=None
)


def report_cost(actual: float, limit: str | None = None) -> None:
    """Report what the running task's call really cost, to settle its reserved estimate.

    ``limit`` names one limit; ``None`` applies to every limit whose cost is an estimate
    (an argument or a callable; fixed costs, such as 1 request, stay). The difference is
    refunded or charged when the task returns. Outside a throttled task this does nothing.
    """
    if (
        isinstance(actual, bool)
        or not isinstance(actual, int | float)
        or not 0 <= actual < math.inf
    ):
        raise ValueError(f"report_cost needs a finite number >= 0 (got {actual!r})")
    ticket = _ticket.get()
    if ticket is not None:
        ticket.reported[limit] = float(actual)


def slot_time() -> float | None:
    """When the running task's slot came (epoch s, this worker's clock), or None outside a
    throttled task: ``time.time() - slot_time()`` is how late the call is behind its slot."""
    ticket = _ticket.get()
    return None if ticket is None else ticket.slot_at


def _queue_of(request: Any) -> str | None:
    """The queue a task was consumed from (its lane counts as the queue itself)."""
    info = request.delivery_info
    if not isinstance(info, Mapping):
        return None
    queue = info.get("routing_key") or info.get("queue") or None
    if not isinstance(queue, str):
        return None
    if queue.endswith(LANE_SUFFIX):
        queue = queue[: -len(LANE_SUFFIX)]
    return queue


# The throttle_* headers come with the message, and whoever can publish a task can write
# them. Each is read defensively: a value of the wrong type or out of range is absent (never
# an exception), and none of them can make a task skip the limiter or pay less: a deadline
# only shortens the wait a task accepts (it times out sooner, it never runs sooner), the
# parking ids only let a second copy of a parked task be dropped, and the dead-letter mark
# only keeps a timed-out task from being dead-lettered again (see _Gate.enter).
_MAX_EPOCH_S = 253402300800.0
"""Year 10000 in epoch s: later than any real deadline (and than ``datetime`` can show)."""


def _deadline_header(headers: Mapping[str, Any]) -> float | None:
    """The ``throttle_deadline`` header in epoch s, or None when absent or corrupt (not a
    number, a bool, NaN, infinite, <= 0, past year 10000, an int too large for a float)."""
    value = headers.get(H_DEADLINE)
    # Compared before float(): a huge int compares exactly, float() would overflow.
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < _MAX_EPOCH_S:
        return float(value)
    return None


def _count_header(headers: Mapping[str, Any]) -> int:
    """The ``throttle_deferrals`` header, or 0 when absent or corrupt."""
    value = headers.get(H_DEFERRALS)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31:
        return value
    return 0


def _id_header(headers: Mapping[str, Any], name: str) -> str | None:
    """A parking token or publish id (hex, ``:``), or None when absent or corrupt."""
    value = headers.get(name)
    if isinstance(value, str) and 0 < len(value) <= 100 and value.isascii() and value.isprintable():
        return value
    return None


class _Gate:
    """Decides for one execution of one task: run now (maybe after a short sleep), or
    re-publish for later, or time out. Raises celery's Retry/Ignore to defer."""

    def __init__(
        self,
        task: Task,
        spec: _Spec | None,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self.task = task
        self.request = task.request
        self.throttler = Throttler.of(task.app)
        self.settings = self.throttler.settings
        headers = self.request.headers
        self.headers: dict[str, Any] = dict(headers) if isinstance(headers, Mapping) else {}
        queue = _queue_of(self.request)
        self.rules = self.throttler.rules(task, spec, queue)
        self.fn, self.args, self.kwargs = fn, args, kwargs
        # Consumed from the dead-letter queue it was sent to: throttled as any task (it still
        # calls the API), but never dead-lettered again (no loop). A forged mark can do no
        # more than make a timed-out task fail instead of being dead-lettered.
        self.dead_lettered = queue is not None and self.headers.get(H_DEAD) == queue

    def enter(self) -> _Ticket | None:
        rules = self.rules
        if not rules:
            return None
        token, publish = _id_header(self.headers, H_PARKED), _id_header(self.headers, H_PUBLISH)
        if token is not None and publish is not None:
            try:
                if not self.throttler.parking.accept(token, publish):
                    logger.info(
                        "throttle: dropping a second copy of parked task %s", self.request.id
                    )
                    raise Ignore()
            except BackendError as exc:
                return self._backend_down(exc)
        # Binding the arguments to names is only needed by templates and argument costs.
        by_name = any(isinstance(r.key, str) or isinstance(r.cost, str) for r in rules)
        named = _arguments(self.fn, self.args, self.kwargs) if by_name else {}
        targets = []
        rates = self.throttler.rates
        try:
            for rule in rules:
                limit = rates.current(rule.limit)
                targets.append(
                    (
                        limit,
                        _key(rule, named, self.args, self.kwargs),
                        _cost(rule, named, self.args, self.kwargs),
                    )
                )
        except BackendError as exc:
            return self._backend_down(exc)
        self.targets = targets
        now = time.time()
        self.deadline = self._deadline(now)
        eager = bool(self.request.is_eager or self.request.called_directly)
        try:
            if eager:
                return self._block()
            ticket = self._decide(now)
            _report_allowed(self, now, ticket)
            return ticket
        except BackendError as exc:
            return self._backend_down(exc)

    # -- deadlines and horizons

    def _deadline(self, now: float) -> float | None:
        deadline = _deadline_header(self.headers)
        if deadline is None:
            waits = [rule.max_wait_s for rule in self.rules if rule.max_wait_s is not None]
            deadline = now + min(waits) if waits else None
        expires = self.request.expires
        if expires:
            try:
                stamp = (
                    datetime.fromisoformat(expires).timestamp()
                    if isinstance(expires, str)
                    else float(expires.timestamp())
                )
            except (TypeError, ValueError, AttributeError, OverflowError):
                stamp = None
            if stamp is not None:
                deadline = stamp if deadline is None else min(deadline, stamp)
        return deadline

    def _horizon(self, now: float) -> float:
        """How far ahead a slot may be reserved: a concurrency unit must not be held while
        the task waits, so with one the wait is at most a sleep."""
        if any(limit.algorithm is Algorithm.CONCURRENCY for limit, _, _ in self.targets):
            horizon = self.settings.sleep_max_s
        else:
            horizon = MAX_RESERVE_S
        if self.deadline is not None:
            horizon = min(horizon, max(self.deadline - now, 0.0))
        return horizon

    def _lease_s(self) -> float:
        """How long the acquisition's record and concurrency units live after its slot, in
        s: the task's hard time limit (or DEFAULT_LEASE_S) + 60 s. The script counts it from
        the slot, so a wait before the slot is in it already; adding the reservation horizon
        (a day for a rate limit) kept a record of every task for a day."""
        limit = self.request.timelimit or (None, None)
        hard = limit[0] or self.task.time_limit or self.task.app.conf.task_time_limit
        return max(float(hard or DEFAULT_LEASE_S), 1.0) + 60.0

    def _acquire(self, max_wait_s: float) -> Decision:
        return self.throttler.limiter.acquire_many(
            self.targets,
            max_wait_s=max_wait_s,
            acquisition_id=self.request.id,
            lease_s=self._lease_s(),
        )

    # -- the worker path

    def _decide(self, now: float) -> _Ticket | None:
        decision = self._give_up_voided(self._acquire(self._horizon(now)))
        if (
            decision.allowed
            and decision.held
            and decision.late_s > self.settings.late_tolerance_s
            and not (self.request.delivery_info or {}).get("redelivered")
        ):
            # The task reached its reserved slot late (busy workers): calling now could land
            # on the next task's slot. Give the slot up and take a new one. Not a refund: the
            # passed slot is lost capacity (a burst-1 API cannot bank it), and handing it
            # back would book the same future slot twice.
            # Not for a redelivered message (its worker or pool child died, most likely in
            # the body, after the slot): it is the same execution again, and keeps the slot
            # it paid for; a new one would charge the task twice. The trade-off: a copy that
            # died before its slot (prefetched) may now call up to its lateness off-slot.
            assert decision.acquisition is not None
            self.throttler.limiter.settle(decision.acquisition, None)
            decision = self._give_up_voided(self._acquire(self._horizon(now)))
        self.throttler.outage(None)
        if decision.allowed:
            wait = decision.wait_s
            if wait <= self.settings.sleep_max_s:
                if wait > 0 and decision.acquisition:
                    left = wait
                    if wait > RECHECK_LEAD_S:
                        # A hold may begin while this task sleeps (the upstream answered
                        # another task 429): look once more, with the id, shortly before
                        # the slot, so that the call itself still lands on the slot.
                        time.sleep(wait - RECHECK_LEAD_S)
                        decision = self._give_up_voided(self._acquire(0.0))
                        left = decision.wait_s
                        if decision.allowed and decision.late_s > self.settings.late_tolerance_s:
                            left = math.inf  # woke too late: handled below
                    if decision.allowed and left > 0 and self._sleep_until_slot(left):
                        # Woke too late (a busy machine): the slot passed, take a new one
                        # (the passed slot is given up, not refunded: see above).
                        assert decision.acquisition is not None
                        self.throttler.limiter.settle(decision.acquisition, None)
                        return self._decide(time.time())
                if decision.allowed:
                    return _Ticket(decision.acquisition, self.rules, now + wait)
            else:
                # A slot is reserved, further ahead: come back just before it.
                self._defer(wait - EARLY_S, wait, decision)
        retry = decision.retry_after_s
        if math.isinf(retry):
            # Paused (celery throttle pause): look again now and then; nothing is lost.
            recheck = self.settings.pause_recheck_s
            retry = recheck + random.uniform(0.0, recheck / 2)
            self._defer(retry, retry, decision)
        if self.deadline is not None and now + retry > self.deadline:
            self._timeout(now, retry, decision)
        jitter = random.uniform(0.0, min(self.settings.jitter_s, max(retry, 0.05)))
        self._defer(retry + jitter, retry, decision)
        raise AssertionError("unreachable")  # pragma: no cover

    def _give_up_voided(self, decision: Decision) -> Decision:
        """Settle (give up) a reserved slot that a hold placed since has voided (an upstream
        429 or a pause covers it): the decision then reads as a denial until the hold ends."""
        if decision.held and not decision.allowed and decision.acquisition is not None:
            self.throttler.limiter.settle(decision.acquisition, None)
        return decision

    def _sleep_until_slot(self, wait_s: float) -> bool:
        """Sleep until the reserved slot; True when the wake-up came later than the
        tolerance (calling then could land on the next holder's slot), or the slot had
        passed already (``wait_s`` is ``inf``)."""
        if math.isinf(wait_s):
            return True
        start = time.monotonic()
        time.sleep(wait_s)
        return time.monotonic() - start - wait_s > self.settings.late_tolerance_s

    def _defer(self, countdown: float, wait_s: float, decision: Decision) -> None:
        request, task = self.request, self.task
        countdown = max(countdown, 0.0)
        headers = {k: v for k, v in self.headers.items() if k not in (H_PARKED, H_PUBLISH)}
        if self.deadline is not None:
            headers[H_DEADLINE] = self.deadline
        else:
            headers.pop(H_DEADLINE, None)  # a corrupt one, read as absent: not passed on
        headers[H_DEFERRALS] = _count_header(headers) + 1
        limits = decision.denied_by or tuple(rule.name for rule in self.rules)
        reason = Throttled(wait_s, limits)
        # Back through the queue's lane, not behind the queue's backlog (Settings.lanes).
        lane = self._lane()
        if countdown > self.settings.park_after_s and self.throttler.releasing:
            sig = task.signature_from_request(request, headers=headers, queue=lane)
            content_type, encoding, body = dumps(  # type: ignore[no-untyped-call]
                dict(sig), serializer=task.serializer
            )
            payload = f"{content_type}\n{encoding}\n".encode() + (
                body if isinstance(body, bytes) else body.encode()
            )
            self.throttler.parking.park(payload, countdown - self.settings.park_lead_s)
            _report_deferral(self, limits, "park", wait_s, headers[H_DEFERRALS])
        else:
            sig = task.signature_from_request(
                request, countdown=countdown, headers=headers, queue=lane
            )
            self._publish(sig)
            _report_deferral(self, limits, "republish", wait_s, headers[H_DEFERRALS])
        raise Retry(exc=reason, when=countdown, sig=sig)

    def _lane(self) -> str | None:
        """The lane of the task's queue, when lanes are on and consumed (install())."""
        queue = _queue_of(self.request)
        if queue is None or not self.settings.lanes or not self.throttler.releasing:
            return None
        return queue + LANE_SUFFIX

    def _timeout(self, now: float, needed_s: float, decision: Decision) -> None:
        left = max((self.deadline or now) - now, 0.0)
        rules = [rule for rule in self.rules if rule.name in decision.denied_by] or list(self.rules)
        queue = next((rule.dead_letter_queue for rule in rules if rule.dead_letter_queue), None)
        if queue is None or self.dead_lettered:
            _report_timeout(self, decision, "fail")
            raise ThrottleTimeout(decision.denied_by, needed_s, left)
        headers = {
            k: v for k, v in self.headers.items() if k not in (H_PARKED, H_PUBLISH, H_DEADLINE)
        }
        headers[H_DEAD] = queue
        sig = self.task.signature_from_request(self.request, queue=queue, headers=headers)
        sig.apply_async(queue=queue)
        _report_timeout(self, decision, "dead_letter")
        logger.warning(
            "throttle: task %s timed out; sent to dead-letter queue %s", self.request.id, queue
        )
        raise Ignore()

    # -- eager mode and direct calls

    def _block(self) -> _Ticket:
        while True:
            now = time.time()
            decision = self._acquire(self._horizon(now))
            if decision.allowed:
                if decision.wait_s > 0:
                    time.sleep(decision.wait_s)
                return _Ticket(decision.acquisition, self.rules, now + decision.wait_s)
            self._give_up_voided(decision)
            retry = min(decision.retry_after_s, self.settings.pause_recheck_s)
            if self.deadline is not None and now + retry > self.deadline:
                raise ThrottleTimeout(decision.denied_by, retry, max(self.deadline - now, 0.0))
            time.sleep(retry + random.uniform(0.0, min(self.settings.jitter_s, retry) / 10))

    # -- Redis down

    def _backend_down(self, exc: BackendError) -> _Ticket | None:
        """Redis failed: apply each rule's ``on_redis_down``. All must let the task run:
        ``allow`` within its bound, ``local`` when every local bucket admits; any other
        rule defers it (fail closed) until Redis may be back."""
        throttler = self.throttler
        throttler.outage(exc)
        metrics.redis_error(rule.name for rule in self.rules)
        eager = bool(self.request.is_eager or self.request.called_directly)
        open_for = time.time() - throttler.outage_since()
        local: list[Rule] = []
        for rule in self.rules:
            if rule.on_redis_down == "local":
                local.append(rule)
            elif not rule.on_redis_down.startswith("allow") or open_for >= (
                self.settings.fail_open_for_s if rule.fail_open_s is None else rule.fail_open_s
            ):
                self._defer_down(exc, BACKEND_RETRY_S, eager)
        share = throttler.share() if local else 1
        if share is None:
            self._defer_down(exc, BACKEND_RETRY_S, eager)  # cannot count the fleet
            return None
        # The configured rates (a rate changed at run time lives in the Redis that is down).
        named = _arguments(self.fn, self.args, self.kwargs)
        targets = [
            (rule.limit, _key(rule, named, self.args, self.kwargs),
             _cost(rule, named, self.args, self.kwargs))
            for rule in local
        ]  # fmt: skip
        while targets:
            wait = throttler.local.take(targets, share, time.monotonic())
            if wait == 0.0:
                break
            if wait > self.settings.sleep_max_s and not eager:
                self._defer_down(exc, wait, eager)
            time.sleep(wait)  # the child is single-threaded: the tokens are there on waking
        return None  # run without a ticket: there is nothing in Redis to settle

    def _defer_down(self, exc: BackendError, countdown: float, eager: bool) -> None:
        """Re-publish the task during an outage (not parked: parking lives in Redis)."""
        if eager:
            raise exc
        # Jittered, so that the tasks deferred during an outage do not all come back at once.
        countdown += random.uniform(0.0, min(self.settings.jitter_s, countdown))
        sig = self.task.signature_from_request(
            self.request, countdown=countdown, headers=dict(self.headers)
        )
        self._publish(sig)
        raise Retry(exc=exc, when=countdown, sig=sig)

    def _publish(self, sig: Any) -> None:
        """Re-publish the task, waiting for a broker that went away (up to about
        :data:`PUBLISH_WAIT_S`).

        Until the copy is published, the message this worker holds is the task's only
        copy, and acknowledging it would lose the task: a failed publish must not end the
        execution normally. So the pool slot waits for the broker (it could run nothing
        else without one), then publishes, and the original is acknowledged as usual.
        After that wait the task fails with the broker's error (``OperationalError``), as
        it would without the throttler; the message, unacknowledgeable while the broker is
        away, comes back after the visibility timeout."""
        sig.apply_async(retry=True, retry_policy=PUBLISH_RETRY)


# -- what the gate reports: Prometheus counters, Flower events, fleet-wide stats ----------
# None of it may fail or lose a task: each part swallows (and logs) its own errors.


def _report_allowed(gate: _Gate, now: float, ticket: _Ticket | None) -> None:
    if ticket is not None:
        metrics.allowed([rule.name for rule in gate.rules], ticket.slot_at - now)


def _report_deferral(
    gate: _Gate, limits: Sequence[str], how: str, wait_s: float, deferrals: int
) -> None:
    """A deferral (``how``: republish or park): counters, a ``task-throttled`` event for
    Flower, and the fleet-wide counts of :class:`StatsBook`."""
    metrics.deferred(limits, how, wait_s)
    # defer_task() (an upstream's word, after the body ran) builds a gate without targets.
    targets = {limit.name: (key, cost) for limit, key, cost in getattr(gate, "targets", ())}
    try:
        gate.task.send_event(
            "task-throttled",
            retry=False,  # an event is not worth blocking a pool slot on a broker outage
            # The task's name, though task-received carried it: the worker's main process
            # buffers its task events, so Flower may see this one first, and would count it
            # under an unnamed task.
            name=gate.task.name,
            limits=list(limits),
            keys=[targets.get(name, (None, None))[0] for name in limits],
            costs=[targets.get(name, (None, None))[1] for name in limits],
            wait=round(wait_s, 3),
            slot=round(time.time() + wait_s, 3),
            how=how,
            deferrals=deferrals,
        )
    except Exception as exc:
        logger.debug("throttle: cannot send the task-throttled event: %s", exc)
    events = ("denied", "parked") if how == "park" else ("denied",)
    _count(gate, limits, events)


def _report_timeout(gate: _Gate, decision: Decision, action: str) -> None:
    limits = decision.denied_by or tuple(rule.name for rule in gate.rules)
    metrics.timed_out(limits, action)
    _count(gate, limits, ("timeout",))


def _count(gate: _Gate, limits: Sequence[str], events: Sequence[str]) -> None:
    try:
        gate.throttler.stats.record_events(limits, events)
    except Exception as exc:  # BackendError, or anything else: a count is not worth a task
        metrics.redis_error(limits)
        logger.debug("throttle: cannot record %s in the fleet stats: %s", events, exc)


def _settle(throttler: Throttler, ticket: _Ticket, failed: bool) -> None:
    acquisition = ticket.acquisition
    if acquisition is None:
        return
    by_name = {rule.name: rule for rule in ticket.rules}
    actuals: list[float | None] = []
    for limit, _ in acquisition.targets:
        rule = by_name.get(limit.name)
        actual = ticket.reported.get(limit.name)
        if actual is None and rule is not None and rule.estimated:
            actual = ticket.reported.get(None)
        if actual is None and failed and rule is not None and rule.on_error == "refund":
            actual = 0.0
        actuals.append(actual)
    try:
        settlement = throttler.limiter.settle(acquisition, actuals)
    except BackendError as exc:
        # The lease expires by itself: concurrency units come back then, a refund is lost.
        throttler.outage(exc)
        metrics.redis_error(limit.name for limit, _ in acquisition.targets)
        return
    metrics.settled([limit.name for limit, _ in acquisition.targets], settlement.deltas)


def _run(
    task: Task,
    spec: _Spec | None,
    fn: Callable[..., Any],
    call: Callable[[], Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    gate = _Gate(task, spec, fn, args, kwargs)
    ticket = gate.enter()
    if ticket is None:
        return call()
    token = _ticket.set(ticket)
    failed = True
    try:
        result = call()
        failed = False
        return result
    finally:
        _ticket.reset(token)
        _settle(gate.throttler, ticket, failed)


# -- the public faces: decorator, base class, install -------------------------------------


def throttled(
    *limits: Limit | Rule | str,
    key: Any = _UNSET,
    cost: Any = _UNSET,
    max_wait: Any = _UNSET,
    on_timeout: Any = _UNSET,
    on_error: Any = _UNSET,
    on_redis_down: Any = _UNSET,
    algorithm: Algorithm | str | Any = _UNSET,
) -> Callable[[F], F]:
    """Throttle a task: put it under ``@app.task`` or ``@shared_task``.

    Parameters
    ----------
    *limits:
        Names of limits in the config file (``"github"``), inline rates (``"20/s burst 1"``,
        ``"8 concurrent"``), :class:`Limit` or :class:`Rule` objects. All apply at once.
    key, cost, max_wait, on_timeout, on_error, on_redis_down:
        As the fields of :class:`throttle.config.Rule` (``max_wait`` in seconds or a
        duration string); for inline limits, and overriding a named limit's own.
    algorithm:
        The algorithm of inline rates (default token bucket).
    """
    options = {
        "key": key, "cost": cost, "max_wait_s": max_wait, "on_timeout": on_timeout,
        "on_error": on_error, "on_redis_down": on_redis_down, "algorithm": algorithm,
    }  # fmt: skip

    def decorate(fn: F) -> F:
        owner = f"{fn.__module__}.{fn.__qualname__}"
        spec = _spec(limits, owner, options)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            task = get_current_task()
            if task is None:
                return fn(*args, **kwargs)  # called outside Celery: a plain function
            return _run(task, spec, fn, lambda: fn(*args, **kwargs), args, kwargs)

        wrapper.__throttle__ = spec  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


class ThrottledTask(Task):  # type: ignore[misc]
    """A Task base applying the config file's limits for the task's name and queue, plus
    those of its ``throttle`` attribute (as the arguments of :func:`throttled`).

    Use ``Celery(..., task_cls=ThrottledTask)`` for every task of an app (per-queue limits
    without decorating each task), or ``@app.task(base=ThrottledTask)`` for one.
    """

    throttle: ClassVar[Sequence[Limit | Rule | str]] = ()
    _throttle_spec: ClassVar[_Spec | None] = None

    @classmethod
    def _class_spec(cls) -> _Spec:
        if cls.__dict__.get("_throttle_spec") is None:
            cls._throttle_spec = _spec(tuple(cls.throttle), cls.__qualname__, {})
        assert cls._throttle_spec is not None
        return cls._throttle_spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        run: Callable[..., Any] = self.run
        if getattr(run, "__throttle__", None) is not None:
            return super().__call__(*args, **kwargs)  # @throttled gates inside run
        fn: Callable[..., Any] = getattr(run, "__func__", run)
        call_args = (self, *args) if fn is not run else args
        return _run(
            self,
            type(self)._class_spec(),
            fn,
            lambda: super(ThrottledTask, self).__call__(*args, **kwargs),
            call_args,
            kwargs,
        )


class ThrottleStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: validates the limits file when the worker starts (a bad file stops
    it), and runs the releaser of parked tasks."""

    label = "throttle"
    # Start after the pool has forked its children: the releaser is a thread, and a fork
    # while it holds a lock would hand the child a lock that nobody releases.
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.app = worker.app
        # Created before the pool forks: the children inherit these (see Throttler.outage
        # and Throttler.share).
        os.environ[WORKER_ENV] = str(os.getpid())
        os.environ[POOL_ENV] = str(getattr(worker, "concurrency", None) or 1)
        throttler = Throttler.from_app(self.app)  # raises ConfigError on a bad file
        throttler.validate()
        if throttler.outage_file is not None:
            throttler.outage_file.unlink(missing_ok=True)  # a stale one of a reused pid
        try:
            throttler.check_cold_start()
        except BackendError as exc:  # a worker starts while Redis is down: it may
            throttler.outage(exc)
        self.releaser: Releaser | None = None

    def start(self, worker: Any) -> None:
        self.releaser = Releaser(self.app)
        self.releaser.start()

    def stop(self, worker: Any) -> None:
        if self.releaser is not None:
            self.releaser.stop()

    def shutdown(self, worker: Any) -> None:
        self.stop(worker)


class LaneStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: every queue the worker consumes, it also consumes its lane
    (``QUEUE.throttled``), where deferred tasks come back when their slot is due. Kombu
    serves a worker's queues in turn, so a task due now waits for at most a message or so
    of the backlog, not for all of it."""

    label = "throttle-lanes"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, consumer: Any) -> None:
        if not Throttler.of(consumer.app).settings.lanes:
            return
        for queue in list(consumer.task_consumer.queues):
            if not queue.name.endswith(LANE_SUFFIX):
                consumer.add_task_queue(queue.name + LANE_SUFFIX)


class _FailureStreak:
    """Logs a run of failures of one repeated operation once, not once per attempt.

    The first failure is a warning with its traceback; later ones are at debug level, but
    for a reminder every :data:`STREAK_REMINDER_S` seconds (a failure that never ends, such
    as a payload that cannot be decoded, must not go quiet); the first success after a
    failure says how long the streak lasted."""

    def __init__(self, what: str, again: str) -> None:
        self.what, self.again = what, again
        self.since: float | None = None  # monotonic s of the streak's first failure
        self.count = 0
        self.reminded = 0.0

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        self.count += 1
        if self.since is None:
            self.since = self.reminded = now
            logger.warning(
                "throttle: %s (%s); retrying, one message per failure streak",
                self.what, exc, exc_info=True,
            )  # fmt: skip
        elif now - self.reminded >= STREAK_REMINDER_S:
            self.reminded = now
            logger.warning(
                "throttle: %s for %.0f s (%d attempts); last error: %s",
                self.what, now - self.since, self.count, exc,
            )  # fmt: skip
        else:
            logger.debug("throttle: %s (attempt %d)", self.what, self.count, exc_info=True)

    def ended(self) -> None:
        if self.since is not None:
            logger.warning(
                "throttle: %s after %.1f s (%d failed attempts)",
                self.again, time.monotonic() - self.since, self.count,
            )  # fmt: skip
            self.since, self.count = None, 0


class Releaser(threading.Thread):
    """Sends parked tasks back to the broker shortly before their slot (one per worker)."""

    def __init__(self, app: Celery, *, poll_s: float = 0.25, batch: int = 200) -> None:
        super().__init__(name="throttle-releaser", daemon=True)
        self.app = app
        self.poll_s = poll_s
        self.batch = batch
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        checked = time.monotonic()
        failing = _FailureStreak(
            "the releaser cannot release parked tasks", "the releaser releases parked tasks again"
        )
        while not self._stop_event.is_set():
            try:
                released = self.release_once()
                throttler = Throttler.of(self.app)
                throttler.outage(None)
                if time.monotonic() - checked >= COLD_CHECK_S:
                    # Redis may have restarted empty between two tasks, unseen by any gate.
                    checked = time.monotonic()
                    throttler.check_cold_start()
                # A round that claimed nothing published nothing: it says the broker is back
                # only if a connection to it now opens.
                if failing.since is not None and (released or self._broker_reachable()):
                    failing.ended()
            except BackendError as exc:
                Throttler.of(self.app).outage(exc)
                released = 0
            except Exception as exc:  # the releaser must outlive a bad payload or a broker blip
                # Usually the broker is away: claimed tasks stay parked (the claim expires
                # and they are claimed again), so nothing is lost, and one line per streak
                # says so rather than a traceback per poll.
                failing.failed(exc)
                released = 0
            if released < self.batch:
                self._stop_event.wait(self.poll_s)

    def _broker_reachable(self) -> bool:
        """Whether the broker accepts a connection now: one attempt, no retries (asked only
        while publishing fails)."""
        try:
            with self.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=0)
        except Exception:
            return False
        return True

    def release_once(self) -> int:
        """Claim, publish and commit one batch; returns how many were released."""
        throttler = Throttler.of(self.app)
        claimed = throttler.parking.claim(lead_s=self.poll_s * 2, batch=self.batch)
        if claimed:
            self.publish(claimed)
            throttler.parking.commit(claimed)
        return len(claimed)

    def publish(self, claimed: Sequence[Claimed]) -> None:
        """Send claimed tasks to the broker, each with its parking token and publish id, to
        arrive ``park_lead`` before its slot."""
        lead_s = Throttler.of(self.app).settings.park_lead_s
        for item in claimed:
            content_type, encoding, body = item.payload.split(b"\n", 2)
            options = loads(  # type: ignore[no-untyped-call]
                body, content_type.decode(), encoding.decode()
            )
            sig = self.app.signature(options)
            headers = dict(sig.options.get("headers") or {})
            headers[H_PARKED] = item.token
            headers[H_PUBLISH] = item.publish_id
            sig.apply_async(countdown=max(item.due_in_s, 0.0) + lead_s, headers=headers)


def install(app: Celery, *, config: Any = None) -> Celery:
    """Wire the throttler into ``app``'s workers: the limits file (``config``: a path or a
    mapping; default ``app.conf.throttle_config`` or ``THROTTLE_CONFIG``) is validated when a
    worker starts, and every worker runs a releaser of parked tasks; with ``settings.metrics``
    every worker counts into its metrics directory (and serves ``settings.metrics_port``),
    and a process that has prometheus_client loaded (Flower) shows the fleet's metrics on
    its default registry (:func:`register_metrics`). Returns ``app``."""
    if config is not None:
        app.conf.throttle_config = config
    if ThrottleStep not in app.steps["worker"]:
        app.steps["worker"].add(ThrottleStep)
    if LaneStep not in app.steps["consumer"]:
        app.steps["consumer"].add(LaneStep)
    _install_metrics(app)
    return app


# -- metrics: set up in the worker, served by it and by Flower -----------------------------

METRICS_PORT_ENV = "THROTTLE_METRICS_PORT"
"""Overrides ``settings.metrics_port`` for one worker (several workers on one host)."""


class MetricsStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep of the metrics (``settings.metrics`` / ``metrics_port``).

    Created in the worker's main process before the pool forks (every step is created
    before any starts): that is when this worker's metrics directory is wiped and
    prometheus_client put in multiprocess mode (:func:`throttle.metrics.setup_worker`), so
    that every pool child counts into a file of its own there. Started after the pool, it
    serves the sum of those files and the Redis-read gauges on the metrics port.
    """

    label = "throttle-metrics"
    # A thread started before the fork could hold a lock the children inherit locked.
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.app = worker.app
        self.server: Any = None
        self.port: int | None = None
        self.directory: Path | None = None
        throttler = Throttler.of(self.app)  # raises ConfigError on a bad file
        if not throttler.settings.metrics:
            return
        source = throttler.config.source
        self.directory = metrics.setup_worker(
            _metrics_base(throttler.settings), worker.hostname, source=source
        )
        self.port = _metrics_port(throttler.settings)

    def start(self, worker: Any) -> None:
        if self.directory is None or self.port is None:
            return
        directory, app = self.directory, self.app
        collector = metrics.ThrottleCollector(lambda: [(None, directory)], lambda: _fleet(app))
        self.server = metrics.serve(self.port, collector, source=Throttler.of(app).config.source)
        logger.info("throttle: metrics of %s on port %d", worker.hostname, self.port)

    def stop(self, worker: Any) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def shutdown(self, worker: Any) -> None:
        self.stop(worker)


def register_metrics(app: Celery, registry: Any = None) -> metrics.ThrottleCollector:
    """Expose ``app``'s throttle metrics on a prometheus_client registry (default: the
    process's ``REGISTRY``, what Flower's ``/metrics`` serves): the counters of every
    worker under ``settings.metrics_dir`` on this host (label ``worker``) and the
    fleet-wide gauges read from Redis at each scrape. Nothing while metrics are off.

    :func:`install` calls it when prometheus_client is already loaded (as in Flower, or
    an exporter of your own that imported it first); call it yourself otherwise."""
    metrics.require()
    if registry is None:
        from prometheus_client import REGISTRY  # noqa: PLC0415

        registry = REGISTRY
    collector = metrics.ThrottleCollector(lambda: _worker_dirs(app), lambda: _fleet(app))
    registry.register(collector)
    return collector


def _install_metrics(app: Celery) -> None:
    # Pool children: drop an exited child's live files (none today; counters stay).
    signals.worker_process_shutdown.connect(
        _child_exited, weak=False, dispatch_uid="throttle-metrics-child-exit"
    )
    if MetricsStep not in app.steps["worker"]:
        app.steps["worker"].add(MetricsStep)
    # Flower (`celery -A proj flower` imports the app, Flower has loaded prometheus_client
    # by then) serves REGISTRY on /metrics: add the fleet's view there, once per app.
    loaded = sys.modules.get("prometheus_client") is not None
    if loaded and getattr(app, "_throttle_collector", None) is None:
        app._throttle_collector = register_metrics(app)


def _child_exited(pid: int | None = None, **kwargs: Any) -> None:
    metrics.process_exited(pid if pid is not None else os.getpid())


def _metrics_base(settings: Settings) -> Path:
    if settings.metrics_dir:
        return Path(settings.metrics_dir)
    return metrics.default_base_dir(settings.prefix, settings.namespace)


def _metrics_port(settings: Settings) -> int | None:
    value = os.environ.get(METRICS_PORT_ENV)
    if not value:
        return settings.metrics_port
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ConfigError(
            "must be a port number from 1 to 65535", field=METRICS_PORT_ENV, value=value
        )
    return int(value)


def _worker_dirs(app: Celery) -> list[tuple[str | None, Path]]:
    settings = Throttler.of(app).settings
    if not settings.metrics:
        return []
    return list(metrics.worker_dirs(_metrics_base(settings)))


def _fleet(app: Celery) -> metrics.FleetState | None:
    """The Redis-read state behind the fleet-wide gauges (None while metrics are off)."""
    throttler = Throttler.of(app)
    if not throttler.settings.metrics:
        return None
    parked, releasing = wrap_errors(throttler.parking.counts)
    limits: dict[str, Limit] = {}
    for rule in _unkeyed_rules(throttler):
        limits.setdefault(rule.name, rule.limit)
    states = [throttler.limiter.peek(throttler.rates.current(limit)) for limit in limits.values()]
    return metrics.FleetState(parked, releasing, states)


def _unkeyed_rules(throttler: Throttler) -> list[Rule]:
    """The rules with one state for all tasks (no key): the file's, then inline ones.
    Keyed limits have a state per key value: not a gauge (labels stay bounded)."""
    inline: list[Rule] = []
    keyed: set[str] = set()  # named limits that a decorator gives a key
    for task in list(throttler.app.tasks.values()):
        spec = _task_spec(task)
        if spec is not None:
            inline.extend(rule for rule in spec.rules if rule.key is None)
            if spec.overrides.get("key") is not None:
                keyed.update(spec.names)
    named = [
        rule
        for rule in throttler.config.rules.values()
        if rule.key is None and rule.name not in keyed
    ]
    return named + inline


def defer_task(countdown_s: float, limits: Sequence[str] = ()) -> None:
    """Run the running throttled task again in ``countdown_s`` seconds, as the throttler
    re-runs a denied task: the same id, arguments, options, headers, links and chord, through
    its queue's lane (parked in Redis beyond ``park_after``), without spending
    ``max_retries``; past its deadline (``max_wait``, ``expires``), ``on_timeout`` applies.
    Raises celery's ``Retry``: let it propagate. For a task that its upstream told to come
    back later (:func:`throttle.upstream.report_upstream`); ``limits`` names the limits that
    wait (default: all the task's), as the reason shown. In eager mode and direct calls,
    where there is no queue, raises :class:`Throttled` instead."""
    from throttle.decision import LimitState  # noqa: PLC0415

    task, ticket = get_current_task(), _ticket.get()
    if task is None or ticket is None:
        raise RuntimeError("defer_task() is for the body of a running throttled task")
    countdown_s = max(float(countdown_s), 0.0)
    names = tuple(limits) or tuple(rule.name for rule in ticket.rules)
    if task.request.is_eager or task.request.called_directly:
        raise Throttled(countdown_s, names)
    # The gate's own path (lanes, parking, deadline headers), with the rules of the ticket.
    gate = _Gate(task, None, task.run, (), {})
    gate.rules = ticket.rules
    now = time.time()
    gate.deadline = gate._deadline(now)
    states = tuple(LimitState(name, False, 0.0, countdown_s, 0.0) for name in names)
    denied = Decision(False, 0.0, countdown_s, 0.0, 0.0, states)
    if gate.deadline is not None and now + countdown_s > gate.deadline:
        gate._timeout(now, countdown_s, denied)
    gate._defer(countdown_s, countdown_s, denied)
