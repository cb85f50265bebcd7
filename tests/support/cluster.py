"""A private Redis Cluster for tests and benchmarks: masters only, on free loopback ports.

:class:`LocalCluster` starts ``masters`` ``redis-server --cluster-enabled yes`` processes
(each a :class:`tests.support.servers.RedisServer`, with its ``nodes.conf`` in that server's
temporary directory), joins them, waits until every node reports ``cluster_state:ok`` and
the same slot map, and stops them on exit. It never touches a Redis it did not start::

    from throttle import Limiter
    from tests.support.cluster import LocalCluster

    with LocalCluster(masters=3) as cluster:
        limiter = Limiter.from_url(cluster.url, namespace="github")

Three masters or more are joined by ``redis-cli --cluster create ... --cluster-yes`` (the
tool operators use); fewer (``redis-cli`` refuses to create them, but a benchmark wants one
master as its baseline) by ``CLUSTER ADDSLOTS`` and ``CLUSTER MEET`` directly. No replicas:
a test cluster needs no failover, and replicas would double the processes on a small VM.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Sequence

import redis
from redis.cluster import ClusterNode, RedisCluster

from tests.support.servers import RedisServer, Service, free_port

__all__ = ["SLOTS", "LocalCluster"]

SLOTS = 16384
"""Hash slots of a Redis Cluster."""


class LocalCluster(Service):
    """``masters`` cluster-enabled ``redis-server`` processes joined into one cluster.

    Parameters
    ----------
    masters:
        How many masters (>= 1); the slots are split evenly between them, in port order.
    start_timeout_s:
        How long to wait, in seconds, for the cluster to report ``cluster_state:ok``.
    """

    def __init__(self, masters: int = 3, *, start_timeout_s: float = 30.0) -> None:
        if masters < 1:
            raise ValueError(f"a cluster needs at least one master (got {masters})")
        self.masters = masters
        self.start_timeout_s = start_timeout_s
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...``: for :meth:`Limiter.from_url`."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def client(self, **kwargs: object) -> RedisCluster:
        """A new redis-py cluster client, knowing every master as a startup node."""
        startup = [
            ClusterNode("127.0.0.1", node.port)  # type: ignore[no-untyped-call]
            for node in self.nodes
        ]
        return RedisCluster(startup_nodes=startup, **kwargs)  # type: ignore[arg-type]

    def node_clients(self) -> list[redis.Redis]:
        """A plain client of each master (for commands aimed at one node: SCRIPT FLUSH,
        CLUSTER SETSLOT, INFO). The caller closes them."""
        return [node.client() for node in self.nodes]

    def start(self) -> LocalCluster:
        """Start the masters, join them, and wait until the cluster serves every slot."""
        try:
            for _ in range(self.masters):
                self.nodes.append(self._start_node())
            if self.masters >= 3:
                self._create_with_redis_cli()
            else:
                self._create_by_hand()
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self) -> RedisServer:
        # The cluster bus port is given explicitly: by default it is the port + 10000, which
        # may be taken or beyond 65535 for a high ephemeral port.
        last: Exception | None = None
        for _ in range(5):
            bus = free_port()
            server = RedisServer(
                (
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",  # in the server's temp dir
                    "--cluster-port", str(bus),
                    "--cluster-node-timeout", "5000",
                )
            )  # fmt: skip
            try:
                return server.start()
            except RuntimeError as exc:  # the bus port was taken meanwhile: another one
                server.stop()
                last = exc
        raise RuntimeError(f"a cluster node did not start: {last}")

    def _create_with_redis_cli(self) -> None:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError("redis-cli is not on PATH (apt-get install redis-tools)")
        hosts = [f"127.0.0.1:{node.port}" for node in self.nodes]
        done = subprocess.run(
            [cli, "--cluster", "create", *hosts, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=self.start_timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed ({done.returncode}): "
                f"{(done.stdout + done.stderr)[-2000:]}"
            )

    def _create_by_hand(self) -> None:
        clients = self.node_clients()
        try:
            share = SLOTS // self.masters
            for i, client in enumerate(clients):
                first = i * share
                last = SLOTS if i == self.masters - 1 else first + share
                client.cluster("ADDSLOTS", *range(first, last))
            # The bus port must be given: it is not the default port + 10000 (_start_node).
            bus = clients[0].config_get("cluster-port")["cluster-port"]
            for client in clients[1:]:
                client.cluster("MEET", "127.0.0.1", self.nodes[0].port, bus)
        finally:
            for client in clients:
                client.close()

    def _wait_ok(self) -> None:
        clients = self.node_clients()
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                infos = [client.cluster("INFO") for client in clients]
                # Every node ok and knowing all masters: then a client's first slot map is
                # the final one, wherever it asks.
                if all(
                    info.get("cluster_state") == "ok"
                    and int(info.get("cluster_known_nodes", 0)) == self.masters
                    and int(info.get("cluster_slots_ok", 0)) == SLOTS
                    for info in infos
                ):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster did not become ok: {infos}")
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()

    def pin(self, cpus: Sequence[int] | None) -> None:
        """Pin master ``i`` (every thread of its ``redis-server``) to CPU ``cpus[i]``, or let
        every master run on any CPU this process may use when ``cpus`` is None.

        For benchmarks: a master executes commands on one thread, so its capacity is one
        core's, and on a host with fewer cores than masters + clients the scheduler decides
        who gets a core unless they are pinned (``taskset -a -p``, through
        ``sched_setaffinity``; Linux only). Pinning reserves nothing: other processes of the
        host may still run on that CPU.
        """
        if cpus is not None and len(cpus) != len(self.nodes):
            raise ValueError(f"{len(self.nodes)} masters, {len(cpus)} CPUs given")
        anywhere = os.sched_getaffinity(0)
        for i, node in enumerate(self.nodes):
            assert node.process is not None, "the cluster is not started"
            allowed = anywhere if cpus is None else {cpus[i]}
            for thread in os.listdir(f"/proc/{node.process.pid}/task"):
                os.sched_setaffinity(int(thread), allowed)

    def stop(self) -> None:
        """Stop every node and remove its directory."""
        for node in self.nodes:
            node.stop()
        self.nodes = []
