"""A limit's arguments to the Lua scripts, and the argument of a hold until lifted.

Every script that runs a limit's algorithm reads it as four ARGV values (see the header of
``lua/acquire.lua``): the algorithm's code, the count, the period in us and the burst (the
capacity). They are sent as bytes, which redis-py passes on as they are: encoded once per
:class:`~throttle.spec.Limit` and kept with it, since the hot path sends them on every call.
"""

from __future__ import annotations

from typing import TypeAlias

from throttle.spec import Limit

__all__ = ["HOLD_FOREVER_US", "LimitArgs", "limit_args", "target_args"]

HOLD_FOREVER_US = 10**18
"""A hold until lifted (a pause) is sent to ``lua/hold.lua`` as a hold of this many us
(about 31,700 years; a reply that long reads as ``inf``: see
:data:`throttle.redis.replies.HELD_FOREVER_S`)."""

LimitArgs: TypeAlias = tuple[bytes, bytes, bytes, bytes]
"""code, count, period_us, burst: a limit's ARGV values, in the scripts' order."""


def limit_args(limit: Limit) -> LimitArgs:
    """``limit``'s ARGV values (:data:`LimitArgs`), encoded on the first call for it.

    Numbers are written with ``repr``: the shortest text that reads back as the same double,
    so the script computes with exactly the limit's values."""
    args: LimitArgs | None = limit._wire
    if args is None:
        args = (
            limit.code.encode(),
            repr(limit.count).encode(),
            repr(limit.period_s * 1e6).encode(),
            repr(limit.capacity).encode(),
        )
        # Limit is frozen; this slot is the one it keeps for this module (see spec.py).
        object.__setattr__(limit, "_wire", args)
    return args


def target_args(limit: Limit, key: str | None) -> LimitArgs:
    """``limit``'s ARGV values for ``key``: :func:`limit_args`, but for a fair limit, whose
    count is the key's weight ``w`` and period ``w / rate`` (lua/fair.lua): count / period
    stays the limit's rate, and the weight of the key rides in the pair."""
    if not limit.fair:
        return limit_args(limit)
    code, _, _, burst = limit_args(limit)
    weight = limit.weight(key) if key is not None else 1.0
    period_us = limit.period_s * 1e6 * weight / limit.count
    return code, repr(weight).encode(), repr(period_us).encode(), burst
