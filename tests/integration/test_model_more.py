"""Property tests: the in-memory limiter (throttle.memory.MemoryLimiter) answers every call
of the public Limiter API as the Lua scripts in a real Redis do, on one test clock.

test_model.py drives one fixed set of limits through acquire and settle. Here Hypothesis
draws a small world (limits of every algorithm, fair ones with weights, each limit in up
to three versions of the same name: a rate or burst changed at run time, faster or
slower; keys) and a sequence of calls interleaved with time steps (forward, and back a
little as Redis TIME may): acquire, acquire_many over one to three limits (of different
algorithms, keyed or not, a cost per limit), acquire_batch, acquire_each, reservations by
max_wait_s and by reserve_until, acquisition ids reused (a redelivered task: ``held``; a
hold placed since: voided), settles above and below the reservation (and None per
limit), releases, holds, pauses and unholds, peeks and holds(), the spacing guard
(space), and concurrency leases that end on the test clock. Every answer (Decision,
Settlement, LimitState, the seconds of a hold, the holds, the spacing guard's wait, the
error raised) must be equal.

Lease records expire on the server's wall clock in both (Redis PEXPIRE,
MemoryRedis.clock_us): the leases drawn here (30 s and more) outlive an example on the
wall clock, while the test clock runs past them (a concurrency unit ends, the record stays).
"""

from __future__ import annotations

import uuid
from typing import Any

import redis
from hypothesis import given
from hypothesis import strategies as st

from tests.support.clock import EPOCH_US, FakeClock
from throttle import Algorithm, Decision, Limit, Limiter, ThrottleError
from throttle.limiter import Acquire
from throttle.memory import MemoryLimiter

KINDS = ("token_bucket", "gcra", "sliding_window", "fixed_window", "concurrency", "fair")
PERIODS_S = (0.05, 1.0, 3.0, 60.0, 3600.0)
KEYS = (None, "a", "b")


@st.composite
def versions(
    draw: st.DrawFn,
    index: int,
    kinds: tuple[str, ...] = KINDS,
    periods: tuple[float, ...] = PERIODS_S,
) -> list[Limit]:
    """One limit in one to three versions of the same name and algorithm (a rate, burst
    or weight changed at run time); the first is the one it starts with."""
    kind = draw(st.sampled_from(kinds))
    algorithm = draw(st.sampled_from(["token_bucket", "gcra"])) if kind == "fair" else kind
    name = f"{kind}-{index}"
    out = []
    for _ in range(draw(st.integers(1, 3))):
        counts = [1.0, 2.0, 3.0, 7.0, 100.0] if kind == "concurrency" else [1.0, 2.0, 2.5, 7.0]
        count = draw(st.sampled_from(counts))
        period_s = draw(st.sampled_from(periods))
        burst = None
        if algorithm in ("token_bucket", "gcra"):
            burst = draw(st.sampled_from([None, 1.0, 1.5, 4.0]))
        if kind == "fair":
            weights = draw(
                st.dictionaries(st.sampled_from(["a", "b"]), st.sampled_from([0.5, 2.0, 4.0]))
            )
            default = draw(st.sampled_from([1.0, 1.0, 3.0]))
            limit = Limit(
                name, Algorithm(algorithm), count, period_s, burst, fair=True, weights=weights,
                default_weight=default,
            )  # fmt: skip
            out.append(limit)
        else:
            out.append(Limit(name, Algorithm(algorithm), count, period_s, burst))
    return out


# A cost: ("abs", value) or ("frac", fraction of the capacity of the version it goes to).
COST = st.one_of(
    st.tuples(st.just("abs"), st.sampled_from([0.0, 1.0, 0.5, 2.0])),
    st.tuples(st.just("frac"), st.sampled_from([0.0, 0.3, 1.0]) | st.floats(0.0, 1.0)),
)
# An actual cost of a settle: the same, up to 1.5 times the capacity (a charge beyond it).
ACTUAL = st.one_of(
    st.none(),
    st.tuples(st.just("abs"), st.sampled_from([0.0, 1.0, 3.0])),
    st.tuples(st.just("frac"), st.sampled_from([0.0, 0.5, 1.5]) | st.floats(0.0, 1.5)),
)
DT = st.one_of(
    st.just(0),
    st.just(0),
    st.just(0),
    st.integers(0, 2_000),
    st.integers(0, 400_000),
    st.integers(0, 5_000_000),
    st.integers(0, 120_000_000),  # past a 30 s lease on the test clock
    st.integers(-1_000, 0),  # Redis TIME may step back a little
    st.integers(-300_000, 0),
)
IDS = st.one_of(st.none(), st.sampled_from(["t1", "t2", "t3"]))
# How long to wait for a slot: max_wait_s (us), reserve_until (us from now), or neither.
WAIT = st.one_of(
    st.just(("none", 0)),
    st.tuples(
        st.just("max_wait"),
        st.sampled_from([0, 100_000, 1_000_000, 5_000_000, 120_000_000, 7_200_000_000]),
    ),
    st.tuples(st.just("max_wait"), st.integers(0, 10_000_000)),
    st.tuples(st.just("until"), st.sampled_from([-1_000_000, 0, 50_000, 2_000_000, 90_000_000])),
)
# A pick of targets: (limit number, version number, key, own cost or None), resolved modulo.
PICK = st.tuples(st.integers(0, 9), st.integers(0, 2), st.sampled_from(KEYS), st.none() | COST)
ACQUIRE = st.tuples(
    st.just("acquire"),
    st.lists(PICK, min_size=1, max_size=3),
    COST,
    WAIT,
    IDS,
    st.sampled_from([30.0, 300.0]),
)
SETTLE = st.tuples(st.just("settle"), st.integers(0, 50), ACTUAL, st.lists(ACTUAL, max_size=3))
OPS = st.one_of(
    ACQUIRE,
    ACQUIRE,
    ACQUIRE,
    ACQUIRE,
    SETTLE,
    SETTLE,
    SETTLE,
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("batch"), st.lists(ACQUIRE, min_size=1, max_size=3)),
    st.tuples(
        st.just("each"),
        st.lists(PICK, min_size=1, max_size=4),
        WAIT,
        st.none() | st.lists(st.sampled_from([0.0, 0.01, 0.3, 2.0]), min_size=4, max_size=4),
    ),
    st.tuples(
        st.just("hold"),
        st.integers(0, 9),
        st.sampled_from(KEYS),
        st.none() | st.sampled_from([0.01, 0.3, 2.0, 100.0]),
    ),
    st.tuples(st.just("unhold"), st.integers(0, 9), st.sampled_from(KEYS)),
    st.tuples(st.just("peek"), PICK),
    st.tuples(st.just("peek"), PICK) | st.tuples(st.just("holds")),
    st.tuples(st.just("space"), st.lists(PICK, min_size=1, max_size=2)),
)


def _errors(decided: list[Any]) -> list[Any]:
    """Decisions, with each error as (its type, its message): errors do not compare."""
    return [(type(d).__name__, str(d)) if isinstance(d, ThrottleError) else d for d in decided]


def _unnamed(decided: list[Any]) -> list[Any]:
    """acquire_each's decisions, without the acquisitions: a concurrency limit's holder
    is named by a uuid there (generated, not settled)."""
    return [
        (d._replace(acquisition=None), d.acquisition and d.acquisition.costs)
        if isinstance(d, Decision)
        else d
        for d in _errors(decided)
    ]


def _answer(one: Limiter, call: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``one.call(*args, **kwargs)`` answers: ("ok", its value) or ("raised", ...)."""
    try:
        return ("ok", getattr(one, call)(*args, **kwargs))
    except ThrottleError as exc:
        return ("raised", type(exc).__name__, str(exc))


class World:
    """The limits drawn, and the resolution of the drawn picks against them."""

    def __init__(self, limits: list[list[Limit]]) -> None:
        self.limits = limits

    def version(self, pick: tuple[Any, ...]) -> Limit:
        family = self.limits[pick[0] % len(self.limits)]
        limit: Limit = family[pick[1] % len(family)]
        return limit

    @staticmethod
    def cost(spec: Any, limit: Limit) -> float:
        kind, value = spec
        return float(value) if kind == "abs" else value * limit.capacity

    def targets(self, picks: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The targets of picks, one per limit (the first pick of a limit wins)."""
        out: list[tuple[Any, ...]] = []
        seen: set[str] = set()
        for pick in picks:
            limit = self.version(pick)
            if limit.name in seen:
                continue
            seen.add(limit.name)
            key = pick[2]
            if limit.fair and key is None:
                key = "c"  # a fair limit shares its rate among keys
            if pick[3] is None:
                out.append((limit, key))
            else:
                out.append((limit, key, self.cost(pick[3], limit)))
        return out


def _acquire_args(
    world: World, op: tuple[Any, ...], now_us: int, step: int
) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
    _, picks, cost, (wait_kind, wait_us), acq, lease_s = op
    targets = world.targets(picks)
    own = min(t[0].capacity for t in targets)
    kwargs: dict[str, Any] = {
        "cost": world.cost(cost, targets[0][0]) if cost[0] == "abs" else cost[1] * own
    }
    if wait_kind == "max_wait":
        kwargs["max_wait_s"] = wait_us / 1e6
    elif wait_kind == "until":
        kwargs["reserve_until"] = (now_us + wait_us) / 1e6
    if acq is None and any(t[0].code == "conc" for t in targets):
        acq = f"g{step}"  # the limiter would generate one: named here, the same in both
    kwargs["acquisition_id"] = acq
    kwargs["lease_s"] = lease_s
    return targets, kwargs


def run_world(
    client: redis.Redis, world: World, sequence: list[tuple[int, tuple[Any, ...]]]
) -> None:
    clock = FakeClock(EPOCH_US)
    prefix = f"mm-{uuid.uuid4().hex[:12]}"
    real = Limiter(client, prefix=prefix, clock_us=clock)
    memory = MemoryLimiter(prefix=prefix, clock_us=clock)
    acquisitions: list[Any] = []

    def both(step: int, op: Any, call: str, *args: Any, **kwargs: Any) -> Any:
        """The same call to both limiters: equal answers, or the step that differed."""
        answers = [_answer(one, call, args, kwargs) for one in (real, memory)]
        assert answers[1] == answers[0], f"step {step}: {op}"
        return answers[0]

    try:
        for i, (dt, op) in enumerate(sequence):
            clock.now_us += dt
            kind = op[0]
            if kind == "acquire":
                targets, kwargs = _acquire_args(world, op, clock.now_us, i)
                answer = both(i, op, "acquire_many", targets, **kwargs)
                if answer[0] == "ok" and answer[1].acquisition is not None:
                    acquisitions.append(answer[1].acquisition)
            elif kind == "batch":
                calls = []
                for j, sub in enumerate(op[1]):
                    targets, kwargs = _acquire_args(world, sub, clock.now_us, 1000 * i + j)
                    calls.append(Acquire(targets, **kwargs))
                batches = [_errors(one.acquire_batch(calls)) for one in (real, memory)]
                assert batches[1] == batches[0], f"step {i}: {op}"
                for decision in batches[0]:
                    if isinstance(decision, Decision) and decision.acquisition is not None:
                        acquisitions.append(decision.acquisition)
            elif kind == "each":
                _, picks, (wait_kind, wait_us), ago = op
                asks = []
                for pick in picks:
                    limit = world.version(pick)
                    key = "c" if limit.fair and pick[2] is None else pick[2]
                    asks.append((limit, key, world.cost(pick[3] or ("abs", 1.0), limit)))
                max_wait_s = wait_us / 1e6 if wait_kind == "max_wait" else 0.0
                ago_s = None if ago is None else ago[: len(asks)]
                answers = [
                    _unnamed(one.acquire_each(asks, max_wait_s=max_wait_s, ago_s=ago_s))
                    for one in (real, memory)
                ]
                assert answers[1] == answers[0], f"step {i}: {op}"
            elif kind in ("settle", "release") and acquisitions:
                acquisition = acquisitions[op[1] % len(acquisitions)]
                if kind == "release":
                    both(i, op, "release", acquisition)
                    continue
                _, _, actual, per_limit = op
                pairs = acquisition.targets
                settled: Any
                if per_limit and len(per_limit) >= len(pairs):
                    settled = [
                        None if a is None else World.cost(a, limit)
                        for a, (limit, _) in zip(per_limit, pairs, strict=False)
                    ]
                elif actual is None:
                    settled = None
                else:
                    settled = World.cost(actual, pairs[0][0])
                both(i, op, "settle", acquisition, settled)
            elif kind in ("hold", "unhold"):
                limit = world.limits[op[1] % len(world.limits)][0]
                both(i, op, kind, limit, *op[2:])
            elif kind == "peek":
                pick = op[1]
                limit = world.version(pick)
                key = "c" if limit.fair and pick[2] is None else pick[2]
                cost = world.cost(pick[3] or ("abs", 1.0), limit)
                both(i, op, "peek", limit, key, cost=cost)
            elif kind == "holds":
                both(i, op, "holds")
            elif kind == "space":
                # the spacing guard (lua/space.lua): its keys live a second or more on the
                # wall clock in Redis, longer than an example
                spaced = []
                for limit, key, *own in world.targets(op[1]):
                    spaced.append((limit, key, own[0] if own else 1.0))
                both(i, op, "space", spaced)
    finally:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)


@given(data=st.data())
def test_the_memory_limiter_answers_every_call_as_redis(
    client: redis.Redis, data: st.DataObject
) -> None:
    n = data.draw(st.integers(1, 4), label="limits")
    world = World([data.draw(versions(i), label=f"limit {i}") for i in range(n)])
    sequence = data.draw(st.lists(st.tuples(DT, OPS), min_size=8, max_size=40), label="calls")
    run_world(client, world, sequence)


# Reservations over several limits: slots ahead, each limit committed as of the latest
# one (the others' slot), a window denying a slot past its window; close calls.
RESERVING = ("token_bucket", "gcra", "fair", "fair", "fixed_window", "sliding_window")
CLOSE_DT = st.one_of(
    st.just(0), st.integers(0, 2_000), st.integers(0, 300_000), st.integers(-1_000, 0)
)
RESERVE = st.tuples(
    st.just("acquire"),
    st.lists(PICK, min_size=1, max_size=3),
    COST,
    st.one_of(
        st.tuples(st.just("max_wait"), st.sampled_from([1_000_000, 10_000_000])),
        st.tuples(st.just("max_wait"), st.integers(0, 5_000_000)),
        st.tuples(st.just("until"), st.integers(-10_000, 5_000_000)),
    ),
    IDS,
    st.just(300.0),
)
RESERVING_OPS = st.one_of(
    RESERVE,
    RESERVE,
    RESERVE,
    SETTLE,
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("peek"), PICK),
    st.tuples(st.just("hold"), st.integers(0, 9), st.sampled_from(KEYS), st.just(0.2)),
)


@given(data=st.data())
def test_reservations_over_several_limits_as_redis(
    client: redis.Redis, data: st.DataObject
) -> None:
    n = data.draw(st.integers(2, 3), label="limits")
    world = World(
        [data.draw(versions(i, RESERVING, (0.05, 1.0, 3.0)), label=f"limit {i}") for i in range(n)]
    )
    calls = st.lists(st.tuples(CLOSE_DT, RESERVING_OPS), min_size=8, max_size=40)
    run_world(client, world, data.draw(calls, label="calls"))
