"""Another revision of this repository beside the working tree, for benchmarks that run the
code before a change and after it in the same invocation."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from workers.harness import ROOT


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
