"""Redis URLs: Sentinel and Cluster URLs, and redaction, so that a password never reaches a log.

The limiter's Redis is named by one URL (``app.conf.throttle_redis_url``,
``settings.redis_url``, ``THROTTLE_REDIS_URL`` or the broker's). Besides redis-py's own forms
(``redis://``, ``rediss://`` for TLS, ``unix://``), a Redis behind Sentinel is named by::

    redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?OPTIONS]
    rediss+sentinel://...                  the same over TLS (to the sentinels and the master)

- ``HOST:PORT``: one or more sentinels (``[::1]:26379`` for IPv6); any one that answers
  names the master of ``SERVICE`` (the name of ``sentinel monitor SERVICE ...``).
- ``USER:PASSWORD``: the credentials of the *master* (an ACL user, or ``:PASSWORD`` for
  ``requirepass``), percent-encoded as in any URL (``/`` is ``%2F``, ``@`` is ``%40``).
- ``OPTIONS``: redis-py's URL options (``socket_timeout``, ``ssl_ca_certs``,
  ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``, ``ssl_check_hostname``...), for the
  master and the sentinels alike; ``sentinel_username`` and ``sentinel_password`` when the
  sentinels themselves ask for credentials (they are not sent to sentinels otherwise).

The client follows failovers: each new connection asks a sentinel for the master first, and
a connection to a server that is no longer the master is dropped (redis-py's
``SentinelConnectionPool``). Calls that were under way when the master died fail once
(:class:`~throttle.errors.BackendUnavailable`); the next ones reach the new master.

A Redis Cluster is named by one or more of its nodes::

    redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/0][?OPTIONS]
    rediss+cluster://...                   the same over TLS

- ``HOST:PORT``: any node; one that answers gives the client (redis-py's ``RedisCluster``)
  the whole slot map, the others are fallbacks for that first read. Database 0 only.
- ``USER:PASSWORD`` and ``OPTIONS`` as for ``redis://``, for every node.

The client sends each call to the master of its keys' slot and follows ``MOVED`` and
``ASK``. It reads the slot map on its first call, as a single server's client connects on
its first call (:class:`LazyCluster`): a worker or pool child that starts while the cluster
is down gets :class:`~throttle.errors.BackendUnavailable` from its calls, so the limits'
``on_redis_down`` applies, and its next call after the cluster is back just works.
Every key of a namespace shares one hash tag (:mod:`throttle.redis.keys`), so each script runs on
one master.

:func:`redact` hides the password of any URL (and any ``*password*`` query option) before it
is shown, logged or put into an error.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
from redis._parsers.encoders import Encoder
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.connection import parse_url
from redis.exceptions import RedisClusterException
from redis.sentinel import Sentinel, SentinelConnectionPool

from throttle.errors import BackendUnavailable, ConfigError

__all__ = [
    "ACL_CLUSTER_COMMANDS",
    "ACL_COMMANDS",
    "CLUSTER_SCHEMES",
    "SENTINEL_SCHEMES",
    "LazyCluster",
    "SentinelURL",
    "acl_rules",
    "async_sentinel_client",
    "cluster_client",
    "describe",
    "is_cluster_url",
    "is_sentinel_url",
    "parse_sentinel_url",
    "redact",
    "sentinel_client",
]

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
"""URL schemes of a Redis behind Sentinel (``rediss+``: over TLS)."""
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
"""URL schemes of a Redis Cluster (``rediss+``: over TLS)."""

MASK = "***"
_SECRET_QUERY = re.compile(r"([?&][^=&#]*password[^=&#]*=)[^&#]*", re.IGNORECASE)
# Options that reach the sentinels as well as the master (the rest is the master's only).
_SHARED = re.compile(r"^(socket_.*|ssl_.*|retry_on_timeout|health_check_interval|protocol)$")


# Every command the limiter sends, with the commands its Lua scripts call (Redis checks
# those against the caller's ACL too). No SELECT: give a database other than 0 with +select.
ACL_COMMANDS = (
    # the limiter's operations: FCALL of its function library, loaded when missing (Redis
    # 7+; without these two, the scripts: throttle.redis.library)
    "fcall", "function|load",
    # scripts: redis-py's Script calls EVALSHA, loads on NOSCRIPT; run_script falls back
    # to EVAL when flushed again in between
    "evalsha", "eval", "script|load",
    # called inside the functions and scripts (lua/*.lua)
    "time", "get", "set", "setrange", "del", "pexpire", "hget", "hmget", "hset", "hdel",
    "hgetall", "exists", "mget",
    "zadd", "zrem", "zcard", "zrange", "zrangebyscore",
    # from Python: run-time rates (hset/hdel/hgetall), fleet stats (hincrby, expire,
    # hgetall), parking counts (zcard), reset (scan, del), the workers' clocks (hset,
    # hgetall), a task's trail (multi, del, hset, pexpire, exec), `celery throttle parked`
    # (hscan)
    "hincrby", "expire", "scan", "multi", "exec", "hscan",
    # waiting tasks hear of capacity given back (lua/settle.lua, a hold lifted, a rate
    # set): the namespace's channel (throttle.celery.capacity)
    "publish", "subscribe", "unsubscribe",
    # redis-py's health checks (it also sends CLIENT SETINFO on Redis 7.2+, and ignores
    # a refusal: add +client|setinfo there to keep it out of the ACL log)
    "ping",
    # a worker at start, and `status`, read whether the Redis may evict keys (INFO memory:
    # throttle.redis.memory)
    "info",
)  # fmt: skip
ACL_CLUSTER_COMMANDS = ("cluster|slots", "command")
"""What redis-py's cluster client sends when it connects, beyond :data:`ACL_COMMANDS`: it
reads the slot map (``CLUSTER SLOTS``) and the command table (``COMMAND``, to find the
keys of a call)."""


def acl_rules(prefix: str = "throttle", *, cluster: bool = False) -> str:
    """The least-privilege ACL rules of a limiter's Redis user, for keys under ``prefix``::

        ACL SETUSER limiter on >PASSWORD <acl_rules()>

    Its keys only (``~PREFIX:*``), its channels only (``&PREFIX:*``: capacity given back
    is announced there), and only the commands the limiter sends
    (:data:`ACL_COMMANDS`; on every master of a Redis Cluster with ``cluster``, also
    :data:`ACL_CLUSTER_COMMANDS`). A shared broker and limiter Redis needs a user with the
    broker's rights as well (Celery's transport uses many more commands and keys)."""
    names = ACL_COMMANDS + (ACL_CLUSTER_COMMANDS if cluster else ())
    commands = " ".join(f"+{command}" for command in names)
    return f"resetkeys ~{prefix}:* resetchannels &{prefix}:* -@all {commands}"


def redact(url: str) -> str:
    """``url`` with its password (and any ``...password...=`` query value) replaced by
    ``***``; the user name stays, as it helps and is not a secret.

    Works on malformed URLs too and rather hides too much than too little: the user
    information is everything between ``://`` and the *last* ``@`` (a password with an
    unencoded ``/`` or ``@`` confuses URL parsers, not this)."""
    scheme, sep, rest = url.partition("://")
    if sep:
        userinfo, at, hosts = rest.rpartition("@")
        if at:
            user, colon, _ = userinfo.partition(":")
            rest = f"{user}{colon}{MASK if colon else ''}@{hosts}"
        url = f"{scheme}{sep}{rest}"
    return _SECRET_QUERY.sub(lambda m: m.group(1) + MASK, url)


_CERT_REQS = ("none", "optional", "required")
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_ca_path")


_SCHEMES = ("redis", "rediss", "unix", *SENTINEL_SCHEMES, *CLUSTER_SCHEMES)
"""The schemes of the URLs the limiter takes (redis-py's, Sentinel's, a Cluster's)."""


def check_options(url: str) -> None:
    """Refuse, as a :class:`ConfigError` naming the option, what redis-py would accept
    here and fail on only at the first call, where it reads as an outage (so
    ``on_redis_down`` would apply to a typo, forever): what :func:`check_form` refuses (a
    scheme it does not take, whose own error, a ValueError, would not name the field; a
    database that is not a number, ``redis://host/zz``, which redis-py reads as database
    0), an ``ssl_cert_reqs`` it does not know, a TLS file or directory that does not
    exist on this host."""
    check_form(url)
    scheme, _, rest = url.partition("://")
    parsed = urlsplit(f"{scheme}://{rest.rpartition('@')[2]}")
    for name, value in parse_qsl(parsed.query, keep_blank_values=True):
        if name == "ssl_cert_reqs" and value.lower() not in _CERT_REQS:
            raise ConfigError(
                f"ssl_cert_reqs must be one of {', '.join(_CERT_REQS)}",
                field="redis_url", value=value,
            )  # fmt: skip
        if name in _TLS_FILES:
            exists = os.path.isdir(value) if name == "ssl_ca_path" else os.path.isfile(value)
            if not exists:
                kind = "directory" if name == "ssl_ca_path" else "file"
                raise ConfigError(
                    f"{name} names no {kind} on this host", field="redis_url", value=value
                )
    check_client_certificate(dict(parse_qsl(parsed.query, keep_blank_values=True)))


def check_client_certificate(options: dict[str, str]) -> None:
    """Refuse a client certificate (mutual TLS) that TLS cannot load: ``ssl_certfile``
    without its private key (in the file itself or ``ssl_keyfile``), a key that is not the
    certificate's, a file that is no PEM, ``ssl_keyfile`` alone. redis-py would fail at
    every connection with OpenSSL's ``[SSL] PEM lib``, read as an outage."""
    certfile, keyfile = options.get("ssl_certfile"), options.get("ssl_keyfile")
    if certfile is None:
        if keyfile is not None:
            raise ConfigError(
                "ssl_keyfile is the private key of a client certificate: give the "
                "certificate as ssl_certfile too", field="redis_url", value=keyfile,
            )  # fmt: skip
        return
    password = options.get("ssl_password")
    try:
        # password: never OpenSSL's prompt on the terminal for an encrypted key
        ssl.create_default_context().load_cert_chain(
            certfile, keyfile, password=(lambda: password or "")
        )
    except (ssl.SSLError, OSError, ValueError) as exc:
        holds = f"ssl_certfile and ssl_keyfile ({keyfile})" if keyfile else "ssl_certfile"
        raise ConfigError(
            f"the client certificate cannot be loaded: {holds} must hold a PEM certificate "
            f"and its own private key (unencrypted, or with ssl_password) ({exc})",
            field="redis_url", value=certfile,
        ) from None  # fmt: skip


_ENCODE = (
    "a URL parser cannot read this URL's host: percent-encode a '/', '?', '#' or '@' in the "
    "user name or password (%2F, %3F, %23, %40)"
)


def check_form(url: str) -> None:
    """Refuse, as a :class:`ConfigError` naming the field, a URL whose form is wrong on
    any host (what ``celery throttle check`` can tell without the workers' files): a
    scheme the limiter does not take, a port or a database that is not a number,
    ``decode_responses``, a user name or password that redis-py would misread."""
    if not isinstance(url, str):
        raise ConfigError("a Redis URL is text", field="redis_url", value=url)
    scheme, _, rest = url.partition("://")
    if scheme not in _SCHEMES:  # as redis-py reads them: lower case
        raise ConfigError(
            f"a Redis URL starts with {', '.join(s + '://' for s in _SCHEMES)}",
            field="redis_url", value=f"{scheme}://" if "://" in url else redact(url),
        )  # fmt: skip
    parsed = urlsplit(f"{scheme}://{rest.rpartition('@')[2]}")
    if "decode_responses" in dict(parse_qsl(parsed.query, keep_blank_values=True)):
        raise ConfigError(
            "the limiter reads its scripts' replies as bytes: drop decode_responses",
            field="redis_url", value=redact(url),
        )  # fmt: skip
    if scheme not in ("redis", "rediss"):
        return  # a socket path; several hosts (Sentinel, Cluster): read by their parsers
    try:
        parsed.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError:
        raise ConfigError(
            "the port must be a number from 0 to 65535", field="redis_url",
            value=parsed.netloc,
        ) from None  # fmt: skip
    db = parsed.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(
            "the database (the URL's path) must be a number, such as /0",
            field="redis_url", value=f"/{db}",
        )  # fmt: skip
    # A user name or password with an unencoded '/', '?' or '#' ends redis-py's host part
    # early: its ValueError quotes a piece of the password, or, when that piece is a number,
    # it reads it as the port and connects elsewhere without a password.
    bare = f"{scheme}://{rest.rpartition('@')[2]}"  # no user name or password
    try:
        options = parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError:
        try:
            parse_url(bare)  # type: ignore[no-untyped-call]
        except ValueError as exc:  # an option of the query
            raise ConfigError(
                f"redis-py cannot read this URL: {exc}", field="redis_url", value=redact(url)
            ) from None
        raise ConfigError(_ENCODE, field="redis_url", value=redact(url)) from None
    if "@" in rest and (options.get("host"), options.get("port")) != (parsed.hostname, parsed.port):
        raise ConfigError(_ENCODE, field="redis_url", value=redact(url))


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a Redis behind Sentinel (``redis+sentinel://``...)."""
    return url.partition("://")[0].lower() in SENTINEL_SCHEMES


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL: where the sentinels are, which master, how."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    master_options: dict[str, Any] = field(default_factory=dict)
    """Connection options of the master: credentials, TLS, timeouts (redis-py names)."""
    sentinel_options: dict[str, Any] = field(default_factory=dict)
    """Connection options of the sentinels: TLS and timeouts, their own credentials."""


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse a ``redis+sentinel://`` URL (see the module's docstring).

    Raises :class:`~throttle.errors.ConfigError` naming the URL without its password."""
    shown = redact(url)

    def bad(problem: str) -> ConfigError:
        return ConfigError(problem, field="redis_url", value=shown)

    scheme, _, rest = url.partition("://")
    scheme = scheme.lower()
    if scheme not in SENTINEL_SCHEMES:
        raise bad(f"not a Sentinel URL: the scheme must be {' or '.join(SENTINEL_SCHEMES)}")
    # The query first: an '@' in an option's value (a file path) is not the credentials'.
    rest, question, query = rest.partition("?")
    userinfo, at, rest = rest.rpartition("@")
    hosts, slash, path = rest.partition("/")
    if not slash or not path.strip("/"):
        raise bad("name the master's service: redis+sentinel://HOST:PORT/SERVICE[/DB]")
    service, _, db_text = path.strip("/").partition("/")
    try:
        db = int(db_text) if db_text else 0
    except ValueError:
        raise bad(f"the database after the service must be a number (got {db_text!r})") from None
    sentinels = []
    for host in hosts.split(","):
        name, colon, port = host.rpartition(":")
        name = name.strip("[]")  # an IPv6 address: [::1]:26379
        if not colon or not name or not port.isdigit() or not 0 < int(port) < 65536:
            # No credentials found, yet an '@': a '?' in the password ended them early.
            raise bad(_ENCODE if "@" in url and not at else f"sentinel {host!r} is not HOST:PORT")
        sentinels.append((name, int(port)))
    # redis-py parses the credentials and typed options, as for any redis:// URL.
    node = "rediss" if scheme.startswith("rediss") else "redis"
    try:
        options: dict[str, Any] = parse_url(  # type: ignore[no-untyped-call]
            f"{node}://{userinfo}{at}{sentinels[0][0]}{question}{query}"
        )
    except ValueError:
        # Its message may quote a piece of the URL, password included: not repeated here.
        raise bad(
            "cannot parse it: percent-encode '/', '@', ':', '?' and '#' in user names and "
            "passwords, and check the options"
        ) from None
    for consumed in ("host", "port", "db", "connection_class"):
        options.pop(consumed, None)
    shared = {name: value for name, value in options.items() if _SHARED.match(name)}
    if node == "rediss":
        options["ssl"] = shared["ssl"] = True
    sentinel_options = {**shared}
    for name in ("username", "password"):
        value = options.pop(f"sentinel_{name}", None)
        if value is not None:
            sentinel_options[name] = value  # parse_url unquoted it
    return SentinelURL(tuple(sentinels), unquote(service), db, options, sentinel_options)


def sentinel_client(url: str, **options: Any) -> redis.Redis:
    """A ``redis.Redis`` on the master of a ``redis+sentinel://`` URL; ``options`` (e.g.
    socket timeouts) go to the master and the sentinels, below the URL's own options.

    Opens no connection: the master is looked up on the first command (an unreachable
    Sentinel then raises redis-py's ``MasterNotFoundError``, a ``ConnectionError``)."""
    parsed = parse_sentinel_url(url)
    shared = {name: value for name, value in options.items() if _SHARED.match(name)}
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(parsed.sentinels),
        sentinel_kwargs={**shared, **parsed.sentinel_options},
        **{**options, **parsed.master_options},
    )
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        parsed.service, db=parsed.db
    )
    return client


def async_sentinel_client(url: str, **options: Any) -> redis.asyncio.Redis:
    """:func:`sentinel_client`'s twin for ``redis.asyncio`` (:mod:`throttle.aio`): a
    ``redis.asyncio.Redis`` on the master of a ``redis+sentinel://`` URL, looked up on its
    first command."""
    parsed = parse_sentinel_url(url)
    shared = {name: value for name, value in options.items() if _SHARED.match(name)}
    sentinel = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(parsed.sentinels),
        sentinel_kwargs={**shared, **parsed.sentinel_options},
        **{**options, **parsed.master_options},
    )
    client: redis.asyncio.Redis = sentinel.master_for(parsed.service, db=parsed.db)
    return client


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://``...)."""
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


class LazyCluster:
    """A ``RedisCluster`` built on first use, and again on each use until one is built.

    redis-py's ``RedisCluster`` reads the slot map in its constructor, so building one
    while the cluster is down raises. A limiter's client is built when a worker's process
    first needs it; with this it opens nothing until its first call, as ``redis.Redis``
    does, and an unreachable cluster surfaces as that call's
    :class:`~throttle.errors.BackendUnavailable` (which the caller's outage policy
    handles) instead of failing whatever built the limiter. Each call before the cluster
    answers pays one attempt to read the slot map (bounded by the connect timeout per
    startup node). Every attribute is the built client's, except that scripts are
    registered without it (registering only hashes the source, with ``encoder``); two
    threads racing on the first call may build one spare client, which is
    garbage-collected.
    """

    def __init__(self, build: Callable[[], RedisCluster], encoder: Encoder) -> None:
        self._build = build
        self._built: RedisCluster | None = None
        self._encoder = encoder

    def register_script(self, script: str | bytes) -> Script:
        """A script called through this client (building it on the first call)."""
        return Script(cast(RedisCluster, self), script)

    def get_encoder(self) -> Encoder:
        """How strings become bytes: the URL's ``encoding`` options, as the client's."""
        return self._encoder

    @property
    def built(self) -> RedisCluster:
        """The cluster client (built now if it is not yet)."""
        client = self._built
        if client is None:
            client = self._built = self._build()
        return client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.built, name)


def cluster_client(url: str, *, lazy: bool = False, **options: Any) -> RedisCluster:
    """A ``redis.cluster.RedisCluster`` for a ``redis+cluster://`` URL (see the module's
    docstring); ``options`` (e.g. socket timeouts) go to every node, below the URL's own.

    A malformed URL raises :class:`~throttle.errors.ConfigError` at once. The slot map is
    read now, raising :class:`~throttle.errors.BackendUnavailable` when no node answers or
    the nodes are not a cluster; with ``lazy``, on the first call instead (a
    :class:`LazyCluster`, typed as the client it stands for). Errors name the URL without
    its password."""
    shown = redact(url)

    def bad(problem: str) -> ConfigError:
        return ConfigError(problem, field="redis_url", value=shown)

    scheme, _, rest = url.partition("://")
    if scheme.lower() not in CLUSTER_SCHEMES:
        raise bad(f"not a Cluster URL: the scheme must be {' or '.join(CLUSTER_SCHEMES)}")
    # The query first: an '@' in an option's value (a file path) is not the credentials'.
    rest, question, query = rest.partition("?")
    userinfo, at, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    if path.strip("/") not in ("", "0"):
        raise bad("a Redis Cluster has only database 0: drop the path or make it /0")
    nodes = []
    for host in hosts.split(","):
        name, colon, port = host.rpartition(":")
        name = name.strip("[]")  # an IPv6 address: [::1]:7000
        if not colon or not name or not port.isdigit() or not 0 < int(port) < 65536:
            mangled = "@" in url and not at  # a '?' in the password ended it early
            raise bad(_ENCODE if mangled else f"cluster node {host!r} is not HOST:PORT")
        nodes.append(ClusterNode(name, int(port)))  # type: ignore[no-untyped-call]
    # The first node through redis-py's URL parser (credentials, typed options), the others
    # as further startup nodes.
    node = "rediss" if scheme.lower().startswith("rediss") else "redis"
    first = f"{node}://{userinfo}{at}{hosts.split(',')[0]}{question}{query}"
    unparsable = (
        "cannot parse it: percent-encode '/', '@', ':', '?' and '#' in user names and "
        "passwords, and check the options"
    )
    try:  # now, lazy or not: a malformed URL is a configuration error
        parsed = {**parse_url(first), **options}  # type: ignore[no-untyped-call]
    except ValueError:
        # Its message may quote a piece of the URL, password included: not repeated here.
        raise bad(unparsable) from None
    first_name, _, first_port = hosts.split(",")[0].rpartition(":")
    if (parsed.get("host"), parsed.get("port")) != (first_name.strip("[]"), int(first_port)):
        raise bad(_ENCODE)  # a password read as a host: the call would go elsewhere

    def build() -> RedisCluster:
        try:
            return RedisCluster.from_url(first, startup_nodes=nodes[1:], **options)
        except ValueError:
            raise bad(unparsable) from None
        except (redis.RedisError, RedisClusterException) as exc:
            # redis-py reads a refused CLUSTER SLOTS as "Cluster mode is not enabled".
            hint = (
                " (a user of the URL needs acl_rules(cluster=True): +cluster|slots +command)"
                if parsed.get("username") and "not enabled" in str(exc)
                else ""
            )
            raise BackendUnavailable(f"Redis Cluster {shown} cannot be used: {exc}{hint}") from exc

    if not lazy:
        return build()
    encoder = Encoder(  # type: ignore[no-untyped-call]
        parsed.get("encoding", "utf-8"),
        parsed.get("encoding_errors", "strict"),
        parsed.get("decode_responses", False),
    )
    # A stand-in with every attribute of the client it builds; the cast says so to mypy.
    return cast(RedisCluster, LazyCluster(build, encoder))


def describe(client: Any) -> str:
    """Where a redis-py client connects, as a URL without credentials: for status output.

    ``redis+sentinel://H:P,H:P/SERVICE/DB`` for a Sentinel client, ``unix://PATH?db=N``,
    ``redis://HOST:PORT/DB`` (``rediss://`` with TLS) otherwise."""
    pool = getattr(client, "connection_pool", None)
    if pool is None:  # e.g. a RedisCluster: no single pool
        nodes: list[Any] = getattr(client, "get_nodes", list)()
        shown = ",".join(f"{node.host}:{node.port}" for node in nodes)
        return f"redis+cluster://{shown}"
    options = pool.connection_kwargs
    tls = issubclass(pool.connection_class, redis.SSLConnection) or bool(options.get("ssl"))
    if isinstance(pool, SentinelConnectionPool):
        sentinels = ",".join(
            f"{s.connection_pool.connection_kwargs.get('host')}:"
            f"{s.connection_pool.connection_kwargs.get('port')}"
            for s in pool.sentinel_manager.sentinels
        )
        scheme = "rediss+sentinel" if tls else "redis+sentinel"
        return f"{scheme}://{sentinels}/{quote(pool.service_name)}/{options.get('db', 0)}"
    if "path" in options:
        return f"unix://{options['path']}?db={options.get('db', 0)}"
    scheme = "rediss" if tls else "redis"
    return f"{scheme}://{options.get('host')}:{options.get('port')}/{options.get('db', 0)}"
