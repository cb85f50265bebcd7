"""The scripts of ``lua/`` in Python: the in-memory limiter of eager tests.

Each model of an algorithm keeps its state in a dict instead of Redis and performs the same
floating-point operations in the same order as its script in ``lua/``, so that a script and
its model fed the same (time, cost) sequence agree exactly: decisions, remaining,
retry_after and reset. ``tests/integration/test_model.py`` proves it with hypothesis,
against the scripts in a real Redis, for every algorithm and for several limits at once,
through :class:`MemoryLimiter` as well as :class:`ModelLimiter`. Missing state reads as it
does in Lua (a full bucket, an empty window); a state key's expiry is not modelled, because
a key only expires once its state reads like a missing key.

:class:`MemoryRedis` stands in for the Redis server of a :class:`~throttle.limiter.Limiter`:
it answers the limiter's script calls (acquire, settle, peek, hold, holds, and
lua/adapt.lua's learned states: :func:`adapt`) with the replies the scripts would give,
computed by the models, so that :class:`MemoryLimiter` is the
:class:`~throttle.limiter.Limiter` itself (its checks, keys and decoding) over memory. It
serves one process: nothing is shared with another process, and the parking lot's scripts
are refused (an eager task never parks). Users' tests reach it through
:mod:`throttle.testing`.

The modules mirror ``lua/``, one model per script:

* ``prelude.py``: what every model shares (prelude.lua's ``ceil_us``, a limit's
  :class:`Params`, the ``Algorithm`` protocol: check, commit, adjust);
* ``token_bucket.py``, ``gcra.py``, ``fixed_window.py``, ``sliding_window.py``,
  ``concurrency.py``, ``fair.py``: one algorithm each, as its script;
* ``model.py``: :class:`ModelLimiter`, acquire.lua and settle.lua over those models (and
  the lease :class:`Record`);
* ``adapt.py``: :func:`adapt`, adapt.lua's learned rates;
* ``server.py``: :class:`MemoryRedis`, the fake server that decodes the scripts' calls and
  answers them with the models;
* ``limiter.py``: :class:`MemoryLimiter`, the :class:`~throttle.limiter.Limiter` over it.
"""

from throttle.memory.adapt import adapt
from throttle.memory.concurrency import Concurrency
from throttle.memory.fair import Fair
from throttle.memory.fixed_window import FixedWindow
from throttle.memory.gcra import Gcra
from throttle.memory.limiter import MemoryLimiter
from throttle.memory.model import ModelLimiter, Record
from throttle.memory.prelude import Params, ceil_us
from throttle.memory.server import MemoryRedis
from throttle.memory.sliding_window import SlidingWindow
from throttle.memory.token_bucket import TokenBucket

__all__ = [
    "Concurrency",
    "Fair",
    "FixedWindow",
    "Gcra",
    "MemoryLimiter",
    "MemoryRedis",
    "ModelLimiter",
    "Params",
    "Record",
    "SlidingWindow",
    "TokenBucket",
    "adapt",
    "ceil_us",
]
