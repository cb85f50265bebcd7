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


RISING_TEST = """
rule_files: [RULES]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # timeouts from minute 70 on, 1/s; no series before (a worker creates its counter
      # at its first timeout), and another limit with a series at 0 before
      - series: 'throttle_timeouts_total{limit="new",action="fail"}'
        values: '_x70 0+60x60'
      - series: 'throttle_timeouts_total{limit="old",action="fail"}'
        values: '0x70 0+60x60'
    alert_rule_test:
      - eval_time: 100m
        alertname: ThrottleTimeoutsRising
        exp_alerts:
          - exp_labels: {severity: warning, limit: new}
            exp_annotations:
              summary: "Throttle timeouts rising on limit new"
              description: "1 tasks per second pass their throttle deadline, twice the rate
                of an hour ago: the backlog outgrows the limit."
          - exp_labels: {severity: warning, limit: old}
            exp_annotations:
              summary: "Throttle timeouts rising on limit old"
              description: "1 tasks per second pass their throttle deadline, twice the rate
                of an hour ago: the backlog outgrows the limit."
"""


def test_timeouts_rising_fires_for_a_limit_without_timeouts_an_hour_ago(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: `make test` installs it (apt-get install prometheus)")
    tests = tmp_path / "rising.yml"
    tests.write_text(RISING_TEST.replace("RULES", str(RULES)))
    done = subprocess.run(
        [promtool, "test", "rules", str(tests)],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
