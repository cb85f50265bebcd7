"""Processes whose wall clock is off by a given offset: ``tests/support/skew_shim.c``, built
with gcc and loaded with ``LD_PRELOAD``, offsets only the wall clock (``CLOCK_REALTIME``,
``gettimeofday``, ``time``). ``time.time()`` and ``datetime.now()`` move; monotonic clocks,
sleeps and timed waits do not (``tests/system/test_skew.py`` checks this)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("skew_shim.c")
SKEW_ENV = "THROTTLE_TEST_SKEW_S"


def build_shim(directory: Path) -> Path:
    """Compile the shim into ``directory``; returns the shared object's path."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc, "gcc is missing: the clock-skew tests build an LD_PRELOAD shim with it"
    out = directory / "skew_shim.so"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O2", "-o", str(out), str(SOURCE), "-ldl"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return out


def skewed_env(shim: Path, offset_s: float) -> dict[str, str]:
    """The environment of a process whose wall clock is ``offset_s`` ahead (< 0: behind)."""
    return {"LD_PRELOAD": str(shim), SKEW_ENV: repr(offset_s)}
