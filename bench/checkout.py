"""Another revision of this repository beside the working tree, for benchmarks that run the
code before a change and after it in the same invocation."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from workers.harness import ROOT
from workers.stack import worker_argv


@contextlib.contextmanager
def checkout(rev: str, *extra: str) -> Iterator[Path]:
    """The tree of git revision ``rev`` in a temporary directory, with the files ``extra``
    (paths relative to the repository: the benchmark's own app, which the old revision may
    lack) copied in from the working tree."""
    with tempfile.TemporaryDirectory(prefix="bench-before-") as tmp:
        tree = Path(tmp)
        archive = subprocess.run(
            ["git", "archive", rev], cwd=ROOT, check=True, capture_output=True, timeout=120
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True, timeout=120)
        for name in extra:
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / name, tree / name)
        yield tree


def start_worker(
    tree: Path, app: str, name: str, env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    """A ``celery worker`` (4 prefork children, queue ``upstream``) of ``app`` run from the
    code of ``tree`` (this working tree, or a :func:`checkout`), its output in ``log``."""
    argv = worker_argv(name, app=app, concurrency=4, queues="upstream")
    argv[0] = sys.executable
    full = {**os.environ, **env, "PYTHONPATH": str(tree)}
    with open(log, "wb") as out:
        return subprocess.Popen(argv, cwd=tree, env=full, stdout=out, stderr=subprocess.STDOUT)


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Warm shutdown of every worker (SIGTERM, then SIGKILL after 30 s)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def wait_started(
    producer: Any, names: Sequence[str], procs: Sequence[subprocess.Popen[bytes]], what: str
) -> None:
    """Until the workers ``names`` (started by :func:`start_worker`) answer a ping; raises
    when one exits first or after 120 s (``what`` names them and their logs)."""
    wanted = {f"{name}@{socket.gethostname()}" for name in names}
    deadline = time.monotonic() + 120
    while True:
        replies = producer.control.ping(timeout=1.0) or []
        if wanted <= {name for reply in replies for name in reply}:
            return
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{what} did not start")
