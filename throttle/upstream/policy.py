"""What the upstream's word asks of the limits: holds, lowered rates, learned rates.

:func:`apply_upstream` is the whole of it for one limit without Celery::

    response = requests.get(url)
    apply_upstream(limiter, response, github, rates=RateBook(limiter.client, limiter.keyspace))

The decisions are pure functions of an :class:`~throttle.upstream.headers.UpstreamSignal`
and a :class:`Target` (:func:`plan`: the rate to store; :func:`judge`: whether a counted
refusal holds the limit; :func:`stated_for`: the rate an answer states); the blocking
steps that call Redis (:func:`apply_signal`, :func:`answer_refusal`, :func:`learn`) are
here, their awaited twins in :mod:`throttle.aio.upstream`, and the Celery binding
(``report_upstream``) in :mod:`throttle.celery.upstream`. All of them use the same pure
functions, so the three forms decide alike.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from throttle.adaptive import Adaptive, Learned, LearnedRates
from throttle.errors import RequestError
from throttle.limiter import Limiter
from throttle.rates import RateBook
from throttle.spec import Algorithm, Limit
from throttle.upstream.headers import PREEMPT_MIN_S, UpstreamSignal, read_response

__all__ = [
    "SPENT_SPACINGS",
    "Target",
    "answer_refusal",
    "apply_signal",
    "apply_upstream",
    "expect_limit",
    "judge",
    "learn",
    "log_hold",
    "log_rate",
    "plan",
    "quota_spent",
    "stated_for",
    "wants_reserved",
]

logger = logging.getLogger("throttle")

SPENT_SPACINGS = 2.0
"""A refusal whose hold is longer than this many spacings of the limit (and than
:data:`~throttle.upstream.headers.PREEMPT_MIN_S`) says the upstream's quota is spent
(:func:`quota_spent`)."""


def _rate_text(number: float) -> str:
    """A number for a rate spec: plain decimal, no exponent (``Limit.parse`` reads no 'e')."""
    return f"{number:.6f}".rstrip("0").rstrip(".")


def _lowered(current: Limit, configured: Limit, signal: UpstreamSignal) -> str | None:
    """The rate spec to store when the upstream states a slower rate than ``current`` (and
    than ``configured``: never above it), or None."""
    stated = signal.rate_per_s
    if stated is None or signal.quota is None or signal.window_s is None:
        return None
    if current.algorithm is Algorithm.CONCURRENCY:
        return None
    if not (stated < current.rate_per_s and stated <= configured.rate_per_s):
        return None
    spec = f"{_rate_text(signal.quota)}/{_rate_text(signal.window_s)}s"
    if current.algorithm in (Algorithm.TOKEN_BUCKET, Algorithm.GCRA):
        # Keep the shape (a burst-1 shaper stays strict) but never more than the quota.
        burst = min(current.capacity, max(signal.quota, 1.0))
        spec += f" burst {_rate_text(burst)}"
    return spec


@dataclass(frozen=True)
class Target:
    """One limit of a call, as the upstream's word is applied to it."""

    current: Limit  # the limit as acquired (with its run-time or learned rate)
    configured: Limit
    key: str | None
    per_call: bool  # charged one unit per call: its units are the upstream's requests
    adaptive: Adaptive | None = None
    ceiling: Limit | None = None  # the rate in force before learning (default: configured)


def plan(
    signal: UpstreamSignal, targets: Sequence[Target], rates: bool
) -> list[tuple[Target, str | None]]:
    """What ``signal`` asks of each target: the target, and the rate spec to store for it
    (None: none; always None without a rate book). Whether to hold is ``signal.hold_s``.
    The pure part of :func:`apply_signal` and of its awaited twin in :mod:`throttle.aio`."""
    steps: list[tuple[Target, str | None]] = []
    for target in targets:
        spec = None
        # One rate per limit for all its keys: a keyed limit's key speaks for itself only.
        if rates and target.key is None and target.per_call:
            spec = _lowered(target.current, target.configured, signal)
        steps.append((target, spec))
    return steps


def log_hold(signal: UpstreamSignal, target: Target) -> None:
    """Log a hold placed on ``target`` (info: a hold is the upstream's word, not a fault)."""
    logger.info(
        "throttle: upstream %s: holding %s%s for %.3f s",
        signal.source, target.current.name, f" key {target.key!r}" if target.key else "",
        signal.hold_s,
    )  # fmt: skip


def log_rate(signal: UpstreamSignal, target: Target, spec: str) -> None:
    """Log a run-time rate lowered for ``target`` (a warning: it stays until an operator
    clears it, and the message says how)."""
    name = target.current.name
    logger.warning(
        "throttle: upstream states %s; rate of %s lowered from %g/s to %s "
        "(RateBook.clear(%r) goes back)",
        f"{_rate_text(signal.quota or 0)} per {_rate_text(signal.window_s or 0)} s",
        name, target.current.rate_per_s, spec, name,
    )  # fmt: skip


def quota_spent(signal: UpstreamSignal, limit: Limit) -> bool:
    """Whether a refusal says the upstream's quota is spent, rather than that one call
    came early: its hold is longer than :data:`PREEMPT_MIN_S` (integer-second headers are
    that much off: a shorter one says "the next call is within rounding") and than
    :data:`SPENT_SPACINGS` spacings of ``limit`` (a slow limit's next slot is far anyway)."""
    spacing = 1.0 / limit.rate_per_s
    return signal.hold_s > max(PREEMPT_MIN_S, SPENT_SPACINGS * spacing)


def wants_reserved(target: Target) -> bool:
    """Whether a refusal of ``target`` asks how far ahead its slots are handed out (an
    adaptive limit's episode lasts as long as them: one extra round trip, on refusals)."""
    return target.adaptive is not None


def judge(signal: UpstreamSignal, target: Target, answer: Learned) -> bool:
    """Whether a refusal of ``target``, counted fleet-wide as ``answer``, holds the whole
    limit (its key): when the refusals persist, the quota is spent, or the limit is faster
    than the upstream's stated policy. Otherwise the refused call is one that the limiter's
    schedule explains (early or late by jitter): the refused task alone comes back for the
    limit's next free slot, and the fleet goes on (an adaptive limit at its lowered rate).
    The pure part of :func:`answer_refusal` and of its awaited twin in :mod:`throttle.aio`."""
    where = f" key {target.key!r}" if target.key else ""
    if answer.decreased:
        ceiling = target.ceiling or target.configured
        logger.info(
            "throttle: upstream refused %s%s: learned rate lowered to %.3f/s (ceiling %g/s)",
            target.current.name, where, answer.rate_per_s, ceiling.rate_per_s,
        )  # fmt: skip
    stated = signal.rate_per_s
    if stated is not None and target.current.rate_per_s > stated * (1 + 1e-9):
        return True  # the limit is above the upstream's word: not jitter, a wrong rate
    if answer.persist or quota_spent(signal, target.current):
        return True
    logger.debug(
        "throttle: upstream refused %s%s (%d in the window): no hold, the call comes back",
        target.current.name, where, answer.refusals,
    )  # fmt: skip
    return False


def answer_refusal(
    limiter: Limiter, learned: LearnedRates, signal: UpstreamSignal, target: Target
) -> bool:
    """Count a refusal of ``target`` fleet-wide (an adaptive limit learns from it), and
    decide whether it holds the whole limit (:func:`judge`)."""
    reserved_s = 0.0
    if wants_reserved(target):
        reserved_s = limiter.peek(target.current, target.key).reset_after_s
    answer = learned.refused(
        target.ceiling or target.configured, target.key, target.adaptive,
        rate_per_s=target.current.rate_per_s, reserved_s=reserved_s,
    )  # fmt: skip
    return judge(signal, target, answer)


def stated_for(signal: UpstreamSignal | None, target: Target) -> float | None:
    """The rate an answer that is no refusal states for ``target`` (None: a success)."""
    return None if signal is None or not target.per_call else signal.rate_per_s


def learn(learned: LearnedRates, signal: UpstreamSignal | None, target: Target) -> None:
    """An answer that is not a refusal, for an adaptive target: a stated rate replaces
    the learned one; otherwise a success lets it probe up."""
    if target.adaptive is None:
        return
    ceiling = target.ceiling or target.configured
    stated = stated_for(signal, target)
    if stated is not None:
        learned.stated(ceiling, target.key, target.adaptive, stated)
    else:
        learned.succeeded(ceiling, target.key, target.adaptive)


def apply_signal(
    limiter: Limiter,
    rates: RateBook | None,
    signal: UpstreamSignal,
    targets: Sequence[Target],
    learned: LearnedRates | None = None,
) -> bool:
    """Act on ``signal`` for each target; returns whether it held any of them."""
    held = False
    for target, spec in plan(signal, targets, rates is not None):
        hold = signal.hold_s > 0
        if learned is not None:
            if signal.refused:
                hold = answer_refusal(limiter, learned, signal, target) and hold
            else:
                learn(learned, signal, target)
        if hold:
            limiter.hold(target.current.name, target.key, signal.hold_s)
            log_hold(signal, target)
            held = True
        if rates is not None and spec is not None:
            rates.set(target.configured, spec)
            log_rate(signal, target, spec)
    return held


def expect_limit(limit: object) -> None:
    """The limit argument of :func:`apply_upstream` (and of its twins) checked."""
    if not isinstance(limit, Limit):
        raise RequestError(f"expected a Limit, e.g. Limit.parse('50/s') (got {limit!r})")


def apply_upstream(
    limiter: Limiter,
    response: Any,
    limit: Limit,
    key: str | None = None,
    *,
    rates: RateBook | None = None,
    learned: LearnedRates | None = None,
    adaptive: Adaptive | None = None,
    now: float | None = None,
) -> UpstreamSignal | None:
    """Without Celery: hold ``limit`` (of ``key`` only, when given) for the upstream's time,
    and with ``rates``, lower its run-time rate to the upstream's stated one when slower.

    ``limit`` is the configured limit; ``rates`` the book the fleet reads (the rate is
    lowered only for a limit without key, and never raised: ``rates.clear(limit.name)``
    goes back to the configured rate). With ``learned``, a refusal is answered in
    proportion, as by :func:`throttle.celery.upstream.report_upstream` (a hold only when
    refusals persist or the quota is spent), and with ``adaptive`` the limit learns its rate
    (``learned.current(limit, key, adaptive)`` is then the limit to acquire). Returns
    what the response said (None: nothing). Raises :class:`BackendError` when Redis
    fails. For asyncio code: :func:`throttle.aio.apply_upstream`.
    """
    expect_limit(limit)
    ceiling = limit if rates is None else rates.current(limit)
    current = ceiling
    if learned is not None and adaptive is not None:
        current = learned.current(ceiling, key, adaptive)
    target = Target(current, limit, key, True, adaptive, ceiling)
    signal = read_response(response, now=now)
    if signal is None:
        if learned is not None:
            learn(learned, None, target)
        return None
    apply_signal(limiter, rates, signal, [target], learned)
    return signal
