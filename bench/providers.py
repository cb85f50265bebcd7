"""A fleet calling an LLM provider through its real SDK: steady, and when the provider halves
its token limit and says so in its headers.

``python -m bench.providers [--scenarios openai-steady,openai-halve,anthropic-halve]
[--json PATH]`` (``make bench-providers``)

Each run starts a private ``redis-server`` (broker, limiter), a mock provider in a process
of its own (``python -m workers.providers``: OpenAI's chat completions or Anthropic's
Messages, with its own headers, judging every call on its own clock) and two ``celery
worker`` processes (prefork, 4 children each, the throttler's default settings) of
``bench/providers_app.py``. Each task makes one call through the real ``openai`` or
``anthropic`` SDK, set up as the docs' provider pages show (``max_retries=0``,
``upstream_hook(retry=True)`` on the SDK's ``http_client``), under two limits that follow
the provider's dimensions::

    llm-requests: {rate: 600/m, burst: 10, upstream: requests}
    llm-tokens:   {rate: 120000/m, burst: 2000, cost: estimate, upstream: tokens}

A call's prompt is 50 tokens and its reply 150 (``max_tokens`` 200): 250 reserved, 200
reported (:func:`throttle.celery.report_usage`). The provider allows 600 requests and
120,000 tokens a minute, in buckets of 2 s' worth (a stricter provider than the real ones,
whose buckets hold a minute: bursts show as refusals). A feeder keeps
:data:`OUTSTANDING` tasks sent and not yet served.

Scenarios:

* ``openai-steady``: :data:`STEADY_S` s. Measured: the share of calls refused, the tokens
  served per minute, tasks served twice or failed.
* ``openai-halve``, ``anthropic-halve``: after :data:`CHANGE_AT_S` s the provider halves
  its token limit (60,000 a minute) and says so in ``x-ratelimit-limit-tokens`` (or
  ``anthropic-ratelimit-tokens-limit``); the run goes on :data:`AFTER_S` s. Measured: the
  share of calls refused from the change on; the tokens served from 5 s after the change
  as a share of the new limit, and the lowest 5 s window of it; tasks twice, failed,
  unfinished.
* ``openai-halve-whole-estimate`` (not run by default): ``openai-halve`` with the tokens
  limit reserving the whole estimate of each call, as before the learned share
  (:mod:`throttle.celery.estimates`): its control, in the same invocation.
* ``openai-halve-unfollowed``, ``anthropic-halve-unfollowed`` (not run by default): the
  same with limits that follow no dimension (no ``upstream:``): what the fleet did before
  the providers' dialects were read. With ``--sdk-retries 2`` (the SDKs' default), the
  setup of the issue that found tasks running twice.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from bench.celery_fleet import MockProcess
from bench.checkout import start_worker, stop, wait_started
from tests.support.servers import RedisServer
from workers.harness import ROOT

APP = "bench.providers_app"
OUTSTANDING = 24
"""Tasks sent and not yet served that the feeder keeps."""
STEADY_S = 40.0
CHANGE_AT_S = 20.0
AFTER_S = 40.0
WINDOW_S = 5.0
"""The window of a rate measured over time, in s."""
REQUESTS_PER_MIN = 600.0
TOKENS_PER_MIN = 120_000.0
PROMPT = "x" * 200  # 50 tokens as the mocks count them
MAX_TOKENS = 200  # the mocks reply with 150 of them
ESTIMATE = 250
CONFIG = """
limits:
  llm-requests: {rate: 600/m, burst: 10, upstream: requests}
  llm-tokens: {rate: 120000/m, burst: 2000, cost: estimate, upstream: tokens}
"""
SCENARIOS = {
    "openai-steady": ("openai", False, True),
    "openai-halve": ("openai", True, True),
    "anthropic-halve": ("anthropic", True, True),
    "openai-halve-unfollowed": ("openai", True, False),
    "anthropic-halve-unfollowed": ("anthropic", True, False),
    "openai-halve-whole-estimate": ("openai", True, True),
}
"""Each scenario: the SDK, whether the provider halves its token limit, whether the limits
follow the provider's dimensions (``upstream:``; without it, the limits read only the
generic headers, as before the dialects)."""
WHOLE_ESTIMATE = {"openai-halve-whole-estimate"}
"""Scenarios whose tokens limit reserves the whole estimate of every call (the workers get
``BENCH_WHOLE_ESTIMATE=1``): the control of the learned share
(:mod:`throttle.celery.estimates`), as the fleet reserved before it."""
DEFAULT_SCENARIOS = "openai-steady,openai-halve,anthropic-halve"


class ProviderProcess(MockProcess):
    """``python -m workers.providers KIND`` (:class:`~bench.celery_fleet.MockProcess`),
    the limits of :data:`REQUESTS_PER_MIN` and :data:`TOKENS_PER_MIN` in 2 s buckets."""

    def __init__(self, kind: str, log: Path) -> None:
        argv = ["workers.providers", kind, "--requests-per-min", str(REQUESTS_PER_MIN),
                "--tokens-per-min", str(TOKENS_PER_MIN), "--burst-s", "2"]  # fmt: skip
        super().__init__(argv, log, "/_mock/stats")


@dataclass
class Run:
    scenario: str
    calls: int
    refused: int
    sent: int
    metrics: dict[str, float | int | None] = field(default_factory=dict)


def feed(
    producer: Celery, task: str, client: redis.Redis, stop_at: float, done: threading.Event
) -> int:
    """Keep :data:`OUTSTANDING` tasks sent and not yet served until ``stop_at``; returns
    how many were sent."""
    sent = 0
    while time.monotonic() < stop_at and not done.is_set():
        served = int(client.get("bench:done") or 0)
        while sent - served < OUTSTANDING:
            producer.send_task(task, args=(PROMPT, ESTIMATE, MAX_TOKENS), queue="upstream")
            sent += 1
        time.sleep(0.02)
    return sent


def tokens_in(arrivals: list[dict[str, Any]], start: float, end: float) -> float:
    return sum(a["charged"].get("tokens", 0.0) for a in arrivals if start <= a["at_s"] < end)


def measure(
    arrivals: list[dict[str, Any]], change_at: float | None, end: float
) -> dict[str, float | int | None]:
    """The figures of one run (times in s since the provider's reset)."""
    allowed = Counter(a["task_id"] for a in arrivals if a["allowed"])
    metrics: dict[str, float | int | None] = {
        "twice": sum(1 for count in allowed.values() if count > 1),
        "refused_share": sum(not a["allowed"] for a in arrivals) / max(len(arrivals), 1),
    }
    first = arrivals[0]["at_s"] if arrivals else 0.0
    if change_at is None:
        metrics["tokens_per_min"] = tokens_in(arrivals, first, end) / (end - first) * 60
        metrics["tokens_share"] = metrics["tokens_per_min"] / TOKENS_PER_MIN
        return metrics
    new_per_s = TOKENS_PER_MIN / 2 / 60
    before = tokens_in(arrivals, first, change_at) / (change_at - first)
    metrics["tokens_share_before"] = before / (TOKENS_PER_MIN / 60)
    after = [a for a in arrivals if a["at_s"] >= change_at]
    metrics["refused_after"] = sum(not a["allowed"] for a in after) / max(len(after), 1)
    settled = change_at + WINDOW_S
    metrics["share_after_5s"] = tokens_in(arrivals, settled, end) / (end - settled) / new_per_s
    windows = []
    t = settled
    while t + WINDOW_S <= end + 1e-9:
        windows.append(tokens_in(arrivals, t, t + WINDOW_S) / WINDOW_S / new_per_s)
        t += 0.5
    metrics["lowest_window_after_5s"] = min(windows) if windows else None
    first_window = tokens_in(arrivals, change_at, settled) / WINDOW_S / new_per_s
    metrics["share_first_5s"] = first_window
    return metrics


def one_run(scenario: str, logs: Path, args: argparse.Namespace) -> Run:
    kind, halve, follow = SCENARIOS[scenario]
    change_at = args.change_at_s if halve else None
    duration = args.steady_s if change_at is None else change_at + args.after_s
    provider = ProviderProcess(kind, logs / f"{scenario}-provider.log")
    with RedisServer() as server:
        config = logs / f"{scenario}.yaml"
        config.write_text(CONFIG if follow else CONFIG.replace(", upstream: requests", "")
                          .replace(", upstream: tokens", ""))  # fmt: skip
        env = {
            "DEMO_BROKER_URL": server.url, "THROTTLE_REDIS_URL": server.url,
            "THROTTLE_CONFIG": str(config), "MOCK_PROVIDER_URL": provider.url,
            "SDK_MAX_RETRIES": str(args.sdk_retries),
            "BENCH_WHOLE_ESTIMATE": "1" if scenario in WHOLE_ESTIMATE else "",
        }  # fmt: skip
        names = ("p1", "p2")
        procs = [start_worker(ROOT, APP, n, env, logs / f"{scenario}-{n}.log") for n in names]
        producer = Celery("providers", broker=server.url)
        producer.conf.update(task_default_queue="upstream", broker_connection_retry_on_startup=True)
        client = redis.Redis.from_url(server.url)
        done = threading.Event()
        sent = [0]
        try:
            wait_started(producer, names, procs, f"workers of {scenario} (see {logs})")
            provider.post("/_mock/reset", {})
            start = time.monotonic()

            def run_feeder() -> None:
                sent[0] = feed(producer, f"{APP}.{kind}_call", client, start + duration, done)

            feeder = threading.Thread(target=run_feeder, daemon=True)
            feeder.start()
            if change_at is not None:
                time.sleep(max(start + change_at - time.monotonic(), 0.0))
                provider.post("/_mock/limit", {"dimension": "tokens",
                                               "per_minute": TOKENS_PER_MIN / 2})  # fmt: skip
            feeder.join(duration + 30)
            drain_until = time.monotonic() + 60
            while int(client.get("bench:done") or 0) < sent[0] and time.monotonic() < drain_until:
                time.sleep(0.2)
            stats = provider.get("/_mock/stats")
            every = provider.get("/_mock/arrivals")
            ends = {k.decode(): int(v) for k, v in client.hgetall("bench:ends").items()}
            served = int(client.get("bench:done") or 0)
        finally:
            done.set()
            stop(procs)
            client.close()
            producer.close()
            provider.stop()
    if args.arrivals is not None:
        args.arrivals.mkdir(parents=True, exist_ok=True)
        (args.arrivals / f"{scenario}.json").write_text(
            json.dumps({"stats": stats, "arrivals": every})
        )
    changed = stats["changes"][0][0] if stats["changes"] else None
    arrivals = [a for a in every if a["at_s"] <= duration]
    metrics = measure(arrivals, changed, duration)
    metrics["twice"] = measure(every, None, duration)["twice"]  # the drain counts too
    metrics["failed"] = ends.get("FAILURE", 0)
    metrics["unfinished"] = sent[0] - served
    refused = sum(not a["allowed"] for a in arrivals)
    return Run(scenario, len(arrivals), refused, sent[0], metrics)


def pct(value: float | int | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS, help=f"of {', '.join(SCENARIOS)}")
    parser.add_argument(
        "--sdk-retries", type=int, default=0,
        help="the SDK's own max_retries (the docs say 0; the SDKs' default is 2)",
    )  # fmt: skip
    parser.add_argument("--steady-s", type=float, default=STEADY_S)
    parser.add_argument("--change-at-s", type=float, default=CHANGE_AT_S)
    parser.add_argument("--after-s", type=float, default=AFTER_S)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--arrivals", type=Path, default=None, help="a directory: each run's calls")
    parser.add_argument("--logs", type=Path, default=None, help="a directory kept: the logs")
    args = parser.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-providers-") as tmp:
        logs = Path(tmp) if args.logs is None else args.logs
        logs.mkdir(parents=True, exist_ok=True)
        for scenario in args.scenarios.split(","):
            run = one_run(scenario, logs, args)
            runs.append(run)
            print(f"{scenario:16} {run.calls} calls, {run.refused} refused, {run.sent} sent  "
                  f"{run.metrics}")  # fmt: skip
    print()
    print(
        "| scenario | calls | refused | refused after the halving | tokens served "
        "(share of the limit in force) | lowest 5 s window | twice | failed | unfinished |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        m = r.metrics
        if "share_after_5s" in m:
            served = (f"{pct(m['tokens_share_before'])} before, {pct(m['share_first_5s'])} in "
                      f"the first 5 s, {pct(m['share_after_5s'])} after")  # fmt: skip
            lowest, after = pct(m["lowest_window_after_5s"]), pct(m["refused_after"])
        else:
            served, lowest, after = pct(m["tokens_share"]), "-", "-"
        counts = f"{m['twice']} | {m['failed']} | {m['unfinished']}"
        print(f"| {r.scenario} | {r.calls} | {r.refused} ({pct(m['refused_share'])}) | {after} "
              f"| {served} | {lowest} | {counts} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
