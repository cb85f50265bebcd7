"""The replies of the Lua scripts, decoded into decisions, states and settlements.

Each script's reply is described in the header of its file in ``lua/``; the numbered
statuses are named here (:class:`AcquireStatus`, :class:`SettleCode`). The decided replies
of ``acquire_one.lua`` and ``acquire.lua`` are packed little-endian doubles (exact, and no
number formatted on either side); the other replies are text, space-separated numbers, with
durations in whole us.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any

from throttle.decision import Acquisition, Decision, LimitState, Settlement, SettleStatus
from throttle.errors import BackendError, CostExceedsCapacity, RequestError, ThrottleError
from throttle.redis.keys import decode_hold_field
from throttle.spec import Limit

__all__ = [
    "HELD_FOREVER_S",
    "AcquireStatus",
    "SettleCode",
    "acquire_decision",
    "held_s",
    "holds",
    "one_limit_decision",
    "peek_state",
    "settlement",
]

HELD_FOREVER_S = 1e11
"""A wait this long (about 3,000 years) can only be a hold until lifted: read as ``inf``."""


class AcquireStatus(IntEnum):
    """The first field of a reply of ``lua/acquire.lua`` (``'2 1'`` of acquire_one.lua too)."""

    DECIDED = 0
    """Decided now: packed doubles, the first one this 0."""
    REDELIVERED = 1
    """The acquisition id holds a live lease on these same keys: allowed, nothing taken again."""
    OVER_CAPACITY = 2
    """The cost exceeds the capacity of limit number ``reply[1]``: never satisfiable."""
    OTHER_LEASE = 3
    """The acquisition id holds a live lease on other limits or keys: nothing done."""
    VOIDED_BY_HOLD = 4
    """As REDELIVERED, but a hold placed after the reservation covers its slot."""


class SettleCode(IntEnum):
    """The first field of a reply of ``lua/settle.lua``."""

    SETTLED = 0
    ALREADY_SETTLED = 1
    UNKNOWN = 2
    """No lease record: never recorded, or expired."""
    MISMATCH = 3
    """The keys differ from those recorded."""


# The statuses of a Settlement, indexed by SettleCode.
_SETTLE_STATUS: tuple[SettleStatus, ...] = ("settled", "already_settled", "unknown", "mismatch")
_INF = math.inf
# tuple.__new__ straight away: the same NamedTuples in half the time of their generated
# __new__ (on the path of every acquire).
_new = tuple.__new__
# acquire_one.lua's decided reply: allowed, wait_us, retry_after_us, remaining, reset_us.
_unpack_one = struct.Struct("<ddddd").unpack
_ONE_REPLY_SIZE = 40
# acquire.lua's decided replies, by their number of doubles (4 + 4 per limit).
_UNPACKERS: dict[int, Callable[[bytes], tuple[float, ...]]] = {}


def held_s(seconds: float) -> float:
    """A wait in seconds, ``inf`` for a hold until lifted (a pause)."""
    return _INF if seconds >= HELD_FOREVER_S else seconds


def _unpack_doubles(raw: bytes, count: int) -> tuple[float, ...]:
    """``count`` little-endian doubles packed by a script (struct '<d'), checked for size."""
    unpack = _UNPACKERS.get(count)
    if unpack is None:
        unpack = _UNPACKERS[count] = struct.Struct(f"<{count}d").unpack
    if len(raw) != 8 * count:
        raise BackendError(f"a script replied {len(raw)} bytes where {8 * count} were due")
    return unpack(raw)


def one_limit_decision(limit: Limit, cost: float, raw: bytes) -> Decision:
    """The Decision of a reply of ``lua/acquire_one.lua`` on ``limit`` for ``cost``.

    Raises :class:`CostExceedsCapacity` for its only other reply, OVER_CAPACITY (``'2 1'``):
    the script re-checks the capacity, the limiter's own check normally fires first."""
    if len(raw) != _ONE_REPLY_SIZE:
        raise CostExceedsCapacity(limit.name, cost, limit.capacity)
    name = limit.name
    admitted, wait_us, retry_us, remaining, reset_us = _unpack_one(raw)
    allowed = admitted == 1.0
    retry_after_s = retry_us / 1e6
    if retry_after_s >= HELD_FOREVER_S:
        retry_after_s = _INF
    reset_after_s = reset_us / 1e6
    wait_s = wait_us / 1e6
    state = _new(LimitState, (name, allowed, remaining, retry_after_s, reset_after_s))
    return _new(
        Decision,
        (allowed, remaining, retry_after_s, reset_after_s, wait_s, (state,), None, False, 0.0),
    )


def series_decisions(
    limit: Limit, costs: Sequence[float], raw: bytes
) -> list[Decision | ThrottleError]:
    """The Decision of each ask of a reply of ``lua/acquire_series.lua`` on ``limit`` (the
    asks' ``costs``, in order): acquire_one.lua's reply per ask, packed one after the
    other; :class:`CostExceedsCapacity` in the place of an ask whose cost the script found
    above the capacity (the limiter's own check normally fires first)."""
    if len(raw) != _ONE_REPLY_SIZE * len(costs):
        raise BackendError(
            f"a script replied {len(raw)} bytes where {_ONE_REPLY_SIZE * len(costs)} were due"
        )
    out: list[Decision | ThrottleError] = []
    for i, cost in enumerate(costs):
        chunk = raw[i * _ONE_REPLY_SIZE : (i + 1) * _ONE_REPLY_SIZE]
        if chunk[:8] == _OVER_CAPACITY:
            out.append(CostExceedsCapacity(limit.name, cost, limit.capacity))
        else:
            out.append(one_limit_decision(limit, cost, chunk))
    return out


_OVER_CAPACITY = struct.pack("<d", 2.0)
"""The first double of an ask acquire_series.lua found above the capacity."""


def acquire_decision(
    pairs: Sequence[tuple[Limit, str | None]],
    costs: Sequence[float],
    acquisition_id: str | None,
    own_keys: tuple[str, ...],
    raw: bytes,
) -> Decision:
    """The Decision of a reply ``raw`` of ``lua/acquire.lua`` on the targets ``pairs`` (their
    ``costs``; ``own_keys``: the state keys and lease record an Acquisition settles). The
    reply comes last, so that a limiter binds the rest before the call.

    Raises :class:`CostExceedsCapacity` for OVER_CAPACITY, :class:`RequestError` for
    OTHER_LEASE."""
    n = len(pairs)
    if raw[:1] == b"\x00":  # DECIDED: packed doubles, the first one 0
        return _decided(raw, pairs, costs, acquisition_id, own_keys)
    reply = raw.split()
    status = int(reply[0])
    if status == AcquireStatus.OVER_CAPACITY:
        index = int(reply[1]) - 1
        limit = pairs[index][0]
        raise CostExceedsCapacity(limit.name, costs[index], limit.capacity)
    if status == AcquireStatus.OTHER_LEASE:
        raise RequestError(
            f"acquisition {acquisition_id!r} already holds a lease on other limits or "
            "keys: an id names one acquisition"
        )
    if status == AcquireStatus.VOIDED_BY_HOLD:
        # The caller gives the lease up (settles it) and comes back when the hold ends.
        index = int(reply[1]) - 1
        retry_after_s = held_s(float(reply[2]) / 1e6)
        voided = Acquisition(str(acquisition_id), tuple(costs), tuple(pairs), own_keys)
        state = LimitState(pairs[index][0].name, False, 0.0, retry_after_s, 0.0)
        return Decision(False, 0.0, retry_after_s, 0.0, 0.0, (state,), voided, held=True)
    if status == AcquireStatus.REDELIVERED:
        # The lease's own costs, not this call's.
        wait_s = float(reply[2]) / 1e6
        held_costs = tuple(float(c) for c in reply[4 : 4 + n])
        held = Acquisition(str(acquisition_id), held_costs, tuple(pairs), own_keys)
        late_s = float(reply[3]) / 1e6
        return Decision(True, 0.0, 0.0, 0.0, wait_s, (), held, held=True, late_s=late_s)
    raise BackendError(f"unexpected reply of lua/acquire.lua: {raw[:100]!r}")


def _decided(
    raw: bytes,
    pairs: Sequence[tuple[Limit, str | None]],
    costs: Sequence[float],
    acquisition_id: str | None,
    own_keys: tuple[str, ...],
) -> Decision:
    """The Decision of a DECIDED reply of lua/acquire.lua: 4 + 4n packed doubles."""
    n = len(pairs)
    values = _unpack_doubles(raw, 4 + 4 * n)
    allowed = values[1] == 1.0
    acquisition = None
    if allowed and acquisition_id is not None:
        acquisition = Acquisition(acquisition_id, tuple(costs), tuple(pairs), own_keys)
    states = tuple(
        [
            _new(
                LimitState,
                (
                    pairs[i][0].name,
                    values[4 * i + 4] == 1.0,
                    values[4 * i + 5],
                    held_s(values[4 * i + 6] / 1e6),
                    values[4 * i + 7] / 1e6,
                ),
            )
            for i in range(n)
        ]
    )
    if n == 1:
        remaining, reset_after_s = states[0].remaining, states[0].reset_after_s
    else:
        remaining = min([state.remaining for state in states])
        reset_after_s = max([state.reset_after_s for state in states])
    return Decision(
        allowed,
        remaining,
        held_s(values[3] / 1e6),
        reset_after_s,
        values[2] / 1e6,
        states,
        acquisition,
    )


def peek_state(name: str, raw: bytes) -> LimitState:
    """The state of limit ``name`` in a reply of ``lua/peek.lua`` on that one limit (text:
    '0 allowed remaining retry_after_us reset_us')."""
    reply = raw.split()
    return LimitState(
        name,
        int(reply[1]) == 1,
        float(reply[2]),
        held_s(float(reply[3]) / 1e6),
        float(reply[4]) / 1e6,
    )


def settlement(raw: bytes) -> Settlement:
    """The Settlement of a reply of ``lua/settle.lua``: its code, then one delta per limit
    when settled."""
    reply = raw.split()
    deltas = tuple(float(delta) for delta in reply[1:])
    return Settlement(_SETTLE_STATUS[int(reply[0])], deltas)


def holds(reply: list[Any]) -> dict[tuple[str, str | None], float]:
    """The holds of a reply of ``lua/holds.lua`` ({now_us, field, until_us, ...}): (limit,
    key or None) -> seconds left (``inf``: a pause)."""
    now_us = int(reply[0])
    return {
        decode_hold_field(reply[i].decode()): held_s((float(reply[i + 1]) - now_us) / 1e6)
        for i in range(1, len(reply), 2)
    }
