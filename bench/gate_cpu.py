"""The throttler's own Python per task, in one process, without the noise of a pool.

``python -m bench.gate_cpu [--tasks 3000] [--rounds 5] [--before REV] [--profile TASK]``

What runs
---------
The tasks of ``bench/overhead_app.py`` (``plain``, ``one_limit``, ``plain_args``,
``two_limits``, ``reported``; each throttled one is compared with its plain twin, as in
``bench/overhead.py``), each executed by Celery's tracer (``celery.app.trace.build_tracer``) on a
request built as a worker builds it from a message, one after the other in one process:
the code a prefork pool child runs per task, without the pool's pipes and the broker.
Two modes, each timed in CPU seconds of the process (``time.process_time``: what the task
costs this process, whatever else the machine runs):

* *redis*: the limiter talks to a private ``redis-server``: the gate's Python, redis-py,
  the system calls of the round trip;
* *canned*: the limiter's script call (``Limiter._call``) returns the reply Redis gave
  the first call of the same script: what remains is the throttler's own Python
  (rules, key and cost, the gate, building the script's arguments and decoding its
  reply, the settle and the observers), which is what a profile can trim.

With ``--before REV`` the same runs are made on the tree of git revision REV (in a child
process with ``PYTHONPATH`` on it), alternating with this tree round by round. With
``--profile TASK`` (canned mode, this tree) cProfile's table of the throttler's functions
is printed instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.checkout import checkout
from bench.overhead import ARGS, BASELINE, TASKS, WARMUP_TASKS
from workers.harness import ROOT


def child(tasks: int, canned: bool, profile: str | None) -> dict[str, float]:
    """In the child process: µs of CPU per task of each task (one block each)."""
    from celery.app.trace import build_tracer  # noqa: PLC0415

    from bench.overhead_app import app  # noqa: PLC0415
    from throttle.limiter import Limiter  # noqa: PLC0415

    app.conf.broker_url = os.environ["OVERHEAD_BROKER_URL"]
    if canned:
        real_call = Limiter._call
        replies: dict[tuple[str, int], Any] = {}

        def call(self: Limiter, script: Any, keys: Any, args: list[Any]) -> Any:
            # a Routine (a function of the library) here, a Script in older trees
            found = (getattr(script, "function", None) or script.sha, len(keys))
            if found not in replies:
                replies[found] = real_call(self, script, keys, args)
            return replies[found]

        Limiter._call = call  # type: ignore[method-assign]
    tracers = {}
    for name in TASKS:
        task = app.tasks[f"bench.overhead_app.{name}"]
        tracers[name] = build_tracer(task.name, task, app=app, hostname="cpu@bench", eager=False)

    def requests(name: str, n: int) -> list[tuple[str, dict[str, Any]]]:
        """Requests as a worker builds them (celery.worker.request.Request)."""
        made = []
        for _ in range(n):
            task_id = str(uuid.uuid4())
            message = app.amqp.as_task_v2(task_id, f"bench.overhead_app.{name}", ARGS[name], {})
            request = dict(message.headers)
            request.update({
                "properties": {"priority": 0}, "reply_to": None, "correlation_id": task_id,
                "hostname": "cpu@bench", "is_eager": False, "args": ARGS[name], "kwargs": {},
                "delivery_info": {"exchange": "", "routing_key": "overhead", "priority": 0,
                                  "redelivered": False},
            })  # fmt: skip
            made.append((task_id, request))
        return made

    def block(name: str, n: int) -> float:
        tracer, args = tracers[name], ARGS[name]
        batch = requests(name, n)
        started = time.process_time()
        for task_id, request in batch:
            result = tracer(task_id, args, {}, request)
            if result.info is not None and result.info.state != "SUCCESS":
                raise RuntimeError(f"{name} did not succeed: {result}")
        return (time.process_time() - started) / n * 1e6

    for name in TASKS:
        block(name, WARMUP_TASKS)
    if profile is not None:
        import cProfile  # noqa: PLC0415
        import pstats  # noqa: PLC0415

        profiler = cProfile.Profile()
        profiler.enable()
        block(profile, tasks)
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(r"throttle[/\\]", 40)
        stats.sort_stats("cumulative").print_stats(r"throttle[/\\]", 25)
        return {}
    return {name: block(name, tasks) for name in TASKS}


def run_child(tree: Path, url: str, tasks: int, canned: bool) -> dict[str, float]:
    argv = [sys.executable, "-m", "bench.gate_cpu", "--child", "--tasks", str(tasks)]
    if canned:
        argv.append("--canned")
    env = {**os.environ, "PYTHONPATH": str(tree), "OVERHEAD_BROKER_URL": url}
    done = subprocess.run(
        argv, cwd=tree, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode:
        raise RuntimeError(f"the child on {tree} failed:\n{done.stderr[-2000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", default=None, help="a git revision to run beside this tree")
    parser.add_argument("--profile", default=None, choices=TASKS, help="cProfile one task")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--canned", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.tasks, args.canned, None)))
        return 0
    from tests.support.servers import RedisServer  # noqa: PLC0415

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        if args.profile is not None:
            os.environ["OVERHEAD_BROKER_URL"] = server.url
            child(args.tasks, True, args.profile)
            return 0
        trees = [("this tree", ROOT)]
        if args.before:
            before = stack.enter_context(
                checkout(args.before, "bench/overhead_app.py", "bench/gate_cpu.py")
            )
            trees.append((f"before ({args.before})", before))
        samples: dict[tuple[str, str, str], list[float]] = {}
        for round_no in range(args.rounds):
            for mode in ("canned", "redis"):
                for label, tree in trees:
                    result = run_child(tree, server.url, args.tasks, mode == "canned")
                    for task, us in result.items():
                        samples.setdefault((label, mode, task), []).append(us)
                    print(
                        f"round {round_no + 1}: {label:<20} {mode:<6} "
                        + " ".join(f"{task} {us:.1f}" for task, us in result.items()),
                        flush=True,
                    )
    print(f"\n{args.tasks} tasks per block, {args.rounds} rounds: CPU µs per task, medians (best)")
    print("| version | mode | task | µs/task (best) | over plain (best) |")
    print("|---|---|---|---:|---:|")
    for label, _ in trees:
        for mode in ("canned", "redis"):
            for task in TASKS:
                plain = samples[(label, mode, BASELINE[task])]
                us = samples[(label, mode, task)]
                median, best = statistics.median(us), min(us)
                print(
                    f"| {label} | {mode} | {task} | {median:.1f} ({best:.1f}) "
                    f"| {median - statistics.median(plain):+.1f} ({best - min(plain):+.1f}) |"
                )
    load = os.getloadavg()
    print(f"\n{started}, load average at the end {load[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
