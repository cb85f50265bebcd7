"""Testing a project's throttled tasks without Redis: the in-memory limiter, and the switch.

A test suite that runs tasks eagerly (``task_always_eager``, ``Task.apply``, direct calls)
still reaches the limiter. Two ways to run it without a Redis:

* **The in-memory limiter** keeps the throttling: the same decisions as the Lua scripts on
  the same clock (the scripts' Python models, proven equal to them by the package's
  property tests), in this process. An eager task blocks until its slot, or raises
  :class:`~throttle.ThrottleTimeout` past its ``max_wait``; reported costs settle::

      app.conf.update(task_always_eager=True, throttle_redis_url="memory://")

  Django test settings (``app.config_from_object("django.conf:settings",
  namespace="CELERY")``)::

      CELERY_TASK_ALWAYS_EAGER = True
      CELERY_THROTTLE_REDIS_URL = "memory://"

* **The switch** turns throttling off: tasks run unthrottled, nothing connects to Redis, no
  limiter is built, ``install(app)`` and the worker's steps do nothing, and
  :func:`~throttle.celery.report_cost` and :func:`~throttle.celery.slot_time` act as
  outside a throttled task::

      app.conf.throttle_enabled = False        # or CELERY_THROTTLE_ENABLED = False,
                                               # or THROTTLE_ENABLED=0 in the environment

Between tests, :func:`reset` forgets what the app's in-memory limiter counted::

    @pytest.fixture(autouse=True)
    def fresh_limits():
        yield
        throttle.testing.reset(celery_app)

A worker takes ``memory://`` when all its tasks run in its own process: Celery's test
worker (``celery.contrib.testing.worker.start_worker``, the ``celery_worker`` fixture, a
solo pool in a thread of the test process), and the solo, threads, gevent and eventlet
pools. A prefork worker of several children refuses it at start (each child would count
alone).

:class:`Recorder` keeps every decision the app's limiter gave (which task waited, how long,
which limit denied it), for a test to assert that a task was throttled. The pytest plugin
(:mod:`throttle.pytest_plugin`) wraps all of this in fixtures.

What the in-memory limiter does not do: share anything with another process; park tasks
(an eager task waits in its caller; a worker re-publishes a long wait as an ETA message,
never parked); read another clock than this host's wall clock (the one Redis ``TIME``
stands for). Holds (``Limiter.hold``, an upstream's 429) and run-time rates work, in this
process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from celery import Celery

from throttle.celery.runtime import MEMORY_URL, Throttler, throttling_enabled
from throttle.errors import ConfigError
from throttle.memory import MemoryLimiter, MemoryRedis

__all__ = [
    "MEMORY_URL",
    "PROVIDERS",
    "MemoryLimiter",
    "MemoryRedis",
    "Recorder",
    "Seen",
    "UpstreamError",
    "memory_limiter",
    "rebuild",
    "reset",
    "upstream_response",
    "use_memory",
]


def use_memory(app: Celery) -> MemoryLimiter:
    """Give ``app`` the in-memory limiter (``app.conf.throttle_redis_url = "memory://"``),
    fresh, in place of any throttler this process built before; returns it."""
    app.conf.throttle_redis_url = MEMORY_URL
    app._throttler = None  # the next task (or the call below) builds the new one
    return memory_limiter(app)


def rebuild(app: Celery) -> None:
    """Forget ``app``'s throttler in this process: the next throttled call builds it again
    from ``app.conf`` as it is then. An app's throttler is built once per process, on its
    first throttled call: a test that changes ``app.conf.throttle_redis_url`` or
    ``throttle_config`` afterwards calls this (the plugin's fixtures and
    :func:`use_memory` do it themselves)."""
    app._throttler = None


def memory_limiter(app: Celery) -> MemoryLimiter:
    """The in-memory limiter of ``app`` in this process (to peek at a limit, place a hold,
    or settle by hand). Raises :class:`ConfigError` when the app's limiter is not the
    in-memory one."""
    throttler = Throttler.of(app)
    limiter = throttler.limiter
    if not isinstance(limiter, MemoryLimiter):
        raise ConfigError(
            "the app's limiter is not the in-memory one: set "
            f'app.conf.throttle_redis_url = "{MEMORY_URL}" (or call use_memory(app))',
            field="redis_url",
        )
    for declared in throttler.declared():  # peek("proj.charge") for an inline limit too
        for rule in declared.rules:
            limiter.limits.setdefault(rule.name, rule.limit)
    return limiter


def reset(app: Celery) -> None:
    """Forget every state, hold, lease and run-time rate of ``app``'s in-memory limiter (a
    new test starts with full buckets and empty windows): the next task builds a new one.
    Nothing to do when throttling is off; :class:`ConfigError` when the app's limiter is
    not the in-memory one."""
    if throttling_enabled(app):
        memory_limiter(app).server.clear()  # for whoever kept a reference to it
        app._throttler = None


@dataclass(frozen=True)
class Seen:
    """One decision of the limiter about a task, as :class:`Recorder` saw it."""

    task_id: str | None
    """The task's id (the acquisition's id); None for a call outside a task."""
    limits: tuple[str, ...]
    """The limits asked for, in order."""
    allowed: bool
    wait_s: float
    """Allowed: how long until its slot (0: at once). Denied: how long until it may ask
    again (``retry_after_s``; ``inf`` while paused)."""
    denied_by: tuple[str, ...]
    """The limits that denied it (empty when allowed)."""

    @property
    def throttled(self) -> bool:
        """The task did not run at once: it was denied, or waited for its slot."""
        return not self.allowed or self.wait_s > 0


class Recorder:
    """Every decision a limiter gives (``acquire`` and ``acquire_many``), from now until
    :meth:`stop`: for a test to assert that a task was throttled and how long it was told
    to wait. It wraps the limiter's two methods on this instance (nothing changes in what
    they decide); eager tasks and Celery's test worker both reach them::

        recorder = Recorder(memory_limiter(app))
        result = fetch.delay("repo")
        assert recorder.throttled(result.id)
        assert recorder.wait_s(result.id) == pytest.approx(0.5, abs=0.05)
    """

    def __init__(self, limiter: Any) -> None:
        self.limiter = limiter
        self.seen: list[Seen] = []
        self._wrapped = [self._wrap("acquire_many", _many), self._wrap("acquire", _one)]

    def _wrap(self, name: str, asked: Callable[..., tuple[str, ...]]) -> str:
        original = getattr(self.limiter, name)

        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            decision = original(*args, **kwargs)
            self.seen.append(
                Seen(
                    task_id=kwargs.get("acquisition_id"),
                    limits=asked(*args, **kwargs),
                    allowed=decision.allowed,
                    # A second look at a slot the task holds already (the pool child's
                    # look before its call) is no new wait.
                    wait_s=0.0
                    if decision.held and decision.allowed
                    else decision.wait_s
                    if decision.allowed
                    else decision.retry_after_s,
                    denied_by=tuple(decision.denied_by),
                )
            )
            return decision

        setattr(self.limiter, name, recorded)
        return name

    def stop(self) -> None:
        """Give the limiter its own methods back."""
        for name in self._wrapped:
            self.limiter.__dict__.pop(name, None)
        self._wrapped = []

    def of(self, task_id: str) -> list[Seen]:
        """The decisions about task ``task_id``, in order."""
        return [seen for seen in self.seen if seen.task_id == task_id]

    def throttled(self, task_id: str) -> bool:
        """Whether task ``task_id`` was denied or waited for its slot at least once."""
        return any(seen.throttled for seen in self.of(task_id))

    def wait_s(self, task_id: str) -> float:
        """How long the limiter told task ``task_id`` to wait, in s: every denial's
        ``retry_after_s`` plus its slot's wait (what it was told, not the wall time it
        took: a worker's deferral also waits for the broker)."""
        return sum(seen.wait_s for seen in self.of(task_id))

    def denied_by(self, task_id: str) -> set[str]:
        """The limits that denied task ``task_id`` at least once."""
        return {name for seen in self.of(task_id) for name in seen.denied_by}


def _many(targets: Sequence[Any], *args: Any, **kwargs: Any) -> tuple[str, ...]:
    return tuple(target[0].name for target in targets)


def _one(limit: Any, *args: Any, **kwargs: Any) -> tuple[str, ...]:
    return (getattr(limit, "name", str(limit)),)


PROVIDERS = ("generic", "openai", "anthropic", "github", "stripe", "discord")
"""The header dialects :func:`upstream_response` speaks (``throttle.upstream`` reads each)."""


def upstream_response(
    provider: str = "generic",
    *,
    status: int = 429,
    retry_after_s: float | None = 2.0,
    limit: int = 60,
    remaining: int = 0,
    reset_s: float = 2.0,
    dimension: str = "requests",
    now: float | None = None,
) -> Any:
    """An upstream's answer as the provider sends it, to test a task's reaction without a
    network: an ``httpx.Response`` (a ``requests``-like stand-in without httpx) with
    ``status`` and the provider's rate-limit headers: ``limit`` and ``remaining`` of
    ``dimension`` (``requests`` or ``tokens`` for OpenAI and Anthropic), reset in
    ``reset_s`` seconds, and ``Retry-After`` (None: none).

    ``generic``: ``RateLimit-Limit``/``-Remaining``/``-Reset``; ``openai``:
    ``x-ratelimit-*-{dimension}`` with Go durations and ``retry-after-ms``; ``anthropic``:
    ``anthropic-ratelimit-{dimension}-*`` with an RFC 3339 reset; ``github``:
    ``x-ratelimit-*`` with ``x-ratelimit-resource: core`` and an epoch reset; ``stripe``:
    ``Stripe-Rate-Limited-Reason`` (``dimension`` is the reason); ``discord``: a bucket's
    ``X-RateLimit-*`` with ``Reset-After`` and ``Scope: user``."""
    import datetime  # noqa: PLC0415 (tests only)
    import time  # noqa: PLC0415

    at = time.time() if now is None else now
    headers: dict[str, str] = {}
    if retry_after_s is not None:
        headers["Retry-After"] = f"{max(round(retry_after_s), 0)}"
    if provider == "generic":
        headers.update(
            {"RateLimit-Limit": f"{limit}", "RateLimit-Remaining": f"{remaining}",
             "RateLimit-Reset": f"{max(round(reset_s), 0)}"}
        )  # fmt: skip
    elif provider == "openai":
        headers.update(
            {f"x-ratelimit-limit-{dimension}": f"{limit}",
             f"x-ratelimit-remaining-{dimension}": f"{remaining}",
             f"x-ratelimit-reset-{dimension}": f"{reset_s:g}s"}
        )  # fmt: skip
        if retry_after_s is not None:
            headers["retry-after-ms"] = f"{round(retry_after_s * 1000)}"
    elif provider == "anthropic":
        stamp = datetime.datetime.fromtimestamp(at + reset_s, tz=datetime.timezone.utc)
        base = f"anthropic-ratelimit-{dimension}-"
        headers.update(
            {base + "limit": f"{limit}", base + "remaining": f"{remaining}",
             base + "reset": stamp.strftime("%Y-%m-%dT%H:%M:%SZ")}
        )  # fmt: skip
    elif provider == "github":
        headers.update(
            {"x-ratelimit-limit": f"{limit}", "x-ratelimit-remaining": f"{remaining}",
             "x-ratelimit-used": f"{limit - remaining}", "x-ratelimit-resource": "core",
             "x-ratelimit-reset": f"{int(at + reset_s)}"}
        )  # fmt: skip
    elif provider == "stripe":
        headers["Stripe-Rate-Limited-Reason"] = dimension
    elif provider == "discord":
        headers.update(
            {"X-RateLimit-Limit": f"{limit}", "X-RateLimit-Remaining": f"{remaining}",
             "X-RateLimit-Reset-After": f"{reset_s:g}", "X-RateLimit-Bucket": "abcd1234",
             "X-RateLimit-Scope": "user"}
        )  # fmt: skip
    else:
        raise ValueError(f"unknown provider {provider!r}; one of {', '.join(PROVIDERS)}")
    try:
        import httpx  # noqa: PLC0415
    except ImportError:
        return _Response(status, headers)
    return httpx.Response(
        status, headers=headers, request=httpx.Request("GET", "https://api.test/")
    )


class _Response:
    """A response with ``status_code`` and case-insensitive ``headers``, as requests' has."""

    def __init__(self, status: int, headers: dict[str, str]) -> None:
        self.status_code = status
        self.headers = _Headers(headers)
        self.text = ""


class _Headers(dict[str, str]):
    """Headers looked up whatever their case, as requests' ``CaseInsensitiveDict`` (requests
    is not a dependency: without httpx, the test helpers must not need it either)."""

    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__({name.lower(): value for name, value in headers.items()})

    def __getitem__(self, name: str) -> str:
        return super().__getitem__(name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(name.lower())

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


class UpstreamError(Exception):
    """An SDK's error for a refused call, as OpenAI's and Anthropic's SDKs raise them
    (``RateLimitError``): the response in ``.response``, its ``.status_code``. Raise it
    from a stand-in client to test a task's ``except`` clause::

        raise UpstreamError(upstream_response("openai", dimension="tokens"))
    """

    def __init__(self, response: Any) -> None:
        super().__init__(f"upstream refused: {response.status_code}")
        self.response = response
        self.status_code = response.status_code
