"""Serving the throttle metrics: a worker's own port, and Flower's (or any) registry.

The counters live in :mod:`throttle.metrics` (one file per pool child, prometheus_client's
multiprocess mode); this module reads what the Celery app knows to serve them: the
worker's metrics directory and port, and the fleet-wide gauges read from Redis at each
scrape (parked tasks, each unkeyed limit's state).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery

from throttle import metrics
from throttle.celery.runtime import Throttler
from throttle.config import Settings
from throttle.errors import ConfigError
from throttle.redis.client import wrap_errors
from throttle.rules import Rule
from throttle.spec import Limit

METRICS_PORT_ENV = "THROTTLE_METRICS_PORT"
"""Overrides ``settings.metrics_port`` for one worker (several workers on one host)."""


def register_metrics(app: Celery, registry: Any = None) -> metrics.ThrottleCollector:
    """Expose ``app``'s throttle metrics on a prometheus_client registry (default: the
    process's ``REGISTRY``, what Flower's ``/metrics`` serves): the counters of every
    worker under ``settings.metrics_dir`` on this host (label ``worker``) and the
    fleet-wide gauges read from Redis at each scrape. Nothing while metrics are off.

    :func:`throttle.celery.install` calls it in Flower and in a worker's main process
    (when prometheus_client is loaded there), and nowhere else: a web process that imports
    the app would otherwise export the fleet-wide gauges once more per pod. Call it
    yourself in a process of your own that should export them (one exporter per fleet is
    enough: the gauges are read from Redis, the same everywhere)."""
    metrics.require()
    if registry is None:
        from prometheus_client import REGISTRY  # noqa: PLC0415

        registry = REGISTRY
    collector = metrics.ThrottleCollector(lambda: worker_dirs(app), lambda: fleet_state(app))
    registry.register(collector)
    return collector


def metrics_base(settings: Settings) -> Path:
    """The directory under which each worker of this host keeps its metrics files."""
    if settings.metrics_dir:
        return Path(settings.metrics_dir)
    return metrics.default_base_dir(settings.prefix, settings.namespace)


def metrics_port(settings: Settings) -> int | None:
    """The port a worker serves its metrics on (``THROTTLE_METRICS_PORT`` first)."""
    value = os.environ.get(METRICS_PORT_ENV)
    if not value:
        return settings.metrics_port
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ConfigError(
            "must be a port number from 1 to 65535", field=METRICS_PORT_ENV, value=value
        )
    return int(value)


def worker_dirs(app: Celery) -> list[tuple[str | None, Path]]:
    """Each worker's metrics directory on this host (none while metrics are off)."""
    settings = Throttler.of(app).settings
    if not settings.metrics:
        return []
    return list(metrics.worker_dirs(metrics_base(settings)))


def fleet_state(app: Celery) -> metrics.FleetState | None:
    """The Redis-read state behind the fleet-wide gauges (None while metrics are off)."""
    throttler = Throttler.of(app)
    if not throttler.settings.metrics:
        return None
    parked, releasing = wrap_errors(throttler.parking.counts)
    limits: dict[str, Limit] = {}
    learning: dict[str, Rule] = {}
    for rule in unkeyed_rules(throttler):
        limits.setdefault(rule.name, rule.limit)
        if rule.adaptive is not None:
            learning.setdefault(rule.name, rule)
    states = [throttler.limiter.peek(throttler.rates.current(limit)) for limit in limits.values()]
    learned = []
    for name, rule in learning.items():
        assert rule.adaptive is not None
        ceiling = throttler.rates.current(rule.limit)
        rate = throttler.learned.read(ceiling, None, rule.adaptive).rate_per_s
        learned.append((name, ceiling.rate_per_s, rate))
    key_rates = []
    fair = {name for name, rule in throttler.config.rules.items() if rule.limit.fair}
    for (name, key), spec in sorted(throttler.rates.key_overrides().items(), key=str):
        if name in fair:  # a fair limit's keys share its rate: the workers ignore it
            continue
        try:
            rate = Limit.parse(spec).rate_per_s
        except ConfigError:  # written by hand: the workers ignore it too
            continue
        if key is not None:
            key_rates.append((name, key, rate))
    return metrics.FleetState(parked, releasing, states, learned, key_rates)


def unkeyed_rules(throttler: Throttler) -> list[Rule]:
    """The rules with one state for all tasks (no key): the file's, then inline ones.
    Keyed limits have a state per key value: not a gauge (labels stay bounded)."""
    inline: list[Rule] = []
    keyed: set[str] = set()  # named limits that a decorator gives a key
    for declared in throttler.declared():
        inline.extend(rule for rule in declared.rules if rule.key is None)
        if declared.overrides.get("key") is not None:
            keyed.update(declared.names)
    named = [
        rule
        for rule in throttler.config.rules.values()
        if rule.key is None and rule.name not in keyed
    ]
    return named + inline
