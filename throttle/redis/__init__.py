"""The Redis boundary: everything that knows how the limiter's state sits in Redis.

- :mod:`throttle.redis.client`: the client type, building one from a URL, calling a script
  or a command with the driver's errors wrapped as :class:`~throttle.errors.BackendError`.
- :mod:`throttle.redis.urls`: Sentinel and Cluster URLs, redaction, the ACL rules.
- :mod:`throttle.redis.keys`: the name of every Redis key.
- :mod:`throttle.redis.scripts`: the sources of the Lua scripts (``lua/``).
- :mod:`throttle.redis.wire`: a limit's arguments to the scripts.
- :mod:`throttle.redis.replies`: the scripts' replies, decoded.

Above it, :mod:`throttle.limiter` and the other modules of the package speak in limits,
keys and decisions.
"""
