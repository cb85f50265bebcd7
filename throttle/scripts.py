"""Loading the Lua scripts of ``lua/``, the only copy of each.

A script sent to Redis is ``prelude.lua`` + the file of each algorithm the call uses +
the operation file (``acquire.lua`` or ``settle.lua``). Each algorithm's arithmetic is
written once; a single-limit call carries only its own algorithm (EVAL re-creates every
function of a script on each call, so unused ones would cost server time); and a
multi-limit acquisition over several algorithms still runs as one atomic script.

The common call, one limit and no acquisition id, runs ``acquire_one.lua`` instead: sent
after the algorithm's file without that file's last line, the ``ALGO[code] = {...}``
registration that only the drivers of several limits need, it calls the algorithm's
``check`` and ``commit`` directly (see ``prelude.lua``).

Scripts are registered as redis-py :class:`~redis.commands.core.Script` objects, which
call EVALSHA and reload the script on NOSCRIPT (after ``SCRIPT FLUSH`` or a restart).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

__all__ = ["ALGORITHM_FILES", "ONE_LIMIT_OPERATION", "lua_dir", "script_source"]

# Algorithm code (as sent in ARGV) -> the file that defines ALGO[code].
ALGORITHM_FILES = {
    "tb": "token_bucket.lua",
    "gcra": "gcra.lua",
    "fw": "fixed_window.lua",
    "sw": "sliding_window.lua",
    "conc": "concurrency.lua",
}
ONE_LIMIT_OPERATION = "acquire_one"
"""The operation of one limit without an acquisition id (not for concurrency limits)."""

# The last line of every algorithm file: ALGO.<code> = {nkeys = ..., check = check, ...}
_REGISTRATION = re.compile(r"^ALGO\.(?P<code>\w+) = \{[^\n]*\}\s*\Z", re.MULTILINE)


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


def _unregistered(code: str) -> str:
    """An algorithm's file without its closing ``ALGO[code] = {...}`` line."""
    name = ALGORITHM_FILES[code]
    source = _read(name)
    match = _REGISTRATION.search(source)
    if match is None or match["code"] != code:
        raise ValueError(f"{name} must end with its one-line registration ALGO.{code} = {{...}}")
    return source[: match.start()]


@functools.cache
def script_source(operation: str, codes: frozenset[str]) -> str:
    """The source of an operation (``"acquire"``, ``"settle"``, or ``"acquire_one"`` for
    exactly one algorithm) over the algorithms named by ``codes`` (``{"tb"}``,
    ``{"tb", "gcra", "fw"}``...)."""
    if operation == ONE_LIMIT_OPERATION:
        if len(codes) != 1 or "conc" in codes:
            raise ValueError(f"{operation} takes one algorithm other than conc (got {codes})")
        (code,) = codes
        parts = [_read("prelude.lua"), _unregistered(code), _read(f"{operation}.lua")]
    else:
        files = [ALGORITHM_FILES[code] for code in sorted(codes)]
        parts = [_read(name) for name in ["prelude.lua", *files, f"{operation}.lua"]]
    return "\n".join(parts)
