"""The Grafana dashboard and the alerting rules (dashboards/) query only metrics the
workers export. The names are read from the code (throttle/metrics.py: its counters and
histograms, and what its collector yields), so a metric added there is known here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from throttle import metrics
from throttle.decision import LimitState

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
NAME = re.compile(r"\bthrottle_[a-zA-Z0-9_]+")


def exported() -> set[str]:
    """Every sample name the exporter serves: the workers' counters and histograms (as
    prometheus_client writes their samples) and the gauges the collector reads from Redis."""
    names: set[str] = set()
    instruments = metrics._build()
    for field in instruments.__dataclass_fields__:
        instrument = getattr(instruments, field)
        base = instrument._name
        kind = instrument._type
        if kind == "counter":
            names.add(f"{base}_total")
        elif kind == "histogram":
            names.update(f"{base}_{suffix}" for suffix in ("bucket", "count", "sum"))
        else:
            raise AssertionError(f"a metric of an unknown type: {base} ({kind})")
    state = metrics.FleetState(
        parked=1, releasing=0, limits=[LimitState("api", True, 1.0, 0.0, 0.0)],
        learned=[("api", 10.0, 8.0)], key_rates=[("api", "acme", 250.0)],
    )  # fmt: skip
    collector = metrics.ThrottleCollector(lambda: [], lambda: state)
    for family in collector.collect():
        names.update(sample.name for sample in family.samples)
    return names


def dashboard_expressions() -> list[str]:
    board = json.loads((DASHBOARDS / "grafana.json").read_text())
    found = [t["expr"] for panel in board["panels"] for t in panel.get("targets", ())]
    found += [
        var["query"]["query"] if isinstance(var.get("query"), dict) else str(var.get("query"))
        for var in board["templating"]["list"]
    ]
    return found


def rule_expressions() -> list[str]:
    rules = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def test_the_exporter_names_are_read_from_the_code() -> None:
    names = exported()
    assert {"throttle_decisions_total", "throttle_wait_seconds_bucket", "throttle_redis_up",
            "throttle_learned_rate", "throttle_upstream_deferrals_total"} <= names  # fmt: skip
    assert "throttle_decisions" not in names  # a counter's samples end in _total


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    expressions = dashboard_expressions()
    assert len(expressions) >= 12
    used = {name for expr in expressions for name in NAME.findall(expr)}
    assert used - exported() == set(), "the dashboard queries metrics nobody exports"
    # Every exported family is on the dashboard (a histogram through its buckets)
    families = {re.sub(r"_(total|bucket|count|sum)$", "", name) for name in exported()}
    shown = {re.sub(r"_(total|bucket|count|sum)$", "", name) for name in used}
    assert families - shown == set(), "metrics the dashboard does not show"


def test_every_metric_the_alerts_query_is_exported() -> None:
    expressions = rule_expressions()
    assert len(expressions) >= 5
    used = {name for expr in expressions for name in NAME.findall(expr)}
    assert used - exported() == set(), "alerting rules on metrics nobody exports"
    wanted = {
        "throttle_redis_up", "throttle_timeouts_total", "throttle_learned_rate",
        "throttle_wait_seconds_bucket", "throttle_upstream_deferrals_total",
    }  # fmt: skip
    assert wanted <= used


def test_the_check_catches_an_unknown_name() -> None:
    assert NAME.findall('rate(throttle_made_up_total{limit="x"}[5m])') == ["throttle_made_up_total"]
    assert "throttle_made_up_total" not in exported()


def test_the_dashboard_imports_into_any_grafana() -> None:
    board = json.loads((DASHBOARDS / "grafana.json").read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    # No data source uid of one installation: the panels follow the ${datasource} variable
    sources = {t["datasource"]["uid"] for p in board["panels"] for t in p["targets"]}
    assert sources == {"${datasource}"}
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "limit"}


def test_the_limit_picker_lists_limits_that_decided_nothing_yet() -> None:
    # A limit in shadow mode decides nothing (no throttle_decisions_total), nor does a
    # keyless limit no task ran under yet (its gauges are read from Redis): each can be
    # picked all the same.
    board = json.loads((DASHBOARDS / "grafana.json").read_text())
    (picker,) = [v for v in board["templating"]["list"] if v["name"] == "limit"]
    query = picker["query"]["query"]
    assert query == picker["definition"]
    assert query.startswith("label_values(") and query.endswith(", limit)")
    assert {"throttle_decisions_total", "throttle_shadow_wait_seconds_count",
            "throttle_tokens_remaining"} <= set(NAME.findall(query))  # fmt: skip
