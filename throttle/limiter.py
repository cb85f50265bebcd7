"""The limiter: acquire tokens from one or more limits, settle them later.

One Redis round trip per decision: the arithmetic runs in ``lua/acquire.lua`` on the Redis
server, against the Redis clock. This module validates arguments, names keys (through
:mod:`throttle.keys`), calls the script and turns its reply into a :class:`Decision`.

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

import math
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.commands.core import Script

from throttle.decision import Acquisition, Decision, LimitState, Settlement, SettleStatus
from throttle.errors import (
    BackendError,
    BackendUnavailable,
    CostExceedsCapacity,
    RequestError,
)
from throttle.keys import KeySpace
from throttle.scripts import script_source
from throttle.spec import Algorithm, Limit

__all__ = ["DEFAULT_LEASE_S", "Limiter"]

DEFAULT_LEASE_S = 300.0
"""How long a recorded acquisition (and its concurrency units) lives after its slot, in s."""

# The status codes of lua/settle.lua, in order.
_SETTLE_STATUS: tuple[SettleStatus, ...] = ("settled", "already_settled", "unknown", "mismatch")


def _number(value: object, what: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"{what} must be a number (got {value!r})")
    number = float(value)
    # NaN fails both comparisons, so it is refused here as well.
    if not (number > 0.0 if positive else number >= 0.0) or number == math.inf:
        bound = "> 0" if positive else ">= 0"
        raise RequestError(f"{what} must be a finite number {bound} (got {value!r})")
    return number


class Limiter:
    """Acquires and settles tokens of limits kept in Redis.

    Parameters
    ----------
    client:
        A redis-py client (``redis.Redis``). The limiter opens no connection itself.
    prefix, namespace:
        Where the keys live (see :class:`throttle.keys.KeySpace`).
    clock_us:
        Tests only: a callable returning "now" in microseconds, sent to the scripts
        instead of letting them read Redis ``TIME``. Production code never sets it, so
        the only clock is the Redis server's and worker clocks never enter the math.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = "throttle",
        namespace: str = "default",
        clock_us: Callable[[], int] | None = None,
    ) -> None:
        self.client = client
        self.keyspace = KeySpace(prefix, namespace)
        self._clock_us = clock_us
        self._acquire: Script = client.register_script(script_source("acquire"))
        self._settle: Script = client.register_script(script_source("settle"))

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Limiter:
        """A limiter on ``redis.Redis.from_url(url)`` (``redis://``, ``rediss://``, ``unix://``)."""
        return cls(redis.Redis.from_url(url), **kwargs)

    def acquire(
        self,
        limit: Limit,
        key: str | None = None,
        *,
        cost: float = 1.0,
        max_wait_s: float = 0.0,
        acquisition_id: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> Decision:
        """Take ``cost`` tokens from one limit for ``key``; see :meth:`acquire_many`."""
        return self.acquire_many(
            ((limit, key),),
            cost=cost,
            max_wait_s=max_wait_s,
            acquisition_id=acquisition_id,
            lease_s=lease_s,
        )

    def acquire_many(
        self,
        targets: Sequence[tuple[Limit, str | None]],
        *,
        cost: float = 1.0,
        max_wait_s: float = 0.0,
        acquisition_id: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> Decision:
        """Take ``cost`` tokens from every ``(limit, key)`` target at once, or from none.

        Parameters
        ----------
        targets:
            Pairs of a limit and the key it applies to (``None``: one state for all).
        cost:
            Tokens to take from each limit, >= 0, fractions allowed. A cost above a
            limit's capacity raises :class:`CostExceedsCapacity` (it could never pass).
        max_wait_s:
            Reserve instead of deny when token bucket and GCRA limits can admit the cost
            within this many seconds: the tokens are taken now and ``Decision.wait_s``
            says when the slot comes. Window and concurrency limits admit now or deny.
        acquisition_id:
            Records the acquisition under this id (a task id, say) so that it can be
            settled, and so that acquiring again with the same id while the record lives
            takes nothing twice (``Decision.held``). Generated when a concurrency limit
            is among the targets and none is given.
        lease_s:
            How long the record and concurrency units live after the slot, in seconds; a
            holder that dies without settling gives its units back when it ends.

        Raises
        ------
        RequestError
            On an invalid argument (cost, key, wait, lease, the same target twice).
        BackendUnavailable, BackendError
            When Redis cannot be reached or answers with an error.
        """
        cost = _number(cost, "cost")
        max_wait_us = round(_number(max_wait_s, "max_wait_s") * 1e6)
        lease_us = max(round(_number(lease_s, "lease_s", positive=True) * 1e6), 1)
        if not targets:
            raise RequestError("acquire needs at least one limit")
        keyspace = self.keyspace
        keys: list[str] = [""]
        args: list[Any] = ["", cost, max_wait_us, "", lease_us, len(targets)]
        needs_id = False
        for limit, key in targets:
            if key is not None and (not isinstance(key, str) or not key):
                raise RequestError(f"key must be a non-empty string or None (got {key!r})")
            if cost > limit.capacity:
                raise CostExceedsCapacity(limit.name, cost, limit.capacity)
            needs_id = needs_id or limit.algorithm is Algorithm.CONCURRENCY
            keys.extend(keyspace.state_keys(limit, key))
            args.extend(limit.script_args)
        if len(set(keys)) != len(keys):
            raise RequestError("the same limit and key appear twice in one acquisition")
        if acquisition_id is None and needs_id:
            acquisition_id = uuid.uuid4().hex
        if acquisition_id is not None:
            if not isinstance(acquisition_id, str) or not acquisition_id:
                raise RequestError(
                    f"acquisition_id must be a non-empty string (got {acquisition_id!r})"
                )
            args[3] = acquisition_id
            keys[0] = keyspace.lease_key(acquisition_id)
        else:
            # Unused by the script, but every key must hash to the namespace's slot.
            keys[0] = keyspace.base + "lease:"
        if self._clock_us is not None:
            args[0] = self._clock_us()
        reply = self._call(self._acquire, keys, args)
        return self._decision(reply, targets, cost, acquisition_id, keys)

    def settle(self, acquisition: Acquisition, actual_cost: float | None) -> Settlement:
        """Finish an acquisition with what it really cost, and release its concurrency units.

        The difference to the reserved cost is refunded (never above capacity; for GCRA
        never to a slot before now; for windows only to the window that paid, while it
        counts) or charged (debt is allowed: later callers wait for it). ``None`` keeps
        the reserved cost (a plain release). Settling twice, or an acquisition whose
        record expired, changes nothing and says so in :attr:`Settlement.status`.
        """
        args: list[Any] = ["", "", acquisition.id, len(acquisition.targets)]
        if actual_cost is not None:
            args[1] = _number(actual_cost, "actual_cost")
        for limit, _ in acquisition.targets:
            args.extend(limit.script_args)
        if self._clock_us is not None:
            args[0] = self._clock_us()
        status, delta = self._call(self._settle, list(acquisition.keys), args)
        return Settlement(_SETTLE_STATUS[int(status)], float(delta))

    def release(self, acquisition: Acquisition) -> Settlement:
        """Settle at the reserved cost: release concurrency units, refund or charge nothing."""
        return self.settle(acquisition, None)

    @staticmethod
    def _call(script: Script, keys: list[str], args: list[Any]) -> Any:
        try:
            return script(keys, args)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise BackendUnavailable(f"Redis is unreachable: {exc}") from exc
        except redis.RedisError as exc:
            raise BackendError(f"Redis refused a limiter call: {exc}") from exc

    @staticmethod
    def _decision(
        reply: list[Any],
        targets: Sequence[tuple[Limit, str | None]],
        cost: float,
        acquisition_id: str | None,
        keys: list[str],
    ) -> Decision:
        status = reply[0]
        if status == 2:
            # The script re-checks capacity: the Python check above normally fires first.
            limit = targets[reply[1] - 1][0]
            raise CostExceedsCapacity(limit.name, cost, limit.capacity)
        allowed = reply[1] == 1
        acquisition = None
        if allowed and acquisition_id is not None:
            acquisition = Acquisition(acquisition_id, cost, tuple(targets), tuple(keys))
        if status == 1:
            return Decision(True, 0.0, 0.0, 0.0, reply[2] / 1e6, (), acquisition, held=True)
        states = tuple(
            LimitState(
                limit.name,
                reply[i] == 1,
                float(reply[i + 1]),
                reply[i + 2] / 1e6,
                reply[i + 3] / 1e6,
            )
            for (limit, _), i in zip(targets, range(5, 5 + 4 * len(targets), 4), strict=True)
        )
        return Decision(
            allowed,
            min(state.remaining for state in states),
            reply[3] / 1e6,
            max(state.reset_after_s for state in states),
            reply[2] / 1e6,
            states,
            acquisition,
        )
