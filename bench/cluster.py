"""Acquisitions per second on a Redis Cluster of 1 master and of 3, from several processes.

What is measured
----------------
Two private clusters started here, side by side: one master holding all 16384 slots, and
three masters (``redis-cli --cluster create``), no replicas (:class:`LocalCluster`). The
same N namespaces are used on both; they are chosen so that on three masters each master
serves N/3 of them (a namespace is one hash slot, so one master: the unit of spreading).
P client processes each acquire from every namespace in turn, a token bucket far above any
reachable rate, so every call is admitted. Two modes:

* ``calls``: :meth:`Limiter.acquire` through ``redis.cluster.RedisCluster``, one call at a
  time per process, as workers call it. Bounded by round trips and by Python on both sides.
* ``pipelined``: the same EVALSHA (captured from a real acquire), sent ``batch`` at a time
  per master through a plain client of that master, routed by the cluster's slot map: what
  the masters can execute when clients cost little. This is the capacity question.

Recorded per case: admitted acquisitions per second (the sum over processes of each one's
count over its own elapsed time), the CPU the client processes used (``process_time``) and
the masters used (``INFO cpu``), both in % of one core, and the busiest master's share of
the acquisitions (``INFO commandstats``). R rounds, each running the four cases (2 modes x
1 or 3 masters) for S seconds in an order shuffled per round (fixed seed), so that drift on
a shared machine hits all cases alike; the 3-vs-1 ratio is taken per round (paired) and its
median printed.

Read it with the machine in mind: every master and every client process share this host's
CPUs. A cluster adds throughput when each master gets a core of its own; with fewer cores
than masters + clients, 3 masters can at best use the cores that 1 master left idle, and
the table's CPU columns say how close each case came to the host's total.

Run from the repository root: ``python -m bench.cluster [--processes 4] [--namespaces 12]
[--seconds 3] [--rounds 3] [--batch 100] [--seed 1]`` (``make bench-cluster``).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import statistics
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from typing import Any

import redis
from redis.crc import key_slot

from bench.core import capture
from throttle import Limit, Limiter
from throttle.testing_cluster import SLOTS, LocalCluster

MODES = ("calls", "pipelined")
MASTERS = (1, 3)
LIMIT = Limit.parse("1000000000/s", name="bench")  # never denies at reachable rates
KEY = "tenant"
ADMITTED = struct.pack("<d", 1.0)  # the first 8 bytes of an admitting acquire_one.lua reply


def spread_namespaces(count: int, masters: int = 3) -> list[str]:
    """``count`` namespaces, as evenly as possible over the slot ranges that ``redis-cli
    --cluster create`` gives ``masters`` masters (slot s goes to master s * masters // 16384,
    give or take one slot at the edges)."""
    want = [count // masters + (1 if i < count % masters else 0) for i in range(masters)]
    chosen: list[str] = []
    i = 0
    while len(chosen) < count:
        name = f"bench-{i}"
        i += 1
        share = key_slot(f"{{{name}}}".encode()) * masters // SLOTS
        if want[share] > 0:
            want[share] -= 1
            chosen.append(name)
    return chosen


# -- the client processes -----------------------------------------------------------------


def worker(
    urls: dict[int, str],
    namespaces: list[str],
    batch: int,
    barrier: Barrier,
    conn: Connection,
) -> None:
    """One client process: builds its clients for both clusters, then runs the cases it is
    sent (mode, masters, seconds), starting each together with the others at ``barrier``."""
    setups: dict[int, Any] = {}
    for masters, url in urls.items():
        # One cluster client per process, as a worker has, shared by its namespaces.
        client = Limiter.from_url(url).client
        limiters = [Limiter(client, namespace=ns) for ns in namespaces]
        # The pipelined replay: each namespace's EVALSHA (as the limiter sends it), a batch
        # of them packed once per master serving them, sent as they are on each round.
        commands: dict[int, list[tuple[Any, ...]]] = {}
        for limiter in limiters:
            script, keys, script_args = capture(
                limiter, lambda lim=limiter: lim.acquire(LIMIT, KEY)
            )
            port = client.get_node_from_key(keys[0]).port
            commands.setdefault(port, []).append(
                ("EVALSHA", script.sha, len(keys), *keys, *script_args)
            )
        groups: dict[int, tuple[redis.Redis, list[bytes]]] = {}
        for port, mine in commands.items():
            node = redis.Redis(port=port)
            batch_of = [mine[i % len(mine)] for i in range(batch)]
            groups[port] = (node, node.connection_pool.get_connection().pack_commands(batch_of))
        setups[masters] = (limiters, groups)
    conn.send("ready")
    while True:
        command = conn.recv()
        if command is None:
            break
        mode, masters, seconds = command
        limiters, groups = setups[masters]
        barrier.wait()
        if mode == "calls":
            result = run_calls(limiters, seconds)
        else:
            result = run_pipelined(groups, batch, seconds)
        conn.send(result)
    for limiters, groups in setups.values():
        limiters[0].client.close()
        for node, _ in groups.values():
            node.close()


def run_calls(limiters: list[Limiter], seconds: float) -> tuple[int, int, float, float]:
    """(admitted, denied, elapsed s, CPU s) of one-at-a-time acquires over every namespace."""
    admitted = denied = 0
    cpu0, start = time.process_time(), time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for limiter in limiters:
            if limiter.acquire(LIMIT, KEY).allowed:
                admitted += 1
            else:
                denied += 1
    return admitted, denied, time.perf_counter() - start, time.process_time() - cpu0


def run_pipelined(
    groups: dict[int, tuple[redis.Redis, list[bytes]]], batch: int, seconds: float
) -> tuple[int, int, float, float]:
    """(admitted, denied, elapsed s, CPU s) of pipelined EVALSHA batches, master by master.

    The batch is packed once: the client's cost per call is reading one reply, so that the
    masters, not Python, are what this mode loads."""
    admitted = denied = 0
    conns = [(node.connection_pool.get_connection(), packed) for node, packed in groups.values()]
    cpu0, start = time.process_time(), time.perf_counter()
    deadline = start + seconds
    try:
        while time.perf_counter() < deadline:
            for conn, packed in conns:
                conn.send_packed_command(packed, check_health=False)
                for _ in range(batch):
                    # acquire_one.lua's reply: five packed doubles, allowed first.
                    if conn.read_response()[:8] == ADMITTED:
                        admitted += 1
                    else:
                        denied += 1
    finally:
        for (node, _), (conn, _) in zip(groups.values(), conns, strict=True):
            node.connection_pool.release(conn)
    return admitted, denied, time.perf_counter() - start, time.process_time() - cpu0


# -- the conductor ------------------------------------------------------------------------


@dataclass
class Case:
    mode: str
    masters: int
    rates: list[float] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)  # % of one core
    server_cpu: list[float] = field(default_factory=list)  # % of one core, all masters
    busiest: list[float] = field(default_factory=list)  # busiest master's share of calls
    server_us: list[float] = field(default_factory=list)  # master CPU us per acquisition
    denied: int = 0


def server_stats(nodes: list[redis.Redis]) -> list[tuple[float, int]]:
    """Per master: (CPU seconds used, EVALSHA calls executed)."""
    stats = []
    for node in nodes:
        cpu = node.info("cpu")
        calls = node.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        stats.append((float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), int(calls)))
    return stats


def run_case(
    case: Case,
    conns: list[Connection],
    barrier: Barrier,
    nodes: list[redis.Redis],
    seconds: float,
) -> None:
    for conn in conns:
        conn.send((case.mode, case.masters, seconds))
    before = server_stats(nodes)
    wall = time.perf_counter()
    barrier.wait()
    results = [conn.recv() for conn in conns]
    wall = time.perf_counter() - wall
    after = server_stats(nodes)
    case.rates.append(sum(n / elapsed for n, _, elapsed, _ in results))
    case.denied += sum(d for _, d, _, _ in results)
    case.client_cpu.append(100 * sum(cpu for *_, cpu in results) / seconds)
    server_s = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    case.server_cpu.append(100 * server_s / wall)
    case.server_us.append(1e6 * server_s / max(sum(n for n, *_ in results), 1))
    calls = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    case.busiest.append(max(calls) / max(sum(calls), 1))


def pct(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} %"


def report(cases: dict[tuple[str, int], Case], args: argparse.Namespace) -> str:
    lines = [
        "| mode | masters | acquisitions/s (median) | rounds min-max | client CPU | "
        "masters' CPU | master CPU per acquisition | busiest master's share |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        for masters in MASTERS:
            case = cases[(mode, masters)]
            lines.append(
                f"| {mode} | {masters} | {statistics.median(case.rates):,.0f} | "
                f"{min(case.rates):,.0f}-{max(case.rates):,.0f} | {pct(case.client_cpu)} | "
                f"{pct(case.server_cpu)} | {statistics.median(case.server_us):.1f} µs | "
                f"{100 * statistics.median(case.busiest):.0f} % |"
            )
    lines += ["", "| mode | 3 masters / 1 master (median of per-round ratios) | rounds |"]
    lines.append("|---|---:|---|")
    for mode in MODES:
        one, three = cases[(mode, 1)], cases[(mode, 3)]
        ratios = [b / a for a, b in zip(one.rates, three.rates, strict=True)]
        shown = ", ".join(f"{r:.2f}" for r in ratios)
        lines.append(f"| {mode} | {statistics.median(ratios):.2f}x | {shown} |")
    denied = sum(case.denied for case in cases.values())
    lines += [
        "",
        f"{args.processes} client processes, {args.namespaces} namespaces "
        f"({args.namespaces // 3} per master of 3), {args.rounds} rounds x {args.seconds:g} s "
        f"per case, batch {args.batch}; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} at the end; denied calls: {denied}. CPU columns: % of one "
        f"core; this host has {100 * (os.cpu_count() or 1)} %.",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--processes", type=int, default=4, help="client processes (4)")
    parser.add_argument("--namespaces", type=int, default=12, help="namespaces (12)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per case (3)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the 4 cases (3)")
    parser.add_argument("--batch", type=int, default=100, help="EVALSHA per pipeline (100)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the per-round order")
    args = parser.parse_args(argv)
    if min(args.processes, args.namespaces, args.rounds, args.batch) < 1 or args.seconds <= 0:
        parser.error("every count must be >= 1 and --seconds > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    namespaces = spread_namespaces(args.namespaces)
    clusters = {masters: LocalCluster(masters) for masters in MASTERS}
    ctx = mp.get_context("spawn")  # no inherited sockets or threads
    procs: list[Any] = []
    conns: list[Connection] = []
    node_clients: dict[int, list[redis.Redis]] = {}
    try:
        for cluster in clusters.values():
            cluster.start()
        node_clients = {m: c.node_clients() for m, c in clusters.items()}
        urls = {masters: cluster.url for masters, cluster in clusters.items()}
        barrier = ctx.Barrier(args.processes + 1)
        for _ in range(args.processes):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(urls, namespaces, args.batch, barrier, theirs))
            proc.start()
            procs.append(proc)
            conns.append(mine)
        for conn in conns:
            if conn.recv() != "ready":
                raise RuntimeError("a client process did not start")
        cases = {(mode, m): Case(mode, m) for mode in MODES for m in MASTERS}
        order = list(cases.values())
        shuffle = random.Random(args.seed).shuffle
        # A first, short round warms connections, script caches and keys; not recorded.
        for case in order:
            run_case(Case(case.mode, case.masters), conns, barrier, node_clients[case.masters], 0.3)
        for round_no in range(args.rounds):
            shuffle(order)
            for case in order:
                run_case(case, conns, barrier, node_clients[case.masters], args.seconds)
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
        print(report(cases, args))
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):  # that process is gone already
                conn.send(None)
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        for clients in node_clients.values():
            for client in clients:
                client.close()
        for cluster in clusters.values():
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
