"""Acquisitions per second on a Redis Cluster of 1, 2 and 3 masters: capacity, CPU, a fleet.

Does the rate a cluster can admit grow with its masters? Three private clusters are
started here, side by side (:class:`LocalCluster`: 1, 2 and 3 masters, no replicas), and
three things are measured, in R rounds whose cases run in an order shuffled per round
(fixed seed), so that drift on a shared machine hits every case alike; ratios are taken
per round against the 1-master case of the same round.

1. Capacity, with a fast client (``capacity`` rows). ``redis-benchmark`` (C, pipelined:
   ``--threads`` one per master, ``-c`` 4 connections per master, ``-P 64``) sends our real
   acquire: EVALSHA of the script :meth:`Limiter.acquire` sends for one token bucket
   (captured from a real call, loaded on every master first), with its real keys and
   arguments. With ``--cluster`` it replaces ``{tag}`` in the keys with a hash tag of the
   node each connection talks to (redis-benchmark.c, ``setClusterKeyHashTag``: the tag of
   the first slot of that node), so each master serves one namespace of its own; it
   refuses a cluster of one node, so the 1-master case is sent to that master without
   ``--cluster`` and keeps ``{tag}`` as its namespace. Masters are pinned to CPUs
   (:meth:`LocalCluster.pin`) when that makes the test fair: with C CPUs, N < C masters
   get a CPU each and the client the rest; N == C masters get a CPU each and the client
   shares them; N > C masters are not pinned. On 2 CPUs: 1 master on CPU 0 with the client
   on CPU 1, against 2 masters on CPUs 0 and 1 with the client sharing them.

   Every call is admitted or denied by the script itself. The limit is ``1/d burst 1e9``:
   a bucket of a billion tokens refilled at one a day, which no run empties, so every call
   is admitted (the capacity case) and each admission leaves its mark: after a case the
   bucket of each namespace is read back (the script's packed state) and ``burst -
   tokens`` is the number admitted. That count, the EVALSHA calls the masters report, and
   no failed or rejected EVALSHA (``INFO commandstats``) are checked after each case (in
   the python fleet, against the decisions' count too); the footer prints admitted and
   denied.

2. CPU accounting, which depends little on how busy the machine was. Per master, the CPU
   it used (``INFO cpu``: ``used_cpu_user + used_cpu_sys`` deltas, the whole process:
   network, event loop and script) over the acquisitions it executed. Not commandstats
   ``usec``: Redis times a command by the clock, so a master preempted by another process
   mid-script is charged the wait. From it, the ``projection`` rows: the rate each cluster
   would admit with one core per master, ``1 / (busiest master's share x CPU per
   acquisition)``, the rate at which the busiest master fills its core, where the share is
   that of the fleet's namespaces (each taking the same part of the traffic) on the
   cluster's real slot map, and the CPU per acquisition is the median over every master of
   every capacity run. A projection, not a measurement: it assumes a master's cost per
   acquisition stays what it was here when it has a core of its own, and it leaves out the
   clients' CPU (other hosts, in production).

3. What one Python fleet sees here (``python fleet`` rows): P client processes, each
   calling :meth:`Limiter.acquire` through ``redis.cluster.RedisCluster`` one call at a
   time, over every namespace in turn (the namespaces spread evenly over 2 or 3 masters),
   on 1 and on 3 masters (not pinned). Bound by Python and round trips, not by the masters.

Run from the repository root: ``python -m bench.cluster [--processes 4] [--namespaces 12]
[--seconds 3] [--rounds 5] [--seed 1] [--no-pin]`` (``make bench-cluster``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing as mp
import os
import random
import shutil
import statistics
import struct
import subprocess
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
from tests.support.cluster import SLOTS, LocalCluster
from throttle import Limit, Limiter

CAPACITY_MASTERS = (1, 2, 3)
FLEET_MASTERS = (1, 3)
BURST = 1_000_000_000
# A bucket no run empties, refilled so slowly (one token a day) that what is missing from
# it after a case is what that case admitted.
LIMIT = Limit.parse(f"1/d burst {BURST}", name="bench")
KEY = "tenant"
CONNECTIONS_PER_MASTER = 4
PIPELINE = 64


def spread_namespaces(count: int, masters: Sequence[int] = (2, 3)) -> list[str]:
    """``count`` namespaces spread evenly over the masters of a cluster of each size in
    ``masters`` (exactly when ``count`` is a multiple of their least common multiple).

    redis-cli and :class:`LocalCluster` give master ``i`` of ``m`` the slots from about
    ``i * 16384 / m``, so the slot range is cut into lcm(masters) equal parts, each given
    the same number of names; names within two slots of a cut are skipped (the tools round
    the edges differently)."""
    parts = math.lcm(*masters)
    want = [count // parts + (1 if i < count % parts else 0) for i in range(parts)]
    chosen: list[str] = []
    i = 0
    while len(chosen) < count:
        name = f"bench-{i}"
        i += 1
        slot = key_slot(f"{{{name}}}".encode())
        offset = slot * parts % SLOTS
        if offset < 2 * parts or SLOTS - offset < 2 * parts:
            continue  # near a cut
        part = slot * parts // SLOTS
        if want[part] > 0:
            want[part] -= 1
            chosen.append(name)
    return chosen


def busiest_share(names: Sequence[str], masters: int) -> float:
    """The largest share of ``names`` that one master of ``masters`` serves (equal slot
    ranges, as redis-cli makes them)."""
    counts = [0] * masters
    for name in names:
        counts[key_slot(f"{{{name}}}".encode()) * masters // SLOTS] += 1
    return max(counts) / len(names)


# -- the Python fleet's processes -----------------------------------------------------------


def worker(urls: dict[int, str], namespaces: list[str], barrier: Barrier, conn: Connection) -> None:
    """One client process: builds a cluster client per cluster, then runs the cases it is
    sent (masters, seconds), starting each together with the others at ``barrier``."""
    fleets: dict[int, list[Limiter]] = {}
    for masters, url in urls.items():
        # One cluster client per process, as a worker has, shared by its namespaces.
        client = Limiter.from_url(url).client
        fleets[masters] = [Limiter(client, namespace=ns) for ns in namespaces]
    conn.send("ready")
    while True:
        command = conn.recv()
        if command is None:
            break
        masters, seconds = command
        barrier.wait()
        conn.send(run_calls(fleets[masters], seconds))
    for limiters in fleets.values():
        limiters[0].client.close()


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


# -- what the masters report ----------------------------------------------------------------


@dataclass(frozen=True)
class NodeStats:
    """One master's counters at one moment."""

    cpu_s: float  # used_cpu_user + used_cpu_sys
    calls: int  # EVALSHA executed
    errors: int  # failed and rejected EVALSHA


def node_stats(node: redis.Redis) -> NodeStats:
    cpu = node.info("cpu")
    # Only EVALSHA's errors: a new redis-py connection's CLIENT SETINFO is an error reply
    # on Redis < 7.2, and harmless.
    evalsha = node.info("commandstats").get("cmdstat_evalsha", {})
    return NodeStats(
        float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        int(evalsha.get("calls", 0)),
        int(evalsha.get("failed_calls", 0)) + int(evalsha.get("rejected_calls", 0)),
    )


def take_admitted(node: redis.Redis) -> int:
    """Acquisitions admitted on ``node`` since its buckets were last taken: ``burst - tokens``
    of every bench bucket (token_bucket.lua's state, packed doubles: tokens first), which
    are then deleted so that the next case starts from full buckets."""
    admitted = 0
    for key in node.scan_iter(match="throttle:*:tb:bench:*", count=1000):
        state = node.get(key)
        if state is not None:
            (tokens,) = struct.unpack_from("<d", state)
            admitted += round(BURST - tokens)  # the refill, a token a day, rounds away
        node.delete(key)
    return admitted


# -- the cases ------------------------------------------------------------------------------


@dataclass
class Case:
    """One row of measurements: a client kind on a cluster of ``masters``."""

    kind: str  # "capacity" or "python fleet"
    masters: int
    placement: str = ""
    rates: list[float] = field(default_factory=list)  # acquisitions/s
    client_cpu: list[float] = field(default_factory=list)  # % of one core
    server_cpu: list[float] = field(default_factory=list)  # % of one core, all masters
    cpu_us: list[list[float]] = field(default_factory=list)  # per master, per round
    busiest: list[float] = field(default_factory=list)  # busiest master's share of calls
    admitted: int = 0
    denied: int = 0


def placement(masters: int, cpus: list[int], pin: bool) -> tuple[list[int] | None, set[int], str]:
    """(the CPU of each master or None, the client's CPUs, a label) for ``masters`` masters
    on ``cpus``: each master on a CPU of its own while there are enough, the client on the
    CPUs left (or on all of them when none is left)."""
    if not pin or masters > len(cpus):
        return None, set(cpus), f"{len(cpus)} CPUs shared by all"
    mine = cpus[:masters]
    rest = set(cpus[masters:])
    shown = ", ".join(str(c) for c in mine)
    if rest:
        return mine, rest, f"CPU {shown}; client on the other {len(rest)}"
    return mine, set(cpus), f"CPUs {shown}; client shares them"


class Capacity:
    """redis-benchmark sending the captured EVALSHA to one cluster."""

    def __init__(self, cluster: LocalCluster, nodes: list[redis.Redis], pin: bool) -> None:
        self.cluster = cluster
        self.nodes = nodes
        self.masters = len(nodes)
        self.master_cpus, self.client_cpus, self.label = placement(
            self.masters, sorted(os.sched_getaffinity(0)), pin
        )
        limiter = Limiter.from_url(cluster.url, namespace="capture")
        try:
            script, keys, args = capture(limiter, lambda: limiter.acquire(LIMIT, KEY))
        finally:
            limiter.client.close()
        for node in nodes:  # redis-benchmark cannot answer a NOSCRIPT
            node.script_load(script.script)
            take_admitted(node)
        words = [a.decode() if isinstance(a, bytes) else str(a) for a in args]
        tagged = [k.replace("{capture}", "{tag}") for k in keys]
        self.command = ["EVALSHA", script.sha, str(len(keys)), *tagged, *words]
        self.requests = 0  # per case, sized by warm_up

    def run(self, requests: int) -> tuple[float, float, float, list[NodeStats], list[NodeStats]]:
        """(acquisitions/s as redis-benchmark measured them, wall s, client CPU s, master
        counters before, after) of one run of ``requests`` calls."""
        found = shutil.which("redis-benchmark")
        if found is None:
            raise FileNotFoundError("redis-benchmark is not on PATH (apt-get install redis-tools)")
        argv = [
            found,
            *(["--cluster"] if self.masters > 1 else []),
            "-h", "127.0.0.1", "-p", str(self.cluster.nodes[0].port),
            "-n", str(requests),
            "-c", str(CONNECTIONS_PER_MASTER * self.masters),
            "-P", str(PIPELINE),
            "--threads", str(self.masters),
            "--csv",
            *self.command,
        ]  # fmt: skip
        self.cluster.pin(self.master_cpus)
        client_cpus = self.client_cpus
        before = [node_stats(node) for node in self.nodes]
        children = os.times()
        wall = time.perf_counter()
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            preexec_fn=lambda: os.sched_setaffinity(0, client_cpus),
        )
        wall = time.perf_counter() - wall
        used = os.times()
        after = [node_stats(node) for node in self.nodes]
        self.cluster.pin(None)
        if done.returncode != 0:
            raise RuntimeError(f"redis-benchmark failed: {(done.stdout + done.stderr)[-2000:]}")
        # --csv: a header line, then "test","rps",...
        rps = float(done.stdout.strip().splitlines()[-1].split('","')[1])
        client_s = used.children_user + used.children_system
        client_s -= children.children_user + children.children_system
        return rps, wall, client_s, before, after

    def warm_up(self, seconds: float) -> None:
        """A short run (loads connections, scripts and caches; not recorded) whose rate sizes
        the recorded runs to about ``seconds`` each."""
        rps, *_ = self.run(20_000 * self.masters)
        for node in self.nodes:
            take_admitted(node)
        self.requests = max(PIPELINE * CONNECTIONS_PER_MASTER, round(rps * seconds))

    def measure(self, case: Case) -> None:
        rps, wall, client_s, before, after = self.run(self.requests)
        calls = [a.calls - b.calls for a, b in zip(after, before, strict=True)]
        errors = sum(a.errors - b.errors for a, b in zip(after, before, strict=True))
        admitted = sum(take_admitted(node) for node in self.nodes)
        if errors or admitted > sum(calls) or sum(calls) < self.requests:
            raise RuntimeError(
                f"{case.masters} masters: {errors} errors, {admitted} admitted of "
                f"{sum(calls)} calls, {self.requests} requests"
            )
        record(case, rps, wall, client_s, before, after)
        case.admitted += admitted
        case.denied += sum(calls) - admitted


def record(
    case: Case,
    rate: float,
    wall: float,
    client_s: float,
    before: list[NodeStats],
    after: list[NodeStats],
) -> None:
    """Adds one round's numbers to ``case``."""
    calls = [a.calls - b.calls for a, b in zip(after, before, strict=True)]
    cpu = [a.cpu_s - b.cpu_s for a, b in zip(after, before, strict=True)]
    case.rates.append(rate)
    case.client_cpu.append(100 * client_s / wall)
    case.server_cpu.append(100 * sum(cpu) / wall)
    case.cpu_us.append([1e6 * s / max(n, 1) for s, n in zip(cpu, calls, strict=True)])
    case.busiest.append(max(calls) / max(sum(calls), 1))


class Fleet:
    """P Python processes calling Limiter.acquire on the clusters of FLEET_MASTERS."""

    def __init__(self, urls: dict[int, str], namespaces: list[str], processes: int) -> None:
        ctx = mp.get_context("spawn")  # no inherited sockets or threads
        self.barrier = ctx.Barrier(processes + 1)
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        for _ in range(processes):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(urls, namespaces, self.barrier, theirs))
            proc.start()
            self.procs.append(proc)
            self.conns.append(mine)
        for conn in self.conns:
            if conn.recv() != "ready":
                raise RuntimeError("a client process did not start")

    def measure(self, case: Case, nodes: list[redis.Redis], seconds: float) -> None:
        for conn in self.conns:
            conn.send((case.masters, seconds))
        before = [node_stats(node) for node in nodes]
        wall = time.perf_counter()
        self.barrier.wait()
        results = [conn.recv() for conn in self.conns]
        wall = time.perf_counter() - wall
        after = [node_stats(node) for node in nodes]
        admitted = sum(n for n, *_ in results)
        drained = sum(take_admitted(node) for node in nodes)
        errors = sum(a.errors - b.errors for a, b in zip(after, before, strict=True))
        if errors or drained != admitted:
            raise RuntimeError(
                f"{case.masters} masters: {errors} errors, {admitted} admitted by the "
                f"decisions, {drained} by the buckets"
            )
        rate = sum(n / elapsed for n, _, elapsed, _ in results)
        record(case, rate, wall, sum(cpu for *_, cpu in results), before, after)
        case.admitted += admitted
        case.denied += sum(d for _, d, _, _ in results)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # that process is gone already
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


# -- the report -----------------------------------------------------------------------------


def shares(cluster: LocalCluster, namespaces: list[str]) -> list[float]:
    """Each master's share of ``namespaces`` (in node order), from the cluster's slot map."""
    client = cluster.client()
    try:
        ports = [node.port for node in cluster.nodes]
        counts = [0] * len(ports)
        for ns in namespaces:
            node = client.get_node_from_key(f"throttle:{{{ns}}}:holds")
            counts[ports.index(node.port)] += 1
        return [n / len(namespaces) for n in counts]
    finally:
        client.close()


def pct(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} %"


def spread(values: Sequence[float], digits: int = 0) -> str:
    """``median (min-max)`` of ``values``."""
    return (
        f"{statistics.median(values):,.{digits}f} "
        f"({min(values):,.{digits}f}-{max(values):,.{digits}f})"
    )


def measured_row(client: str, case: Case, base: Case) -> str:
    ratios = [b / a for a, b in zip(base.rates, case.rates, strict=True)]
    per_round = [statistics.median(row) for row in case.cpu_us]
    return (
        f"| {client} | {case.masters} | {case.placement} | {spread(case.rates)} | "
        f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
        f"{spread(per_round, 1)} µs | "
        f"{100 * statistics.median(case.busiest):.0f} % | {pct(case.server_cpu)} | "
        f"{pct(case.client_cpu)} |"
    )


def report(
    capacity: dict[int, Case],
    fleet: dict[int, Case],
    share: dict[int, list[float]],
    args: argparse.Namespace,
    load: tuple[float, float],
) -> str:
    lines = [
        "| clients | masters | CPUs of the masters | acquisitions/s: median (min-max) | "
        "vs 1 master, per round | master CPU per acquisition | busiest master's share of "
        "acquisitions | masters' CPU | client CPU |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in capacity.values():
        lines.append(measured_row("capacity: redis-benchmark", case, capacity[1]))
    # One cost per acquisition for every projection: the median over every master of every
    # capacity run (what one core does per acquisition does not depend on the masters).
    costs = [us for case in capacity.values() for row in case.cpu_us for us in row]
    cost = statistics.median(costs)
    for masters in capacity:
        busiest = max(share[masters])
        lines.append(
            f"| projection: one core per master | {masters} | one core each | "
            f"{1e6 / (busiest * cost):,.0f} | {1 / busiest:.2f}x | {cost:.1f} µs "
            f"(all capacity runs) | {100 * busiest:.0f} % of {args.namespaces} namespaces | "
            "100 % (busiest) | not counted |"
        )
    for case in fleet.values():
        lines.append(measured_row(f"python fleet: {args.processes} processes", case, fleet[1]))
    everything = [*capacity.values(), *fleet.values()]
    admitted = sum(case.admitted for case in everything)
    denied = sum(case.denied for case in everything)
    cpus = len(os.sched_getaffinity(0))
    arbitrary = [f"ns-{i}" for i in range(args.namespaces)]
    unchosen = ", ".join(
        f"{100 * busiest_share(arbitrary, m):.0f} % on {m} masters ("
        f"{1 / busiest_share(arbitrary, m):.2f}x)"
        for m in capacity
        if m > 1
    )
    lines += [
        "",
        f"{args.rounds} rounds, cases shuffled per round, about {args.seconds:g} s each; "
        f"redis-benchmark: {CONNECTIONS_PER_MASTER} connections and 1 thread per master, "
        f"pipeline {PIPELINE}; {cpus} CPUs; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end; acquisitions admitted: {admitted:,}, denied: {denied}. "
        f"CPU: % of one core (this host has {100 * cpus} %); master CPU per acquisition: "
        f"used_cpu_user + used_cpu_sys over the acquisitions executed ("
        f"{min(costs):.1f}-{max(costs):.1f} µs over every master of every capacity run). "
        f"The projection's namespaces are the fleet's, chosen to spread evenly; with "
        f"{args.namespaces} names not chosen (ns-0, ns-1, ...) the busiest master would "
        f"serve {unchosen}.",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--processes", type=int, default=4, help="Python processes (4)")
    parser.add_argument("--namespaces", type=int, default=12, help="namespaces (12)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per case (3)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every case (5)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the per-round order")
    parser.add_argument("--no-pin", action="store_true", help="never pin masters to CPUs")
    args = parser.parse_args(argv)
    if min(args.processes, args.namespaces, args.rounds) < 1 or args.seconds <= 0:
        parser.error("every count must be >= 1 and --seconds > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    namespaces = spread_namespaces(args.namespaces)
    clusters = {masters: LocalCluster(masters) for masters in CAPACITY_MASTERS}
    nodes: dict[int, list[redis.Redis]] = {}
    fleet: Fleet | None = None
    try:
        for cluster in clusters.values():
            cluster.start()
        nodes = {m: c.node_clients() for m, c in clusters.items()}
        share = {m: shares(c, namespaces) for m, c in clusters.items()}
        benches = {m: Capacity(clusters[m], nodes[m], not args.no_pin) for m in CAPACITY_MASTERS}
        fleet = running = Fleet(
            {m: clusters[m].url for m in FLEET_MASTERS}, namespaces, args.processes
        )
        capacity = {m: Case("capacity", m, bench.label) for m, bench in benches.items()}
        fleets = {m: Case("python fleet", m, "any CPU") for m in FLEET_MASTERS}
        steps = [("capacity", m) for m in CAPACITY_MASTERS] + [("fleet", m) for m in FLEET_MASTERS]
        # A first round warms connections, script caches and keys and sizes the capacity
        # runs; not recorded.
        for bench in benches.values():
            bench.warm_up(args.seconds)
        for m in FLEET_MASTERS:
            running.measure(Case("warm-up", m), nodes[m], 0.3)
        shuffle = random.Random(args.seed).shuffle
        for round_no in range(args.rounds):
            shuffle(steps)
            for kind, m in steps:
                if kind == "capacity":
                    benches[m].measure(capacity[m])
                else:
                    running.measure(fleets[m], nodes[m], args.seconds)
            print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr)
        print(report(capacity, fleets, share, args, (load_start, os.getloadavg()[0])))
    finally:
        if fleet is not None:
            fleet.close()
        for clients in nodes.values():
            for client in clients:
                client.close()
        for cluster in clusters.values():
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
