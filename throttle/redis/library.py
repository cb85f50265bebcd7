"""The limiter's operations as Redis functions (``FCALL``), or as scripts (``EVALSHA``).

On Redis 7 and later, :func:`throttle.redis.scripts.library_source` is loaded once with
``FUNCTION LOAD`` and each operation is called with ``FCALL``: the prelude, the algorithms
and their registry are built when the library loads, where a script sent with EVALSHA
rebuilds every function and table it defines on each call (the larger part of a
multi-limit acquire's own server time). A :class:`Routine` is one operation; it knows both
ways to call it, and its :class:`Library` knows which one this Redis takes:

* unknown yet (``functions is None``): the first call tries ``FCALL``;
* ``FCALL`` answers that the function is missing (a new Redis, one restarted without its
  data, ``FUNCTION FLUSH``): the library is loaded (``FUNCTION LOAD``; a library of the
  same name loaded meanwhile by another worker is this code, as the name is a hash of it)
  and the call sent again, as redis-py's ``Script`` does on NOSCRIPT;
* Redis refuses ``FCALL`` or ``FUNCTION LOAD`` as an unknown command (Redis 5 and 6) or
  by its ACL (``NOPERM``): the scripts from then on, by EVALSHA (``functions = False``).

A Redis Cluster client (and any client that is not ``redis.Redis``, such as the in-memory
:class:`throttle.memory.MemoryRedis`) always uses the scripts: redis-py's cluster client
finds the keys of an ``FCALL`` by asking a node (``COMMAND GETKEYS``), one more round trip
per call, where it reads an EVALSHA's keys from its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import redis
import redis.asyncio
from redis.exceptions import NoPermissionError, ResponseError

from throttle.redis.scripts import library_source

__all__ = ["Library", "Routine"]

_S = TypeVar("_S")
"""The script of a routine: redis-py's ``Script``, its ``AsyncScript``, or a stand-in."""


class Library:
    """Whether a client calls the limiter's functions (``FCALL``) or its scripts.

    ``functions``: None until the first call has told, then True (the library is on
    this Redis, or was loaded) or False (this Redis or its ACL does not take functions:
    scripts only)."""

    def __init__(self, client: object) -> None:
        self.functions: bool | None = (
            None if isinstance(client, (redis.Redis, redis.asyncio.Redis)) else False
        )
        self.source = library_source()

    def refused(self, exc: ResponseError) -> bool:
        """Whether ``exc`` (from ``FCALL`` or ``FUNCTION LOAD``) says that this Redis or
        this user does not take functions: then scripts from now on. A refusal of
        anything else (a key outside the user's ACL, say) is not one."""
        message = str(exc).lower()
        if isinstance(exc, NoPermissionError):
            # "... no permissions to run the 'fcall' command" (or 'function|load'); not
            # a key outside the user's patterns, nor a command a function calls
            refused = "run the 'fcall'" in message or "run the 'function|" in message
        else:
            # "unknown command 'FCALL', with args ..." (Redis 6 quotes it `FCALL`)
            command = message.partition(",")[0]
            refused = command.startswith("unknown command") and (
                "fcall" in command or "function" in command
            )
        if refused:
            self.functions = False
        return refused

    @staticmethod
    def missing(exc: ResponseError) -> bool:
        """Whether ``exc`` (from ``FCALL``) says the function is not loaded."""
        return "function not found" in str(exc).lower()

    @staticmethod
    def exists(exc: ResponseError) -> bool:
        """Whether ``exc`` (from ``FUNCTION LOAD``) says the library is there already:
        loaded by another client since (its name is the hash of its code)."""
        return "already exists" in str(exc).lower()


@dataclass(frozen=True, slots=True)
class Routine(Generic[_S]):
    """One operation: the library's function ``function``, or ``script`` (EVALSHA)."""

    library: Library
    function: str
    script: _S
