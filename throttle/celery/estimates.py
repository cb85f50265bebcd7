"""Estimated costs reserved as the calls really cost: the share of its estimate a limit's
calls use, learned from what they report.

A tokens limit whose cost is an estimate (``cost: estimate``, typically the prompt plus
``max_tokens``) reserves the estimate before the call, and the reported usage settles the
difference after it (:func:`throttle.celery.report_cost`). In a steady state the refunds
make the sum exact. But they come back only when a call ends, while the tasks already
waiting hold slots spaced by the whole estimate: the slots reserved ahead are that much
too far apart. When the provider lowers its limit (a limit that follows its dimension,
``upstream: tokens``), the fleet then calls for seconds at the new rate divided by the
estimate: calls that use 200 of an estimate of 250 tokens get 80 % of the new rate, until
the refunds catch up (seen in ``bench/providers.py``).

So a limit that follows a dimension of its upstream (``upstream:`` set) and whose cost is
an estimate reserves the estimate times the share its calls used (:class:`Estimates`),
learned in each process from the costs its tasks report, and settles the actual cost as
before: a call that uses more than it reserved is charged the difference, and the next
slots move back by it. The share rises at once to a larger one and falls slowly
(:data:`FALL`), never above 1 (the estimate) nor below :data:`FLOOR`, and is applied only
after :data:`MIN_SAMPLES` reports. A body that reports no cost is charged its whole
estimate at the settle (as reserving it would have): a stream left before its end errs on
the safe side still.

Trade-off: between a call that uses more than its share and its settle, the fleet may be
ahead of the provider by that difference (the provider's own bucket, a minute's worth for
OpenAI and Anthropic, absorbs it); limits without ``upstream:`` keep reserving the whole
estimate.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from throttle.rules import Rule, Target

__all__ = ["FALL", "FLOOR", "MIN_SAMPLES", "Estimates", "learns"]

MIN_SAMPLES = 3
"""Reports of a limit seen in this process before its share is applied."""
FALL = 0.2
"""How far one report of a smaller share moves the share towards it (a larger share is
taken at once): after a change to smaller calls, the reservations follow within ~10
reports."""
FLOOR = 0.1
"""The smallest share of its estimate a call reserves: calls that report (nearly) no
usage do not make the limit reserve nothing."""


def learns(rule: Rule) -> bool:
    """Whether ``rule``'s reservations follow the share of their estimate its calls use:
    a cost that is an estimate, on a limit that follows a dimension of its upstream."""
    return rule.estimated and rule.upstream is not None


@dataclass
class _Share:
    value: float = 1.0
    samples: int = 0


class Estimates:
    """The share of their estimate the calls of each learning limit used, in this process
    (one per :class:`~throttle.celery.runtime.Throttler`)."""

    def __init__(self) -> None:
        self._shares: dict[str, _Share] = {}
        self._lock = threading.Lock()  # a threads pool settles from several threads

    def share(self, name: str) -> float:
        """The share of its estimate a call of limit ``name`` reserves (1.0 until
        :data:`MIN_SAMPLES` reports)."""
        found = self._shares.get(name)
        if found is None or found.samples < MIN_SAMPLES:
            return 1.0
        return found.value

    def observe(self, name: str, estimate: float, actual: float) -> None:
        """A call of limit ``name`` estimated at ``estimate`` reported ``actual`` (both in
        the limit's units); an estimate of 0 says nothing."""
        if not estimate > 0:
            return
        seen = min(max(actual / estimate, FLOOR), 1.0)
        with self._lock:
            found = self._shares.setdefault(name, _Share(seen, 0))
            if seen >= found.value or found.samples == 0:
                found.value = seen
            else:
                found.value += FALL * (seen - found.value)
            found.samples += 1

    def scaled(
        self, rules: Sequence[Rule], targets: Sequence[Target]
    ) -> tuple[list[Target], dict[str, float]]:
        """``targets`` (each rule's limit, key, cost, in order) with the learning rules'
        costs scaled by their share, and the estimates scaled (rule name -> the whole
        estimate), for :meth:`settle_costs`."""
        scaled: list[Target] = []
        estimates: dict[str, float] = {}
        for rule, (limit, key, cost) in zip(rules, targets, strict=True):
            reserved = cost
            if learns(rule):
                estimates[rule.name] = cost
                reserved = cost * self.share(rule.name)
            scaled.append((limit, key, reserved))
        return scaled, estimates

    def settled(self, estimates: Mapping[str, float], actuals: Mapping[str, float]) -> None:
        """Learn from a settled call: ``actuals`` is the cost reported per rule name."""
        for name, estimate in estimates.items():
            actual = actuals.get(name)
            if actual is not None:
                self.observe(name, estimate, actual)
