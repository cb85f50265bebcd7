"""The alerting rules pass Prometheus' own check (``promtool check rules``, from Debian's
``prometheus`` package, installed by ``make test`` when missing)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "dashboards" / "alerts.yml"


def test_promtool_accepts_the_alerting_rules() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: `make test` installs it (apt-get install prometheus)")
    done = subprocess.run(
        [promtool, "check", "rules", str(RULES)],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 6 rules found" in done.stdout, done.stdout
