"""A limit's arguments to the Lua scripts, and the argument of a hold until lifted.

Every script that runs a limit's algorithm reads its code and three numbers: the count, the
period in us and the burst (the capacity). ``lua/settle.lua`` and ``lua/peek.lua`` take
them as four ARGV values of text (:func:`limit_args`); ``lua/acquire.lua`` takes the code
alone and the numbers packed as doubles with every other limit's and the costs
(:func:`target_numbers`, :func:`pack_numbers`; see its header). Both are computed once per
:class:`~throttle.spec.Limit` and kept with it, since the hot path sends them on every
call; both give the script the same doubles.
"""

from __future__ import annotations

import functools
import struct
from typing import TypeAlias

from throttle.spec import Limit

__all__ = [
    "HOLD_FOREVER_US",
    "LimitArgs",
    "LimitNumbers",
    "limit_args",
    "pack_numbers",
    "target_args",
    "target_numbers",
]

HOLD_FOREVER_US = 10**18
"""A hold until lifted (a pause) is sent to ``lua/hold.lua`` as a hold of this many us
(about 31,700 years; a reply that long reads as ``inf``: see
:data:`throttle.redis.replies.HELD_FOREVER_S`)."""

LimitArgs: TypeAlias = tuple[bytes, bytes, bytes, bytes]
"""code, count, period_us, burst: a limit's ARGV values, in the scripts' order."""

LimitNumbers: TypeAlias = tuple[float, float, float]
"""count, period_us, burst: the doubles that a script reads from :data:`LimitArgs`."""


def _wire(limit: Limit) -> tuple[LimitArgs, LimitNumbers]:
    """``limit``'s :data:`LimitArgs` and :data:`LimitNumbers`, computed on the first call."""
    wire: tuple[LimitArgs, LimitNumbers] | None = limit._wire
    if wire is None:
        count, period_us, burst = limit.count, limit.period_s * 1e6, limit.capacity
        # repr: the shortest text that reads back as the same double, so the script
        # computes with exactly the limit's values, as it does from the packed doubles.
        args = (
            limit.code.encode(),
            repr(count).encode(),
            repr(period_us).encode(),
            repr(burst).encode(),
        )
        wire = args, (float(count), float(period_us), float(burst))
        # Limit is frozen; this slot is the one it keeps for this module (see spec.py).
        object.__setattr__(limit, "_wire", wire)
    return wire


def limit_args(limit: Limit) -> LimitArgs:
    """``limit``'s ARGV values (:data:`LimitArgs`), encoded on the first call for it."""
    return _wire(limit)[0]


def target_args(limit: Limit, key: str | None) -> LimitArgs:
    """``limit``'s ARGV values for ``key``: :func:`limit_args`, but for a fair limit, whose
    count is the key's weight ``w`` and period ``w / rate`` (lua/fair.lua): count / period
    stays the limit's rate, and the weight of the key rides in the pair."""
    if not limit.fair:
        return limit_args(limit)
    code, _, _, burst = limit_args(limit)
    weight, period_us = _fair_pair(limit, key)
    return code, repr(weight).encode(), repr(period_us).encode(), burst


def target_numbers(limit: Limit, key: str | None) -> LimitNumbers:
    """The numbers of :func:`target_args`, as the doubles the script reads from them."""
    if not limit.fair:
        return _wire(limit)[1]
    weight, period_us = _fair_pair(limit, key)
    return float(weight), period_us, _wire(limit)[1][2]


def _fair_pair(limit: Limit, key: str | None) -> tuple[float, float]:
    """A fair limit's count and period_us for ``key``: its weight, and weight / rate."""
    weight = limit.weight(key) if key is not None else 1.0
    return weight, limit.period_s * 1e6 * weight / limit.count


@functools.cache
def _packer(n: int) -> struct.Struct:
    return struct.Struct(f"<{4 * n}d")


def pack_numbers(numbers: list[float]) -> bytes:
    """``lua/acquire.lua``'s ARGV of numbers: count, period_us, burst and cost of each limit
    in turn (``numbers``, 4 per limit), packed as little-endian doubles."""
    return _packer(len(numbers) // 4).pack(*numbers)
