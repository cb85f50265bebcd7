"""The demo's producer: ``python -m workers.producer --tasks 2000 --workers 2 --plot PATH``.

It enqueues a backlog of ``call_api`` tasks of ``workers/demo_app.py`` at once, shows a
progress bar while the fleet drains it into the mock API, and ends with a summary of what
the API saw and what the tasks saw:

* calls, violations (the API's 429s) and utilization of the API's limit, where the bound
  is ``burst + rate x span`` over the span from the first call to the last;
* reschedules per task (how often throttling re-published it: mean and max);
* lateness behind the slot the throttler reserved (p50, p95, max): the time between the
  slot and the moment the task was about to call;
* lost (enqueued, never reached the API) and ran twice (reached it more than once).

It writes a PNG of calls per second at the API against its limit (``--plot``, empty for
none), and exits 1 when a task was lost or ran twice, or the API counted a violation.

The same command is the ``producer`` service of docker-compose.yml and the last process
``make demo`` starts (``workers/stack.py``). Addresses come from the environment:
``DEMO_BROKER_URL`` (read by the demo app), ``MOCK_API_URL``, and ``FLOWER_URL`` (printed).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO


def api_json(path: str, method: str = "GET") -> Any:
    """GET or POST ``path`` of the mock API (``MOCK_API_URL``) and decode its JSON."""
    base = os.environ.get("MOCK_API_URL", "http://127.0.0.1:8080").rstrip("/")
    request = urllib.request.Request(
        base + path, method=method, data=b"" if method == "POST" else None
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


@dataclass(frozen=True)
class Summary:
    """What one run did, from the API's arrivals and the tasks' results."""

    enqueued: int
    completed: int
    calls: int
    violations: int
    utilization: float
    span_s: float
    elapsed_s: float
    rate: float
    lost: int
    twice: int
    reschedules_mean: float
    reschedules_max: int
    late_ms: tuple[float, float, float]  # p50, p95, max; nan when no task had a slot

    @property
    def ok(self) -> bool:
        return (
            self.completed == self.enqueued
            and not self.lost
            and not self.twice
            and self.violations == 0
        )

    def table(self) -> str:
        p50, p95, worst = self.late_ms
        span, run = self.span_s, self.elapsed_s
        mean, most = self.reschedules_mean, self.reschedules_max
        rows = [
            ("tasks", f"{self.completed} completed of {self.enqueued}"),
            ("calls at the API", f"{self.calls} in {span:.1f} s (run {run:.1f} s)"),
            ("violations (429)", str(self.violations)),
            (f"utilization of {self.rate:g}/s", f"{self.utilization:.1%} of burst + rate x span"),
            ("reschedules per task", f"{mean:.2f} mean, {most} max"),
            ("lateness behind slot", f"p50 {p50:.1f} ms, p95 {p95:.1f} ms, max {worst:.1f} ms"),
            ("lost / ran twice", f"{self.lost} / {self.twice}"),
        ]  # fmt: skip
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def summarize(
    task_ids: list[str],
    results: list[dict[str, Any] | None],
    arrivals: list[dict[str, Any]],
    rate: float,
    burst: float,
    elapsed_s: float,
) -> Summary:
    """The run's figures. ``results[i]`` is task ``task_ids[i]``'s return value, or None if
    it did not complete; ``arrivals`` are the API's (``GET /arrivals``), in arrival order."""
    per_task = collections.Counter(a["task_id"] for a in arrivals)
    done = [r for r in results if r is not None]
    deferrals = [int(r.get("deferrals", 0)) for r in done] or [0]
    late = sorted(1000 * r["late_s"] for r in done if r.get("late_s") is not None)
    if late:
        late_ms = (statistics.median(late), late[math.ceil(0.95 * len(late)) - 1], late[-1])
    else:
        late_ms = (math.nan, math.nan, math.nan)
    span = arrivals[-1]["at_s"] - arrivals[0]["at_s"] if arrivals else 0.0
    allowed = sum(1 for a in arrivals if a["allowed"])
    return Summary(
        enqueued=len(task_ids),
        completed=len(done),
        calls=len(arrivals),
        violations=len(arrivals) - allowed,
        utilization=allowed / (burst + rate * span) if arrivals else 0.0,
        span_s=span,
        elapsed_s=elapsed_s,
        rate=rate,
        lost=sum(1 for i in task_ids if per_task[i] == 0),
        twice=sum(1 for n in per_task.values() if n > 1),
        reschedules_mean=statistics.mean(deferrals),
        reschedules_max=max(deferrals),
        late_ms=late_ms,
    )


class Progress:
    """A one-line progress bar of calls at the API, redrawn with ``\\r`` on a terminal.

    The API's call count is the progress: every task calls it exactly once. Off a terminal
    (docker-compose logs, a test) it prints a plain line every 10 s instead.
    """

    def __init__(
        self, total: int, started: float, out: TextIO = sys.stdout, width: int = 30
    ) -> None:
        """``started``: ``time.monotonic()`` when the first task was enqueued."""
        self.total, self.started, self.out, self.width = total, started, out, width
        self.tty = out.isatty()
        self.history: collections.deque[tuple[float, int]] = collections.deque(maxlen=7)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def __enter__(self) -> Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_event.set()
        self.thread.join()
        self._draw(final=True)

    def _run(self) -> None:
        period = 0.5 if self.tty else 10.0
        while not self.stop_event.wait(period):
            self._draw()

    def _draw(self, final: bool = False) -> None:
        try:
            stats = api_json("/stats")
        except OSError:
            return  # one missed frame; the next one will tell
        now, calls = time.monotonic(), int(stats["calls"])
        self.history.append((now, calls))
        # calls per second over the last 3 s (since the start, at first)
        then, before = self.history[0] if len(self.history) > 1 else (self.started, 0)
        rate = (calls - before) / (now - then) if now > then else 0.0
        filled = min(self.width, self.width * calls // max(self.total, 1))
        line = (
            f"  [{'#' * filled}{'.' * (self.width - filled)}] {calls:>5}/{self.total} calls"
            f"  {rate:4.1f}/s  {stats['violations']} violations  {now - self.started:5.1f} s"
        )
        if self.tty:
            self.out.write("\r" + line + ("\n" if final else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()


def wait_for_workers(app: Any, count: int, timeout_s: float = 120.0) -> None:
    """Block until ``count`` workers answer a ping: enqueue only when the fleet is up, so
    that the run's time measures the fleet, not its start-up."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while time.monotonic() < deadline:
        for reply in app.control.ping(timeout=1.0) or []:
            seen.update(reply)
        if len(seen) >= count:
            return
    raise TimeoutError(f"{len(seen)} of {count} workers answered within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000, help="backlog size")
    parser.add_argument("--workers", type=int, default=2, help="workers to wait for")
    parser.add_argument("--plot", default="", help="PNG of calls per second (empty: none)")
    args = parser.parse_args(argv)

    from celery.exceptions import TimeoutError as CeleryTimeout  # noqa: PLC0415

    from workers.demo_app import app, call_api  # noqa: PLC0415 (reads DEMO_BROKER_URL)

    wait_for_workers(app, args.workers)
    if os.environ.get("FLOWER_URL"):
        print(f"Flower: {os.environ['FLOWER_URL']}/tasks (task states live)", flush=True)
    api_json("/reset", "POST")  # count this run's calls only
    limit = api_json("/stats")
    rate, burst = float(limit["rate"]), float(limit["burst"])
    print(f"enqueueing {args.tasks} tasks; the API allows {rate:g}/s burst {burst:g}", flush=True)
    started = time.monotonic()
    handles = [call_api.delay(n) for n in range(args.tasks)]
    # Generous: the backlog at the API's rate, twice over, plus start-up.
    deadline = started + args.tasks / rate * 2 + 60
    results: list[dict[str, Any] | None] = []
    with Progress(args.tasks, started):
        for handle in handles:
            try:
                value = handle.get(timeout=max(deadline - time.monotonic(), 0.1), propagate=False)
            except CeleryTimeout:
                value = None  # counted as not completed in the summary
            results.append(value if isinstance(value, dict) else None)
    elapsed = time.monotonic() - started
    summary = summarize(
        [h.id for h in handles], results, api_json("/arrivals"), rate, burst, elapsed
    )
    print()
    print(summary.table())
    if args.plot:
        from workers.plot import plot_calls  # noqa: PLC0415 (matplotlib: slow to import)

        path = plot_calls(api_json("/arrivals"), rate, burst, Path(args.plot))
        print(f"\n  plot: {path.resolve()}")
    print(
        "\nOK"
        if summary.ok
        else "\nFAILED: a task was lost, ran twice or failed, or the API saw a violation"
    )
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
