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

What the in-memory limiter does not do: share anything with another process (a worker
refuses ``memory://`` at start: each pool child would count alone); park tasks (an eager
task waits in its caller, never parked); read another clock than this host's wall clock
(the one Redis ``TIME`` stands for). Holds (``Limiter.hold``, an upstream's 429) and
run-time rates work, in this process.
"""

from __future__ import annotations

from celery import Celery

from throttle.celery.runtime import MEMORY_URL, Throttler, throttling_enabled
from throttle.errors import ConfigError
from throttle.memory import MemoryLimiter, MemoryRedis

__all__ = ["MEMORY_URL", "MemoryLimiter", "MemoryRedis", "memory_limiter", "reset", "use_memory"]


def use_memory(app: Celery) -> MemoryLimiter:
    """Give ``app`` the in-memory limiter (``app.conf.throttle_redis_url = "memory://"``),
    fresh, in place of any throttler this process built before; returns it."""
    app.conf.throttle_redis_url = MEMORY_URL
    app._throttler = None  # the next task (or the call below) builds the new one
    return memory_limiter(app)


def memory_limiter(app: Celery) -> MemoryLimiter:
    """The in-memory limiter of ``app`` in this process (to peek at a limit, place a hold,
    or settle by hand). Raises :class:`ConfigError` when the app's limiter is not the
    in-memory one."""
    limiter = Throttler.of(app).limiter
    if not isinstance(limiter, MemoryLimiter):
        raise ConfigError(
            "the app's limiter is not the in-memory one: set "
            f'app.conf.throttle_redis_url = "{MEMORY_URL}" (or call use_memory(app))',
            field="redis_url",
        )
    return limiter


def reset(app: Celery) -> None:
    """Forget every state, hold, lease and run-time rate of ``app``'s in-memory limiter (a
    new test starts with full buckets and empty windows): the next task builds a new one.
    Nothing to do when throttling is off; :class:`ConfigError` when the app's limiter is
    not the in-memory one."""
    if throttling_enabled(app):
        memory_limiter(app).server.clear()  # for whoever kept a reference to it
        app._throttler = None
