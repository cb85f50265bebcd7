"""The upstream's word: 429 / Retry-After and RateLimit headers, handed to the throttler.

When the third-party API answers 429 with ``Retry-After``, or says in its rate-limit headers
that the quota is spent, one call hands that to the throttler and the whole fleet holds the
limit until the upstream's reset (:meth:`Limiter.hold`, atomic in Redis), instead of every
worker finding out by its own 429. When the upstream states its policy (``RateLimit-Policy``,
or ``X-RateLimit-Limit`` with a window) and it is slower than the limit, the fleet's run-time
rate is lowered to it (:class:`throttle.rates.RateBook`). Inside a task::

    import requests
    from throttle.celery import throttled
    from throttle.upstream import report_upstream, upstream_hook

    session = requests.Session()
    session.hooks["response"].append(upstream_hook(retry=True))     # one line, every call

    @app.task
    @throttled("github")
    def fetch(url):
        return session.get(url).json()   # a 429 re-runs the task after the upstream's reset

    # or with httpx: httpx.Client(event_hooks={"response": [upstream_hook(retry=True)]})
    # or by hand:    report_upstream(response, retry=True)

Without Celery, :func:`apply_upstream` does the same for a :class:`Limiter` and a limit::

    response = requests.get(url)
    apply_upstream(limiter, response, github, rates=RateBook(limiter.client, limiter.keyspace))

The package has three layers, one module each:

- :mod:`throttle.upstream.headers`: the pure part, status code and headers in, an
  :class:`UpstreamSignal` (or None) out (:func:`parse_upstream`); it never raises,
  whatever the header values. The providers' own headers (OpenAI, Anthropic, GitHub,
  Stripe, Discord) are read per dimension by :mod:`throttle.upstream.dialects`, the
  values by :mod:`throttle.upstream.values`.
- :mod:`throttle.upstream.policy`: what a signal asks of the limits (holds, lowered and
  learned rates), :func:`apply_upstream` for one limit without Celery.
- :mod:`throttle.celery.upstream`: :func:`report_upstream` and :func:`upstream_hook`,
  with the Celery layer. They are re-exported here, imported on first use, so that the
  parser and the plain helpers (and :mod:`throttle.aio`) import no Celery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from throttle.upstream.headers import (
    DEFAULT_HOLD_S,
    MAX_HOLD_S,
    MAX_WINDOW_S,
    PREEMPT_MIN_S,
    Reading,
    UpstreamSignal,
    parse_upstream,
    read_response,
)
from throttle.upstream.policy import SPENT_SPACINGS, apply_upstream, quota_spent

if TYPE_CHECKING:
    from throttle.celery.upstream import report_upstream, upstream_hook

__all__ = [
    "DEFAULT_HOLD_S",
    "MAX_HOLD_S",
    "MAX_WINDOW_S",
    "PREEMPT_MIN_S",
    "SPENT_SPACINGS",
    "Reading",
    "UpstreamSignal",
    "apply_upstream",
    "parse_upstream",
    "quota_spent",
    "read_response",
    "report_upstream",
    "upstream_hook",
]

_CELERY = ("report_upstream", "upstream_hook")


def __getattr__(name: str) -> Any:
    """The Celery binding's names, imported when first asked for (PEP 562)."""
    if name in _CELERY:
        from throttle.celery import upstream  # noqa: PLC0415

        return getattr(upstream, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
