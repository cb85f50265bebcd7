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
from throttle.rates import RateBook, RateBookBase
from throttle.refusals import Refusal, RefusalBook
from throttle.spec import Limit
from throttle.upstream.dialects import dimension_name
from throttle.upstream.headers import PREEMPT_MIN_S, UpstreamSignal, read_response

__all__ = [
    "SPENT_SPACINGS",
    "Step",
    "Target",
    "answer_refusal",
    "apply_signal",
    "apply_upstream",
    "expect_dimension",
    "expect_limit",
    "judge",
    "learn",
    "log_follow",
    "log_hold",
    "log_rate",
    "plan",
    "quota_spent",
    "refusal_entry",
    "seen_by",
    "stated_for",
    "wants_reserved",
]

logger = logging.getLogger("throttle")

SPENT_SPACINGS = 2.0
"""A refusal whose hold is longer than this many spacings of the limit (and than
:data:`~throttle.upstream.headers.PREEMPT_MIN_S`) says the upstream's quota is spent
(:func:`quota_spent`)."""


ROUNDING_S = 1.0
"""How much longer than the call's wait an integer-second header may say (a delta rounded
up), in s."""


def _rate_text(number: float) -> str:
    """A number for a rate spec: plain decimal, no exponent (``Limit.parse`` reads no 'e')."""
    return f"{number:.6f}".rstrip("0").rstrip(".")


def _spec(quota: float, window_s: float, shape: Limit) -> str:
    """The rate spec of ``quota`` per ``window_s`` s, keeping ``shape``'s burst (a burst-1
    shaper stays strict) but never more than the quota."""
    spec = f"{_rate_text(quota)}/{_rate_text(window_s)}s"
    if shape.algorithm.reserves:
        burst = min(shape.capacity, max(quota, 1.0))
        spec += f" burst {_rate_text(burst)}"
    return spec


def _lowered(current: Limit, configured: Limit, signal: UpstreamSignal) -> str | None:
    """The rate spec to store when the upstream states a slower rate than ``current`` (and
    than ``configured``: never above it), or None."""
    stated = signal.rate_per_s
    if stated is None or signal.quota is None or signal.window_s is None:
        return None
    if current.algorithm.holds_units:
        return None
    if not (stated < current.rate_per_s and stated <= configured.rate_per_s):
        return None
    return _spec(signal.quota, signal.window_s, current)


def _followed(ceiling: Limit, signal: UpstreamSignal) -> str | None:
    """The rate spec the upstream states for a limit that follows its dimension: its
    quota per window when slower than ``ceiling`` (the operator's or the configured
    rate), with ``ceiling``'s burst at most; None when it is as fast or faster (the
    ceiling is in force)."""
    stated = signal.rate_per_s
    if stated is None or signal.quota is None or signal.window_s is None:
        return None
    if stated >= ceiling.rate_per_s * (1 - 1e-9):
        return None
    return _spec(signal.quota, signal.window_s, ceiling)


@dataclass(frozen=True)
class Target:
    """One limit of a call, as the upstream's word is applied to it."""

    current: Limit  # the limit as acquired (with its run-time or learned rate)
    configured: Limit
    key: str | None
    per_call: bool  # charged one unit per call: its units are the upstream's requests
    adaptive: Adaptive | None = None
    ceiling: Limit | None = None  # the rate in force before learning (default: configured)
    dimension: str | None = None  # the upstream's dimension it follows (Rule.upstream)
    cost: float = 1.0  # what the call took of it, in its units (a refusal blames a
    # dimension left with less than this)

    def follows(self, signal: UpstreamSignal) -> bool:
        """Whether ``signal`` (as this target sees it) states a rate in this limit's units:
        the limit follows the dimension the signal speaks for."""
        return self.dimension is not None and signal.dimension == self.dimension


@dataclass(frozen=True)
class Step:
    """What a signal asks of one target.

    Attributes
    ----------
    target:
        The limit.
    signal:
        The signal as the target sees it (:meth:`UpstreamSignal.follow`): whether it is
        refused, how long to hold (``signal.hold_s``), the stated rate in its units.
    lowered:
        A rate spec to store with :meth:`RateBook.set <throttle.rates.RateBook.set>` (a
        limit that follows no dimension: lowered, never raised), or None.
    follow:
        Whether to store ``followed`` with :meth:`RateBook.follow
        <throttle.rates.RateBook.follow>` (a limit that follows a dimension: down and back
        up with the upstream's word).
    followed:
        That spec; None drops the upstream's rate (it states the ceiling or more).
    """

    target: Target
    signal: UpstreamSignal
    lowered: str | None = None
    follow: bool = False
    followed: str | None = None


def seen_by(signal: UpstreamSignal, targets: Sequence[Target]) -> list[UpstreamSignal]:
    """The signal as each target sees it (:meth:`UpstreamSignal.follow`). A refusal blames
    the dimensions the upstream says are spent, and those left with less than what the
    call took of a target that follows them (OpenAI refuses a call of 5,000 tokens when
    3,000 are left: ``remaining`` is not 0)."""
    if not signal.readings:
        return [signal for _ in targets]
    blamed = {reading.dimension for reading in signal.readings if reading.spent}
    if signal.refused:
        for target in targets:
            reading = None if target.dimension is None else signal.reading(target.dimension)
            left = None if reading is None else reading.remaining
            if left is not None and left < target.cost:
                blamed.add(str(target.dimension))
    frozen = frozenset(blamed)
    return [signal.follow(target.dimension, frozen) for target in targets]


def plan(
    signal: UpstreamSignal, targets: Sequence[Target], rates: RateBookBase | None
) -> list[Step]:
    """What ``signal`` asks of each target (:class:`Step`): how it sees the signal, and
    the rate to store for it (none without a rate book). ``rates``' cache is read (its
    ``current`` was called for the targets), not Redis. The pure part of
    :func:`apply_signal` and of its awaited twin in :mod:`throttle.aio`."""
    steps: list[Step] = []
    for target, seen in zip(targets, seen_by(signal, targets), strict=True):
        step = Step(target, seen)
        # One rate per limit for all its keys: a keyed limit's key speaks for itself only.
        shaped = not target.current.algorithm.holds_units
        if rates is not None and target.key is None and shaped:
            if target.follows(seen):
                spec = _followed(rates.ceiling(target.configured), seen)
                if spec != rates.followed(target.configured.name):
                    step = Step(target, seen, follow=True, followed=spec)
            elif target.per_call and target.adaptive is None:
                # Not for an adaptive limit: its learned rate takes the stated one, down
                # and back up (learn()); a lowered run-time rate would pin it for good,
                # as its ceiling, after the upstream raised its limit again.
                step = Step(target, seen, _lowered(target.current, target.configured, seen))
        steps.append(step)
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
        _policy_text(signal), name, target.current.rate_per_s, spec, name,
    )  # fmt: skip


def log_follow(signal: UpstreamSignal, target: Target, spec: str | None) -> None:
    """Log a limit's rate following its dimension of the upstream (a warning when it goes
    down, info when it goes back up to the operator's or the configured rate)."""
    name = target.current.name
    if spec is None:
        logger.info(
            "throttle: upstream states %s %s: rate of %s back to %g/s",
            _policy_text(signal), signal.dimension, name, target.configured.rate_per_s,
        )  # fmt: skip
        return
    logger.warning(
        "throttle: upstream states %s %s; rate of %s follows it: %s",
        _policy_text(signal), signal.dimension, name, spec,
    )  # fmt: skip


def _policy_text(signal: UpstreamSignal) -> str:
    return f"{_rate_text(signal.quota or 0)} per {_rate_text(signal.window_s or 0)} s"


def quota_spent(signal: UpstreamSignal, limit: Limit) -> bool:
    """Whether a refusal says the upstream's quota is spent, rather than that one call
    came early: its hold is longer than :data:`SPENT_SPACINGS` spacings of ``limit`` (a
    slow limit's next slot is far anyway), and than the second an integer-second header
    rounds a call's wait up by beyond them (``Retry-After: 1`` at 10/s says no more than
    "the next call is within rounding"; ``Retry-After: 2`` says more than a second, ten
    spacings), up to :data:`PREEMPT_MIN_S`."""
    spacing = 1.0 / limit.rate_per_s
    rounded = min(PREEMPT_MIN_S, ROUNDING_S + SPENT_SPACINGS * spacing)
    return signal.hold_s > max(rounded, SPENT_SPACINGS * spacing)


def wants_reserved(target: Target) -> bool:
    """Whether a refusal of ``target`` asks how far ahead its slots are handed out (an
    adaptive limit's episode lasts as long as them: one extra round trip, on refusals)."""
    return target.adaptive is not None


def judge(signal: UpstreamSignal, target: Target, answer: Learned) -> bool:
    """Whether a refusal of ``target``, counted fleet-wide as ``answer``, holds the whole
    limit (its key): when the refusals persist, the quota is spent, the limit is faster
    than the upstream's stated policy, or the provider's headers blame the dimension the
    limit follows. Otherwise the refused call is one that the limiter's
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
    if answer.persist or quota_spent(signal, target.current) or signal.blamed or signal.insists:
        # (blamed: the provider's headers say this dimension is spent; insists: its limit
        # says to wait, GitHub's secondary one)
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
    """The rate an answer that is no refusal states for ``target`` (None: a success): the
    generic policy for a limit charged one unit per call, its dimension's for a limit that
    follows one."""
    if signal is None or not (target.per_call or target.follows(signal)):
        return None
    return signal.rate_per_s


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
) -> dict[int, float]:
    """Act on ``signal`` for each target (:func:`plan`): hold, learn, store a rate;
    returns the holds placed: the index of each target held, and for how long (s; a
    dimension the signal speaks of has its own reset, so the holds may differ)."""
    held: dict[int, float] = {}
    for index, step in enumerate(plan(signal, targets, rates)):
        target, seen = step.target, step.signal
        hold = seen.hold_s > 0
        if learned is not None:
            if seen.refused:
                hold = answer_refusal(limiter, learned, seen, target) and hold
            else:
                learn(learned, seen, target)
        if hold:
            limiter.hold(target.current.name, target.key, seen.hold_s)
            log_hold(seen, target)
            held[index] = seen.hold_s
        if rates is not None and step.lowered is not None:
            rates.set(target.configured, step.lowered)
            log_rate(seen, target, step.lowered)
        if rates is not None and step.follow:
            rates.follow(target.configured, step.followed)
            log_follow(seen, target, step.followed)
    return held


def expect_dimension(dimension: object) -> str | None:
    """The dimension argument of :func:`apply_upstream` (and of its twins) checked and
    spelt as readings spell it (lower-case)."""
    if dimension is None:
        return None
    name = dimension_name(dimension)
    if name is None:
        raise RequestError(
            f"expected the name of an upstream dimension such as 'tokens' or 'requests' "
            f"(got {dimension!r})"
        )
    return name


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
    dimension: str | None = None,
    cost: float = 1.0,
    now: float | None = None,
    refusals: RefusalBook | None = None,
) -> UpstreamSignal | None:
    """Without Celery: hold ``limit`` (of ``key`` only, when given) for the upstream's time,
    and with ``rates``, lower its run-time rate to the upstream's stated one when slower.

    ``limit`` is the configured limit; ``rates`` the book the fleet reads (the rate is
    lowered only for a limit without key, and never raised: ``rates.clear(limit.name)``
    goes back to the configured rate). With ``learned``, a refusal is answered in
    proportion, as by :func:`throttle.celery.upstream.report_upstream` (a hold only when
    refusals persist or the quota is spent), and with ``adaptive`` the limit learns its rate
    (``learned.current(limit, key, adaptive)`` is then the limit to acquire).

    ``dimension`` (``"tokens"``, ``"requests"``, a GitHub resource...): the dimension of
    the upstream the limit follows, as ``upstream:`` does in a limits file: only that
    dimension's spent quota holds it, and with ``rates`` its stated quota sets the
    limit's rate, in the limit's units, down and back up (:meth:`RateBook.follow
    <throttle.rates.RateBook.follow>`). ``cost``: what the call took of the limit, in
    its units (a refusal blames a dimension left with less than it).

    ``refusals`` (a :class:`throttle.refusals.RefusalBook`): a refusal is kept in the
    fleet's record of refusals too (``celery throttle refusals``), without a task id.

    Returns what the response said (None: nothing). Raises :class:`BackendError` when
    Redis fails. For asyncio code: :func:`throttle.aio.apply_upstream`.
    """
    expect_limit(limit)
    dimension = expect_dimension(dimension)
    ceiling = limit if rates is None else rates.current(limit)
    current = ceiling
    if learned is not None and adaptive is not None:
        current = learned.current(ceiling, key, adaptive)
    # Learning needs the book: without one, the limit is answered as a plain one (its
    # run-time rate lowered to a slower stated policy, which plan() leaves to learning).
    learning = adaptive if learned is not None else None
    target = Target(current, limit, key, True, learning, ceiling, dimension, cost)
    signal = read_response(response, now=now)
    if signal is None:
        if learned is not None:
            learn(learned, None, target)
        return None
    held = bool(apply_signal(limiter, rates, signal, [target], learned))
    if refusals is not None and signal.refused:
        refusals.record([refusal_entry(response, signal, limit, key, held)])
    return signal


def refusal_entry(
    response: Any, signal: UpstreamSignal, limit: Limit, key: str | None, held: bool
) -> Refusal:
    """The record's entry for a refusal seen without Celery (no task id, no task name),
    by :func:`apply_upstream` and its asyncio twin."""
    status = getattr(response, "status_code", None)
    return Refusal(
        limit.name, key, None, None, status if isinstance(status, int) else None,
        signal.source, signal.hold_s, held,
    )  # fmt: skip
