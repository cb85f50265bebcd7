"""Monitoring: Flower events and states, Prometheus metrics (multiprocess, served by the
worker and by Flower), fleet-wide stats. A real ``celery worker`` (1 x 2 prefork children,
``-E``), a real Flower, a real redis-server; the multiprocess set-up itself in fresh
subprocesses."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import redis
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.apps.celery_limits import LIMITS
from tests.support.events import EventLog
from tests.support.servers import RedisServer, free_port
from throttle.config import Settings
from throttle.errors import ConfigError, Throttled
from throttle.redis.keys import KeySpace
from throttle.stats import StatsBook
from workers.harness import ROOT, Worker, wait_ready

CONFIG = (
    """
settings:
  sleep_max: 0.3s
  park_after: 1.5s
  line_max: 0s  # waits beyond sleep_max are rescheduled (re-published, parked), as tested here
  park_lead: 0.5s
  metrics: true
  metrics_dir: {metrics_dir}
limits:
"""
    + LIMITS
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
        return body


def scrape(url: str) -> Samples:
    """Every sample of a /metrics page: (name, sorted labels) -> value."""
    found: Samples = {}
    for family in text_string_to_metric_families(get(url).decode()):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over the samples carrying ``labels`` (and any others)."""
    return sum(
        value
        for (sample, have), value in samples.items()
        if sample == name and set(labels.items()) <= set(have)
    )


class Monitored:
    def __init__(self, tmp: Path, server: RedisServer) -> None:
        self.server = server
        self.metrics_dir = tmp / "metrics"
        self.config = tmp / "limits.yaml"
        self.config.write_text(CONFIG.format(metrics_dir=self.metrics_dir))
        self.metrics_port, self.flower_port = free_port(), free_port()
        self.env = {
            "DEMO_BROKER_URL": server.url,
            "THROTTLE_CONFIG": str(self.config),
        }
        self.worker = Worker(
            "mon", {**self.env, "THROTTLE_METRICS_PORT": str(self.metrics_port)},
            concurrency=2, queues="celery", app="tests.apps.celery_app", log=tmp / "worker.log",
            extra=["-E"],
        )  # fmt: skip
        self.flower_log = tmp / "flower.log"
        self.flower: subprocess.Popen[bytes] | None = None
        self.client = redis.Redis.from_url(server.url)
        # The producer: an app of its own on this test's Redis (tests.apps.celery_app is shared
        # with other modules, and caches its connections), sending the worker's tasks by name.
        self.producer = Celery(
            "monitoring", broker=server.url, backend=server.url, set_as_current=False
        )
        self.producer.conf.task_default_queue = "celery"

    def send(self, task: str, *args: Any) -> Any:
        return self.producer.send_task(f"tests.apps.celery_app.{task}", args)

    @property
    def worker_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def flower_url(self) -> str:
        return f"http://127.0.0.1:{self.flower_port}"

    def start_flower(self) -> None:
        env = {**os.environ, **self.env, "FLOWER_UNAUTHENTICATED_API": "true"}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with open(self.flower_log, "wb") as out:
            self.flower = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.apps.celery_app", "flower",
                 f"--port={self.flower_port}", "--address=127.0.0.1"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.flower.poll() is not None:
                raise RuntimeError(f"flower exited: {self.flower_log.read_text()[-2000:]}")
            try:
                get(self.flower_url + "/healthcheck")
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("flower did not answer /healthcheck in 30 s")

    def flower_tasks(self) -> dict[str, Any]:
        tasks: dict[str, Any] = json.loads(get(self.flower_url + "/api/tasks"))
        return tasks

    def stop(self) -> None:
        if self.flower is not None and self.flower.poll() is None:
            self.flower.terminate()
            try:
                self.flower.wait(10)
            except subprocess.TimeoutExpired:
                self.flower.kill()
        self.worker.stop()
        self.client.close()
        self.producer.close()


@pytest.fixture(scope="module")
def mon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitored]:
    tmp = tmp_path_factory.mktemp("monitoring")
    with RedisServer() as server:
        mon = Monitored(tmp, server)
        try:
            mon.worker.start()
            mon.start_flower()
            wait_ready(mon.producer, [mon.worker])
            # Flower receives events once its receiver is connected: wait until it saw one.
            warm = mon.send("plain", 0)
            warm.get(timeout=30)
            deadline = time.monotonic() + 20
            while warm.id not in mon.flower_tasks() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert warm.id in mon.flower_tasks()
            yield mon
        finally:
            mon.stop()


def test_throttled_tasks_in_flower_and_in_the_metrics(mon: Monitored) -> None:
    # Given 12 tasks under a limit of 3/s burst 1, 2 pool children: the first runs, the
    # next sleeps to its slot, the later ones are deferred (re-published, or parked when
    # the wait is beyond 1.5 s)
    events = EventLog(mon.producer)
    handles = [mon.send("far", x) for x in range(12)]
    ids = {h.id for h in handles}
    # While they wait, Flower shows them as RETRY with the limit and the wait
    waiting: dict[str, str] = {}
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not waiting:
        waiting = {
            tid: task["exception"]
            for tid, task in mon.flower_tasks().items()
            if tid in ids and task["state"] == "RETRY"
        }
        time.sleep(0.1)
    assert waiting, "no throttled task seen in state RETRY"
    assert all(e.startswith("Throttled(limit='parked', wait=") for e in waiting.values())
    done = [h.get(timeout=30) for h in handles]
    deferrals = sum(r["deferrals"] for r in done)
    assert deferrals >= 6, deferrals

    # Each deferral sent one task-throttled event with its fields
    throttled = events.wait_for(deferrals)
    assert len(throttled) == deferrals
    for event in throttled:
        assert event["uuid"] in ids
        assert (event["limits"], event["keys"], event["costs"]) == (["parked"], [None], [1.0])
        assert event["how"] in ("republish", "park")
        assert event["name"] == "tests.apps.celery_app.far"  # Flower's label, whatever the order
        assert 0 < event["wait"] < 5
        assert event["slot"] == pytest.approx(event["timestamp"] + event["wait"], abs=0.1)
        assert event["deferrals"] >= 1

    # The worker's own port: the counters summed over its pool children
    worker = scrape(mon.worker_url)
    assert total(worker, "throttle_reschedules_total", limit="parked") == deferrals
    parks = total(worker, "throttle_reschedules_total", limit="parked", how="park")
    assert 1 <= parks < deferrals  # both ways were taken
    assert parks == sum(event["how"] == "park" for event in throttled)
    assert total(worker, "throttle_decisions_total", limit="parked", decision="denied") == (
        deferrals
    )
    assert total(worker, "throttle_decisions_total", limit="parked", decision="allowed") == 12
    assert total(worker, "throttle_wait_seconds_count", limit="parked") == 12 + deferrals
    assert total(worker, "throttle_wait_seconds_bucket", limit="parked", le="0.0") >= 1
    assert total(worker, "throttle_redis_up") == 1
    assert total(worker, "throttle_parked_tasks", state="waiting") == 0
    assert ("throttle_tokens_remaining", (("limit", "parked"),)) in worker
    assert ("throttle_next_slot_seconds", (("limit", "parked"),)) in worker
    assert ("throttle_tokens_remaining", (("limit", "tokens"),)) not in worker  # keyed

    # Multiprocess: each of the two pool children counted its decisions into a file of its
    # own (the first two tasks reach the two idle children at once), and the port serves
    # their sum
    children = {p.pid for p in psutil.Process(mon.worker.proc.pid).children()}  # type: ignore[union-attr]
    per_pid = counts_per_file(next(mon.metrics_dir.iterdir()), "throttle_decisions_total")
    counted = {pid for pid, n in per_pid.items() if n > 0}
    assert len(counted) == 2 and counted <= children, (per_pid, children)
    assert sum(per_pid.values()) == total(worker, "throttle_decisions_total") == 12 + deferrals

    # Flower: its own event counter, the workers' counters (label worker), the gauges
    flower = poll_flower(mon, "flower_events_total", deferrals, type="task-throttled")
    assert total(
        flower, "flower_events_total", type="task-throttled", task="tests.apps.celery_app.far"
    ) == (deferrals)
    assert total(
        flower, "throttle_reschedules_total", limit="parked", worker=mon.worker.hostname
    ) == (deferrals)
    assert total(flower, "throttle_parked_tasks", state="waiting") == 0
    assert ("throttle_next_slot_seconds", (("limit", "parked"),)) in flower
    # and every deferred task with its final state and the repr naming the limit
    tasks = mon.flower_tasks()
    for handle, result in zip(handles, done, strict=True):
        assert tasks[handle.id]["state"] == "SUCCESS"
        if result["deferrals"]:
            assert tasks[handle.id]["exception"].startswith("Throttled(limit='parked', wait=")

    # The fleet-wide stats (read one minute ahead: the current minute counts in full)
    stats = StatsBook(mon.client, KeySpace(), clock=lambda: time.time() + 60).per_minute(2)
    assert stats["parked"]["denied"] * 2 == deferrals
    assert stats["parked"]["parked"] * 2 == parks


def counts_per_file(directory: Path, name: str) -> dict[int, float]:
    """The sum of the samples ``name`` in each pid's counter file (read as the collector
    reads them)."""
    from prometheus_client.multiprocess import MultiProcessCollector  # noqa: PLC0415

    found = {}
    for path in directory.glob("counter_*.db"):
        pid = int(path.stem.split("_")[1])
        n = 0.0
        for metric in MultiProcessCollector.merge([str(path)]):
            for sample in metric.samples:
                if sample.name == name:
                    n += sample.value
        found[pid] = n
    return found


def poll_flower(mon: Monitored, name: str, want: float, **labels: str) -> Samples:
    """Flower's /metrics once ``name`` reached ``want`` (events arrive asynchronously, and
    on a loaded host Flower's event thread can be seconds behind)."""
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(mon.flower_url + "/metrics")
        if total(samples, name, **labels) >= want or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_timeouts_refunds_and_charges_are_counted(mon: Monitored) -> None:
    assert mon.send("hurry", 1).get(timeout=30) == 1  # the one slot of the hour
    with pytest.raises(Exception, match="throttle deadline"):
        mon.send("hurry", 2).get(timeout=30)
    mon.send("spend", "refund", 1000, 200).get(timeout=30)  # 800 back
    mon.send("spend", "charge", 1000, 1500).get(timeout=30)  # 500 more
    with pytest.raises(ValueError):
        mon.send("spend", "failed", 300, None, True).get(timeout=30)  # on_error: refund, 300 back
    worker = scrape(mon.worker_url)
    assert total(worker, "throttle_timeouts_total", limit="deadline", action="fail") == 1
    assert total(worker, "throttle_decisions_total", limit="deadline", decision="denied") == 1
    assert total(worker, "throttle_refunded_tokens_total", limit="tokens") == 1100
    assert total(worker, "throttle_charged_tokens_total", limit="tokens") == 500
    assert total(worker, "throttle_redis_errors_total") == 0
    stats = StatsBook(mon.client, KeySpace(), clock=lambda: time.time() + 60).per_minute(2)
    assert stats["deadline"] == {"denied": 0.0, "parked": 0.0, "timeout": 0.5, "waited": 0.0}


# -- the pieces, without a fleet ----------------------------------------------------------


def test_throttled_repr_names_the_limits_and_the_wait() -> None:
    assert repr(Throttled(3.21, ["upstream"])) == "Throttled(limit='upstream', wait=3.2s)"
    assert repr(Throttled(0.05, ["a", "b"])) == "Throttled(limits=['a', 'b'], wait=0.050s)"
    assert repr(Throttled(12.0)) == "Throttled(wait=12.0s)"
    assert repr(Throttled(math.inf, ["x"])) == "Throttled(limit='x', wait=inf)"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"metrics_port": 0}, "field 'settings.metrics_port': must be a port number"),
        ({"metrics_port": "9100"}, "field 'settings.metrics_port': must be a port number"),
        ({"metrics": "on"}, "field 'settings.metrics': must be true or false"),
        ({"metrics": False, "metrics_port": 9100}, "contradicts metrics_port"),
        ({"metrics_dir": ""}, "field 'settings.metrics_dir': must be a non-empty string"),
    ],
    ids=["port-zero", "port-string", "metrics-string", "contradiction", "empty-dir"],
)
def test_bad_metrics_settings_name_their_field(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        Settings.from_mapping(settings, source="limits.yaml")
    assert str(caught.value).startswith("limits.yaml: ")


def test_a_metrics_port_turns_metrics_on() -> None:
    assert Settings.from_mapping({"metrics_port": 9100}, source=None).metrics
    assert not Settings().metrics


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT, env={**environ, **env}, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip


def test_forked_children_count_into_their_own_files_and_are_summed(tmp_path: Path) -> None:
    # Given prometheus_client imported before the worker sets up (as the celery command
    # does, through Flower's plugin), then two forked children counting
    proc = run_python(
        f"""
        import os, prometheus_client
        from prometheus_client import values
        from pathlib import Path
        from types import SimpleNamespace
        from throttle import metrics
        from throttle.celery.observe import PrometheusReporter
        assert not values.ValueClass._multiprocess
        directory = metrics.setup_worker(Path({str(tmp_path)!r}), "w1@host")
        assert values.ValueClass._multiprocess
        for n in (3, 4):
            pid = os.fork()
            if pid == 0:
                for _ in range(n):
                    metrics.deferred(["api"], "park", 2.0)
                # A deferral by defer_task (no targets: the upstream's word) and one by
                # the gate (targets): only the first is an upstream deferral
                reporter = PrometheusReporter()
                for targets in ([], [("limit", None, 1.0)]):
                    execution = SimpleNamespace(targets=targets)
                    reporter.deferred(execution, ["api"], "republish", 1.0, 1)
                os._exit(0)
            os.waitpid(pid, 0)
        collector = metrics.ThrottleCollector(lambda: [(None, directory)], lambda: None)
        for metric in collector.collect():
            for s in metric.samples:
                print(s.name, sorted(s.labels.items()), s.value)
        print("files", sorted(p.name.split("_")[0] for p in directory.iterdir()))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "throttle_reschedules_total [('how', 'park'), ('limit', 'api')] 7.0" in out
    assert "throttle_reschedules_total [('how', 'republish'), ('limit', 'api')] 4.0" in out
    assert "throttle_upstream_deferrals_total [('limit', 'api')] 2.0" in out
    # and only the gate's are decisions, with a wait: a task the upstream sent back had
    # its run counted allowed already
    assert "throttle_wait_seconds_count [('limit', 'api')] 9.0" in out
    assert "throttle_decisions_total [('decision', 'denied'), ('limit', 'api')] 9.0" in out
    assert "files ['counter', 'counter', 'histogram', 'histogram']" in out


def test_a_foreign_multiproc_dir_is_a_clear_error(tmp_path: Path) -> None:
    proc = run_python(
        f"""
        from pathlib import Path
        from throttle import metrics
        metrics.setup_worker(Path({str(tmp_path)!r}), "w1@host")
        """,
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "elsewhere"),
    )
    assert proc.returncode != 0
    assert "PROMETHEUS_MULTIPROC_DIR is set to another directory" in proc.stderr


def test_without_prometheus_client_the_throttler_works_and_asking_for_metrics_fails() -> None:
    proc = run_python(
        """
        import sys
        sys.modules["prometheus_client"] = None  # as if not installed
        from celery import Celery
        from throttle import metrics
        from throttle.celery import install
        from throttle.errors import ConfigError
        install(Celery("x"))
        metrics.deferred(["api"], "park", 1.0)  # metrics off: nothing happens
        try:
            metrics.setup_worker(__import__("pathlib").Path("/tmp"), "w")
        except ConfigError as exc:
            print(exc)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'celery-throttled[metrics]'" in proc.stdout


def test_a_failing_stats_write_never_fails_the_task(prefix: str) -> None:
    # The gate's recording of a deferral against a Redis that is gone: no exception.
    from throttle.celery.observe import FleetStatsReporter, Observer  # noqa: PLC0415

    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    reporter = FleetStatsReporter(StatsBook(dead, KeySpace(prefix)), on_error=Observer())
    execution = SimpleNamespace(targets=[])
    reporter.deferred(execution, ["api"], "republish", 1.0, 1)  # type: ignore[arg-type]
    dead.close()


def test_a_deferral_reads_as_throttled_in_flower_on_a_threads_pool(tmp_path: Path) -> None:
    # Given a threads-pool worker sending task events: nothing is pickled between a task
    # and the worker's main process (as on gevent, eventlet and solo), which sends
    # task-retried with the repr of what the task raised (Flower's exception column)
    with RedisServer() as server:
        config = tmp_path / "limits.yaml"
        config.write_text(CONFIG.format(metrics_dir=tmp_path / "metrics"))
        env = {"DEMO_BROKER_URL": server.url, "THROTTLE_CONFIG": str(config)}
        worker = Worker(
            "threads", env, concurrency=4, queues="celery", app="tests.apps.celery_app",
            log=tmp_path / "worker.log", pool="threads", events=True,
        )  # fmt: skip
        producer = Celery("threads", broker=server.url, backend=server.url, set_as_current=False)
        try:
            worker.start()
            wait_ready(producer, [worker])
            events = EventLog(producer, "task-retried")
            # When tasks under a limit of 3/s burst 1 are deferred
            handles = [producer.send_task("tests.apps.celery_app.far", (x,)) for x in range(6)]
            deferrals = sum(handle.get(timeout=60)["deferrals"] for handle in handles)
            retried = events.wait_for(deferrals)
        finally:
            worker.stop()
            producer.close()
    # Then each task-retried event names the limit and the wait, as under prefork, not
    # Celery's repr of its Retry ("Retry(Retry(...), Throttled(...), 1.8)")
    assert deferrals >= 3
    assert len(retried) == deferrals
    shown = [event["exception"] for event in retried]
    assert all(text.startswith("Throttled(limit='parked', wait=") for text in shown), shown
