"""The Redis client: its type, building one from a URL, and calling it with errors wrapped.

Every call the package makes to Redis goes through :func:`run_routine` (an operation of
the limiter: a Redis function, or its script), :func:`run_script` (a Lua script) or
:func:`wrap_errors` (any other command), so that a driver error always surfaces as
:class:`~throttle.errors.BackendUnavailable` (Redis cannot serve now) or
:class:`~throttle.errors.BackendError` (Redis refused the call), never as redis-py's own.
Their asyncio twins, for ``redis.asyncio`` (:mod:`throttle.aio`): :func:`run_routine_async`,
:func:`run_script_async`, :func:`wrap_errors_async` and :func:`async_client_from_url`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias, TypeVar, cast

import redis
import redis.asyncio
from redis.cluster import RedisCluster
from redis.commands.core import AsyncScript, Script
from redis.exceptions import (
    ClusterDownError,
    NoScriptError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
)

from throttle.errors import BackendError, BackendUnavailable, ConfigError
from throttle.redis.direct import DirectCalls
from throttle.redis.library import Library, Routine
from throttle.redis.urls import (
    async_sentinel_client,
    check_options,
    cluster_client,
    is_cluster_url,
    is_sentinel_url,
    parse_sentinel_url,
    redact,
    sentinel_client,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RedisClient",
    "async_client_from_url",
    "check_client",
    "client_from_url",
    "run_routine",
    "run_routine_async",
    "run_script",
    "run_script_async",
    "wrap_errors",
    "wrap_errors_async",
]

_T = TypeVar("_T")

RedisClient: TypeAlias = redis.Redis | RedisCluster
"""The clients a limiter works with: one Redis server, or a Redis Cluster."""

DEFAULT_TIMEOUT_S = 5.0
"""Socket timeouts of :func:`client_from_url`: a hung Redis must not block a worker."""
DEFAULT_MAX_CONNECTIONS = 1000
"""The connection pool's size of :func:`client_from_url` (one server, or Sentinel's
master; a Redis Cluster keeps redis-py's per node), unless the URL or the options say
otherwise: redis-py's default, 100, raises
"Too many connections" beyond (read as Redis unreachable), which a gevent or threads pool
of 100 slots reaches with the worker's own calls beside them. A connection is opened only
when that many calls run at once."""

# Errors that mean "Redis cannot serve this now" rather than "Redis refused this call": a
# cluster without a master for the slot (failing over, or never covered) is as unreachable
# as a server that refuses connections.
_UNAVAILABLE = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, SlotNotCoveredError)
_REFUSED = (redis.RedisError, RedisClusterException)


def _wrapped(exc: Exception) -> BackendError:
    """The package's error for a driver error (one of ``_REFUSED``)."""
    if isinstance(exc, redis.AuthenticationError):
        return BackendUnavailable(
            f"Redis refused the limiter's credentials: {_said(exc)} (check the user and "
            "password of the URL)"
        )
    if isinstance(exc, _UNAVAILABLE):
        return BackendUnavailable(f"Redis is unreachable: {_said(exc)}{_hint(exc)}")
    return BackendError(f"Redis refused a limiter call: {_said(exc)}{_hint(exc)}")


def _hint(exc: Exception) -> str:
    """What to do about a driver error that a configuration causes, or ''."""
    said = str(exc)
    if isinstance(exc, redis.exceptions.MovedError) or said.startswith(("MOVED ", "ASK ")):
        return " (a Redis Cluster node: use a redis+cluster:// URL)"
    if "NOAUTH" in said or "must be called with the client already authenticated" in said:
        return " (this Redis wants a password: redis://:PASSWORD@host:port/db)"
    if said == "Too many connections":  # redis-py's pool, full: no server was asked
        return (
            " (the client's connection pool is full, every connection in use by a call in "
            "flight: its max_connections, 1000 for a client built from a URL here, 100 for "
            "redis-py's own: pass max_connections=N, or make fewer calls at once)"
        )
    return ""


def _said(exc: Exception) -> str:
    """What a driver error says, without the client's repr that some append (redis-py's
    ``MasterNotFoundError``: "No master found for 'name' : <redis.client.Redis(<...>)>",
    a kilobyte of pool options)."""
    text = str(exc)
    head, sep, _ = text.partition(" : <redis.")
    return head if sep else text


def check_client(client: object) -> None:
    """Refuse, as a :class:`ConfigError`, a client the limiter cannot read replies from:
    one made with ``decode_responses=True``, which decodes every reply as text, where the
    limiter's scripts answer in bytes that are not (packed numbers). Use a client of its
    own, without the option (the rest of an application may keep its decoding one)."""
    get_encoder = getattr(client, "get_encoder", None)
    encoder = get_encoder() if callable(get_encoder) else None
    if getattr(encoder, "decode_responses", False):
        raise ConfigError(
            "the limiter reads its scripts' replies as bytes: give it a client made "
            "without decode_responses (a client of its own)",
            field="decode_responses", value=True,
        )  # fmt: skip


def client_from_url(url: str, **options: Any) -> RedisClient:
    """A client of the Redis at ``url``, with socket timeouts of :data:`DEFAULT_TIMEOUT_S`
    unless given in ``options``, so that a hung Redis raises :class:`BackendUnavailable`.

    ``redis://``, ``rediss://`` and ``unix://`` name one server
    (``redis.Redis.from_url``), ``redis+sentinel://`` a master behind Sentinel, and
    ``redis+cluster://`` a Redis Cluster (see :mod:`throttle.redis.urls`). No client opens a
    connection before the first call (a cluster's reads its slot map then:
    :class:`throttle.redis.urls.LazyCluster`), so an unreachable Redis makes the calls, not
    this, raise :class:`BackendUnavailable`. A malformed Sentinel or cluster URL raises
    :class:`ConfigError` here.
    """
    check_options(url)
    options.setdefault("socket_timeout", DEFAULT_TIMEOUT_S)
    options.setdefault("socket_connect_timeout", DEFAULT_TIMEOUT_S)
    if is_cluster_url(url):
        return cluster_client(url, lazy=True, **options)
    options.setdefault("max_connections", DEFAULT_MAX_CONNECTIONS)
    if is_sentinel_url(url):
        return sentinel_client(url, **options)  # the master's pool
    return redis.Redis.from_url(url, **options)


def run_script(client: RedisClient, script: Script, keys: Sequence[str], args: list[Any]) -> Any:
    """One script call: EVALSHA (reloaded by redis-py on NOSCRIPT), driver errors wrapped.

    On a Redis Cluster, redis-py sends it to the master of the keys' slot (all keys of a
    call share their namespace's hash tag), follows MOVED and ASK, and on NOSCRIPT loads
    the script on every master before it retries."""
    try:
        try:
            return script(keys, args)
        except NoScriptError:
            # Flushed again between redis-py's SCRIPT LOAD and its retry: send the source.
            # (the package registers every script from a str: see throttle.redis.scripts)
            return client.eval(cast(str, script.script), len(keys), *keys, *args)
    except _REFUSED as exc:
        raise _wrapped(exc) from exc


def run_routine(
    client: RedisClient,
    routine: Routine[Script],
    keys: Sequence[str],
    args: list[Any],
    direct: DirectCalls | None = None,
) -> Any:
    """One call of a limiter operation: ``FCALL`` of its function in the library, loaded
    first when missing, or :func:`run_script` of its script where functions are not taken
    (see :mod:`throttle.redis.library`); driver errors wrapped. The ``FCALL`` goes through
    ``direct`` when given (:mod:`throttle.redis.direct`: on ``client``'s connections,
    without redis-py's per-command work)."""
    library = routine.library
    if library.functions is False:
        return run_script(client, routine.script, keys, args)
    send = direct if direct is not None else client.execute_command
    try:
        try:
            reply = send("FCALL", routine.function, len(keys), *keys, *args)
        except ResponseError as exc:
            if not _loaded(client, library, exc):
                return run_script(client, routine.script, keys, args)
            try:
                reply = send("FCALL", routine.function, len(keys), *keys, *args)
            except ResponseError as again:
                if not library.missing(again):
                    raise
                # Flushed again between the load and this call: the script, this once.
                return run_script(client, routine.script, keys, args)
    except _REFUSED as exc:
        raise _wrapped(exc) from exc
    if library.functions is None:
        library.functions = True
    return reply


def run_routines(
    client: RedisClient,
    calls: Sequence[tuple[Routine[Script], Sequence[str], list[Any]]],
    direct: DirectCalls | None = None,
) -> list[Any]:
    """Several independent calls, in one round trip when they can go as one (``FCALL`` on
    ``direct``'s connections, the library known to be loaded), else one by one through
    :func:`run_routine`. Each call's reply in order, or the :class:`BackendError` that
    call failed with on the server; a Redis that cannot be reached raises
    :class:`BackendUnavailable` for all."""
    if direct is None or any(routine.library.functions is not True for routine, _, _ in calls):
        return [_reply_or_error(client, call, direct) for call in calls]
    try:
        replies = direct.each(
            [("FCALL", routine.function, len(keys), *keys, *args) for routine, keys, args in calls]
        )
    except _REFUSED as exc:
        raise _wrapped(exc) from exc
    out: list[Any] = []
    for call, reply in zip(calls, replies, strict=True):
        if isinstance(reply, ResponseError):
            # A library flushed since (loaded again there), or the script's own error.
            out.append(_reply_or_error(client, call, direct) if call[0].library.missing(reply)
                       else _wrapped(reply))  # fmt: skip
        else:
            out.append(reply)
    return out


def _reply_or_error(
    client: RedisClient,
    call: tuple[Routine[Script], Sequence[str], list[Any]],
    direct: DirectCalls | None,
) -> Any:
    """One call of :func:`run_routines` alone: its reply, or its :class:`BackendError`."""
    try:
        return run_routine(client, *call, direct)
    except BackendUnavailable:
        raise
    except BackendError as exc:
        return exc


def _loaded(client: RedisClient, library: Library, exc: ResponseError) -> bool:
    """After ``FCALL`` failed with ``exc``: True when the library is loaded now (call
    again), False when this Redis takes no functions (use the script); raises ``exc`` when
    it is another error (a script error, say)."""
    if library.refused(exc):
        return False
    if not library.missing(exc):
        raise exc
    try:
        client.function_load(library.source)
    except ResponseError as load_exc:
        if library.refused(load_exc):
            return False
        if not library.exists(load_exc):
            raise
    return True


def wrap_errors(call: Callable[[], Any]) -> Any:
    """Run a plain Redis command, driver errors wrapped as in :func:`run_script`."""
    try:
        return call()
    except _REFUSED as exc:
        raise _wrapped(exc) from exc


# -- asyncio (redis.asyncio) ---------------------------------------------------------------


def async_client_from_url(url: str, **options: Any) -> redis.asyncio.Redis:
    """A ``redis.asyncio`` client of the Redis at ``url``: :func:`client_from_url`'s twin,
    with the same default timeouts and no connection opened here.

    ``redis://``, ``rediss://`` and ``unix://`` name one server, ``redis+sentinel://`` a
    master behind Sentinel (without TLS). A Redis Cluster URL and ``rediss+sentinel://``
    raise :class:`ConfigError`: the asyncio limiter does not support them (use the
    blocking :class:`throttle.Limiter` there)."""
    check_options(url)
    options.setdefault("socket_timeout", DEFAULT_TIMEOUT_S)
    options.setdefault("socket_connect_timeout", DEFAULT_TIMEOUT_S)
    if is_cluster_url(url):
        raise ConfigError(
            "the asyncio limiter (throttle.aio) does not support a Redis Cluster: use "
            "throttle.Limiter, or a redis:// URL",
            field="redis_url",
            value=redact(url),
        )
    options.setdefault("max_connections", DEFAULT_MAX_CONNECTIONS)
    if is_sentinel_url(url):
        if parse_sentinel_url(url).master_options.get("ssl"):
            raise ConfigError(
                "the asyncio limiter (throttle.aio) does not support Sentinel over TLS "
                "(rediss+sentinel://): use throttle.Limiter, or a rediss:// URL of the master",
                field="redis_url",
                value=redact(url),
            )
        return async_sentinel_client(url, **options)  # the master's pool
    return redis.asyncio.Redis.from_url(url, **options)


async def run_script_async(
    client: redis.asyncio.Redis, script: AsyncScript, keys: Sequence[str], args: list[Any]
) -> Any:
    """:func:`run_script` awaited: EVALSHA (reloaded by redis-py on NOSCRIPT), the source
    sent if flushed again in between, driver errors wrapped."""
    try:
        try:
            return await script(keys, args, client=client)
        except NoScriptError:
            return await client.eval(cast(str, script.script), len(keys), *keys, *args)
    except _REFUSED as exc:
        raise _wrapped(exc) from exc
    except RuntimeError as exc:
        _raise_if_other_loop(exc)
        raise


async def run_routine_async(
    client: redis.asyncio.Redis,
    routine: Routine[AsyncScript],
    keys: Sequence[str],
    args: list[Any],
) -> Any:
    """:func:`run_routine` awaited."""
    library = routine.library
    if library.functions is False:
        return await run_script_async(client, routine.script, keys, args)
    try:
        try:
            reply = await client.fcall(routine.function, len(keys), *keys, *args)
        except ResponseError as exc:
            if not await _loaded_async(client, library, exc):
                return await run_script_async(client, routine.script, keys, args)
            try:
                reply = await client.fcall(routine.function, len(keys), *keys, *args)
            except ResponseError as again:
                if not library.missing(again):
                    raise
                # Flushed again between the load and this call: the script, this once.
                return await run_script_async(client, routine.script, keys, args)
    except _REFUSED as exc:
        raise _wrapped(exc) from exc
    except RuntimeError as exc:
        _raise_if_other_loop(exc)
        raise
    if library.functions is None:
        library.functions = True
    return reply


async def _loaded_async(client: redis.asyncio.Redis, library: Library, exc: ResponseError) -> bool:
    """:func:`_loaded` awaited."""
    if library.refused(exc):
        return False
    if not library.missing(exc):
        raise exc
    try:
        await client.function_load(library.source)
    except ResponseError as load_exc:
        if library.refused(load_exc):
            return False
        if not library.exists(load_exc):
            raise
    return True


async def wrap_errors_async(call: Callable[[], Awaitable[_T]]) -> _T:
    """Await a plain Redis command, driver errors wrapped as in :func:`run_script`."""
    try:
        return await call()
    except _REFUSED as exc:
        raise _wrapped(exc) from exc
    except RuntimeError as exc:
        _raise_if_other_loop(exc)
        raise


_OTHER_LOOP = (
    "Event loop is closed",
    "attached to a different loop",
    "bound to a different event loop",
)
"""What asyncio (and redis-py) say when a connection made in one event loop is used in
another."""


def _raise_if_other_loop(exc: RuntimeError) -> None:
    """Raise a BackendError naming the cause when ``exc`` says the client's connections
    belong to another event loop (an ``asyncio.run`` that ended, then another)."""
    if any(words in str(exc) for words in _OTHER_LOOP):
        raise BackendError(
            f"the limiter's asyncio client was used in an event loop other than the one "
            f"its connections were made in ({exc}): build the limiter (its client) inside "
            f"each event loop, as in each asyncio.run()"
        ) from exc
