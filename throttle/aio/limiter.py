"""The asyncio limiter: :class:`throttle.Limiter`'s methods, awaited, on ``redis.asyncio``.

The same scripts, the same :class:`~throttle.Decision`: every call is built by
:class:`throttle.limiter.RequestBuilder` (argument checks, key names, script arguments) and
its reply read by the decoders of :mod:`throttle.redis.replies`, exactly as the blocking
limiter's; only the round trip is awaited (:func:`throttle.redis.client.run_script_async`).
Both limiters can share the limits of one Redis: a decision of one counts for the other.

Example::

    import httpx
    from throttle import Limit
    from throttle.aio import Limiter

    limiter = Limiter.from_url("redis://localhost:6379/0")
    github = Limit.parse("5000/h", name="github")

    async def fetch(client: httpx.AsyncClient, url: str) -> httpx.Response:
        decision = await limiter.acquire(github, max_wait_s=30)
        if not decision:
            raise RuntimeError(f"come back in {decision.retry_after_s:.1f} s")
        await asyncio.sleep(decision.wait_s)  # a reserved slot: wait for it
        return await client.get(url)
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio
from redis.commands.core import AsyncScript

from throttle.decision import Acquisition, Decision, LimitState, Settlement
from throttle.errors import BackendError, BackendUnavailable, ThrottleError
from throttle.limiter import (
    _NO_WAIT,
    DEFAULT_LEASE_S,
    Acquire,
    Request,
    RequestBuilder,
    _place,
    _placed,
)
from throttle.redis.client import (
    async_client_from_url,
    check_client,
    run_routine_async,
    wrap_errors_async,
)
from throttle.redis.library import Library, Routine
from throttle.redis.replies import one_limit_decision
from throttle.spec import Limit

__all__ = ["Limiter"]

logger = logging.getLogger("throttle")


class Limiter(RequestBuilder[Routine[AsyncScript]]):
    """Acquires and settles tokens of limits kept in Redis, from asyncio code.

    Every method of :class:`throttle.Limiter`, with the same arguments, raising the same
    errors (:class:`~throttle.RequestError` before anything is sent,
    :class:`~throttle.BackendUnavailable` and :class:`~throttle.BackendError` for Redis),
    awaited. See there for what each does.

    Parameters
    ----------
    client:
        A ``redis.asyncio.Redis`` (one server, or a master behind Sentinel). A Redis Cluster
        is not supported here. The limiter opens no connection itself, and does not close
        the client: ``await limiter.client.aclose()`` when done.
    prefix, namespace:
        Where the keys live (see :class:`throttle.redis.keys.KeySpace`); a blocking and an
        asyncio limiter with the same prefix and namespace share their limits.
    clock_us:
        Tests only: "now" in microseconds instead of Redis ``TIME`` (see
        :class:`throttle.Limiter`).
    """

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        prefix: str = "throttle",
        namespace: str = "default",
        clock_us: Callable[[], int] | None = None,
    ) -> None:
        check_client(client)
        self.library = Library(client)
        """Whether this limiter calls Redis functions or scripts (see
        :mod:`throttle.redis.library`)."""

        def register(function: str, source: str) -> Routine[AsyncScript]:
            return Routine(self.library, function, client.register_script(source))

        super().__init__(register, prefix, namespace, clock_us)
        self.client = client
        self._giving_back: set[asyncio.Task[None]] = set()
        """What cancelled acquisitions are giving back (kept: a task is weakly held)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The event loop the client is in use by (its connections and redis-py's locks
        belong to it); another loop running at the same time is refused."""
        self._loop_lock = threading.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "throttle",
        namespace: str = "default",
        **client_options: Any,
    ) -> Limiter:
        """A limiter on the Redis at ``url`` (a client built by
        :func:`throttle.redis.client.async_client_from_url`: ``redis://``, ``rediss://``,
        ``unix://`` or ``redis+sentinel://``). No connection is opened here. A Redis Cluster
        URL, or Sentinel over TLS, raises :class:`~throttle.ConfigError`."""
        client = async_client_from_url(url, **client_options)
        return cls(client, prefix=prefix, namespace=namespace)

    async def acquire(
        self,
        limit: Limit,
        key: str | None = None,
        *,
        cost: float = 1.0,
        max_wait_s: float = _NO_WAIT,
        acquisition_id: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> Decision:
        """Take ``cost`` tokens from one limit for ``key``: :meth:`throttle.Limiter.acquire`."""
        one = self._one_request(limit, key, cost, max_wait_s, acquisition_id, lease_s)
        if one is None:
            return await self.acquire_many(
                ((limit, key),),
                cost=cost,
                max_wait_s=max_wait_s,
                acquisition_id=acquisition_id,
                lease_s=lease_s,
            )
        script, keys, args = one
        return await self._take(
            script, keys, args, lambda raw: one_limit_decision(limit, cost, raw)
        )

    async def acquire_many(
        self,
        targets: Sequence[tuple[Limit, str | None] | tuple[Limit, str | None, float]],
        *,
        cost: float = 1.0,
        max_wait_s: float = _NO_WAIT,
        acquisition_id: str | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        reserve_until: float | None = None,
    ) -> Decision:
        """Take ``cost`` tokens from every target at once, or from none:
        :meth:`throttle.Limiter.acquire_many`."""
        script, keys, args, decode = self._many_request(
            targets, cost, max_wait_s, acquisition_id, lease_s, reserve_until
        )
        return await self._take(script, keys, args, decode)

    async def _take(
        self,
        routine: Routine[AsyncScript],
        keys: Sequence[str],
        args: list[Any],
        decode: Callable[[Any], Decision],
    ) -> Decision:
        """An acquisition's call, which takes capacity once Redis runs it. The caller may be
        cancelled (``asyncio.timeout``, a task cancelled) after the call left: the call then
        finishes on its own, and what it took is given back (settled at cost 0: concurrency
        units released, tokens refunded), since the caller never gets the acquisition to do
        it. An acquisition without a record (no id, no concurrency limit) cannot be named:
        its cost stays taken, as a call made."""
        call = asyncio.ensure_future(self._call(routine, keys, args))
        try:
            return decode(await asyncio.shield(call))
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: self._give_back(done, decode))
            raise

    def _give_back(self, done: asyncio.Future[Any], decode: Callable[[Any], Decision]) -> None:
        """The call of a cancelled acquisition finished: settle what it took at cost 0."""
        if done.cancelled() or done.exception() is not None:
            return
        try:
            decision = decode(done.result())
        except Exception:
            return
        if decision.allowed and decision.acquisition is not None and not decision.held:
            task = asyncio.ensure_future(self._give_back_now(decision.acquisition))
            self._giving_back.add(task)
            task.add_done_callback(self._giving_back.discard)

    async def _give_back_now(self, acquisition: Acquisition) -> None:
        try:
            # Unless an acquire under the same id found the record meanwhile (a retry,
            # from this process or another): it is that one's now.
            script, keys, args, decode = self._settle_request(acquisition, 0.0, unless_found=True)
            decode(await self._call(script, keys, args))
        except Exception as exc:  # the lease ends by itself
            logger.debug("throttle: a cancelled acquisition was not given back: %s", exc)

    async def acquire_each(
        self,
        targets: Sequence[tuple[Limit, str | None, float]],
        *,
        max_wait_s: float = _NO_WAIT,
        ago_s: Sequence[float] | None = None,
    ) -> list[Decision | ThrottleError]:
        """Take each target on its own: :meth:`throttle.Limiter.acquire_each`, the calls
        awaited one after the other (not pipelined)."""
        out, calls = self._each_requests(targets, max_wait_s, ago_s)
        for positions, (script, keys, args, decode) in calls:
            try:
                reply = await self._call(script, keys, args)
            except BackendUnavailable:
                raise
            except ThrottleError as exc:
                reply = exc
            _place(out, positions, decode, reply)
        return _placed(out)

    async def acquire_batch(self, calls: Sequence[Acquire]) -> list[Decision | ThrottleError]:
        """Several independent acquisitions: :meth:`throttle.Limiter.acquire_batch`, the
        calls awaited one after the other (not pipelined)."""
        return await self._send_each(self._batch_requests(calls))

    async def _send_each(
        self, built: Sequence[Request[Any, Decision] | ThrottleError]
    ) -> list[Decision | ThrottleError]:
        out: list[Decision | ThrottleError] = []
        for item in built:
            if isinstance(item, ThrottleError):
                out.append(item)
                continue
            script, keys, args, decode = item
            try:
                out.append(decode(await self._call(script, keys, args)))
            except BackendUnavailable:
                raise
            except ThrottleError as exc:
                out.append(exc)
        return out

    async def settle(
        self, acquisition: Acquisition, actual_cost: float | Sequence[float | None] | None
    ) -> Settlement:
        """Finish an acquisition with what it really cost: :meth:`throttle.Limiter.settle`."""
        script, keys, args, decode = self._settle_request(acquisition, actual_cost)
        return decode(await self._call(script, keys, args))

    async def release(self, acquisition: Acquisition) -> Settlement:
        """Settle at the reserved cost: :meth:`throttle.Limiter.release`."""
        return await self.settle(acquisition, None)

    async def peek(
        self, limit: Limit | str, key: str | None = None, *, cost: float = 1.0
    ) -> LimitState:
        """What an acquire would be told now, taking nothing: :meth:`throttle.Limiter.peek`."""
        script, keys, args, decode = self._peek_request(limit, key, cost)
        return decode(await self._call(script, keys, args))

    async def hold(
        self, limit: Limit | str, key: str | None = None, seconds: float | None = None
    ) -> float:
        """Admit nothing of ``limit`` for ``seconds`` (None: a pause):
        :meth:`throttle.Limiter.hold`. Returns the seconds the hold now lasts."""
        script, keys, args, decode = self._hold_request(limit, key, seconds)
        return decode(await self._call(script, keys, args))

    async def unhold(self, limit: Limit | str, key: str | None = None) -> None:
        """Lift the hold (or pause) of ``limit``: :meth:`throttle.Limiter.unhold`."""
        script, keys, args, _ = self._unhold_request(limit, key)
        await self._call(script, keys, args)

    async def mark_started(self) -> None:
        """A Redis without the restart fence's marker gets one that has ended:
        :meth:`throttle.Limiter.mark_started`. One round trip."""
        key = self.keyspace.fence_key()
        self._check_loop()
        await wrap_errors_async(lambda: self.client.set(key, 0, nx=True))

    async def holds(self) -> dict[tuple[str, str | None], float]:
        """The live holds of the namespace: :meth:`throttle.Limiter.holds`."""
        script, keys, args, decode = self._holds_request()
        return decode(await self._call(script, keys, args))

    async def space(self, targets: Sequence[tuple[Limit, str | None, float]]) -> float:
        """The call-time spacing guard: :meth:`throttle.Limiter.space`. Returns the
        seconds to wait before the call."""
        script, keys, args, decode = self._space_request(targets)
        return decode(await self._call(script, keys, args))

    async def _call(
        self, routine: Routine[AsyncScript], keys: Sequence[str], args: list[Any]
    ) -> Any:
        self._check_loop()
        return await run_routine_async(self.client, routine, keys, args)

    def _check_loop(self) -> None:
        """Refuse a call from an event loop other than the one using the client while that
        one still runs (two threads, each with its loop): redis-py's connections and locks
        belong to one loop, and a waiter of the other loop could then wait forever. Once
        that loop has stopped (an ``asyncio.run`` that ended), the next loop takes over, and
        what the client then does (a :class:`~throttle.BackendError` naming the cause, for
        connections left open) is redis-py's."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        with self._loop_lock:
            owner = self._loop
            if owner is None or owner is loop or not owner.is_running():
                self._loop = loop
                return
        raise BackendError(
            "the limiter's asyncio client is in use by another event loop running at the "
            "same time (another thread's): build a limiter (its client) per event loop, or "
            "use the blocking throttle.Limiter from threads"
        )
