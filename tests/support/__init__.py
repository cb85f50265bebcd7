"""Test tooling, not shipped in the wheel: private servers (servers.py: RedisServer,
RedisSentinel, TlsFiles; cluster.py: LocalCluster), the test clock (clock.py), the
pure-Python reference models (model.py) and the clock-skew client (skewed_client.py).
Also used by the demos (workers/) and the benchmarks (bench/), run from the repo root."""
