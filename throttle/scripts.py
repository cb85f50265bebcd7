"""Loading the Lua scripts of ``lua/``, the only copy of each.

A script sent to Redis is ``prelude.lua`` + the file of each algorithm the call uses +
the operation file (``acquire.lua`` or ``settle.lua``). Each algorithm's arithmetic is
written once; a single-limit call carries only its own algorithm (EVAL re-creates every
function of a script on each call, so unused ones would cost server time); and a
multi-limit acquisition over several algorithms still runs as one atomic script.
Scripts are registered as redis-py :class:`~redis.commands.core.Script` objects, which
call EVALSHA and reload the script on NOSCRIPT (after ``SCRIPT FLUSH`` or a restart).
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["ALGORITHM_FILES", "lua_dir", "operation_source", "script_source"]

# Algorithm code (as sent in ARGV) -> the file that defines ALGO[code].
ALGORITHM_FILES = {
    "tb": "token_bucket.lua",
    "gcra": "gcra.lua",
    "fw": "fixed_window.lua",
    "sw": "sliding_window.lua",
    "conc": "concurrency.lua",
}


@functools.cache
def lua_dir() -> Path:
    """The directory holding the scripts: inside the installed wheel, or the checkout's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "lua", here.parent / "lua"):
        if (candidate / "prelude.lua").is_file():
            return candidate
    raise FileNotFoundError(
        f"the Lua scripts are missing: neither {here / 'lua'} nor {here.parent / 'lua'} "
        "holds prelude.lua"
    )


@functools.cache
def _read(name: str) -> str:
    return (lua_dir() / name).read_text(encoding="utf-8")


@functools.cache
def script_source(operation: str, codes: frozenset[str]) -> str:
    """The source of an operation (``"acquire"`` or ``"settle"``) over the algorithms
    named by ``codes`` (``{"tb"}``, ``{"tb", "gcra", "fw"}``...)."""
    files = [ALGORITHM_FILES[code] for code in sorted(codes)]
    return "\n".join(_read(name) for name in ["prelude.lua", *files, f"{operation}.lua"])


@functools.cache
def operation_source(operation: str) -> str:
    """The source of an operation that uses no algorithm (``"park"``, ``"claim_parked"``...):
    the prelude (for the clock) and the operation file."""
    return "\n".join(_read(name) for name in ["prelude.lua", f"{operation}.lua"])
