"""The in-memory limiter: the :class:`~throttle.limiter.Limiter` itself over a
:class:`~throttle.memory.server.MemoryRedis`."""

from __future__ import annotations

from collections.abc import Callable

from throttle.limiter import Limiter
from throttle.memory.server import MemoryRedis
from throttle.redis.client import RedisClient


class MemoryLimiter(Limiter):
    """A :class:`~throttle.limiter.Limiter` whose Redis is a :class:`MemoryRedis`: the same
    checks, keys, decisions and settlements, computed in this process by the models of the
    scripts (proven equal to them: ``tests/integration/test_model.py``).

    Parameters
    ----------
    prefix, namespace:
        As :class:`~throttle.limiter.Limiter`'s (several limiters may share one ``server``).
    clock_us:
        As :class:`~throttle.limiter.Limiter`'s: "now" in us sent with every call; default
        the server's clock.
    server:
        The store (default a new :class:`MemoryRedis` on this host's wall clock).

    Warning
    -------
    One process only: two processes, or two ``MemoryLimiter`` objects without a shared
    ``server``, each count alone. Lease records and holds live on the server's clock.
    """

    def __init__(
        self,
        *,
        prefix: str = "throttle",
        namespace: str = "default",
        clock_us: Callable[[], int] | None = None,
        server: MemoryRedis | None = None,
    ) -> None:
        self.server = server if server is not None else MemoryRedis()
        # The client type is redis-py's; the memory server answers what the limiter sends.
        client: RedisClient = self.server  # type: ignore[assignment]
        super().__init__(client, prefix=prefix, namespace=namespace, clock_us=clock_us)
