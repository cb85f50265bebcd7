"""The services of the demo stack and their commands: the one place they are written.

``docker-compose.yml`` runs these services as containers, ``make demo``
(``workers/celery_demo.py``) runs them as processes on this machine, and
``tests/system/test_stack.py`` checks that every compose service's ``command`` and
``environment`` are the ones built here, so the two cannot drift apart.

=========  ===============================================================================
service    command
=========  ===============================================================================
redis      ``redis-server`` without persistence: broker, result backend and limiter
mock-api   ``python -m workers.mock_api``: the upstream, 20 calls/s with burst 2
worker1/2  ``celery -A workers.demo_app worker`` with ``-E`` (task events, for Flower)
flower     ``celery -A workers.demo_app flower``
producer   ``python -m workers.producer``: enqueues the backlog, reports, plots
=========  ===============================================================================

What differs between compose and this machine is only where things listen, and it never
comes from the command itself:

* the Python services read their addresses from the environment (:func:`environment`):
  compose's host names (``redis``, ``mock-api``) there, loopback ports here;
* the mock API takes no address from the environment, so on this machine the harness
  *appends* loopback arguments (:attr:`Service.local_args`): a later flag overrides an
  earlier one, the command itself is the compose one; ``redis-server`` is started by
  :class:`tests.support.servers.RedisServer` with the same arguments plus a free port.

``python`` at the head of a command is the image's interpreter in compose and this
process's interpreter (the virtualenv's) here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "API_BURST",
    "API_RATE",
    "COMPOSE",
    "CONCURRENCY",
    "TASKS",
    "WORKERS",
    "Addresses",
    "Service",
    "environment",
    "services",
    "worker_argv",
]

API_RATE, API_BURST = 20.0, 2.0
"""The mock API's own limit, calls per second and burst. Burst 2 is one call of headroom
over the fleet's strict spacing (configs/demo.yaml: GCRA 19.6/s burst 1): a call reaches
the API about a millisecond after Redis admitted it, and a burst-1 API would count two calls
49 ms apart as a violation (``make bench-celery`` measures that strictest case)."""

WORKERS, CONCURRENCY, TASKS = 2, 4, 2000
"""The default fleet: 2 ``celery worker`` processes x 4 prefork children, 2,000 tasks
(about 100 s of work at 19.6/s)."""

APP = "workers.demo_app"
PLOT = "docs/demo.png"


@dataclass(frozen=True)
class Service:
    """One service of the stack.

    ``argv`` is the command, exactly as in docker-compose.yml. ``local_args`` is what the
    harness appends on this machine to listen on loopback (a free port where it says 0).
    ``python_env`` says whether the service gets :func:`environment` (the Python services).
    """

    argv: tuple[str, ...]
    local_args: tuple[str, ...] = ()
    python_env: bool = True


@dataclass(frozen=True)
class Addresses:
    """Where the services find each other.

    ``flower_url`` is the address a person opens in a browser (the producer prints it),
    which in compose is the published port on the host, not the container's name.
    """

    redis_url: str
    api_url: str
    flower_address: str
    flower_port: int
    flower_url: str


COMPOSE = Addresses(
    redis_url="redis://redis:6379/0",
    api_url="http://mock-api:8080",
    flower_address="0.0.0.0",
    flower_port=5555,
    flower_url="http://localhost:5555",
)
"""The addresses inside the compose network (service names as host names)."""


TASKS_COLUMNS = "name,state,exception,received,worker"
"""Flower's tasks page columns: its defaults with ``exception`` (for a RETRY, why the task
waits: the limit and the wait) in place of ``uuid`` and ``runtime``, to fit 1400 pixels."""


def environment(addresses: Addresses) -> dict[str, str]:
    """The environment of every Python service: addresses, and Flower's API left open.

    ``DEMO_BROKER_URL`` and ``MOCK_API_URL`` are read by ``workers/demo_app.py``;
    ``FLOWER_PORT`` and ``FLOWER_ADDRESS`` by Flower itself (any ``FLOWER_<option>``);
    ``FLOWER_TASKS_COLUMNS`` adds the column that shows throttling;
    ``FLOWER_UNAUTHENTICATED_API`` lets the demo and the screenshot read Flower's
    ``/api/tasks`` without configuring auth: fine on loopback and inside compose, where
    the port is published on 127.0.0.1 only.
    """
    return {
        "DEMO_BROKER_URL": addresses.redis_url,
        "MOCK_API_URL": addresses.api_url,
        "FLOWER_URL": addresses.flower_url,
        "FLOWER_ADDRESS": addresses.flower_address,
        "FLOWER_PORT": str(addresses.flower_port),
        "FLOWER_UNAUTHENTICATED_API": "true",
        "FLOWER_TASKS_COLUMNS": TASKS_COLUMNS,
    }


def worker_argv(
    name: str,
    *,
    app: str = APP,
    concurrency: int = CONCURRENCY,
    queues: str = "upstream",
    events: bool = False,
    extra: tuple[str, ...] = (),
    pool: str = "prefork",
) -> list[str]:
    """A ``celery worker`` command (``pool``: prefork by default; no mingle or gossip).

    ``events`` adds ``-E`` (task events), which Flower needs to show task states; the demo
    turns it on, the tests and the benchmark leave it off (one event message per state
    change per task is load they do not measure).

    The pool goes here, once, never in ``extra``: ``celery`` applies gevent's or
    eventlet's monkey-patching by the *first* ``-P`` of its command line
    (``celery.maybe_patch_concurrency``), while the worker runs the pool of the last one,
    so ``-P prefork ... -P gevent`` runs a gevent pool over unpatched sockets: one
    blocking call at a time.
    """
    return [
        "python", "-m", "celery", "-A", app, "worker", "-P", pool,
        "-c", str(concurrency), "-Q", queues, "-n", f"{name}@%h",
        "--without-mingle", "--without-gossip", "-l", "INFO",
        *(["-E"] if events else []), *extra,
    ]  # fmt: skip


def services(
    *,
    workers: int = WORKERS,
    concurrency: int = CONCURRENCY,
    tasks: int = TASKS,
    plot: str = PLOT,
) -> dict[str, Service]:
    """Every service of the stack, by compose service name.

    With the defaults this is docker-compose.yml; ``make demo`` may ask for another
    backlog size or fleet (``python -m workers.celery_demo --help``).
    """
    api = ["python", "-m", "workers.mock_api", "--host", "0.0.0.0", "--port", "8080",
           "--rate", f"{API_RATE:g}", "--burst", f"{API_BURST:g}"]  # fmt: skip
    stack = {
        "redis": Service(
            # On this machine tests.support.servers.RedisServer runs it, adding a free loopback
            # port, a temporary directory and a log file.
            ("redis-server", "--save", "", "--appendonly", "no"),
            python_env=False,
        ),
        "mock-api": Service(tuple(api), local_args=("--host", "127.0.0.1", "--port", "0"),
                            python_env=False),
    }  # fmt: skip
    for i in range(1, workers + 1):
        argv = worker_argv(f"demo{i}", concurrency=concurrency, events=True)
        stack[f"worker{i}"] = Service(tuple(argv))
    stack["flower"] = Service(("python", "-m", "celery", "-A", APP, "flower"))
    stack["producer"] = Service(
        ("python", "-m", "workers.producer", "--tasks", str(tasks),
         "--workers", str(workers), "--plot", plot),
    )  # fmt: skip
    return stack
