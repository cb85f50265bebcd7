"""One clock: two clients whose clocks differ by 30 s get the same decisions.

The clients run as subprocesses under `faketime` (libfaketime), which shifts every clock
call of the process, so nothing in the client could read a true local time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_client(redis_url: str, prefix: str, shift: str | None) -> dict[str, Any]:
    command = [sys.executable, "-m", "tests._skewed_client", redis_url, prefix, "acquire"]
    if shift is not None:
        faketime = shutil.which("faketime")
        assert faketime, "faketime is missing: `make test` installs it (apt-get install faketime)"
        command = [faketime, "-f", shift, *command]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.parametrize("shift", ["+30s", "-30s"])
def test_skewed_clients_get_the_same_decisions(redis_url: str, shift: str) -> None:
    # The same sequence, once with both clients on true time, once with one 30 s off.
    runs: dict[str, list[dict[str, Any]]] = {}
    for label, skew in (("true", None), ("skewed", shift)):
        prefix = f"skew-{uuid.uuid4().hex[:8]}"
        runs[label] = [run_client(redis_url, prefix, s) for s in (None, skew, None, skew)]
    true_run, skewed_run = runs["true"], runs["skewed"]
    # faketime really moved the second client's clock.
    offset = skewed_run[1]["local_time_s"] - skewed_run[0]["local_time_s"]
    assert abs(offset - (30 if shift == "+30s" else -30)) < 5
    assert [r["allowed"] for r in skewed_run] == [r["allowed"] for r in true_run]
    assert [r["allowed"] for r in skewed_run] == [True, True, False, False]
    # A 2/min bucket emptied: the next token is ~30 s away for every client, whatever its
    # clock says (a client-clock limiter would say 0 s or 60 s to the skewed one).
    for a, b in zip(true_run, skewed_run, strict=True):
        assert a["retry_after_s"] == pytest.approx(b["retry_after_s"], abs=2.0)
        assert a["remaining"] == pytest.approx(b["remaining"], abs=0.1)
    assert skewed_run[3]["retry_after_s"] == pytest.approx(30, abs=2.0)
