"""The hot path's round trip: a command on a connection the limiter keeps for itself.

Besides the round trip, redis-py's ``Redis.execute_command`` does on every command: it
takes a connection from the pool under a lock, checks the process id twice, wraps the call
in its retries and its observability hooks (timers, metrics), packs the command in Python
around hiredis, and puts the connection back. Measured on the project's 2-core VM, that
more than doubles the client's CPU for one ``FCALL`` (29 us against 13 us here, on an
idle loopback Redis), paid by every throttled task in its pool child.

:class:`DirectCalls` sends a command on a connection of its own instead: taken from the
client's pool once (the same host, credentials, database, TLS, RESP version, Sentinel's
master lookup and retry policy as the client's), kept in a list of idle connections, and
used again by the next call. What keeps it as safe as the pool:

* an idle connection is checked before use as the pool checks one it hands out (a
  zero-timeout read, about 1 us): one the server closed while it sat idle (a restart, an
  idle ``timeout``) or that holds stray data is replaced before the command is sent;
* a connection is put back only after a whole reply was read (a result, or an error
  reply such as a missing function). Any other way out of a call (a timeout, a lost
  connection, an exception raised into the call between its write and its read, such as
  Celery's soft time limit) disconnects it, so no call can ever read an earlier call's
  reply, and puts it back disconnected: it connects again when next used (a connection
  dropped instead would stay counted as in use by the pool, which runs out);
* a process forked from one that made calls drops the idle connections it inherited
  (``os.register_at_fork``): a socket is never shared by two processes;
* a call that fails with an error of the connection's retry policy is retried as the
  client would retry it (reconnecting first);
* the connections stay the pool's, counted as in use: ``client.close()`` (and
  ``connection_pool.disconnect()``) closes them too; a call after that reconnects.

Threads and greenlets each take their own idle connection (``list.pop`` and ``append``
are atomic), so the list holds as many connections as calls ran at once. Every limiter on
one pool shares its list (:func:`direct_calls`).

Used for a plain :class:`redis.Redis` on a :class:`redis.ConnectionPool` (or Sentinel's)
speaking RESP2, without client-side caching or a single connection
(:func:`direct_calls` returns None otherwise, and the client's own path is used).
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.exceptions import DataError, ResponseError
from redis.sentinel import SentinelConnectionPool

__all__ = ["DirectCalls", "direct_calls"]

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # the [hiredis] extra is not installed
    _hiredis_pack = None

# redis-py before 5.3 asks for a command name when checking a connection out; later
# versions warn when given one.
_NAMED_CHECKOUT = tuple(map(int, re.findall(r"\d+", redis.__version__)[:2])) < (5, 3)

_BY_POOL: weakref.WeakKeyDictionary[redis.ConnectionPool, DirectCalls] = weakref.WeakKeyDictionary()
"""The one :class:`DirectCalls` of each pool: limiters made on one client share its
connections (a limiter per call must not check out a connection each)."""


def _forget_after_fork() -> None:
    for calls in list(_BY_POOL.values()):
        calls.idle = []


os.register_at_fork(after_in_child=_forget_after_fork)


def _packer(pool: redis.ConnectionPool) -> Callable[[tuple[Any, ...]], list[bytes]] | None:
    """hiredis's packer, when it packs commands exactly as ``pool``'s connections do: in C,
    a few us less than their ``pack_command``. None otherwise (no hiredis; a redis-py that
    packs in Python with a client's other encoding): their ``pack_command`` then."""
    pack = _hiredis_pack
    if pack is None:
        return None
    sample = ("ECHO", "\u00e9", 0.1, 1e300, 10**20, -3, b"\x00")
    try:
        probe = pool.connection_class(**pool.connection_kwargs)  # not connected
        same = b"".join(probe.pack_command(*sample)) == pack(sample)
    except Exception:  # a connection class of the user's that cannot be made so
        return None
    if not same:
        return None

    def packed(command: tuple[Any, ...]) -> list[bytes]:
        try:
            return [pack(command)]
        except TypeError as exc:  # a bad argument, in the words of redis-py's packer
            raise DataError(str(exc)) from exc

    return packed


class DirectCalls:
    """Commands sent on connections taken once from ``pool`` and kept (see the module)."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.pool = pool
        self._pack = _packer(pool)
        # redis-py's connections (untyped): connected, or disconnected by client.close();
        # never one in the middle of a call.
        self.idle: list[Any] = []

    def __call__(self, *command: Any) -> Any:
        """Send ``command`` (its name, then its arguments) and return its reply, parsed
        by the connection as the client would (without the client's response callbacks:
        for FCALL there are none). Raises redis-py's errors, as the client does."""
        idle = self.idle
        conn = self._idle()
        pack = self._pack
        try:
            packed = pack(command) if pack is not None else conn.pack_command(*command)
        except BaseException:
            idle.append(conn)  # nothing was sent on it
            raise

        def once() -> Any:
            conn.send_packed_command(packed)
            return conn.read_response()

        try:
            reply = conn.retry.call_with_retry(once, lambda _error: conn.disconnect())
        except ResponseError:
            # An error reply, read whole: the connection is clean.
            idle.append(conn)
            raise
        except BaseException:
            conn.disconnect()  # what it would read next is unknown
            idle.append(conn)  # still the pool's: it connects again when next used
            raise
        idle.append(conn)
        return reply

    def each(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Send ``commands`` in one write and read their replies in order (a pipeline
        without MULTI: one round trip, each command on its own). A command that fails on
        the server has its ``ResponseError`` in its place; every reply is read whatever
        came before, so the connection goes back clean. Anything else (a lost connection)
        raises for all, and is not retried: which of the commands ran is not known."""
        if not commands:
            return []
        idle = self.idle
        conn = self._idle()
        pack = self._pack
        try:
            packed: list[bytes] = []
            for command in commands:
                packed.extend(pack(command) if pack is not None else conn.pack_command(*command))
        except BaseException:
            idle.append(conn)  # nothing was sent on it
            raise

        replies: list[Any] = []
        try:
            conn.send_packed_command(packed)
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:  # read whole: the next reply follows it
                    replies.append(exc)
        except BaseException:
            conn.disconnect()
            idle.append(conn)
            raise
        idle.append(conn)
        return replies

    def _idle(self) -> Any:
        """A connection ready to send, checked as the pool checks one it hands out: an
        idle one that was disconnected (an error, ``client.close()``) connects now, and
        a Redis that cannot be reached fails the call here, after the connect's own
        retries; one that the server closed while it sat idle (a restart, an idle
        timeout) or that holds stray data is replaced (a zero-timeout read, about 1 us).
        A new connection when none is idle."""
        try:
            conn = self.idle.pop()
        except IndexError:
            return self._connection()
        try:
            if getattr(conn, "_sock", True) is not None:  # connected (redis-py's mark)
                try:
                    if not conn.can_read():
                        return conn
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    pass
                conn.disconnect()  # closed by the server while idle, or stray data
            conn.connect()
        except BaseException:
            self.idle.append(conn)
            raise
        return conn

    def _connection(self) -> Any:
        """A new connection of the pool's (connected and checked), checked out of it for
        good."""
        if _NAMED_CHECKOUT:
            return self.pool.get_connection("FCALL")
        return self.pool.get_connection()


def direct_calls(client: object) -> DirectCalls | None:
    """The :class:`DirectCalls` of ``client``'s pool (one per pool), or None when the
    client's own path must be kept: anything but a plain ``redis.Redis`` on a
    ``ConnectionPool`` or ``SentinelConnectionPool`` (a cluster, a blocking pool, which
    would run out of the connections kept here, the asyncio client), a single-connection
    client, client-side caching, or RESP3 (whose push messages the client handles)."""
    if type(client) is not redis.Redis or client.connection is not None:
        return None
    pool = client.connection_pool
    if type(pool) not in (redis.ConnectionPool, SentinelConnectionPool):
        return None
    if getattr(pool, "cache", None) is not None:
        return None
    if str(pool.connection_kwargs.get("protocol") or 2) != "2":
        return None
    calls = _BY_POOL.get(pool)
    if calls is None:
        calls = _BY_POOL.setdefault(pool, DirectCalls(pool))
    return calls
