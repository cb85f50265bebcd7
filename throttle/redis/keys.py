"""Every Redis key of the package is built here.

Layout: ``{prefix}:{{namespace}}:{kind}:{limit}:{key}``. The namespace sits in braces: it is
the Redis Cluster hash tag, so every key of one namespace (state of all its limits and the
lease records) lands in one slot and a multi-limit acquisition stays one atomic script.
Limits that are never acquired together can live in different namespaces to spread load
over a cluster's masters. A :class:`~throttle.Limiter` has exactly one key space, and a
``Limit`` carries no namespace, so no acquisition can name keys of two namespaces (two
slots): limits acquired together share a namespace by construction, not by checking.

Limit names and key values are encoded so that no two distinct (limit, key) pairs share a
Redis key: values made only of ``[A-Za-z0-9_.@+=~-]`` (and at most 100 characters) are used
as they are, others are percent-encoded (so they contain ``%``), and anything longer than 100
characters after encoding becomes ``#`` + SHA-256. The three forms cannot collide, and braces
in a value can never move the hash tag: the tag is always the first ``{...}`` of the key.

What a key value may be: any non-empty ``str`` of Unicode text, of any length, with any
characters (braces, ``:``, ``%``, NUL, emoji...). Refused with a :class:`RequestError`: the
empty string (it would name the keyless state) and lone surrogates (``"\\ud800"``, which a
JSON message can carry but UTF-8 cannot encode). Distinct strings are distinct keys: nothing
is case-folded or Unicode-normalised (``"é"`` composed and decomposed are two tenants). Values
longer than 100 characters are hashed without being percent-encoded first and are not kept in
the name caches, so a huge value costs one SHA-256 pass and no memory.
"""

from __future__ import annotations

import functools
import hashlib
import re
import string
from dataclasses import dataclass
from urllib.parse import quote, unquote

from throttle.errors import ConfigError, RequestError
from throttle.spec import Limit

__all__ = ["PART_ALPHABET", "KeySpace", "decode_hold_field", "encode", "encode_part", "text_error"]

_SAFE = re.compile(r"[A-Za-z0-9_.@+=~-]{1,100}")
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
_MAX_ENCODED = 100
PART_ALPHABET = frozenset(string.ascii_letters + string.digits + "_.@+=~-%#")
"""Every character :func:`encode` may output: a character outside it (``:``, ``/``, ``|``,
a space...) never occurs in an encoded value, so it can separate encoded values."""


def text_error(value: str) -> str | None:
    """Why ``value`` is not Unicode text that can be (part of) a Redis key name, or None
    when it is: names are sent as UTF-8, which has no form for a lone surrogate (a JSON
    message may carry one, as ``"\\ud800"``)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate U+{ord(value[exc.start]):04X} at index {exc.start}"
    return None


def encode(value: str) -> str:
    """Encode one key component (limit name or key value) injectively, without ``:{}``.

    Raises :class:`RequestError` for an empty value or one that is not Unicode text (see
    the module's docstring)."""
    if _SAFE.fullmatch(value):
        return value
    if not value:
        raise RequestError("a key component must be a non-empty string (got '')")
    if len(value) > _MAX_ENCODED:
        # Percent-encoding never shortens: hash at once, without building a string 3 to 12
        # times as large first.
        return "#" + hashlib.sha256(_utf8(value)).hexdigest()
    encoded = quote(_utf8(value), safe="")
    if len(encoded) > _MAX_ENCODED:
        return "#" + hashlib.sha256(_utf8(value)).hexdigest()
    return encoded


def encode_part(value: str) -> str:
    """:func:`encode` for one value of a composite key (``"{tenant}:{region}"``), where an
    empty value is allowed (it stays empty): the result never contains a character outside
    :data:`PART_ALPHABET`."""
    return encode(value) if value else ""


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern (``*?[]\\`` escaped)."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def _utf8(value: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(
            f"a key must be Unicode text; it has {text_error(value)} (got {value[:100]!r})"
        ) from None


def _state_keys_of(base: str, code: str, limit: str, key: str | None) -> tuple[str, ...]:
    name = f"{base}{code}:{encode(limit)}:"
    if key is not None:
        name += encode(key)
    if code == "conc":
        return (name, name + ":h")
    if code == "fair":
        # The key's schedule, then the limit's shared HASH and its ZSET of active keys:
        # an encoded key never contains ':' and is never empty, so neither shared name
        # can be a key's.
        if key is None:
            raise RequestError(
                f"limit {limit!r} is fair: it shares its rate among keys, and needs one"
            )
        shared = name[: -len(encode(key))]
        return (name, shared, shared + ":a")
    return (name,)


def _hold_fields_of(limit: str, key: str | None) -> tuple[str, str]:
    name = encode(limit)
    # encode() never yields ':', so "limit:key" cannot be read as another limit's field.
    return (name, "" if key is None else f"{name}:{encode(key)}")


def _one_limit_of(
    base: str, code: str, limit: str, key: str | None
) -> tuple[tuple[str, str], str, str]:
    (state,) = _state_keys_of(base, code, limit, key)
    return (f"{base}holds", state), *_hold_fields_of(limit, key)


# Names are rebuilt on every acquire of a hot limit: cache the recent ones (strings only,
# so the cache key hashes fast), bounded so that many tenants cannot grow it without end.
# Long key values (hashed anyway) bypass the caches: 4096 entries of 10 MB keys would hold
# 40 GB.
_state_keys = functools.lru_cache(maxsize=4096)(_state_keys_of)
_hold_fields = functools.lru_cache(maxsize=4096)(_hold_fields_of)
_one_limit = functools.lru_cache(maxsize=4096)(_one_limit_of)


def decode_hold_field(field: str) -> tuple[str, str | None]:
    """The (limit, key) of a field of the holds hash, as far as it can be decoded: a value
    that was hashed (``#`` + SHA-256) stays hashed."""
    limit, _, key = field.partition(":")
    return unquote(limit), (unquote(key) if key else None)


@dataclass(frozen=True)
class KeySpace:
    """Names the Redis keys of one namespace.

    Parameters
    ----------
    prefix:
        First component of every key (default ``throttle``); no braces.
    namespace:
        The hash tag shared by all keys of this key space (default ``default``).
    """

    prefix: str = "throttle"
    namespace: str = "default"

    def __post_init__(self) -> None:
        for what in ("prefix", "namespace"):
            value = getattr(self, what)
            if not isinstance(value, str) or not value or "{" in value or "}" in value:
                raise ConfigError(
                    "must be a non-empty string without braces", field=what, value=value
                )
            problem = text_error(value)
            if problem is not None:
                raise ConfigError(
                    f"must be Unicode text; it has {problem}", field=what, value=value
                )
        object.__setattr__(self, "_base", f"{self.prefix}:{{{self.namespace}}}:")

    @property
    def base(self) -> str:
        """The common start of every key: ``prefix:{namespace}:``."""
        base: str = self.__dict__["_base"]
        return base

    def state_keys(self, limit: Limit, key: str | None) -> tuple[str, ...]:
        """The Redis keys holding ``limit``'s state for ``key`` (None: one global state).

        Concurrency limits use two keys (holders and their units), fair limits three (the
        key's schedule, the limit's shared HASH and its active keys); others one.
        """
        if key is None or len(key) <= _MAX_ENCODED:
            return _state_keys(self.base, limit.code, limit.name, key)
        return _state_keys_of(self.base, limit.code, limit.name, key)

    def state_pattern(self, limit: Limit) -> str:
        """A ``SCAN MATCH`` pattern of every Redis key of ``limit``'s state: of every key
        value, and of the keyless state.

        Under the limit's algorithm only: a stand-in limit of the same name per algorithm
        finds the state another algorithm left. ``encode()`` never yields ``:``, so the
        ``:`` after the name keeps limit ``api`` from matching the keys of ``api-2``."""
        return f"{_glob_escape(self.base)}{limit.code}:{_glob_escape(encode(limit.name))}:*"

    def holds_key(self) -> str:
        """The HASH of holds (lua/hold.lua): field -> until, in us of the Redis clock."""
        return f"{self.base}holds"

    def one_limit(self, limit: Limit, key: str | None) -> tuple[tuple[str, str], str, str]:
        """The KEYS and hold fields of lua/acquire_one.lua: ((holds, state), whole, own)."""
        if key is None or len(key) <= _MAX_ENCODED:
            return _one_limit(self.base, limit.code, limit.name, key)
        return _one_limit_of(self.base, limit.code, limit.name, key)

    def hold_fields(self, limit_name: str, key: str | None) -> tuple[str, str]:
        """The two fields of the holds hash that hold ``(limit, key)``: the whole limit's and
        this key's (``""`` when ``key`` is None)."""
        if key is None or len(key) <= _MAX_ENCODED:
            return _hold_fields(limit_name, key)
        return _hold_fields_of(limit_name, key)

    def lease_key(self, acquisition_id: str) -> str:
        """The lease record of one acquisition (what it took, for settle and redelivery)."""
        return f"{self.base}lease:{encode(acquisition_id)}"

    def learned_key(self, limit_name: str, key: str | None) -> str:
        """The HASH of what the upstream's answers taught about ``(limit, key)``
        (lua/adapt.lua): the learned rate of an adaptive limit, the recent refusals."""
        whole, own = self.hold_fields(limit_name, key)
        return f"{self.base}learned:{own or whole}"

    def learned_pattern(self) -> str:
        """A SCAN pattern of every learned state of the namespace."""
        return f"{_glob_escape(self.base)}learned:*"

    def capacity_channel(self) -> str:
        """The pub/sub channel on which capacity given back is announced: settle.lua
        publishes the names of an acquisition's limits when it refunds or releases, the
        lifting of a hold and a rate set at run time publish the limit's name (a rate with
        ``!rates`` before it); a hold placed publishes ``!held NAME``. Waiting tasks
        listen (:mod:`throttle.celery.capacity`). Not a key: no TTL, nothing kept."""
        return f"{self.base}capacity"

    def rates_key(self) -> str:
        """The HASH of rates changed at run time: limit name -> rate spec."""
        return f"{self.base}rates"

    def followed_rates_key(self) -> str:
        """The HASH of rates the upstream stated for the limits that follow one of its
        dimensions (``upstream:``): limit name -> rate spec. Apart from the operator's
        (:meth:`rates_key`), so that following the upstream up and down never overwrites
        an operator's decision."""
        return f"{self.base}rates:followed"

    def estimate_shares_key(self) -> str:
        """The HASH of the share of their estimate the calls of each limit use, learned by
        the workers (:mod:`throttle.celery.estimates`): limit name -> share (0.1 to 1)."""
        return f"{self.base}estimates"

    def key_rates_key(self) -> str:
        """The HASH of rates set at run time for single keys of keyed limits: the key's
        field of :meth:`hold_fields` (``limit:key``, encoded) -> rate spec."""
        return f"{self.base}rates:keys"

    def key_names_key(self) -> str:
        """The HASH of the keys of :meth:`key_rates_key` too long to stand in a field
        name: the field (its key hashed, ``#`` + SHA-256) -> the key itself, so that an
        operator reads which key a rate is for."""
        return f"{self.base}rates:keys:names"

    def modes_key(self) -> str:
        """The HASH of modes set at run time (``celery throttle enforce`` / ``shadow``):
        limit name -> ``enforce`` or ``shadow``."""
        return f"{self.base}rates:modes"

    def refusals_key(self, limit_name: str) -> str:
        """The STREAM of the refusals the upstream reported for ``limit_name``, capped
        (:mod:`throttle.refusals`)."""
        return f"{self.base}refusals:{encode(limit_name)}"

    def parking_keys(self) -> tuple[str, str, str, str]:
        """The parking lot: parked (ZSET token -> due us), messages (HASH token -> payload),
        claimed (ZSET token -> claim expiry us), publish ids (HASH token -> id)."""
        base = f"{self.base}park:"
        return (base + "due", base + "msg", base + "claimed", base + "pub")

    def parking_index_keys(self) -> tuple[str, str]:
        """The parking lot's index: ids (HASH task id -> token) and tasks (HASH token ->
        task id), written with the task (lua/park.lua) and deleted with it."""
        base = f"{self.base}park:"
        return (base + "ids", base + "tasks")

    def task_key(self, task_id: str) -> str:
        """The HASH of the last thing the throttler did with one task (a deferral, a time
        out), for ``celery throttle task ID``; it expires (see
        :class:`throttle.celery.observe.TaskTrailReporter`)."""
        return f"{self.base}task:{encode(task_id)}"

    def parked_run_key(self, token: str) -> str:
        """Which published copy of a parked task may run (the first one to start)."""
        return f"{self.base}park:run:{encode(token)}"

    def copy_key(self, task_id: str) -> str:
        """The number of the newest copy of one task that throttling sent back
        (re-published or parked): an older copy that the broker delivers again is stale
        (see :meth:`throttle.parking.ParkingLot.sent_copy`); it expires."""
        return f"{self.base}copy:{encode(task_id)}"

    def alive_key(self) -> str:
        """The marker that this Redis kept the namespace's data (no TTL): its absence tells
        a worker that Redis is new or restarted empty (the ``cold_start`` setting)."""
        return f"{self.base}alive"

    def fence_key(self) -> str:
        """The restart fence's marker (no TTL; a number: the fence's end, us of the Redis
        clock), written by the first script that finds it missing: its absence tells that
        Redis is new or lost its data, states included (see ``lua/prelude.lua``)."""
        return f"{self.base}fence"

    def space_key(self, limit: Limit, key: str | None) -> str:
        """When the next call of ``limit`` (for ``key``) may come, stamped by the call-time
        spacing guard (``lua/space.lua``)."""
        name = f"{self.base}space:{encode(limit.name)}:"
        return name if key is None else name + encode(key)

    def clocks_key(self) -> str:
        """The HASH of the workers' clocks: worker name -> its offset to the Redis clock,
        the round trip that bounds it, and when it was measured (see
        :mod:`throttle.redis.clock`)."""
        return f"{self.base}clocks"

    def stats_key(self, minute: int) -> str:
        """The HASH of fleet-wide counts of one minute (``minute`` = epoch s // 60):
        field ``EVENT:LIMIT`` -> count (see :mod:`throttle.stats`)."""
        return f"{self.base}stats:{minute}"
