"""Judging a fleet by what the mock API saw: how late each call was behind its slot, and
whether a refusal is the limiter's fault or a late call's (shared by the fleet tests)."""

from __future__ import annotations

import time
from typing import Any

from workers.harness import Api


def api_lateness(
    api: Api, arrivals: list[dict[str, Any]], slot_of: dict[str, float]
) -> list[float]:
    """How long after its slot each arrival reached the API, in s (in arrival order). The
    slots are Redis time, the arrivals this host's monotonic clock: Redis runs here."""
    epoch_of_monotonic = time.time() - time.monotonic()
    return [
        epoch_of_monotonic + api.api.started + a["at_s"] - slot_of[a["task_id"]] for a in arrivals
    ]


def violations_explained(
    arrivals: list[dict[str, Any]], late: list[float], rate: float, burst: float
) -> list[int]:
    """The refused arrivals (indexes) that calls on time cannot explain.

    The API is a bucket of ``burst`` = 2 refilled every spacing = 1 / ``rate``; the slots
    are a spacing apart. Say every call of a stretch of arrivals [a_i, a_j] came at most L
    after its slot (and none before): the n calls of that stretch have slots in
    [a_i - L, a_j], so n <= 1 + (a_j - a_i + L) / spacing, while refusing a_j with the
    bucket full at a_i takes n > 2 + (a_j - a_i) / spacing: L > spacing. So each refusal
    must have a call more than a spacing late since the bucket was last full (a host that
    stalled a worker between its slot and its call); one without is the limiter's fault,
    and returned.
    """
    spacing = 1 / rate
    # The API's bucket replayed on its arrivals, to know when it was last full; the verdicts
    # are the API's own (a replay could differ on a float rounding at the edge).
    tokens, stamp = burst, 0.0  # reset() refilled it at at_s = 0
    full_since, unexplained = 0, []
    for j, arrival in enumerate(arrivals):
        tokens = min(burst, tokens + (arrival["at_s"] - stamp) * rate)
        stamp = arrival["at_s"]
        if tokens >= burst - 1e-9:
            full_since = j
        if arrival["allowed"]:
            tokens -= 1
        elif max(late[full_since : j + 1]) <= spacing:
            unexplained.append(j)
    return unexplained
