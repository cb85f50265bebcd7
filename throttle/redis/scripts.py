"""Loading the Lua scripts of ``lua/``, the only copy of each.

A script sent to Redis is ``prelude.lua`` + the file of each algorithm the call uses +
the operation file (``acquire.lua`` or ``settle.lua``). Each algorithm's arithmetic is
written once; a single-limit call carries only its own algorithm (EVAL re-creates every
function of a script on each call, so unused ones would cost server time); and a
multi-limit acquisition over several algorithms still runs as one atomic script.

The common call, one limit and no acquisition id, runs ``acquire_one.lua`` instead, after
``prelude.lua`` and the algorithm's file each cut at the line :data:`SEVERAL_LIMITS_ONLY`:
what follows it (the ``ALGO`` registry, the per-limit record, each algorithm's
``ALGO[code]`` entry and its ``adjust``) serves only the drivers of several limits, and a
script pays for every table and function it creates on each call. ``acquire_one.lua``
calls the algorithm's ``check`` and ``commit`` directly (see ``prelude.lua``). The
operations of the parking lot (``park.lua``, ``claim_parked.lua``, ``commit_parked.lua``,
``accept_parked.lua``: :mod:`throttle.parking`) use no algorithm: each is sent after the
same cut prelude (:func:`operation_source`).

Scripts are registered as redis-py :class:`~redis.commands.core.Script` objects, which
call EVALSHA and reload the script on NOSCRIPT (after ``SCRIPT FLUSH`` or a restart).
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = [
    "ALGORITHM_FILES",
    "ONE_LIMIT_OPERATION",
    "SEVERAL_LIMITS_ONLY",
    "lua_dir",
    "operation_source",
    "script_source",
]

# Algorithm code (as sent in ARGV) -> the file that defines ALGO[code].
ALGORITHM_FILES = {
    "tb": "token_bucket.lua",
    "gcra": "gcra.lua",
    "fw": "fixed_window.lua",
    "sw": "sliding_window.lua",
    "conc": "concurrency.lua",
    "fair": "fair.lua",
}
ONE_LIMIT_OPERATION = "acquire_one"
"""The operation of one limit without an acquisition id (not for concurrency limits)."""

SEVERAL_LIMITS_ONLY = (
    "-- ==== several limits only: acquire_one.lua is sent without the rest of this file ===="
)
"""The line, once in ``prelude.lua`` and in each algorithm file, where the one-limit script
stops reading that file."""


@functools.cache
def lua_dir() -> Path:
    """The directory holding the scripts: inside the installed wheel (``throttle/lua``, see
    pyproject.toml), or the checkout's top-level ``lua/``."""
    package = Path(__file__).resolve().parent.parent
    candidates = (package / "lua", package.parent / "lua")
    for candidate in candidates:
        if (candidate / "prelude.lua").is_file():
            return candidate
    raise FileNotFoundError(
        f"the Lua scripts are missing: neither {candidates[0]} nor {candidates[1]} "
        "holds prelude.lua"
    )


@functools.cache
def _read(name: str) -> str:
    return (lua_dir() / name).read_text(encoding="utf-8")


def _one_limit_part(name: str) -> str:
    """A file up to its :data:`SEVERAL_LIMITS_ONLY` line."""
    parts = _read(name).split(f"\n{SEVERAL_LIMITS_ONLY}\n")
    if len(parts) != 2:
        raise ValueError(f"{name} must hold the line {SEVERAL_LIMITS_ONLY!r} exactly once")
    return parts[0]


@functools.cache
def script_source(operation: str, codes: frozenset[str]) -> str:
    """The source of an operation (``"acquire"``, ``"settle"``, or ``"acquire_one"`` for
    exactly one algorithm) over the algorithms named by ``codes`` (``{"tb"}``,
    ``{"tb", "gcra", "fw"}``...)."""
    if operation == ONE_LIMIT_OPERATION:
        if len(codes) != 1 or codes & {"conc", "fair"}:
            raise ValueError(
                f"{operation} takes one algorithm other than conc and fair (got {codes})"
            )
        (code,) = codes
        parts = [
            _one_limit_part("prelude.lua"),
            _one_limit_part(ALGORITHM_FILES[code]),
            _read(f"{operation}.lua"),
        ]
    else:
        files = [ALGORITHM_FILES[code] for code in sorted(codes)]
        parts = [_read(name) for name in ["prelude.lua", *files, f"{operation}.lua"]]
    return "\n".join(parts)


@functools.cache
def operation_source(operation: str) -> str:
    """The source of an operation that uses no algorithm (``"park"``, ``"claim_parked"``...):
    the prelude up to its :data:`SEVERAL_LIMITS_ONLY` line (the clock and helpers; not the
    registry of algorithms, which such a script would only build and drop on every call)
    and the operation file."""
    return "\n".join([_one_limit_part("prelude.lua"), _read(f"{operation}.lua")])
