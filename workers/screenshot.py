"""``make screenshot``: Flower's tasks page while the demo stack throttles, as docs/flower.png;
with ``--page web``, the limits page (``celery throttle web``) of the same stack, as
docs/web.png.

It runs the stack of ``make demo`` (``workers/stack.py``: redis, mock API, two workers with
task events, Flower, the producer) with one change: the demo's ``upstream`` limit lowered
from 19.6/s to 4/s (``--rate``), so that eight pool children cannot all sleep to their slots
(``sleep_max``, 1 s) and most tasks are deferred: re-published for their slot, or parked in
Redis for the longer waits: a RETRY in Flower (the exception names the limit and the wait),
THROTTLED while it waits (the gate's ``task-throttled`` event). Once Flower has seen tasks
both throttled and finished, headless Chromium loads ``/tasks`` and saves the PNG; then
the stack is stopped, backlog and all.

Chromium runs with a fresh profile, no network beyond the page (no updates, sync or
QUIC), and a virtual-time budget so that the page's table, filled by JavaScript after
load, is drawn before the shot.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from workers.harness import ROOT, LocalStack, Process
from workers.stack import APP, services

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--virtual-time-budget=8000",
)  # fmt: skip


def flower_states(flower_url: str) -> collections.Counter[str]:
    """Tasks Flower knows of, counted by state (``/api/tasks``)."""
    with urllib.request.urlopen(f"{flower_url}/api/tasks", timeout=10) as response:
        tasks: dict[str, Any] = json.load(response)
    return collections.Counter(str(task.get("state")) for task in tasks.values())


def shoot(url: str, out: Path, size: str = "1400,900", timeout_s: float = 90.0) -> None:
    """Save a headless-Chromium screenshot of ``url`` to ``out``."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise FileNotFoundError("chromium is not on PATH: `make screenshot` installs it")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="throttle-chromium-") as profile:
        command = [
            chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
            f"--screenshot={out.resolve()}", f"--window-size={size}", url,
        ]  # fmt: skip
        done = subprocess.run(
            command, check=False, capture_output=True, text=True, timeout=timeout_s
        )
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")


def shoot_web(local: LocalStack, logs: Path, out: Path, seconds: float = 40.0) -> None:
    """Start ``celery throttle web`` beside the stack, let its chart fill for ``seconds``
    (with a pause of the upstream limit in the middle, so the chart shows it), and shoot."""
    from tests.support.servers import free_port  # noqa: PLC0415 (as LocalStack does)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ("python", "-m", "celery", "-A", APP, "throttle", "web", "--port", str(port))
    page = Process("web", argv, local.env, log=logs / "web.log").start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/state", timeout=5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the limits page did not answer") from None
                time.sleep(0.5)
        command = [sys.executable, "-m", "celery", "-A", APP, "throttle"]
        env = {**os.environ, **local.env}
        time.sleep(seconds / 2)
        for action in ("pause", "resume"):
            subprocess.run([*command, action, "upstream"], cwd=ROOT, env=env, check=True,
                           capture_output=True, timeout=60)  # fmt: skip
            time.sleep(6)
        time.sleep(seconds / 2)
        print(f"shooting the limits page {url}/")
        shoot(f"{url}/", out, size="1500,300")
    finally:
        page.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", choices=("flower", "web"), default="flower")
    parser.add_argument("--out", type=Path, help="default: docs/flower.png or docs/web.png")
    parser.add_argument("--rate", default="4/s", help="the upstream limit while shooting")
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--min-throttled", type=int, default=20, help="throttled tasks to wait for")
    args = parser.parse_args(argv)
    out: Path = args.out or ROOT / "docs" / f"{args.page}.png"

    logs = Path(tempfile.mkdtemp(prefix="throttle-screenshot-"))
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    config["limits"]["upstream"]["rate"] = args.rate
    config_path = logs / "limits.yaml"
    config_path.write_text(yaml.safe_dump(config))

    stack = services(tasks=args.tasks, plot="")
    with LocalStack(stack, logs, env={"THROTTLE_CONFIG": str(config_path)}) as local:
        print(f"Flower {local.flower_url}; upstream limit {args.rate}; logs in {logs}")
        local.start("producer")
        deadline = time.monotonic() + 90
        states: collections.Counter[str] = collections.Counter()
        while time.monotonic() < deadline:
            states = flower_states(local.flower_url)
            # THROTTLED: the task-throttled event's custom state (it sticks until the
            # task ends); RETRY: the Retry that re-published it.
            throttled = states["RETRY"] + states["THROTTLED"]
            if throttled >= args.min_throttled and states["SUCCESS"] >= 5:
                break
            time.sleep(1)
        else:
            raise TimeoutError(f"Flower never showed throttled tasks: {dict(states)}")
        if args.page == "web":
            shoot_web(local, logs, out)
        else:
            print(f"Flower sees {dict(states)}; shooting {local.flower_url}/tasks")
            shoot(f"{local.flower_url}/tasks", out)
    print(f"screenshot: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
