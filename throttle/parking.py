"""The parking lot: deferred tasks wait in Redis, not as broker messages held by workers.

A task whose slot is far ahead must not sit as an ETA message in a worker's memory (a
backlog of 100,000 of them is 100,000 messages held unacked) nor wait longer than the
broker's visibility timeout (kombu#337: the message is delivered again, the task runs
twice). So a long wait is parked here: the task's message goes into a Redis hash and its
token into a sorted set scored by when it is due back, on the Redis clock. Releasers (one
thread per worker) claim what is due shortly, publish it to the broker with the remaining
countdown, then commit. The move is safe under failure:

* a releaser that dies after claiming and before publishing: its claim expires and another
  releaser takes the task again (nothing lost);
* a releaser that dies after publishing and before committing: the task is published again
  under a new publish id, and the worker that starts a copy first records its id
  (:meth:`ParkingLot.accept`); the other copy is dropped (nothing runs twice). A broker
  redelivery of the same copy keeps its publish id and is accepted.

This module knows nothing of Celery: payloads are opaque bytes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from throttle.redis.client import RedisClient, run_script, wrap_errors
from throttle.redis.keys import KeySpace
from throttle.redis.scripts import operation_source

__all__ = ["Claimed", "Parked", "ParkingLot"]

DEFAULT_CLAIM_S = 30.0
"""How long a claim protects a task from other releasers, in s (publishing takes ms)."""
DEFAULT_RUN_TTL_S = 7 * 86400.0
"""How long the publish id of a started parked task is remembered, in s."""
DEFAULT_COPY_TTL_S = 86400.0
"""How long the number of a task's newest copy is remembered, in s: longer than a
broker takes to deliver an unacknowledged message again (kombu's Redis transport: its
``visibility_timeout``, 1 h by default; RabbitMQ: when the connection drops)."""


@dataclass(frozen=True, slots=True)
class Claimed:
    """A parked task claimed for release."""

    token: str
    due_in_s: float
    """Seconds from the claim until it is due (< 0: overdue), on the Redis clock."""
    publish_id: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class Parked:
    """A task in the lot, as an operator sees it (:meth:`ParkingLot.find`,
    :meth:`ParkingLot.scan`)."""

    token: str
    due_us: int | None
    """When it is due back at the broker, in us of the Redis clock (None: claimed)."""
    claimed_until_us: int | None
    """While a releaser has claimed it (it is being published): when the claim expires."""
    payload: bytes
    task_id: str | None = None
    """From the lot's index (None for a task parked by a version without it)."""


class ParkingLot:
    """Parks payloads in Redis until they are due, and hands them out once each.

    Parameters
    ----------
    client:
        A redis-py client (bytes replies: ``decode_responses`` off).
    keyspace:
        Where the lot's keys live (one hash tag: one Redis Cluster slot).
    clock_us:
        Tests only: "now" in us sent to the scripts instead of Redis ``TIME``.
    """

    def __init__(
        self,
        client: RedisClient,
        keyspace: KeySpace,
        *,
        clock_us: Callable[[], int] | None = None,
    ) -> None:
        self.client = client
        self.keyspace = keyspace
        self._keys = [*keyspace.parking_keys(), *keyspace.parking_index_keys()]
        self._clock_us = clock_us
        register = client.register_script
        self._park = register(operation_source("park"))
        self._claim = register(operation_source("claim_parked"))
        self._commit = register(operation_source("commit_parked"))
        self._accept = register(operation_source("accept_parked"))
        self._purge = register(operation_source("purge_parked"))

    def _now(self) -> Any:
        return b"" if self._clock_us is None else self._clock_us()

    def park(
        self,
        payload: bytes,
        delay_s: float,
        task_id: str | None = None,
        *,
        copy: int | None = None,
        copy_ttl_s: float = DEFAULT_COPY_TTL_S,
    ) -> str:
        """Park ``payload`` until ``delay_s`` from now (Redis clock); returns its token.
        ``task_id``: indexed with it (:meth:`find`), in the same atomic call. ``copy``:
        the parked payload is copy number ``copy`` of task ``task_id``, recorded as
        :meth:`sent_copy` does, in the same call: recorded after it, a worker killed in
        between left the message it ran (acknowledged only after this) to be delivered
        again with nothing to tell it stale, and both it and the parked copy ran."""
        token = uuid.uuid4().hex
        delay_us = max(round(delay_s * 1e6), 0)
        keys = [self._keys[0], self._keys[1], *self._keys[4:]]
        args: list[Any] = [self._now(), token, delay_us, payload, task_id or ""]
        if copy is not None and task_id:
            keys.append(self.keyspace.copy_key(task_id))
            args += [copy, max(round(copy_ttl_s * 1000), 1)]
        run_script(self.client, self._park, keys, args)
        return token

    def claim(
        self, *, lead_s: float, batch: int = 100, claim_s: float = DEFAULT_CLAIM_S
    ) -> list[Claimed]:
        """Claim up to ``batch`` tasks due within ``lead_s`` (and any whose claim expired)."""
        args = [self._now(), round(lead_s * 1e6), batch, round(claim_s * 1e6), uuid.uuid4().hex]
        reply = run_script(self.client, self._claim, self._keys, args)
        now = int(reply[0])
        return [
            Claimed(
                reply[i].decode(),
                (int(reply[i + 1]) - now) / 1e6,
                reply[i + 2].decode(),
                bytes(reply[i + 3]),
            )
            for i in range(1, len(reply), 4)
        ]

    def commit(self, claimed: list[Claimed]) -> int:
        """Forget tasks whose messages reached the broker; returns how many."""
        if not claimed:
            return 0
        args = [part for c in claimed for part in (c.token, c.publish_id)]
        return int(run_script(self.client, self._commit, self._keys, args))

    def accept(self, token: str, publish_id: str, *, ttl_s: float = DEFAULT_RUN_TTL_S) -> bool:
        """True when this published copy of a parked task may run (see the module doc)."""
        key = self.keyspace.parked_run_key(token)
        return bool(run_script(self.client, self._accept, [key], [publish_id, round(ttl_s * 1000)]))

    def sent_copy(self, task_id: str, copy: int, *, ttl_s: float = DEFAULT_COPY_TTL_S) -> None:
        """Record that copy number ``copy`` of task ``task_id`` was sent back (published
        or parked). The copy it replaces is acknowledged only after this; a worker that
        dies in between leaves that copy to be delivered again, and :meth:`stale_copy`
        then tells it apart. One copy at a time defers a task, so the newest number
        wins."""
        key, ttl_ms = self.keyspace.copy_key(task_id), max(round(ttl_s * 1000), 1)
        wrap_errors(lambda: self.client.set(key, copy, px=ttl_ms))

    def stale_copy(self, task_id: str, copy: int) -> bool:
        """Whether a newer copy of task ``task_id`` than number ``copy`` was sent back:
        this one, delivered again, must not run (the newer one runs)."""
        key = self.keyspace.copy_key(task_id)
        raw = wrap_errors(lambda: self.client.get(key))
        if raw is None:
            return False
        try:
            return int(raw) > copy
        except ValueError:
            return False

    def find(self, task_id: str) -> Parked | None:
        """The parked task of ``task_id`` (from the lot's index), or None."""
        raw = self.client.hget(self._keys[4], task_id)
        if raw is None:
            return None
        token = raw.decode() if isinstance(raw, bytes) else str(raw)
        found = self._read([token])
        if not found:
            return None
        return Parked(
            found[0].token, found[0].due_us, found[0].claimed_until_us, found[0].payload, task_id
        )

    def scan(self, count: int = 500) -> Iterator[Parked]:
        """Every task in the lot, in no order, ``count`` at a time (``HSCAN``): a task
        parked or released during the scan may be missed or seen once more."""
        tokens: list[str] = []
        for field, _ in self.client.hscan_iter(self._keys[1], count=count):
            tokens.append(field.decode() if isinstance(field, bytes) else str(field))
            if len(tokens) >= count:
                yield from self._read(tokens)
                tokens = []
        if tokens:
            yield from self._read(tokens)

    def _read(self, tokens: list[str]) -> list[Parked]:
        due, messages, claimed, _, _, tasks = self._keys
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zmscore(due, tokens)
            pipe.zmscore(claimed, tokens)
            pipe.hmget(messages, tokens)
            pipe.hmget(tasks, tokens)
            dues, claims, payloads, ids = pipe.execute()
        out = []
        for token, when, claim, payload, task in zip(
            tokens, dues, claims, payloads, ids, strict=True
        ):
            if payload is None:  # released or purged since
                continue
            out.append(
                Parked(
                    token,
                    None if when is None else int(when),
                    None if claim is None else int(claim),
                    bytes(payload),
                    None if task is None else task.decode(),
                )
            )
        return out

    def purge(self, tokens: list[str]) -> int:
        """Delete these parked tasks for good, but for those a releaser has claimed since
        (they are being published: they will run). Returns how many were deleted."""
        if not tokens:
            return 0
        return int(run_script(self.client, self._purge, self._keys, list(tokens)))

    def bring_forward(self, parked: Sequence[Parked], delay_s: float = 0.0) -> int:
        """Make these parked tasks due ``delay_s`` from now (those due later than that;
        a resume: they were parked until a hold's end). One pipelined round trip; ``ZADD
        XX`` leaves out a task claimed meanwhile (being published). Returns how many
        were moved."""
        target = self.now_us() + round(delay_s * 1e6)
        later = [p.token for p in parked if p.due_us is not None and p.due_us > target]
        if not later:
            return 0
        due = self._keys[0]
        with self.client.pipeline(transaction=False) as pipe:
            for token in later:
                pipe.zadd(due, {token: target}, xx=True, ch=True)
            return sum(int(changed) for changed in pipe.execute())

    def now_us(self) -> int:
        """Now on the Redis clock (``TIME``), in us (tests: the lot's clock)."""
        if self._clock_us is not None:
            return int(self._clock_us())
        seconds, micros = self.client.time()
        return int(seconds) * 1_000_000 + int(micros)

    def counts(self) -> tuple[int, int]:
        """(parked, claimed but not yet committed)."""
        due, _, claimed, *_ = self._keys
        with self.client.pipeline(transaction=False) as pipe:
            pipe.zcard(due)
            pipe.zcard(claimed)
            parked, in_flight = pipe.execute()
        return int(parked), int(in_flight)
