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
calls the algorithm's ``check`` and ``commit`` directly (see ``prelude.lua``), and so does
``acquire_series.lua``, several asks of one limit and key in one call. The
operations of the parking lot (``park.lua``, ``claim_parked.lua``, ``commit_parked.lua``,
``accept_parked.lua``: :mod:`throttle.parking`) use no algorithm: each is sent after the
same cut prelude (:func:`operation_source`).

Scripts are registered as redis-py :class:`~redis.commands.core.Script` objects, which
call EVALSHA and reload the script on NOSCRIPT (after ``SCRIPT FLUSH`` or a restart).

On Redis 7 and later the limiter's operations are one Redis *function library* instead
(:func:`library_source`, loaded once with ``FUNCTION LOAD`` and called with ``FCALL``; see
:mod:`throttle.redis.library`): the same files, composed once, so that the functions and
tables of the prelude and of every algorithm are created when the library loads rather
than on every call, which is what a script sent with EVALSHA pays for on each call.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = [
    "ALGORITHM_FILES",
    "LIBRARY_OPERATIONS",
    "ONE_LIMIT_OPERATION",
    "ONE_LIMIT_OPERATIONS",
    "SERIES_OPERATION",
    "SEVERAL_LIMITS_ONLY",
    "function_name",
    "library_name",
    "library_source",
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
SERIES_OPERATION = "acquire_series"
"""The operation of several asks of one limit and key, each on its own
(:meth:`throttle.Limiter.acquire_each`; not for concurrency or fair limits)."""
ONE_LIMIT_OPERATIONS = (ONE_LIMIT_OPERATION, SERIES_OPERATION)
"""The operations of one algorithm's limit (not conc or fair), sent cut as
``acquire_one.lua`` is, and held by the library once per algorithm."""

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
    if operation in ONE_LIMIT_OPERATIONS:
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


LIBRARY_OPERATIONS = ("acquire", "settle", "peek", "hold", "holds", "space")
"""The operations of the limiter that the function library holds besides ``acquire_one``
(one per algorithm that runs it): every call :class:`throttle.limiter.RequestBuilder`
builds. The parking lot's and the learned rates' operations stay scripts (EVALSHA): they
run once per parked task or per upstream answer, not per acquire."""

# Each operation's body runs inside a function of the library. KEYS and ARGV are the
# library's locals (a function gets them as arguments, not as globals), and FENCE, which an
# EVAL script starts at 0 on every call, is set back to 0: it outlives the call here. The
# prelude's locals of the globals are bound on the first call (see prelude.lua).
_FUNCTION = """redis.register_function('{name}', function(keys, args)
KEYS, ARGV, FENCE = keys, args, 0
if not struct then
  bind_globals()
end
{body}
end)"""


@functools.cache
def _library() -> tuple[str, str]:
    """(name, source) of the function library."""
    parts = ["local KEYS, ARGV", _read("prelude.lua")]
    bodies: list[tuple[str, str]] = []
    for code, name in sorted(ALGORITHM_FILES.items()):
        parts.append(_read(name))
        if code not in ("conc", "fair"):
            # Right after its algorithm's file: the one-limit bodies call that file's check
            # and commit, as in their scripts.
            parts.extend(
                _FUNCTION.format(name=f"{{lib}}_{operation}_{code}", body=_read(f"{operation}.lua"))
                for operation in ONE_LIMIT_OPERATIONS
            )
    for operation in LIBRARY_OPERATIONS:
        bodies.append((operation, _read(f"{operation}.lua")))
    parts.extend(_FUNCTION.format(name=f"{{lib}}_{op}", body=body) for op, body in bodies)
    body = "\n".join(parts)
    # Named after its content: libraries of different versions of the package live side
    # by side in one Redis, and a library of this name is this code.
    name = "throttle_" + hashlib.sha1(body.encode()).hexdigest()[:16]
    return name, f"#!lua name={name}\n" + body.replace("{lib}", name)


def library_name() -> str:
    """The name of the function library (``throttle_`` and a hash of its source)."""
    return _library()[0]


def library_source() -> str:
    """The source of the function library, for ``FUNCTION LOAD``: ``prelude.lua``, every
    algorithm's file (each followed by its ``acquire_one`` and ``acquire_series``
    functions, which call that file's ``check`` and ``commit``), then a function per operation of
    :data:`LIBRARY_OPERATIONS`, each the operation's file as its body."""
    return _library()[1]


@functools.cache
def function_name(operation: str, code: str | None = None) -> str:
    """The library's function of ``operation`` (``acquire_one`` or ``acquire_series`` of
    algorithm ``code``)."""
    if operation in ONE_LIMIT_OPERATIONS:
        if code not in ALGORITHM_FILES or code in ("conc", "fair"):
            raise ValueError(f"{operation} takes one algorithm other than conc and fair")
        return f"{library_name()}_{operation}_{code}"
    if operation not in LIBRARY_OPERATIONS:
        raise ValueError(f"the library has no operation {operation!r}")
    return f"{library_name()}_{operation}"
