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

How the package is laid out, in the order a task meets it:

- :mod:`~throttle.celery.task`: ``@throttled``, ``ThrottledTask``, ``report_cost``,
  ``slot_time``; each execution runs gate -> body -> settle.
- :mod:`~throttle.celery.message`: the queue and ``throttle_*`` headers of a message.
- :mod:`~throttle.celery.runtime`: the ``Throttler`` of a process (config, limiter, rules).
- :mod:`~throttle.celery.waiting`: the worker's consumer admits a task and holds it until
  shortly before its slot, outside the pool.
- :mod:`~throttle.celery.gate`: admit, wait to the slot, run.
- :mod:`~throttle.celery.deadlines`: ``max_wait``, ``expires``, the lease;
  :mod:`~throttle.celery.plan`: shared capacity taken when a task can run.
- :mod:`~throttle.celery.comeback`: every way a task comes back later (a denial, a far
  slot, a plan, ``defer_task``); :mod:`~throttle.celery.reschedule` re-publishes it
  through the lane, parks it, or times it out.
- :mod:`~throttle.celery.redis_down`: the rules' ``on_redis_down``, for a task that met an
  outage of the limiter's Redis; :mod:`~throttle.celery.outage`: what a process knows of it.
- :mod:`~throttle.celery.settle`: after the body, the actual cost;
  :mod:`~throttle.celery.usage` reads it from an SDK's reply or stream
  (``report_usage``, ``metered``).
- :mod:`~throttle.celery.upstream`: the upstream's answers (``report_upstream``,
  ``upstream_hook``).
- :mod:`~throttle.celery.observe`: events, fleet stats and metrics behind one interface.
- :mod:`~throttle.celery.steps`, :mod:`~throttle.celery.releaser`,
  :mod:`~throttle.celery.exporter`: the worker's bootsteps, the releaser of parked
  tasks, serving the metrics.

Monitoring: each deferral sends a ``task-throttled`` event and raises Celery's ``Retry``
carrying :class:`Throttled`, so Flower lists the waiting task as RETRY with
``Throttled(limit='upstream', wait=3.2s)``; it adds to the fleet-wide counts of
:class:`throttle.stats.StatsBook`, and with ``settings.metrics`` to the worker's Prometheus
counters (:mod:`throttle.metrics`), served on ``settings.metrics_port`` and on Flower's
``/metrics``.
"""

from throttle.celery.comeback import defer_task
from throttle.celery.exporter import register_metrics
from throttle.celery.runtime import Throttler
from throttle.celery.steps import install
from throttle.celery.task import ThrottledTask, report_cost, slot_time, throttled
from throttle.celery.usage import metered, report_usage

__all__ = [
    "ThrottledTask",
    "Throttler",
    "defer_task",
    "install",
    "metered",
    "register_metrics",
    "report_cost",
    "report_usage",
    "slot_time",
    "throttled",
]
