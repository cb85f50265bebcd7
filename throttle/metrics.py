"""Prometheus metrics of the throttler, correct under Celery's prefork pool.

Two kinds of numbers, from two places:

* **Counters from the workers** (what the gate decided): every pool child adds to
  ``prometheus_client``'s multiprocess files in its worker's directory; the worker's main
  process (``settings.metrics_port``) and Flower (``/metrics``, same host or shared volume)
  sum the files at scrape time. Labels: ``limit`` (a configured limit name: bounded by the
  config, never a key value) and one small fixed set each.

  ======================================  =========  =====================================
  metric                                  type       labels
  ======================================  =========  =====================================
  ``throttle_decisions_total``            counter    limit, decision = allowed | denied
  ``throttle_wait_seconds``               histogram  limit
  ``throttle_reschedules_total``          counter    limit, how = republish | park
  ``throttle_timeouts_total``             counter    limit, action = fail | dead_letter | expired
  ``throttle_refunded_tokens_total``      counter    limit
  ``throttle_charged_tokens_total``       counter    limit
  ``throttle_redis_errors_total``         counter    limit
  ``throttle_upstream_deferrals_total``   counter    limit
  ``throttle_shadow_wait_seconds``        histogram  limit (shadow mode: the would-be wait)
  ======================================  =========  =====================================

* **Gauges read from Redis at scrape time** (fleet-wide, the same wherever scraped):
  ``throttle_parked_tasks{state=waiting|releasing}``, and for limits without a key
  template ``throttle_tokens_remaining{limit}`` and ``throttle_next_slot_seconds{limit}``
  (+Inf while a limit is paused), for adaptive limits without a key template
  ``throttle_learned_rate{limit}`` beside ``throttle_configured_rate{limit}`` (per s),
  for each key given a rate of its own at run time (``celery throttle set LIMIT RATE
  --key KEY``: a few operator decisions, so the labels stay bounded)
  ``throttle_key_rate{limit,key}`` (per s), and ``throttle_redis_up`` (0 when the read failed).

Multiprocess mode. ``prometheus_client`` picks its value class when it is imported: in
multiprocess mode only if ``PROMETHEUS_MULTIPROC_DIR`` is set by then. A Celery worker
cannot rely on that: ``celery`` loads its command plugins (Flower's among them) before the
app, and Flower imports ``prometheus_client``. So :func:`setup_worker`, run in the
worker's main process before the pool forks, sets the variable to a directory of this
worker's own (wiped first: counters restart with the worker), and if ``prometheus_client``
is already loaded in single-process mode, selects the multiprocess value class the import
would have chosen (``values.ValueClass``). It refuses clearly when that cannot be done
safely. Pool children inherit both; each writes its own ``counter_PID.db``. The metric
objects are created in the process that counts, on first use, and registered in no
registry: they are only ever read back from the files, so nothing is counted twice.

This module knows nothing of Celery; :mod:`throttle.celery` wires it into workers and
Flower. ``prometheus_client`` is optional (``pip install 'celery-throttled[metrics]'``):
without it every recording call here is a no-op, and asking for metrics is a ConfigError.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from throttle.decision import LimitState
from throttle.errors import ConfigError, ThrottleError

if TYPE_CHECKING:
    from prometheus_client import Counter, Histogram
    from prometheus_client.metrics_core import Metric

__all__ = [
    "MULTIPROC_ENV",
    "FleetState",
    "ThrottleCollector",
    "allowed",
    "available",
    "counter_totals",
    "default_base_dir",
    "deferred",
    "process_exited",
    "redis_error",
    "require",
    "serve",
    "settled",
    "setup_worker",
    "shadowed",
    "timed_out",
    "upstream_deferred",
    "worker_dirs",
]

logger = logging.getLogger("throttle")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "throttle_"
WAIT_BUCKETS_S = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
"""Buckets of ``throttle_wait_seconds``: 0 is "ran at once", then up to an hour (parked)."""


class _State:
    """This process's metrics state: set in a worker's main process, inherited by fork."""

    active: str | None = None
    """The directory this process tree counts into (None: metrics off here)."""
    instruments: _Instruments | None = None
    """The metric objects, created in the process that counts, on first use."""
    failed = False


def counting() -> bool:
    """Whether this process counts metrics (``settings.metrics`` on, in a worker)."""
    return _State.active is not None


def available() -> bool:
    """True when ``prometheus_client`` is installed."""
    return importlib.util.find_spec("prometheus_client") is not None


def require(source: str | None = None) -> None:
    """Raise a ConfigError with the install hint when ``prometheus_client`` is missing."""
    if not available():
        raise ConfigError(
            "metrics need prometheus_client: pip install 'celery-throttled[metrics]'",
            field="settings.metrics", source=source,
        )  # fmt: skip


def default_base_dir(prefix: str, namespace: str) -> Path:
    """Where workers of one key space keep their metric files by default."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"throttle-metrics-{prefix}-{namespace}")
    return Path(tempfile.gettempdir()) / name


def _dir_name(worker: str) -> str:
    # Worker names are "name@host": keep them readable, but never a path separator.
    return re.sub(r"[^A-Za-z0-9_.@-]", "_", worker) or "_"


def setup_worker(base: Path, worker: str, *, source: str | None = None) -> Path:
    """Make this process (a worker's main process, before its pool forks) and its future
    children count into ``base/WORKER``: wiped, set as ``PROMETHEUS_MULTIPROC_DIR``, and
    prometheus_client in multiprocess mode. Returns the directory.

    Raises ConfigError when prometheus_client is missing, when ``PROMETHEUS_MULTIPROC_DIR``
    already names another directory (one process has one multiprocess directory), or when
    prometheus_client is loaded in single-process mode and cannot be switched.
    """
    require(source)
    directory = (base / _dir_name(worker)).resolve()
    current = os.environ.get(MULTIPROC_ENV)
    if current and Path(current).resolve() != directory:
        raise ConfigError(
            f"{MULTIPROC_ENV} is set to another directory ({current}); the throttler counts "
            f"into {directory}: unset it, or point settings.metrics_dir at its parent",
            field="settings.metrics_dir", value=str(base), source=source,
        )  # fmt: skip
    try:
        # Wiped at every start, as prometheus_client requires: a new worker's counters
        # start at 0 (Prometheus reads that as a counter reset), no file of an old run
        # (whose pids may be reused) is summed in.
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the metrics directory {directory}: {exc.strerror}",
            field="settings.metrics_dir", value=str(base), source=source,
        ) from None  # fmt: skip
    os.environ[MULTIPROC_ENV] = str(directory)
    _multiprocess_values(source)
    _State.active = str(directory)
    return directory


def _multiprocess_values(source: str | None) -> None:
    from prometheus_client import values  # noqa: PLC0415  (optional, loaded on demand)

    current = getattr(values, "ValueClass", None)
    if getattr(current, "_multiprocess", False):
        return  # imported with the variable set: files go to the directory set now
    factory = getattr(values, "MultiProcessValue", None)
    if current is None or factory is None or _State.instruments is not None:
        raise ConfigError(
            f"prometheus_client is already loaded in single-process mode and cannot be "
            f"switched here: set {MULTIPROC_ENV} in the worker's environment before it starts",
            field="settings.metrics", source=source,
        )  # fmt: skip
    # What `import prometheus_client` would have chosen had the variable been set then.
    # Metrics created before this (by other libraries) keep per-process values; ours are
    # created after, in the pool children.
    values.ValueClass = factory()


def process_exited(pid: int) -> None:
    """Bookkeeping for an exited pool child: drop its live-gauge files. Its counter files
    stay, so that totals never go down when a child is replaced."""
    if _State.active is None:
        return
    with contextlib.suppress(Exception):
        from prometheus_client import multiprocess  # noqa: PLC0415

        multiprocess.mark_process_dead(pid, _State.active)  # type: ignore[no-untyped-call]


# -- counting (pool children) -------------------------------------------------------------


@dataclass(frozen=True)
class _Instruments:
    decisions: Counter
    wait: Histogram
    reschedules: Counter
    timeouts: Counter
    refunded: Counter
    charged: Counter
    redis_errors: Counter
    upstream: Counter
    shadow: Histogram


def _build() -> _Instruments:
    from prometheus_client import Counter, Histogram  # noqa: PLC0415

    def counter(name: str, doc: str, *labels: str) -> Counter:
        # registry=None: read back from the files only (a registered copy would be a
        # second, per-process view of the same counts wherever REGISTRY is served).
        return Counter(name, doc, ["limit", *labels], registry=None)

    return _Instruments(
        decisions=counter(
            "throttle_decisions",
            "Gate decisions per limit: allowed (the task ran) or denied (deferred or timed out)",
            "decision",
        ),
        wait=Histogram(
            "throttle_wait_seconds",
            "Seconds from a gate decision to the task's slot (0: ran at once)",
            ["limit"],
            buckets=WAIT_BUCKETS_S,
            registry=None,
        ),
        reschedules=counter(
            "throttle_reschedules", "Deferred tasks, by how: republish or park", "how"
        ),
        timeouts=counter(
            "throttle_timeouts",
            "Tasks whose throttle deadline passed, by action: fail, dead_letter or expired",
            "action",
        ),
        refunded=counter("throttle_refunded_tokens", "Reserved cost given back on settle"),
        charged=counter("throttle_charged_tokens", "Cost taken beyond the estimate on settle"),
        redis_errors=counter("throttle_redis_errors", "Redis errors met by the gate"),
        shadow=Histogram(
            "throttle_shadow_wait_seconds",
            "Seconds a limit in shadow mode would have delayed a task (0: none); it ran at once",
            ["limit"],
            buckets=WAIT_BUCKETS_S,
            registry=None,
        ),
        upstream=counter(
            "throttle_upstream_deferrals",
            "Tasks deferred by the upstream's word (defer_task: report_upstream(retry=True) "
            "after a 429), counted in throttle_reschedules_total too",
        ),
    )


def _record(update: Callable[[_Instruments], None]) -> None:
    """Apply ``update`` when this process counts; a metrics failure never fails a task."""
    if _State.active is None:
        return
    try:
        if _State.instruments is None:
            _State.instruments = _build()
        update(_State.instruments)
    except Exception:
        if not _State.failed:  # say it once, not on every task
            _State.failed = True
            logger.exception("throttle: recording a metric failed; tasks are not affected")


def allowed(limits: Iterable[str], wait_s: float) -> None:
    """The gate let a task run, ``wait_s`` after its decision (a short sleep, or 0)."""

    def update(m: _Instruments) -> None:
        for limit in limits:
            m.decisions.labels(limit, "allowed").inc()
            m.wait.labels(limit).observe(max(wait_s, 0.0))

    _record(update)


def deferred(limits: Iterable[str], how: str, wait_s: float, *, by_gate: bool = True) -> None:
    """A task was deferred for ``wait_s``: ``how`` is ``republish`` or ``park``.
    ``by_gate``: the gate's denial (a decision, and its wait); False for a deferral the
    body asked for after it ran (the upstream's word: :func:`upstream_deferred`), which
    is a reschedule only: its run was counted allowed already."""

    def update(m: _Instruments) -> None:
        for limit in limits:
            if by_gate:
                m.decisions.labels(limit, "denied").inc()
                m.wait.labels(limit).observe(max(wait_s, 0.0))
            m.reschedules.labels(limit, how).inc()

    _record(update)


def shadowed(looks: Sequence[tuple[Sequence[str], Sequence[float]]]) -> None:
    """Limits in shadow mode would have delayed tasks: per task, its ``(limits, waits)``
    (s, one per limit)."""

    def update(m: _Instruments) -> None:
        for limits, waits in looks:
            for limit, wait_s in zip(limits, waits, strict=True):
                m.shadow.labels(limit).observe(max(wait_s, 0.0))

    _record(update)


def upstream_deferred(limits: Iterable[str]) -> None:
    """A running task was deferred by the upstream's word (:func:`defer_task`, what
    ``report_upstream(retry=True)`` does on a 429), under ``limits``."""

    def update(m: _Instruments) -> None:
        for limit in limits:
            m.upstream.labels(limit).inc()

    _record(update)


def timed_out(limits: Iterable[str], action: str) -> None:
    """A task's deadline passed: ``action`` is ``fail``, ``dead_letter`` or ``expired``."""

    def update(m: _Instruments) -> None:
        for limit in limits:
            m.decisions.labels(limit, "denied").inc()
            m.timeouts.labels(limit, action).inc()

    _record(update)


def settled(limits: Sequence[str], deltas: Sequence[float]) -> None:
    """A settle changed costs: ``deltas`` (actual - reserved) per limit, in order."""

    def update(m: _Instruments) -> None:
        for limit, delta in zip(limits, deltas, strict=False):
            if delta < 0:
                m.refunded.labels(limit).inc(-delta)
            elif delta > 0:
                m.charged.labels(limit).inc(delta)

    _record(update)


def redis_error(limits: Iterable[str]) -> None:
    """The gate met a Redis error while handling a task of ``limits``."""

    def update(m: _Instruments) -> None:
        for limit in limits:
            m.redis_errors.labels(limit).inc()

    _record(update)


# -- reading (worker main process, Flower) -------------------------------------------------


@dataclass(frozen=True)
class FleetState:
    """What the fleet-wide gauges show, read from Redis at scrape time."""

    parked: int
    releasing: int
    limits: Sequence[LimitState]
    """One peek per limit without a key template."""
    learned: Sequence[tuple[str, float, float]] = ()
    """Each adaptive limit without a key template: (limit, the rate in force before
    learning, the learned rate), per s."""
    key_rates: Sequence[tuple[str, str, float]] = ()
    """Each key given a rate of its own at run time: (limit, key, rate per s)."""


def worker_dirs(base: Path) -> list[tuple[str, Path]]:
    """The (worker, directory) pairs below ``base``: what Flower sums."""
    if not base.is_dir():
        return []
    return sorted((d.name, d) for d in base.iterdir() if d.is_dir())


def _read_files(directory: Path) -> list[Metric]:
    from prometheus_client.multiprocess import MultiProcessCollector  # noqa: PLC0415

    files = glob.glob(os.path.join(directory, "*.db"))
    if not files:
        return []
    # Only ours: if PROMETHEUS_MULTIPROC_DIR also points here in another process (say
    # Flower's), its own metrics are served by its registry already.
    return [
        m
        for m in MultiProcessCollector.merge(files)  # type: ignore[no-untyped-call]
        if m.name.startswith(PREFIX)
    ]


def counter_totals(directories: Iterable[Path], name: str, **labels: str) -> dict[str, float]:
    """The samples of counter ``name`` (``..._total``) carrying ``labels``, summed per
    ``limit`` over the workers' files in ``directories`` (the limits page's admitted
    rate). A directory that cannot be read right now (a file being written or wiped) is
    skipped this time."""
    totals: dict[str, float] = {}
    for directory in directories:
        try:
            found = _read_files(directory)
        except Exception:
            continue
        for metric in found:
            for sample in metric.samples:
                if sample.name != name or "limit" not in sample.labels:
                    continue
                if any(sample.labels.get(k) != v for k, v in labels.items()):
                    continue
                limit = sample.labels["limit"]
                totals[limit] = totals.get(limit, 0.0) + sample.value
    return totals


class ThrottleCollector:
    """A prometheus_client collector: the workers' counters summed from their files, and
    the fleet-wide gauges read from Redis.

    Parameters
    ----------
    directories:
        Called at each scrape: ``(worker, directory)`` pairs to sum. ``worker`` None: one
        worker's own directory, no label; else every sample gets ``worker=...`` (Flower
        reading several workers: each worker's counters stay monotonic on their own).
    fleet:
        Called at each scrape: the Redis-read state, or None for no gauges (metrics off).
        An exception there is logged and shown as ``throttle_redis_up 0``.
    """

    def __init__(
        self,
        directories: Callable[[], Sequence[tuple[str | None, Path]]],
        fleet: Callable[[], FleetState | None],
    ) -> None:
        self.directories = directories
        self.fleet = fleet

    def describe(self) -> list[Metric]:
        # Nothing to describe up front: registering must not read files or Redis.
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            directories = self.directories()
        except Exception:
            logger.exception("throttle: cannot list the metrics directories")
            directories = []
        yield from self._counters(directories)
        yield from self._gauges()

    def _counters(self, directories: Sequence[tuple[str | None, Path]]) -> Iterator[Metric]:
        from prometheus_client.metrics_core import Metric  # noqa: PLC0415

        merged: dict[str, Metric] = {}
        for worker, directory in directories:
            try:
                metrics = _read_files(directory)
            except Exception:  # a file being written or wiped: skip this worker once
                logger.exception("throttle: cannot read metric files in %s", directory)
                continue
            for metric in metrics:
                if worker is None:
                    merged[metric.name] = metric
                    continue
                into = merged.get(metric.name)
                if into is None:
                    into = merged[metric.name] = Metric(
                        metric.name, metric.documentation, metric.type
                    )
                into.samples.extend(
                    s._replace(labels={**s.labels, "worker": worker}) for s in metric.samples
                )
        yield from merged.values()

    def _gauges(self) -> Iterator[Metric]:
        from prometheus_client.metrics_core import GaugeMetricFamily  # noqa: PLC0415

        up = GaugeMetricFamily(
            "throttle_redis_up", "1 when the fleet-wide gauges could be read from Redis"
        )
        try:
            state = self.fleet()
        except (ThrottleError, OSError) as exc:
            logger.warning("throttle: cannot read the fleet state for metrics: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        if state is None:
            return
        up.add_metric([], 1)
        yield up
        parked = GaugeMetricFamily(
            "throttle_parked_tasks",
            "Tasks parked in Redis: waiting for their slot, or being released to the broker",
            labels=["state"],
        )
        parked.add_metric(["waiting"], state.parked)
        parked.add_metric(["releasing"], state.releasing)
        yield parked
        if state.key_rates:
            keyed = GaugeMetricFamily(
                "throttle_key_rate",
                "The rate set at run time for one key of a limit (celery throttle set "
                "--key), per s",
                labels=["limit", "key"],
            )
            for name, key, rate in state.key_rates:
                keyed.add_metric([name, key], rate)
            yield keyed
        if not state.limits:
            return
        tokens = GaugeMetricFamily(
            "throttle_tokens_remaining",
            "What a limit without a key could admit now (tokens, units or calls)",
            labels=["limit"],
        )
        slot = GaugeMetricFamily(
            "throttle_next_slot_seconds",
            "Seconds until a limit without a key admits a cost of 1 (+Inf: paused)",
            labels=["limit"],
        )
        for limit in state.limits:
            tokens.add_metric([limit.limit], limit.remaining)
            slot.add_metric([limit.limit], limit.retry_after_s)
        yield tokens
        yield slot
        if not state.learned:
            return
        ceiling = GaugeMetricFamily(
            "throttle_configured_rate",
            "An adaptive limit's rate before learning (configured, or set at run time), per s",
            labels=["limit"],
        )
        learned = GaugeMetricFamily(
            "throttle_learned_rate",
            "The rate an adaptive limit learned from the upstream's answers, per s",
            labels=["limit"],
        )
        for name, configured, rate in state.learned:
            ceiling.add_metric([name], configured)
            learned.add_metric([name], rate)
        yield ceiling
        yield learned


def serve(
    port: int,
    collector: ThrottleCollector,
    *,
    field: str = "settings.metrics_port",
    source: str | None = None,
) -> Any:
    """Serve ``collector`` alone on ``port`` (all interfaces) from a daemon thread;
    returns the server (``.shutdown()`` stops it). A taken port is a ConfigError naming
    ``field`` of ``source``, where the port was set."""
    from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    try:
        started = start_http_server(port, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on port {port}: {exc.strerror or exc}",
            field=field, value=port, source=source,
        ) from None  # fmt: skip
    return started[0] if isinstance(started, tuple) else started
