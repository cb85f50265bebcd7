"""Loading the Lua scripts of ``lua/``, the only copy of each.

An operation script sent to Redis is ``prelude.lua`` + every algorithm file + the
operation file (``acquire.lua`` or ``settle.lua``): each algorithm's arithmetic is written
once and a multi-limit acquisition over several algorithms still runs as one atomic
script. Scripts are registered as redis-py :class:`~redis.commands.core.Script` objects,
which call EVALSHA and reload the script on NOSCRIPT (after ``SCRIPT FLUSH`` or a restart).
"""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["ALGORITHM_FILES", "lua_dir", "script_source"]

ALGORITHM_FILES = (
    "token_bucket.lua",
    "gcra.lua",
    "fixed_window.lua",
    "sliding_window.lua",
    "concurrency.lua",
)


@functools.cache
def lua_dir() -> Path:
    """The directory holding the scripts: inside the installed wheel, or the checkout's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "lua", here.parent / "lua"):
        if (candidate / "prelude.lua").is_file():
            return candidate
    raise FileNotFoundError(f"the Lua scripts are missing: neither {here / 'lua'} nor "
                            f"{here.parent / 'lua'} holds prelude.lua")  # fmt: skip


@functools.cache
def script_source(operation: str) -> str:
    """The full source of an operation script (``"acquire"`` or ``"settle"``)."""
    directory = lua_dir()
    parts = ["prelude.lua", *ALGORITHM_FILES, f"{operation}.lua"]
    return "\n".join((directory / part).read_text(encoding="utf-8") for part in parts)
