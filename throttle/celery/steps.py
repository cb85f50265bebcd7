"""The worker's bootsteps, and :func:`install`, which adds them to an app.

- :class:`ThrottleStep` (worker): validates the limits file when the worker starts,
  registers the lanes of its queues before the pool forks, and runs the
  :class:`~throttle.celery.releaser.Releaser` of parked tasks.
- :class:`LaneStep` (consumer): every queue the worker consumes, it also consumes its lane.
- :class:`~throttle.celery.waiting.WaitStep` (consumer): throttled tasks wait for their
  slot in the consumer, not in a pool slot.
- :class:`MetricsStep` (worker): the worker's metrics directory and port.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import click
from celery import Celery, bootsteps, concurrency, signals

from throttle import metrics
from throttle.celery.exporter import (
    METRICS_PORT_ENV,
    fleet_state,
    metrics_base,
    metrics_port,
    register_metrics,
)
from throttle.celery.message import LANE_SUFFIX
from throttle.celery.outage import POOL_ENV, WORKER_ENV
from throttle.celery.releaser import Releaser
from throttle.celery.routing import declare_lanes, lane_queue
from throttle.celery.runtime import (
    MEMORY_URL,
    RELEASER_STEP,
    Throttler,
    throttling_enabled,
    unknown_tasks,
)
from throttle.celery.sent import install_stamp
from throttle.celery.task import argument_errors
from throttle.celery.waiting import WaitStep
from throttle.config import MAPPING_SOURCE, ThrottleConfig
from throttle.errors import BackendError, ConfigError
from throttle.redis.clock import record_clock
from throttle.redis.memory import eviction_policy, eviction_warning

CLOCK_WARN_S = 0.5
"""A worker whose wall clock is further than this from the Redis clock (s) warns at start."""

logger = logging.getLogger("throttle")


class ThrottleStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker bootstep: validates the limits file when the worker starts (a bad file stops
    it), and runs the releaser of parked tasks."""

    label = RELEASER_STEP
    # Start after the pool has forked its children: the releaser is a thread, and a fork
    # while it holds a lock would hand the child a lock that nobody releases.
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.app = worker.app
        # Created before the pool forks: the children inherit these (see
        # throttle.celery.outage.OutageWatch). Put back when the worker stops: a test
        # process that ran Celery's test worker builds throttlers after it, which must not
        # think they are in a worker (the restart fence would stall their first task).
        self.saved_env = {name: os.environ.get(name) for name in (WORKER_ENV, POOL_ENV)}
        os.environ[WORKER_ENV] = str(os.getpid())
        os.environ[POOL_ENV] = str(getattr(worker, "concurrency", None) or 1)
        self.hostname = worker.hostname
        self.releaser: Releaser | None = None
        self.in_memory = False
        if not throttling_enabled(self.app):
            logger.info("throttle: throttling is off (throttle_enabled): tasks run unthrottled")
            return
        try:
            # The process's own (raises ConfigError on a bad file): in a test process,
            # the one a test set up (a prefix of its own), which the fence and the
            # clock check must write under too.
            throttler = Throttler.of(self.app)
            check_worker(throttler, worker)
        except ConfigError as exc:
            refuse_to_start(exc, self.app)
        self.in_memory = throttler.in_memory
        if throttler.settings.lanes:
            # Before the pool forks: every process of the worker must know the lanes.
            declare_lanes(self.app)
        if throttler.in_memory:
            # One process, nothing parked (long waits stay ETA messages), no Redis that
            # could restart or run on another clock: no fence, no releaser, no clock check.
            logger.info("throttle: the in-memory limiter (memory://), this process only")
            return
        if throttler.watch.file is not None:
            throttler.watch.file.unlink(missing_ok=True)  # a stale one of a reused pid
        try:
            # A new deployment: no task of this worker sleeps to a slot yet, so a Redis
            # without the restart fence's marker gets one that has ended (no stall).
            throttler.limiter.mark_started()
            throttler.check_cold_start()
            check_clock(throttler, worker.hostname)
            policy = eviction_policy(throttler.limiter.client)
            if policy is not None:
                logger.warning("throttle: %s", eviction_warning(policy))
        except BackendError as exc:  # a worker starts while Redis is down: it may
            throttler.outage(exc)

    def start(self, worker: Any) -> None:
        if not throttling_enabled(self.app) or self.in_memory:
            return
        self.releaser = Releaser(self.app, worker=self.hostname)
        self.releaser.start()

    def stop(self, worker: Any) -> None:
        if self.releaser is not None:
            self.releaser.stop()
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def terminate(self, worker: Any) -> None:
        self.stop(worker)

    def shutdown(self, worker: Any) -> None:
        self.stop(worker)


ONE_PROCESS_POOLS = frozenset({"solo", "threads", "gevent", "eventlet"})
"""Pools whose tasks all run in the worker's own process: the in-memory limiter
(``memory://``) counts right there. Celery's test worker
(``celery.contrib.testing.worker.start_worker``, the ``celery_worker`` fixture) runs solo
in a thread of the test process."""


def pool_name(worker: Any) -> str:
    """The name of ``worker``'s pool (``solo``, ``prefork``, ``threads``...): its alias when
    given as one, else the module its class lives in (``celery.concurrency.prefork`` ->
    ``prefork``)."""
    pool = worker.pool_cls
    if isinstance(pool, str):  # an alias, or "module:Class"; not imported (gevent may be absent)
        module = concurrency.ALIASES.get(pool, pool).split(":")[0]
    else:
        module = str(getattr(pool, "__module__", ""))
    name = module.rsplit(".", 1)[-1]
    return "threads" if name == "thread" else name


def check_worker(throttler: Throttler, worker: Any) -> None:
    """What would make ``worker`` throttle wrongly, as a :class:`ConfigError`: the in-memory
    limiter in a pool of several processes (each would count apart), a limit its tasks name
    that the file lacks, settings that outlive the broker's visibility timeout
    (:meth:`Throttler.validate`); and logs each key, plan or cost naming an argument its
    task does not have (:func:`throttle.celery.task.argument_errors`), and each task of
    ``tasks:`` the app does not register (:func:`throttle.celery.runtime.unknown_tasks`)
    and each likely typo of the file (:meth:`ThrottleConfig.warnings`)."""
    if throttler.in_memory:
        from_file = throttler.url_origin == throttler.config.source
        pool = pool_name(worker)
        if pool not in ONE_PROCESS_POOLS and (worker.concurrency or 1) > 1:
            raise ConfigError(
                f"the in-memory limiter serves one process: the {pool} pool with "
                f"{worker.concurrency} child processes would count in each child apart; "
                "give the worker a Redis, or use a one-process pool (solo, threads, "
                "gevent, eventlet; Celery's test worker runs solo)",
                field="settings.redis_url" if from_file else None, value=MEMORY_URL,
                source=throttler.url_origin,
            )  # fmt: skip
    throttler.validate()
    # Logged, not refused: a shared task (Celery's @app.task default) joins every app that
    # imports its module, called or not, and a worker must not refuse to start over a task
    # it never runs. `celery throttle check -A` counts them as errors.
    for error in argument_errors(throttler.app, throttler.config):
        logger.error("throttle: %s: every call of that task will fail or fall back", error)
    for warning in [*throttler.config.warnings(), *unknown_tasks(throttler.app, throttler.config)]:
        logger.warning("throttle: %s", warning)


def refuse_to_start(exc: ConfigError, app: Celery) -> NoReturn:
    """Stop a worker on a bad limits file (or ``throttle_config`` mapping of ``app``): under
    the ``celery`` program, every error of it, one line each (what ``celery throttle
    check`` prints), on stderr, and exit code 1, rather than a traceback that shows only
    the first; elsewhere (a worker embedded in a test) ``exc`` is raised."""
    if click.get_current_context(silent=True) is None:
        raise exc
    errors: list[ConfigError] = []
    if exc.source == MAPPING_SOURCE:  # all of the mapping's own errors
        errors = ThrottleConfig.check_mapping(app.conf.get("throttle_config"), source=exc.source)
    elif exc.source is not None and os.path.isfile(exc.source):
        # the file's own errors, all of them (not for a setting's name: a Redis URL)
        errors = ThrottleConfig.check(exc.source)
    if str(exc) not in map(str, errors):  # an error against the app (validate)
        errors.append(exc)
    for error in errors:
        click.echo(f"throttle: {error}", err=True)
    plural = "s" if len(errors) > 1 else ""
    click.echo(f"throttle: {len(errors)} error{plural}: the worker does not start", err=True)
    raise click.exceptions.Exit(1)


def check_clock(throttler: Throttler, worker: str) -> float:
    """Measure this host's offset to the Redis clock, record it for ``celery throttle
    status``, and warn once when it exceeds :data:`CLOCK_WARN_S`. Returns the offset (s)."""
    clock = throttler.clock
    offset = clock.measure()
    record_clock(clock, throttler.limiter.keyspace.clocks_key(), worker)
    if abs(offset) > CLOCK_WARN_S:
        logger.warning(
            "throttle: this host's clock is %+.3f s off the Redis clock (+/- %.3f s): "
            "the throttler keeps its times on the Redis clock, but check the host's NTP",
            -offset, clock.error_s,
        )  # fmt: skip
    return offset


class LaneStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: every queue the worker consumes, it also consumes its lane
    (``QUEUE.throttled``, declared with QUEUE's arguments: see
    :func:`throttle.celery.routing.lane_queue`), where deferred tasks come back when their
    slot is due. Kombu
    serves a worker's queues in turn, so a task due now waits for at most a message or so
    of the backlog, not for all of it."""

    label = "throttle-lanes"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, consumer: Any) -> None:
        if not throttling_enabled(consumer.app) or not Throttler.of(consumer.app).settings.lanes:
            return
        task_consumer = consumer.task_consumer
        queues = consumer.app.amqp.queues
        for queue in list(task_consumer.queues):
            if queue.name.endswith(LANE_SUFFIX):
                continue
            # Declared like the queue it serves (a quorum queue's lane is a quorum queue).
            lane = queues.select_add(lane_queue(consumer.app, queue))
            if task_consumer.consuming_from(lane.name):
                continue
            # Added, not consumed: the consumer's loop starts consuming every queue of the
            # task consumer once it has set the message callback. Celery's
            # ``add_task_queue`` consumes at once: on RabbitMQ a lane with ready messages
            # (a restart during a backlog, a killed worker's deferred tasks) then delivers
            # them before there is a callback, and the worker stops ("Consumer does not
            # have any callbacks"; the messages are requeued).
            task_consumer.add_queue(lane)
            logger.info("throttle: consuming from lane %s", lane.name)


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
        if not throttling_enabled(self.app):
            return
        try:
            throttler = Throttler.of(self.app)  # raises ConfigError on a bad file
        except ConfigError as exc:
            refuse_to_start(exc, self.app)
        if not throttler.settings.metrics:
            return
        source = throttler.config.source
        try:  # prometheus_client missing, a directory it cannot write
            self.directory = metrics.setup_worker(
                metrics_base(throttler.settings), worker.hostname, source=source
            )
        except ConfigError as exc:
            refuse_to_start(exc, self.app)
        self.port = metrics_port(throttler.settings)

    def start(self, worker: Any) -> None:
        if self.directory is None or self.port is None:
            return
        directory, app = self.directory, self.app
        collector = metrics.ThrottleCollector(lambda: [(None, directory)], lambda: fleet_state(app))
        if os.environ.get(METRICS_PORT_ENV):  # the environment's port, not the file's
            field, source = METRICS_PORT_ENV, None
        else:
            field, source = "settings.metrics_port", Throttler.of(app).config.source
        self.server = metrics.serve(self.port, collector, field=field, source=source)
        logger.info("throttle: metrics of %s on port %d", worker.hostname, self.port)

    def stop(self, worker: Any) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def shutdown(self, worker: Any) -> None:
        self.stop(worker)


def install(app: Celery, *, config: Any = None) -> Celery:
    """Wire the throttler into ``app``'s workers: the limits file (``config``: a path or a
    mapping; default ``app.conf.throttle_config`` or ``THROTTLE_CONFIG``) is validated when a
    worker starts, and every worker runs a releaser of parked tasks; with ``settings.metrics``
    every worker counts into its metrics directory (and serves ``settings.metrics_port``).
    The fleet's metrics go on prometheus_client's default registry (:func:`register_metrics`)
    only in Flower and in a worker's main process, where prometheus_client is loaded: never
    in other processes that import the app (a Django web process), which would each export
    the fleet-wide gauges again, or a false ``throttle_redis_up 0`` (see
    :func:`metrics_belong_here`). Returns ``app``."""
    if config is not None:
        app.conf.throttle_config = config
    if ThrottleStep not in app.steps["worker"]:
        app.steps["worker"].add(ThrottleStep)
    if LaneStep not in app.steps["consumer"]:
        app.steps["consumer"].add(LaneStep)
    if WaitStep not in app.steps["consumer"]:
        app.steps["consumer"].add(WaitStep)  # throttled tasks wait in the consumer
    # An exited pool child's live-gauge files are dropped; its counters stay.
    signals.worker_process_shutdown.connect(
        _child_exited, weak=False, dispatch_uid="throttle-metrics-child-exit"
    )
    if MetricsStep not in app.steps["worker"]:
        app.steps["worker"].add(MetricsStep)
    install_stamp(app)  # producers stamp the send time, for shadow mode
    _register_where_it_belongs(app)
    return app


def metrics_belong_here() -> str | None:
    """Which process this is, when the fleet's metrics belong on its default registry:
    ``"flower"`` when the ``celery`` command runs its ``flower`` subcommand (the app is
    imported by the ``celery`` group's callback, inside click's context, which already
    names the subcommand), else None. A worker's main process is told apart later, by the
    ``worker_init`` signal (:func:`install` connects it); any other process importing the
    app (a web process, a script, ``celery beat``, ``celery throttle``) gets nothing, and
    can ask with :func:`register_metrics`."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.find_root().invoked_subcommand == "flower":
        return "flower"
    return None


def _register_where_it_belongs(app: Celery) -> None:
    """Register the fleet's metrics in Flower now, and in a worker's main process when it
    initialises (``worker_init``: sent once, in the main process, before the pool forks)."""
    if metrics_belong_here() == "flower":
        _register_once(app)
        return

    def on_worker_init(sender: Any = None, **kwargs: Any) -> None:
        if getattr(sender, "app", None) is app:
            _register_once(app)

    signals.worker_init.connect(
        on_worker_init, weak=False, dispatch_uid=f"throttle-metrics-registry-{id(app)}"
    )


def _register_once(app: Celery) -> None:
    """:func:`register_metrics` on the default registry, once per app, when prometheus_client
    is loaded (Flower loads it; a worker with ``settings.metrics`` on too)."""
    if sys.modules.get("prometheus_client") is None:
        return
    if getattr(app, "_throttle_collector", None) is not None:
        return
    try:
        app._throttle_collector = register_metrics(app)
    except ValueError as exc:  # another app of this process registered the same names
        logger.warning("throttle: the fleet's metrics of %s are not registered: %s", app, exc)


def _child_exited(pid: int | None = None, **kwargs: Any) -> None:
    metrics.process_exited(pid if pid is not None else os.getpid())
