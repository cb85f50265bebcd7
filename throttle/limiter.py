"""The limiter: acquire tokens from one or more limits, settle them later.

One Redis round trip per decision: the arithmetic runs in ``lua/acquire.lua`` on the Redis
server, against the Redis clock. This module validates arguments, names keys (through
:mod:`throttle.redis.keys`), calls the script (:func:`throttle.redis.client.run_script`)
and has its reply decoded into a :class:`Decision` (:mod:`throttle.redis.replies`).
It is on the hot path of every throttled call, so it avoids work it can do once: a limit's
arguments are encoded once per limit (:mod:`throttle.redis.wire`), key names are cached,
scripts are registered once per set of algorithms.

Example::

    import redis
    from throttle import Limit, Limiter

    limiter = Limiter(redis.Redis.from_url("redis://localhost:6379/0"))
    per_tenant = Limit.parse("10/s", name="per-tenant")
    fleet = Limit.parse("100/s burst 20", name="fleet", algorithm="gcra")
    daily = Limit.parse("50000/d", name="daily", algorithm="fixed_window")

    decision = limiter.acquire_many(
        [(per_tenant, "acme"), (fleet, None), (daily, "acme")], cost=1
    )
    if not decision:
        print("come back in", decision.retry_after_s, "s; denied by", decision.denied_by)

    # Reserve an estimated cost, settle the actual one afterwards (refund or charge):
    tokens = Limit.parse("90000/m", name="llm-tokens")
    decision = limiter.acquire(tokens, "acme", cost=2000, acquisition_id="task-1")
    ...  # call the API, learn it used 1200 tokens
    limiter.settle(decision.acquisition, 1200)  # 800 refunded
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeAlias, TypeVar

from redis.commands.core import Script

from throttle.decision import Acquisition, Decision, LimitState, Settlement
from throttle.errors import CostExceedsCapacity, RequestError, ThrottleError
from throttle.redis.client import (
    RedisClient,
    check_client,
    client_from_url,
    run_routine,
    run_routines,
    wrap_errors,
)
from throttle.redis.direct import direct_calls
from throttle.redis.keys import KeySpace
from throttle.redis.library import Library, Routine
from throttle.redis.replies import (
    acquire_decision,
    held_s,
    holds,
    one_limit_decision,
    peek_state,
    series_decisions,
    settlement,
)
from throttle.redis.scripts import (
    ONE_LIMIT_OPERATION,
    SERIES_OPERATION,
    function_name,
    operation_source,
    script_source,
)
from throttle.redis.wire import (
    HOLD_FOREVER_US,
    limit_args,
    pack_numbers,
    target_args,
    target_numbers,
)
from throttle.spec import MAX_AMOUNT, Limit
from throttle.units import MAX_DURATION_S, real

__all__ = [
    "DEFAULT_LEASE_S", "HOLD_PLACED", "MAX_DURATION_S", "Acquire", "Limiter", "Request",
    "RequestBuilder",
]  # fmt: skip

DEFAULT_LEASE_S = 300.0
"""How long a recorded acquisition (and its concurrency units) lives after its slot, in s."""
MAX_AGO_S = 1.0
"""The furthest back :meth:`Limiter.acquire_each` dates an acquisition, in s: a key's TTL is
set from the dated time, with a second to spare."""
HOLD_PLACED = "!held"
"""The word an announcement of a hold placed (or lengthened) carries on the capacity
channel (:meth:`KeySpace.capacity_channel`) besides the limit's name (``lua/hold.lua``
writes it; no limit is named so)."""

_INF = math.inf
_SEVERAL = ("conc", "fair")  # codes only lua/acquire.lua runs (not acquire_one.lua)
_NO_WAIT = 0.0  # the default max_wait_s, recognised by identity


class Acquire(NamedTuple):
    """One acquisition of :meth:`Limiter.acquire_batch`: the arguments of
    :meth:`Limiter.acquire_many`, with the same defaults and meaning."""

    targets: Sequence[tuple[Limit, str | None] | tuple[Limit, str | None, float]]
    cost: float = 1.0
    max_wait_s: float = _NO_WAIT
    acquisition_id: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    reserve_until: float | None = None


MAX_DEBT_S = 86400.0
"""The longest one call's cost may keep a key of a rate limit waiting, in s: a settle
charging more (a debt beyond the burst that the limit's rate takes longer than this to
repay) or a spacing as long is a mistake (a typo, a unit mixed up), refused."""


def _most_owed(limit: Limit) -> float:
    """The largest cost one call of ``limit`` may be charged or spaced for: its burst and
    :data:`MAX_DEBT_S` of its rate."""
    return min(limit.capacity + limit.count * MAX_DEBT_S / limit.period_s, MAX_AMOUNT)


def checked_actual(limit: Limit, actual: object) -> float:
    """``actual`` as a settle of ``limit`` takes it (a number from 0 to :func:`_most_owed`;
    any number for a concurrency limit, whose units come back whatever the cost), or the
    :class:`RequestError` that settle raises for it."""
    most = MAX_AMOUNT if limit.algorithm.holds_units else _most_owed(limit)
    return _number(actual, f"actual_cost of limit {limit.name!r}", most=most)


def _number(value: object, what: str, *, positive: bool = False, most: float = _INF) -> float:
    """``value`` as a finite float >= 0 (> 0 when ``positive``, <= ``most``), or a
    RequestError that names ``what`` and the value."""
    number = real(value)
    if number is None:
        raise RequestError(f"{what} must be a number (got {value!r})")
    if (number > 0 if positive else number >= 0) and number <= most and number != _INF:
        return number
    # NaN fails every comparison, so it lands here as well.
    bound = "> 0" if positive else ">= 0"
    if most != _INF:
        bound += f" and <= {most:g}"
    raise RequestError(f"{what} must be a finite number {bound} (got {value!r})")


def _options(cost: object, max_wait_s: object, lease_s: object) -> tuple[float, int, float]:
    """The options of an acquire, checked: cost, max_wait in us, lease_s."""
    # A plain float passes at once.
    checked_cost = cost if type(cost) is float and 0.0 <= cost < _INF else _number(cost, "cost")
    # The defaults are checked by identity: this is the hot path.
    max_wait_us = 0
    if max_wait_s is not _NO_WAIT:
        max_wait_us = round(_number(max_wait_s, "max_wait_s", most=MAX_DURATION_S) * 1e6)
    lease = DEFAULT_LEASE_S
    if lease_s is not DEFAULT_LEASE_S:
        lease = _number(lease_s, "lease_s", positive=True, most=MAX_DURATION_S)
    return checked_cost, max_wait_us, lease


_S = TypeVar("_S")
"""A registered operation: a :class:`~throttle.redis.library.Routine` of redis-py's
``Script`` here, of its ``AsyncScript`` in :mod:`throttle.aio`."""
_R = TypeVar("_R")

Request: TypeAlias = tuple[_S, Sequence[str], list[Any], Callable[[Any], _R]]
"""One script call, built and not yet sent: (script, keys, args, the decoder of its reply)."""
Series: TypeAlias = tuple[tuple[int, ...], Request[_S, list[Decision | ThrottleError]]]
"""A call of :meth:`Limiter.acquire_each` and the positions of the targets its reply
decides, in order."""


class RequestBuilder(Generic[_S]):
    """The pure part of a limiter, shared by :class:`Limiter` and :class:`throttle.aio.Limiter`:
    it checks a call's arguments, names its keys, builds its script arguments and picks the
    script; the decoders of :mod:`throttle.redis.replies` read the reply. A subclass only
    sends the call (one round trip, blocking or awaited), so the two limiters cannot drift.

    Each ``_..._request`` method returns a :data:`Request` (the hot one-limit acquire: the
    script, keys and args alone, decoded with :func:`one_limit_decision`) or raises
    :class:`RequestError` before anything is sent.
    """

    def __init__(
        self,
        register: Callable[[str, str], _S],
        prefix: str,
        namespace: str,
        clock_us: Callable[[], int] | None,
    ) -> None:
        self.keyspace = KeySpace(prefix, namespace)
        self._clock_us = clock_us
        self.fence_s = 0.0
        """The restart fence, in s (0: none). Set it to the longest a caller may still
        sleep to a reserved slot (the Celery layer: ``sleep_max``): then the first script
        that finds the namespace's marker missing (a Redis that is new or lost its data)
        writes it with a fence of this length, and token bucket and GCRA limits read a
        missing state as one that was empty at the fence's end: no new slot comes within a
        spacing of a slot (or call) the lost state may have granted, and they refill from
        there. The cost: one GET per call, and after each loss of the data no slot for
        ``fence_s`` and no burst until refilled (see ``lua/prelude.lua``)."""
        self.limits: dict[str, Limit] = {}
        """Limits known by name, so that :meth:`Limiter.peek` takes a name as
        :meth:`Limiter.hold` does. Empty for a limiter of your own (add yours); the Celery
        layer fills it with the limits file's and the app's inline limits."""
        self._space_script: _S | None = None
        # register(function, source): an operation, called as the library's function or
        # as the script of that source. Registering sends nothing: the library or the
        # script reaches Redis when a call finds it missing.
        self._register = register
        # One (acquire, settle) pair per set of algorithm codes.
        self._scripts: dict[frozenset[str], tuple[_S, _S]] = {}
        # The one-limit acquire script (lua/acquire_one.lua) of each algorithm code.
        self._one: dict[str, _S] = {}
        # The acquire_series script (lua/acquire_series.lua) of each algorithm code.
        self._series: dict[str, _S] = {}
        self._peek: dict[str, _S] = {}
        self._hold_script: _S | None = None
        self._holds_script: _S | None = None

    def _script_of(self, scripts: dict[str, _S], operation: str, limit: Limit) -> _S:
        """The script of a one-limit ``operation`` for ``limit``'s algorithm, registered in
        ``scripts`` (one per algorithm code) on its first use."""
        script = scripts[limit.code] = self._register(
            function_name(operation, limit.code), script_source(operation, limit.codes)
        )
        return script

    def _one_request(
        self,
        limit: Limit,
        key: str | None,
        cost: float,
        max_wait_s: float,
        acquisition_id: str | None,
        lease_s: float,
    ) -> tuple[_S, Sequence[str], list[Any]] | None:
        """The call of lua/acquire_one.lua for an acquire of one limit, or None when the
        acquire needs lua/acquire.lua (an acquisition id, a concurrency or fair limit, not a
        Limit): then :meth:`_many_request` of the one target."""
        if acquisition_id is not None or type(limit) is not Limit or limit.code in _SEVERAL:
            return None
        # The same checks in the same order as _many_request; written out here, because
        # every Python call on this path shows in the latency.
        if (
            type(cost) is float
            and 0.0 <= cost < _INF
            and max_wait_s is _NO_WAIT
            and lease_s is DEFAULT_LEASE_S
        ):
            max_wait_us = 0
        else:
            cost, max_wait_us, _ = _options(cost, max_wait_s, lease_s)
        if key is not None and (type(key) is not str or not key):
            raise RequestError(f"key must be a non-empty string or None (got {key!r})")
        if cost > limit.capacity:
            raise CostExceedsCapacity(limit.name, cost, limit.capacity)
        script = self._one.get(limit.code)
        if script is None:
            script = self._script_of(self._one, ONE_LIMIT_OPERATION, limit)
        _, count, period_us, burst = limit_args(limit)
        clock = self._clock_us
        pair, whole, own = self.keyspace.one_limit(limit, key)
        keys: Sequence[str] = pair
        args = [
            b"" if clock is None else clock(), max_wait_us, count, period_us, burst, cost,
            whole, own,
        ]  # fmt: skip
        if self.fence_s:
            keys = (*keys, self.keyspace.fence_key())
            args.append(round(self.fence_s * 1e6))
        return script, keys, args

    def _many_request(
        self,
        targets: Sequence[tuple[Limit, str | None] | tuple[Limit, str | None, float]],
        cost: float,
        max_wait_s: float,
        acquisition_id: str | None,
        lease_s: float,
        reserve_until: float | None = None,
    ) -> Request[_S, Decision]:
        """The call of an acquire of several targets (see :meth:`Limiter.acquire_many`)."""
        targets = _checked_targets(targets, (2, 3))
        n = len(targets)
        checked = _options(cost, max_wait_s, lease_s)
        if not targets:
            raise RequestError("acquire needs at least one limit")
        cost, max_wait_us, lease_s = checked
        if reserve_until is not None:
            # Sent negated: the script measures the window from its own TIME (acquire.lua).
            max_wait_us = -round(_number(reserve_until, "reserve_until", positive=True) * 1e6)
        elif n == 1 and acquisition_id is None:
            # The common call: lua/acquire_one.lua (the options are checked already, and
            # cost is a plain float now, so _one_request's checks pass at once).
            target = targets[0]
            limit = target[0]
            if type(limit) is Limit and limit.code not in _SEVERAL:
                own = cost
                if len(target) == 3:
                    own = _number(target[2], f"cost of limit {limit.name!r}")
                one = self._one_request(limit, target[1], own, max_wait_s, None, lease_s)
                if one is not None:
                    return (*one, functools.partial(one_limit_decision, limit, own))
        keyspace = self.keyspace
        keys: list[str] = [keyspace.holds_key()]
        args: list[Any] = [b"", max_wait_us, n]
        pairs, costs, fields = _encode_targets(keyspace, targets, cost, keys, args)
        if n > 1 and len(set(keys)) != len(keys):
            raise RequestError("the same limit and key appear twice in one acquisition")
        codes = pairs[0][0].codes if n == 1 else frozenset(lim.code for lim, _ in pairs)
        if acquisition_id is None and "conc" in codes:
            acquisition_id = uuid.uuid4().hex  # a concurrency holder needs a name
        if acquisition_id is not None:
            if type(acquisition_id) is not str or not acquisition_id:
                raise RequestError(
                    f"acquisition_id must be a non-empty string (got {acquisition_id!r})"
                )
            keys.append(keyspace.lease_key(acquisition_id))
        args.extend((acquisition_id or b"", max(round(lease_s * 1e6), 1), *fields))
        if self._clock_us is not None:
            args[0] = self._clock_us()
        # What settle needs: the state keys and the lease record, without the holds.
        decode = functools.partial(acquire_decision, pairs, costs, acquisition_id, tuple(keys[1:]))
        if self.fence_s:  # the marker goes before the lease record, which stays last
            keys.insert(len(keys) - (acquisition_id is not None), self.keyspace.fence_key())
            args.append(round(self.fence_s * 1e6))
        return self._scripts_for(codes)[0], keys, args, decode

    def _each_requests(
        self,
        targets: Sequence[tuple[Limit, str | None, float]],
        max_wait_s: float,
        ago_s: Sequence[float] | None,
    ) -> tuple[list[Decision | ThrottleError | None], list[Series[_S]]]:
        """The calls of an acquire of each target on its own (see
        :meth:`Limiter.acquire_each`), each target dated ``ago_s`` back: per target, the
        error its arguments raise or None (its call decides it); and the calls, each with
        the positions of the targets it decides. The targets of one limit and key go in one
        call (``lua/acquire_series.lua``, in their order) where its algorithm allows (a
        token bucket, GCRA or window: one state per key); the others one call each."""
        targets = _checked_targets(targets, (3,))
        if ago_s is not None and (isinstance(ago_s, str) or not hasattr(ago_s, "__len__")):
            raise RequestError(f"ago_s must be one number of s per target, a list (got {ago_s!r})")
        if ago_s is not None and len(ago_s) != len(targets):
            raise RequestError(f"ago_s has {len(ago_s)} values for {len(targets)} targets")
        out: list[Decision | ThrottleError | None] = [None] * len(targets)
        calls: list[Series[_S]] = []
        groups: dict[tuple[Limit, str | None], list[tuple[int, float, int]]] = {}
        try:
            _, max_wait_us, _ = _options(1.0, max_wait_s, DEFAULT_LEASE_S)
        except ThrottleError as exc:
            return [exc] * len(targets), []
        for i, (limit, key, cost) in enumerate(targets):
            ago = 0.0
            if ago_s is not None:
                given = real(ago_s[i])
                if given is None or math.isnan(given):
                    out[i] = RequestError(f"ago_s must be a number of s (got {ago_s[i]!r})")
                    continue
                ago = min(max(given, 0.0), MAX_AGO_S)  # < 0: now; beyond: MAX_AGO_S ago
            if type(limit) is Limit and limit.code not in _SEVERAL:
                try:
                    own = _checked_ask(limit, key, cost)
                except ThrottleError as exc:
                    out[i] = exc
                    continue
                groups.setdefault((limit, key), []).append((i, own, round(ago * 1e6)))
                continue
            try:
                request = self._many_request(
                    [(limit, key, cost)], 1.0, max_wait_s, None, DEFAULT_LEASE_S
                )
            except ThrottleError as exc:
                out[i] = exc
                continue
            if ago > 0:
                ago_us = round(ago * 1e6)
                args = request[2]
                args[0] = -ago_us if self._clock_us is None else self._clock_us() - ago_us
            script, keys, args, decode = request
            calls.append(((i,), (script, keys, args, functools.partial(_as_list, decode))))
        for (limit, key), asks in groups.items():
            calls.append(self._series_request(limit, key, max_wait_us, asks))
        return out, calls

    def _series_request(
        self, limit: Limit, key: str | None, max_wait_us: int, asks: list[tuple[int, float, int]]
    ) -> Series[_S]:
        """The call of lua/acquire_series.lua for ``asks`` (position, cost, ago in us) of
        one limit and key, checked already."""
        script = self._series.get(limit.code)
        if script is None:
            script = self._script_of(self._series, SERIES_OPERATION, limit)
        _, count, period_us, burst = limit_args(limit)
        clock = self._clock_us
        pair, whole, own = self.keyspace.one_limit(limit, key)
        keys: Sequence[str] = pair
        fence: Any = b""
        if self.fence_s:
            keys = (*keys, self.keyspace.fence_key())
            fence = round(self.fence_s * 1e6)
        args: list[Any] = [
            b"" if clock is None else clock(), max_wait_us, count, period_us, burst, whole, own,
            fence,
        ]  # fmt: skip
        costs: list[float] = []
        for _, cost, ago_us in asks:
            args.append(ago_us)
            args.append(cost)
            costs.append(cost)
        decode = functools.partial(series_decisions, limit, costs)
        return tuple(i for i, _, _ in asks), (script, keys, args, decode)

    def _batch_requests(
        self, calls: Sequence[Acquire]
    ) -> list[Request[_S, Decision] | ThrottleError]:
        """The calls of :meth:`Limiter.acquire_batch`: per acquisition, its call or the
        error its arguments raise."""
        built: list[Request[_S, Decision] | ThrottleError] = []
        for call in calls:
            try:
                built.append(self._many_request(*call))  # its fields in the same order
            except ThrottleError as exc:
                built.append(exc)
        return built

    def _settle_request(
        self,
        acquisition: Acquisition,
        actual_cost: float | Sequence[float | None] | None,
        unless_found: bool = False,
    ) -> Request[_S, Settlement]:
        """The call of a settle (see :meth:`Limiter.settle`); ``unless_found``: none if an
        acquire under the same id has found the record since (status
        ``already_settled``: the give-back of a cancelled acquire whose retry took the
        record over)."""
        if not isinstance(acquisition, Acquisition):
            raise RequestError(
                f"settle needs the Acquisition of an allowed, recorded decision "
                f"(got {acquisition!r})"
            )
        n = len(acquisition.targets)
        actuals: Sequence[float | None]
        if actual_cost is None or not isinstance(actual_cost, Sequence):
            actuals = (actual_cost,) * n
        else:
            actuals = actual_cost
            if len(actuals) != n:
                raise RequestError(
                    f"settle got {len(actuals)} actual costs for {n} limits: give one number, "
                    "or one per limit"
                )
        args: list[Any] = [b"", acquisition.id, n]
        for (limit, key), actual in zip(acquisition.targets, actuals, strict=True):
            args.extend(target_args(limit, key))
            if actual is None:
                args.append(b"")
                continue
            args.append(checked_actual(limit, actual))
        # A refund or a released unit is announced, for the tasks waiting for it.
        args.append(self.keyspace.capacity_channel())
        args.extend(limit.name for limit, _ in acquisition.targets)
        args.append(b"1" if unless_found else b"")
        if self._clock_us is not None:
            args[0] = self._clock_us()
        codes = frozenset(limit.code for limit, _ in acquisition.targets)
        return self._scripts_for(codes)[1], list(acquisition.keys), args, settlement

    def _peek_request(
        self, limit: Limit | str, key: str | None, cost: float
    ) -> Request[_S, LimitState]:
        """The call of a peek (see :meth:`Limiter.peek`)."""
        if isinstance(limit, str):
            known = self.limits.get(limit)
            if known is None:
                names = ", ".join(sorted(self.limits)) or "none"
                raise RequestError(
                    f"unknown limit {limit!r}: peek needs its rate; known limits: {names} "
                    "(add yours to Limiter.limits, or pass a Limit)"
                )
            limit = known
        if not isinstance(limit, Limit):
            raise RequestError(f"expected a Limit, e.g. Limit.parse('50/s') (got {limit!r})")
        if key is not None and (type(key) is not str or not key):
            raise RequestError(f"key must be a non-empty string or None (got {key!r})")
        asked = min(_number(cost, "cost"), limit.capacity)
        keyspace = self.keyspace
        keys = [keyspace.holds_key(), *keyspace.state_keys(limit, key)]
        args: list[Any] = [b"", 0, 1, *target_args(limit, key), repr(asked), b"", 1]
        args.extend(keyspace.hold_fields(limit.name, key))
        if self._clock_us is not None:
            args[0] = self._clock_us()
        if self.fence_s:  # read as the acquires read it (never written by a peek)
            keys.append(keyspace.fence_key())
            args[1] = 1
        script = self._peek.get(limit.code)
        if script is None:
            script = self._peek[limit.code] = self._register(
                function_name("peek"), script_source("peek", limit.codes)
            )
        return script, keys, args, functools.partial(peek_state, limit.name)

    def _hold_request(
        self, limit: Limit | str, key: str | None, seconds: float | None
    ) -> Request[_S, float]:
        """The call of a hold (see :meth:`Limiter.hold`): its decoder gives the seconds the
        hold now lasts."""
        if seconds is None:
            for_us = HOLD_FOREVER_US
        else:
            for_us = max(round(_number(seconds, "seconds", most=MAX_DURATION_S) * 1e6), 1)
        script, keys, args = self._hold_call(limit, key, for_us)
        name = limit.name if isinstance(limit, Limit) else limit
        # Announced (HOLD_PLACED): a worker that admitted a task before the hold looks
        # again before the task runs.
        return script, keys, [*args, self.keyspace.capacity_channel(), name], _held_s

    def _unhold_request(self, limit: Limit | str, key: str | None) -> Request[_S, None]:
        """The call of an unhold (see :meth:`Limiter.unhold`): the lifting is announced
        on the capacity channel (:meth:`KeySpace.capacity_channel`)."""
        script, keys, args = self._hold_call(limit, key, b"")
        name = limit.name if isinstance(limit, Limit) else limit
        return script, keys, [*args, self.keyspace.capacity_channel(), name], _nothing

    def _hold_call(
        self, limit: Limit | str, key: str | None, for_us: int | bytes
    ) -> tuple[_S, Sequence[str], list[Any]]:
        name = limit.name if isinstance(limit, Limit) else limit
        if type(name) is not str or not name:
            raise RequestError(f"hold needs a limit or a limit's name (got {limit!r})")
        if key is not None and (type(key) is not str or not key):
            raise RequestError(f"key must be a non-empty string or None (got {key!r})")
        whole, own = self.keyspace.hold_fields(name, key)
        if self._hold_script is None:
            self._hold_script = self._register(function_name("hold"), operation_source("hold"))
        now = b"" if self._clock_us is None else self._clock_us()
        return self._hold_script, [self.keyspace.holds_key()], [now, own or whole, for_us]

    def _holds_request(self) -> Request[_S, dict[tuple[str, str | None], float]]:
        """The call of :meth:`Limiter.holds`."""
        if self._holds_script is None:
            self._holds_script = self._register(function_name("holds"), operation_source("holds"))
        now = b"" if self._clock_us is None else self._clock_us()
        return self._holds_script, [self.keyspace.holds_key()], [now], holds

    def _space_request(
        self, targets: Sequence[tuple[Limit, str | None, float]]
    ) -> Request[_S, float]:
        """The call of the spacing guard (see :meth:`Limiter.space`): its decoder gives the
        seconds to wait before the call."""
        keys: list[str] = []
        args: list[Any] = [b"" if self._clock_us is None else self._clock_us(), b""]
        units: list[str] = []
        for limit, key, cost in targets:
            if not isinstance(limit, Limit) or limit.code == "conc":
                raise RequestError(f"the spacing guard needs a rate limit (got {limit!r})")
            if key is not None and (type(key) is not str or not key):
                raise RequestError(f"key must be a non-empty string or None (got {key!r})")
            own = _number(cost, f"cost of limit {limit.name!r}", most=_most_owed(limit))
            spacing_us = limit.period_s * 1e6 / limit.count * own
            # A fair limit's rate is its keys' total: its calls are spaced as one.
            keys.append(self.keyspace.space_key(limit, None if limit.fair else key))
            args.append(repr(spacing_us))
            units.append(repr(limit.period_s * 1e6 / limit.count))
        if not keys:
            raise RequestError("the spacing guard needs at least one limit")
        args.extend(units)  # the spacing per unit now: a rate raised since shortens the wait
        if self.fence_s:
            keys.append(self.keyspace.fence_key())
            args[1] = round(self.fence_s * 1e6)
        if self._space_script is None:
            self._space_script = self._register(function_name("space"), operation_source("space"))
        return self._space_script, keys, args, _space_s

    def _scripts_for(self, codes: frozenset[str]) -> tuple[_S, _S]:
        scripts = self._scripts.get(codes)
        if scripts is None:
            register = self._register
            scripts = (
                register(function_name("acquire"), script_source("acquire", codes)),
                register(function_name("settle"), script_source("settle", codes)),
            )
            self._scripts[codes] = scripts
        return scripts


class Limiter(RequestBuilder[Routine[Script]]):
    """Acquires and settles tokens of limits kept in Redis.

    Parameters
    ----------
    client:
        A redis-py client: ``redis.Redis``, or ``redis.cluster.RedisCluster`` for a Redis
        Cluster (every key of a namespace shares one hash slot, so every script of this
        limiter runs on the one master of that slot). The limiter opens no connection
        before its first call.
    prefix, namespace:
        Where the keys live (see :class:`throttle.redis.keys.KeySpace`).
    clock_us:
        Tests only: a callable returning "now" in microseconds, sent to the scripts
        instead of letting them read Redis ``TIME``. Production code never sets it, so
        the only clock is the Redis server's and worker clocks never enter the math.
    own_connections:
        True (the default): the limiter's function calls go out on connections it keeps
        from the client's pool (:mod:`throttle.redis.direct`), about half the client's
        CPU per call, past redis-py's per-command hooks (so an instrumentation of
        ``Redis.execute_command``, such as OpenTelemetry's, does not see them). False:
        every call through the client. A client for which it cannot be done (a cluster,
        RESP3, ...) always uses the client.

    Notes
    -----
    For asyncio code (``redis.asyncio``), :class:`throttle.aio.Limiter` has the same
    methods, awaited, and builds the same calls (:class:`RequestBuilder`).
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str = "throttle",
        namespace: str = "default",
        clock_us: Callable[[], int] | None = None,
        own_connections: bool = True,
    ) -> None:
        check_client(client)
        self.library = Library(client)
        """Whether this limiter calls Redis functions or scripts (see
        :mod:`throttle.redis.library`)."""

        def register(function: str, source: str) -> Routine[Script]:
            return Routine(self.library, function, client.register_script(source))

        super().__init__(register, prefix, namespace, clock_us)
        self.client = client
        self._direct = direct_calls(client) if own_connections else None

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "throttle",
        namespace: str = "default",
        own_connections: bool = True,
        **client_options: Any,
    ) -> Limiter:
        """A limiter on the Redis at ``url``: a client built by
        :func:`throttle.redis.client.client_from_url` (one server, Sentinel or Cluster
        URLs; socket timeouts of :data:`~throttle.redis.client.DEFAULT_TIMEOUT_S` unless
        given in ``client_options``). No connection is opened here: an unreachable Redis
        makes the calls raise :class:`BackendUnavailable`; a malformed Sentinel or cluster
        URL raises :class:`ConfigError` here.
        """
        return cls(
            client_from_url(url, **client_options),
            prefix=prefix,
            namespace=namespace,
            own_connections=own_connections,
        )

    def acquire(
        self,
        limit: Limit,
        key: str | None = None,
        *,
        cost: float = 1.0,
        max_wait_s: float = _NO_WAIT,
        acquisition_id: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> Decision:
        """Take ``cost`` tokens from one limit for ``key``; see :meth:`acquire_many`."""
        one = self._one_request(limit, key, cost, max_wait_s, acquisition_id, lease_s)
        if one is None:
            return self.acquire_many(
                ((limit, key),),
                cost=cost,
                max_wait_s=max_wait_s,
                acquisition_id=acquisition_id,
                lease_s=lease_s,
            )
        # The common call, one limit and nothing to record: lua/acquire_one.lua.
        script, keys, args = one
        return one_limit_decision(limit, cost, self._call(script, keys, args))

    def acquire_many(
        self,
        targets: Sequence[tuple[Limit, str | None] | tuple[Limit, str | None, float]],
        *,
        cost: float = 1.0,
        max_wait_s: float = _NO_WAIT,
        acquisition_id: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        reserve_until: float | None = None,
    ) -> Decision:
        """Take ``cost`` tokens from every ``(limit, key)`` target at once, or from none.

        Parameters
        ----------
        targets:
            Pairs of a limit and the key it applies to (``None``: one state for all), or
            triples that add this limit's own cost (one call may cost 1 request from one
            limit and 2000 tokens from another).
        cost:
            Tokens to take from each limit without a cost of its own, >= 0, fractions
            allowed. A cost above a limit's capacity raises :class:`CostExceedsCapacity`
            (it could never pass).
        max_wait_s:
            Reserve instead of deny when token bucket and GCRA limits can admit the cost
            within this many seconds: the tokens are taken now and ``Decision.wait_s``
            says when the slot comes. Window and concurrency limits admit now or deny.
        reserve_until:
            Instead of ``max_wait_s``: reserve no slot later than this time, in epoch s on
            the Redis clock (a deadline such as a task's expiry). The script measures the
            window from its own ``TIME``, so the call's latency cannot carry a slot past
            it, as ``max_wait_s`` computed by the caller beforehand could. A deadline
            already passed reads as ``max_wait_s=0`` (admitted if there is room now).
        acquisition_id:
            Records the acquisition under this id (a task id, say) so that it can be
            settled, and so that acquiring again with the same id, on the same limits and
            keys, while the record lives and is not settled, takes nothing twice
            (``Decision.held``). Generated when a concurrency limit is among the targets
            and none is given.
        lease_s:
            How long the record and concurrency units live after the slot, in seconds; a
            holder that dies without settling gives its units back when it ends.

        Raises
        ------
        RequestError
            On an invalid argument (cost, key, wait, lease, the same target twice), or when
            ``acquisition_id`` already holds a live lease on other limits or keys.
        BackendUnavailable, BackendError
            When Redis cannot be reached or answers with an error.
        """
        script, keys, args, decode = self._many_request(
            targets, cost, max_wait_s, acquisition_id, lease_s, reserve_until
        )
        return decode(self._call(script, keys, args))

    def acquire_each(
        self,
        targets: Sequence[tuple[Limit, str | None, float]],
        *,
        max_wait_s: float = _NO_WAIT,
        ago_s: Sequence[float] | None = None,
    ) -> list[Decision | ThrottleError]:
        """Take each ``(limit, key, cost)`` target on its own (each one passes or not
        alone, where :meth:`acquire_many` takes all or none), in one round trip.

        Parameters
        ----------
        targets:
            The acquisitions, in the order Redis runs them.
        max_wait_s:
            As for :meth:`acquire_many`, for each.
        ago_s:
            How long ago each was asked for, in s (0 to :data:`MAX_AGO_S`, longer counts
            as that): each is taken as of Redis ``TIME`` less it, so asks gathered for a
            moment and sent together see the spacing they came with. None: now.

        Returns
        -------
        Per target, its :class:`Decision`, or the :class:`ThrottleError` it failed with
        (an invalid argument, an error on the server); no target is recorded for
        settling. Raises :class:`BackendUnavailable` when Redis cannot be reached (which
        of the targets were taken is then not known).

        Where the limiter's calls go on connections of its own (see ``own_connections``)
        and Redis takes functions, the calls are pipelined: about a quarter of the client's
        CPU per call of separate round trips, for ten at a time. Otherwise they go one by
        one.
        """
        out, calls = self._each_requests(targets, max_wait_s, ago_s)
        replies = run_routines(self.client, [call[:3] for _, call in calls], self._direct)
        for (positions, call), reply in zip(calls, replies, strict=True):
            _place(out, positions, call[3], reply)
        return _placed(out)

    def acquire_batch(self, calls: Sequence[Acquire]) -> list[Decision | ThrottleError]:
        """Several independent :meth:`acquire_many` calls (each all or nothing, each with
        its own targets, cost, wait and acquisition id), run by Redis one after the other
        in the order given, in one round trip.

        For a caller that decides for many waiting jobs at once (a scheduler admitting a
        queue): one send and one read for all of them, where separate calls would cost
        one each. The calls are independent: one denied does not stop the next (a
        cheaper one behind it may pass), so a caller that must keep an order among jobs
        of the same limit asks for no more of them than the limit is likely to admit.

        Returns, per call, its :class:`Decision`, or the :class:`ThrottleError` it failed
        with (an invalid argument, an error on the server). Raises
        :class:`BackendUnavailable` when Redis cannot be reached (which calls were taken
        is then not known: an acquisition id makes asking again safe). Pipelined as
        :meth:`acquire_each` is; otherwise the calls go one by one.
        """
        return self._send_each(self._batch_requests(calls))

    def _send_each(
        self, built: Sequence[Request[Routine[Script], Decision] | ThrottleError]
    ) -> list[Decision | ThrottleError]:
        """Send the built calls in one round trip (:func:`run_routines`); each call's
        decision, or the error it was built or answered with, in order."""
        sent = [request for request in built if not isinstance(request, ThrottleError)]
        replies = iter(run_routines(self.client, [r[:3] for r in sent], self._direct))
        out: list[Decision | ThrottleError] = []
        for item in built:
            if isinstance(item, ThrottleError):
                out.append(item)
                continue
            reply = next(replies)
            if isinstance(reply, ThrottleError):
                out.append(reply)
                continue
            try:
                out.append(item[3](reply))
            except ThrottleError as exc:  # a reply that names a misuse (a lease in use)
                out.append(exc)
        return out

    def settle(
        self, acquisition: Acquisition, actual_cost: float | Sequence[float | None] | None
    ) -> Settlement:
        """Finish an acquisition with what it really cost, and release its concurrency units.

        ``actual_cost`` is one number for every limit, one per limit (in the order of the
        acquisition's targets; ``None`` for a limit keeps its reserved cost), or ``None``
        to keep every reserved cost (a plain release). The difference to the reserved cost
        is refunded (never above capacity; for GCRA never to a slot before now; for windows
        only to the window that paid, while it counts) or charged (debt is allowed: later
        callers wait for it). Settling twice, or an acquisition whose record expired,
        changes nothing and says so in :attr:`Settlement.status`.
        """
        script, keys, args, decode = self._settle_request(acquisition, actual_cost)
        return decode(self._call(script, keys, args))

    def release(self, acquisition: Acquisition) -> Settlement:
        """Settle at the reserved cost: release concurrency units, refund or charge nothing."""
        return self.settle(acquisition, None)

    def peek(self, limit: Limit | str, key: str | None = None, *, cost: float = 1.0) -> LimitState:
        """What an acquire of ``cost`` would be told now, taking nothing: the ``remaining``
        tokens now (units, for concurrency), ``retry_after_s`` until such a call could pass
        (the next free slot; ``inf`` while the limit is paused), ``reset_after_s`` until
        full. For status displays and gauges: one round trip, like an acquire. ``limit``
        is a :class:`Limit`, or the name of one in :attr:`limits` (a throttled app's
        limiter knows its file's and inline limits)."""
        script, keys, args, decode = self._peek_request(limit, key, cost)
        return decode(self._call(script, keys, args))

    def hold(
        self, limit: Limit | str, key: str | None = None, seconds: float | None = None
    ) -> float:
        """Admit nothing of ``limit`` (of its ``key`` only, when given; of every key when
        None) for ``seconds`` (None: until :meth:`unhold`, a pause), from the Redis clock.

        The upstream's word (a 429 with Retry-After) and the operator's brake. A hold only
        lengthens: a shorter one leaves a longer one (or a pause) in place. Acquisitions are
        denied with ``retry_after_s`` = the time left (``inf`` for a pause); a recorded
        acquisition whose reserved slot falls inside a hold placed after it is voided when
        acquired again with its id (what a throttled task does at its slot). Returns the
        seconds the hold now lasts (``inf`` for a pause).
        """
        script, keys, args, decode = self._hold_request(limit, key, seconds)
        return decode(self._call(script, keys, args))

    def unhold(self, limit: Limit | str, key: str | None = None) -> None:
        """Lift the hold (or pause) of ``limit`` (of its ``key``, when given)."""
        script, keys, args, _ = self._unhold_request(limit, key)
        self._call(script, keys, args)

    def mark_started(self) -> None:
        """Say that this deployment's callers start now, none of them sleeping to a slot
        yet: a Redis (or namespace) without the restart fence's marker gets one that has
        ended, so that :attr:`fence_s` does not deny the first calls for its length (a
        new Redis looks like one that lost its data). Call it once at start-up, before
        the first acquire, when you set ``fence_s``, as the Celery layer's workers do. A
        marker already there is left alone. One round trip."""
        key = self.keyspace.fence_key()
        wrap_errors(lambda: self.client.set(key, 0, nx=True))

    def holds(self) -> dict[tuple[str, str | None], float]:
        """The live holds of the namespace: (limit, key or None) -> seconds left (``inf``:
        a pause). Keys longer than 100 characters show as their hash (``#...``).

        One script (lua/holds.lua), so that "now" is the clock of the Redis that keeps the
        holds: in a Redis Cluster, the master of the namespace's slot."""
        script, keys, args, decode = self._holds_request()
        return decode(self._call(script, keys, args))

    def space(self, targets: Sequence[tuple[Limit, str | None, float]]) -> float:
        """The call-time spacing guard: stamp a call that is about to be made, on the Redis
        clock, and return how long to wait first (s; 0 when every ``(limit, key, cost)``
        target's previous call is at least its spacing ago: ``period / count * cost`` of
        the previous call).

        For callers that sleep to reserved slots: a caller that reached its slot late
        (a busy host) and one on time would otherwise call closer than the limit's spacing,
        which a strict upstream (burst 1) refuses. One round trip per call; calls of one
        target are then at least a spacing apart as stamped, so the guard suits limits of
        burst 1 (it takes away a burst). Rate limits only (not concurrency). A fair limit
        is guarded as one, whatever the key: its rate is the total of its keys'."""
        script, keys, args, decode = self._space_request(targets)
        return decode(self._call(script, keys, args))

    def _call(self, routine: Routine[Script], keys: Sequence[str], args: list[Any]) -> Any:
        """One call through :func:`run_routine` (the one place bench/core.py taps)."""
        return run_routine(self.client, routine, keys, args, self._direct)


def _checked_ask(limit: Limit, key: str | None, cost: object) -> float:
    """The cost of one ask of ``limit`` for ``key``, checked as :meth:`RequestBuilder._one_request`
    checks a target (a RequestError or CostExceedsCapacity otherwise)."""
    own = cost if type(cost) is float and 0.0 <= cost < _INF else None
    if own is None:
        own = _number(cost, f"cost of limit {limit.name!r}")
    if key is not None and (type(key) is not str or not key):
        raise RequestError(f"key must be a non-empty string or None (got {key!r})")
    if own > limit.capacity:
        raise CostExceedsCapacity(limit.name, own, limit.capacity)
    return own


def _as_list(decode: Callable[[Any], Decision], raw: Any) -> list[Decision | ThrottleError]:
    """A one-target call's decision as a series call's: a list of one."""
    return [decode(raw)]


def _place(
    out: list[Decision | ThrottleError | None],
    positions: tuple[int, ...],
    decode: Callable[[Any], list[Decision | ThrottleError]],
    reply: Any,
) -> None:
    """Put the decisions of one call of :meth:`Limiter.acquire_each` (its ``reply``, or the
    error it failed with) in the places of its targets."""
    try:
        decided = [reply] * len(positions) if isinstance(reply, ThrottleError) else decode(reply)
    except ThrottleError as exc:  # a reply that names a misuse, or a malformed one
        decided = [exc] * len(positions)
    for position, decision in zip(positions, decided, strict=True):
        out[position] = decision


def _placed(out: list[Decision | ThrottleError | None]) -> list[Decision | ThrottleError]:
    """The outcomes of :meth:`Limiter.acquire_each`, each target's placed."""
    placed: list[Decision | ThrottleError] = []
    for item in out:
        assert item is not None, "every target is decided or failed"
        placed.append(item)
    return placed


def _held_s(raw: Any) -> float:
    """The reply of lua/hold.lua (us the hold now lasts) in s, ``inf`` for a pause."""
    return held_s(float(raw) / 1e6)


def _space_s(raw: Any) -> float:
    """The reply of lua/space.lua (us to wait) in s."""
    return int(raw) / 1e6


def _nothing(raw: Any) -> None:
    """The decoder of a call whose reply says nothing (unhold)."""


def _checked_targets(targets: Any, sizes: tuple[int, ...]) -> Sequence[Any]:
    """``targets`` when it is a sequence of tuples of one of ``sizes`` (``(limit, key)``,
    ``(limit, key, cost)``), else a RequestError that says what is wrong."""
    shapes = " or ".join(("(limit, key)", "(limit, key, cost)")[size - 2] for size in sizes)
    if not isinstance(targets, Sequence) or isinstance(targets, str | bytes):
        raise RequestError(f"expected a list of {shapes} tuples (got {targets!r})")
    for target in targets:
        if not isinstance(target, tuple | list) or len(target) not in sizes:
            raise RequestError(f"each target is a {shapes} tuple (got {target!r})")
    return targets


def _encode_targets(
    keyspace: KeySpace,
    targets: Sequence[tuple[Limit, str | None] | tuple[Limit, str | None, float]],
    cost: float,
    keys: list[str],
    args: list[Any],
) -> tuple[list[tuple[Limit, str | None]], list[float], list[str]]:
    """Check each target of an acquisition and append its state keys to ``keys`` and its
    script arguments to ``args`` (lua/acquire.lua: each limit's code, then one value of
    every limit's numbers and cost, packed); returns the (limit, key) pairs, each limit's
    cost, and the fields of the holds hash the script reads."""
    pairs: list[tuple[Limit, str | None]] = []
    costs: list[float] = []
    fields: list[str] = []
    numbers: list[float] = []
    for target in targets:
        if len(target) == 3:
            limit, key, own = target
            if type(own) is float and 0.0 <= own < _INF:  # the common case, checked at once
                limit_cost = own
            else:
                limit_cost = _number(own, f"cost of limit {getattr(limit, 'name', limit)!r}")
        else:
            limit, key = target
            limit_cost = cost
        if not isinstance(limit, Limit):
            raise RequestError(f"expected a Limit, e.g. Limit.parse('50/s') (got {limit!r})")
        if key is not None and (type(key) is not str or not key):
            raise RequestError(f"key must be a non-empty string or None (got {key!r})")
        if limit_cost > limit.capacity:
            raise CostExceedsCapacity(limit.name, limit_cost, limit.capacity)
        keys.extend(keyspace.state_keys(limit, key))
        args.append(limit_args(limit)[0])
        numbers.extend(target_numbers(limit, key))
        numbers.append(limit_cost)
        pairs.append((limit, key))
        costs.append(limit_cost)
        fields.extend(keyspace.hold_fields(limit.name, key))
    args.append(pack_numbers(numbers))
    return pairs, costs, fields
