"""Where Redis spends the server time of an acquire: the pieces, measured inside Redis.

Every case is one Redis function (``FCALL``) replayed in pipelined batches on a private
``redis-server`` (Redis busy, as ``bench/core.py``'s warm column), its server time read
from ``INFO commandstats`` per batch. Cases, all in one library loaded here:

* the building blocks of a script: an empty function, by its number of arguments (Redis
  turns each into a Lua string); ``TIME``; ``GET``; ``SET ... PX`` against ``SETRANGE``
  of the same bytes (what a state write costs with and without setting its TTL); ``HMGET``
  of 2 and of 6 fields (the holds of one and of three limits); three ``GET`` against one
  ``MGET`` of three keys; ``EXISTS`` against ``HMGET`` of 6 fields of a missing hash (the
  holds when none was placed); 12 ``tonumber`` calls against 12 conversions by coercion
  (``x * 1``); 20 closures and 10 tables made per call (what a script rebuilds on each
  call, and a function library does not);
* the limiter's own functions, called with the arguments ``bench/core.py`` sends: the
  one-limit token bucket and GCRA (``acquire_one``) and three limits (``acquire``), also
  in a namespace whose holds hash exists (holding another limit);
* ``three_limits_unrolled``: the same three limits with a driver written out for exactly
  these three, reading with the same commands (``EXISTS``, ``MGET``) but with no per-limit
  array, no loop, no holds decoding, no reservation: the floor of any driver of several
  limits over these algorithms, which the generic ``acquire`` is measured against.

The rounds interleave the cases in a shuffled order; each case's minimum and median over
the rounds are printed (the minimum: its cost on a quiet moment of a shared machine).

Run from the repository root: ``python -m bench.lua_costs [--rounds 30] [--batch 500]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import redis

from bench.core import capture
from tests.support.servers import RedisServer
from throttle import Limit, Limiter
from throttle.redis.scripts import library_name, library_source

HUGE = 1_000_000_000
BENCH = "throttlebench"  # the library's name here: its functions must not clash with ours

BLOCKS = {
    "empty": "return 1",
    "time": "redis.call('TIME') return 1",
    "get": "redis.call('GET', KEYS[1]) return 1",
    "set_px": "redis.call('SET', KEYS[1], 'abcdefghabcdefgh', 'PX', 100000) return 1",
    "setrange": "redis.call('SETRANGE', KEYS[1], 0, 'abcdefghabcdefgh') return 1",
    "hmget_2": "redis.call('HMGET', KEYS[2], 'a', 'b') return 1",
    "hmget_6": "redis.call('HMGET', KEYS[2], 'a', 'b', 'c', 'd', 'e', 'f') return 1",
    "get_3": "redis.call('GET', KEYS[1]) redis.call('GET', KEYS[1]) redis.call('GET', KEYS[1])"
    " return 1",
    "mget_3": "redis.call('MGET', KEYS[1], KEYS[1], KEYS[1]) return 1",
    "exists_absent": "redis.call('EXISTS', 'b:absent') return 1",
    "hmget_6_absent": "redis.call('HMGET', 'b:absent', 'a', 'b', 'c', 'd', 'e', 'f') return 1",
    "tonumber_12": "local a = '1234567.125' for i = 1, 4 do "
    "local x, y, z = tonumber(a), tonumber(a), tonumber(a) end return 1",
    "coerce_12": "local a = '1234567.125' for i = 1, 4 do local x, y, z = a * 1, a * 1, a * 1 end"
    " return 1",
    "closures_20": "local a = {} for i = 1, 20 do a[i] = function() return i end end return 1",
    "tables_10": "local a = {} for i = 1, 10 do a[i] = {i, i, i, i, i, i, i, i, i, i} end return 1",
}

# Three limits, token bucket + GCRA + fixed window in this order (bench/core.py's), without
# acquisition id, fence, hold or reservation: acquire.lua's decision with nothing generic.
UNROLLED = """
local now = clock_us(ARGV[1])
local max_wait = ARGV[2] * 1
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HMGET', KEYS[1], unpack(ARGV, 10, 15))
end
local a1, a2, a3 = ALGO[ARGV[4]], ALGO[ARGV[5]], ALGO[ARGV[6]]
local c1, p1, b1, x1, c2, p2, b2, x2, c3, p3, b3, x3 =
  struct.unpack('<dddddddddddd', ARGV[7])
local s = redis.call('MGET', KEYS[2], KEYS[3], KEYS[4])
local ok1, w1, r1, m1, e1, s11, s12, s13, s14 = a1.check(2, c1, p1, b1, now, x1, max_wait, s[1])
local ok2, w2, r2, m2, e2, s21, s22, s23, s24 = a2.check(3, c2, p2, b2, now, x2, max_wait, s[2])
local ok3, w3, r3, m3, e3, s31, s32, s33, s34 = a3.check(4, c3, p3, b3, now, x3, max_wait, s[3])
if ok1 == 1 and ok2 == 1 and ok3 == 1 then
  a1.commit(2, c1, p1, b1, now, x1, nil, nil, false, s11, s12, s13, s14)
  a2.commit(3, c2, p2, b2, now, x2, nil, nil, false, s21, s22, s23, s24)
  a3.commit(4, c3, p3, b3, now, x3, nil, nil, false, s31, s32, s33, s34)
end
return struct.pack('<dddddddddddddddd', 0, 1, 0, 0, ok1, m1, r1, e1, ok2, m2, r2, e2,
                   ok3, m3, r3, e3)
"""


def function(name: str, body: str) -> str:
    return (
        f"redis.register_function('{BENCH}_{name}', function(keys, args)\n"
        "KEYS, ARGV, FENCE = keys, args, 0\nif not struct then\n  bind_globals()\nend\n"
        f"{body}\nend)\n"
    )


def library() -> str:
    """The limiter's library under its bench name, with the blocks and the unrolled
    driver appended (they use its prelude and algorithms)."""
    source = library_source().replace(library_name(), BENCH)
    extra = [function(name, body) for name, body in BLOCKS.items()]
    extra.append(function("three_limits_unrolled", UNROLLED))
    return source + "\n" + "\n".join(extra)


Send = Callable[[Any], Any]


def cases(client: redis.Redis) -> dict[str, Send]:
    limiter = Limiter(client, namespace="lua-costs")
    tb = Limit.parse(f"{HUGE}/s", name="tb")
    gcra = Limit.parse(f"{HUGE}/s", name="gcra", algorithm="gcra")
    three = [
        (Limit.parse(f"{HUGE}/s", name="three-tb"), "k"),
        (Limit.parse(f"{HUGE}/s", name="three-gcra", algorithm="gcra"), None),
        (Limit.parse(f"{HUGE}/d", name="three-daily", algorithm="fixed_window"), "k"),
    ]
    calls = {
        "acquire_one_tb": capture(limiter, lambda: limiter.acquire(tb, "k")),
        "acquire_one_gcra": capture(limiter, lambda: limiter.acquire(gcra, "k")),
        "acquire (three limits)": capture(limiter, lambda: limiter.acquire_many(three)),
    }
    # The same calls where the namespace's holds hash exists, holding another limit (as it
    # does from a namespace's first hold until a later hold call sweeps the ended ones).
    held = Limiter(client, namespace="lua-costs-held")
    client.hset(held.keyspace.holds_key(), "another-limit", 2**62)
    calls["acquire_one_tb, holds present"] = capture(held, lambda: held.acquire(tb, "k"))
    calls["acquire (three limits), holds present"] = capture(held, lambda: held.acquire_many(three))
    _, three_keys, three_args = calls["acquire (three limits)"]
    client.set("b:1", "abcdefghabcdefgh", px=10**9)
    client.hset("b:2", "zz", 1)

    def fcall(name: str, keys: Sequence[Any], args: Sequence[Any]) -> Send:
        return lambda pipe: pipe.fcall(f"{BENCH}_{name}", len(keys), *keys, *args)

    out: dict[str, Send] = {}
    for name in BLOCKS:
        out[name] = fcall(name, ["b:1", "b:2"], [])
    out["empty, 11 args"] = fcall("empty", ["b:1", "b:2"], [b"1234567.125"] * 9)
    out["empty, 30 args"] = fcall("empty", ["b:1", "b:2", "b:3", "b:4"], [b"1234567.125"] * 26)
    for label, call in calls.items():
        out[label] = replay(*call)
    out["three_limits_unrolled"] = fcall(
        "three_limits_unrolled",
        [key.replace("{lua-costs}", "{lua-costs-u}") for key in three_keys],
        three_args,
    )
    return out


def replay(send: Callable[..., Any], keys: list[Any], args: list[Any]) -> Send:
    """A captured call of the limiter, sent to a pipeline."""
    return lambda pipe: send(keys, args, client=pipe)


def measure(client: redis.Redis, sends: dict[str, Send], rounds: int, batch: int) -> None:
    per_round: dict[str, list[float]] = {name: [] for name in sends}
    order = list(sends)
    shuffle = random.Random(1).shuffle
    for round_no in range(rounds + 1):
        shuffle(order)
        for name in order:
            pipe = client.pipeline(transaction=False)
            for _ in range(batch):
                sends[name](pipe)
            client.config_resetstat()
            pipe.execute()
            stats = client.info("commandstats")["cmdstat_fcall"]
            if round_no:  # the first round warms up
                per_round[name].append(stats["usec"] / stats["calls"])
    print("| function | server µs/call, min | median |")
    print("|---|---:|---:|")
    for name, values in per_round.items():
        print(f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} |")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lua_costs", description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args(argv)
    with RedisServer() as server:
        client = server.client()
        client.function_load(library())
        sends = cases(client)
        measure(client, sends, args.rounds, args.batch)
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
