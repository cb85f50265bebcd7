"""A fleet whose limiter Redis is killed and restarted empty mid-run, judged at a strict API.

Shared by tests/system/test_restart.py (one run) and bench/restart.py (many runs): a
private broker and a separate limiter ``redis-server``, the mock API of
``workers/mock_api.py`` at 20/s **burst 1** (one call every 50 ms, judged on arrival), and
``celery worker`` processes of ``workers.demo_app`` calling it through a GCRA limit at
98 % of its rate. While tasks sleep to their reserved slots, the limiter's Redis is
SIGKILLed and started again, empty, on the same port; several times per run.
"""

from __future__ import annotations

import collections
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tests.support.servers import RedisServer
from workers.harness import Api, Worker, demo_env, running, start_api

LOSSES = ((1.0, "flush"), (3.0, "kill"), (5.0, "flush"), (7.0, "flush"))
"""When (s after the first call) and how the limiter's Redis loses its data in a run."""
API_RATE = 20.0
LIMIT_RATE = 15.0
"""75 % of the API's: a call may reach the API up to 16 ms late behind the previous one (a
loaded host) without a refusal, so that the refusals counted are the schedule's: two calls
closer than 50 ms, which a schedule that forgot the calls before a loss gives."""
CONFIG = """
settings:
  sleep_max: 1s
  # Waits stay broker messages (ETA): the parking lot lives in the limiter's Redis, and a
  # Redis that loses its data loses the tasks parked there (docs/failures.md).
  park_after: 60s
limits:
  upstream: {{algorithm: gcra, rate: {rate}/s, burst: 1, max_wait: 1h{extra}}}
  tokens: {{rate: 20000/m, key: "{{tenant}}", cost: max_tokens}}  # the demo app's other task
queues:
  upstream: [upstream]
"""


def respawn(server: RedisServer) -> None:
    """Start ``server`` again on the same port (its data is gone unless its args persist it):
    what a restarted Redis looks like to clients that keep their URL."""
    server.process = subprocess.Popen(
        [
            server.executable, "--port", str(server.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--logfile", "", *server.args,
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = server.client(socket_timeout=1.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return
        except redis.ConnectionError:
            time.sleep(0.01)
    raise RuntimeError(f"redis-server did not come back on port {server.port}")


def kill(server: RedisServer) -> None:
    """SIGKILL: a crash, nothing written on the way out."""
    assert server.process is not None
    server.process.kill()
    server.process.wait(10)


@dataclass
class Outcome:
    """What one run did: at the API and in the result backend."""

    tasks: int
    calls: int
    refused: int
    once: int
    """Tasks whose id reached the API exactly once."""
    twice: int
    """Tasks whose id reached the API more than once."""
    completed: int
    kills: list[float]
    """When each loss happened, s since the API's start."""
    refused_at: list[float]
    """When each refused call arrived, s since the API's start."""
    unexplained: list[float]
    """The refused calls (s since the API's start) whose slot was too close to the last
    allowed call's: the schedule's fault (see :func:`unexplained_refusals`)."""

    @property
    def good(self) -> bool:
        """Every task called once, and the schedule was right: no refusal of a call whose
        slot was too close to the last allowed call's."""
        return not self.unexplained and self.once == self.tasks == self.completed

    def line(self) -> str:
        kills = ", ".join(f"{k:.2f}" for k in self.kills)
        refused = ", ".join(f"{r:.2f}" for r in self.refused_at)
        return (
            f"{self.tasks} tasks, {self.calls} calls, {self.refused} refused [{refused}], "
            f"{len(self.unexplained)} with slots too close, "
            f"{self.once} once, {self.twice} more than once, {self.completed} completed; "
            f"losses at [{kills}] s"
        )


class RestartFleet:
    """The pieces of the run; :meth:`run` may be called many times on one fleet."""

    def __init__(
        self, broker: RedisServer, limiter: RedisServer, api: Api, tmp: Path, extra: str = ""
    ) -> None:
        self.broker, self.limiter, self.api = broker, limiter, api
        config = tmp / "limits.yaml"
        config.write_text(CONFIG.format(rate=LIMIT_RATE, extra=extra))
        env = demo_env(
            broker.url, api.url, THROTTLE_REDIS_URL=limiter.url, THROTTLE_CONFIG=str(config)
        )
        self.workers = [
            Worker(f"restart{i}", env, concurrency=2, log=tmp / f"restart{i}.log") for i in (1, 2)
        ]

    def run(
        self, tasks: int = 120, losses: Sequence[tuple[float, str]] = LOSSES,
        down_s: float = 0.0, timeout_s: float = 90.0,
    ) -> Outcome:  # fmt: skip
        """Send ``tasks`` calls at once; at each ``(s, how)`` of ``losses``, counted from
        the first call's arrival at the API (tasks are then sleeping to their slots: 2 x 2
        children at 15/s), the limiter's Redis loses its data: ``"kill"``: SIGKILLed and
        started again, empty, ``down_s`` later; ``"flush"``: FLUSHALL, a loss without an
        outage (a failover to an empty replica). Then wait for every task."""
        from workers.demo_app import app, call_api  # noqa: PLC0415 (the env must be set)

        self.api.api.reset()
        sent = [call_api.delay(n) for n in range(tasks)]
        api = self.api.api
        deadline = time.monotonic() + 30
        while not api.arrivals and time.monotonic() < deadline:
            time.sleep(0.005)
        first = time.monotonic()
        kills = []
        for at, how in losses:
            time.sleep(max(first + at - time.monotonic(), 0.0))
            kills.append(time.monotonic() - api.started)
            if how == "flush":
                self.limiter.client().flushall()
                continue
            kill(self.limiter)
            time.sleep(down_s)
            respawn(self.limiter)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(r.ready() for r in sent):
            time.sleep(0.2)
        completed = sum(r.successful() for r in sent)
        time.sleep(0.2)  # a straggler's call reaching the API
        arrivals = api.arrivals_json()
        slot_of = {r.id: r.result["slot"] for r in sent if r.successful() and r.result.get("slot")}
        seen = collections.Counter(a["task_id"] for a in arrivals)
        ids = [r.id for r in sent]
        del app
        return Outcome(
            tasks=tasks,
            calls=len(arrivals),
            refused=sum(not a["allowed"] for a in arrivals),
            once=sum(seen[i] == 1 for i in ids),
            twice=sum(seen[i] > 1 for i in ids),
            completed=completed,
            kills=kills,
            refused_at=[a["at_s"] for a in arrivals if not a["allowed"]],
            unexplained=unexplained_refusals(self.api, arrivals, slot_of),
        )


def unexplained_refusals(
    api: Api, arrivals: list[dict[str, Any]], slot_of: dict[str, float]
) -> list[float]:
    """The refused arrivals (s since the API's start) that the schedule explains.

    The API refuses a call that comes less than 1/20 s after the last one it allowed; the
    limit's slots are 1/15 s (66.7 ms) apart when the schedule is right, so a refusal needs
    a late call, or two slots too close: the schedule's fault, what a limiter that forgot
    the lost state's calls gives (a call admitted at once after a loss, next to the last
    slot before it). Slots are read on the worker's clock before its acquire's round trip
    (``slot_time()``): on a loaded host a slot may read tens of ms early. So a refusal is
    counted when the slots of the refused call and of the last allowed one are less than
    half a spacing apart (33 ms), which such skew does not reach."""
    del api  # the arrivals' times are not needed: the slots say it
    half = 0.5 / LIMIT_RATE
    found: list[float] = []
    last_slot = None
    for arrival in arrivals:
        slot = slot_of.get(arrival["task_id"])
        if arrival["allowed"]:
            last_slot = slot
        elif slot is None or last_slot is None or abs(slot - last_slot) < half:
            found.append(arrival["at_s"])
    return found


@contextmanager
def restart_fleet(tmp: Path, extra: str = "") -> Iterator[RestartFleet]:
    """A broker, a limiter Redis, the strict API and 2 workers x 2 children, all private."""
    api = start_api(API_RATE, 1.0)
    try:
        with RedisServer() as broker, RedisServer() as limiter:
            fleet = RestartFleet(broker, limiter, api, tmp, extra)
            import os  # noqa: PLC0415

            os.environ["DEMO_BROKER_URL"] = broker.url  # this process's producer
            from workers.demo_app import app  # noqa: PLC0415

            app.conf.broker_url = broker.url
            app.conf.result_backend = broker.url
            with running(app, fleet.workers, kill=True):
                yield fleet
    finally:
        api.stop()
