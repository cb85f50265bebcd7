"""The example limits file parses, limit by limit."""

from __future__ import annotations

from pathlib import Path

import yaml

from throttle import Algorithm, Limit

EXAMPLE = Path(__file__).resolve().parent.parent / "configs" / "limits.yaml"


def test_example_limits_parse() -> None:
    document = yaml.safe_load(EXAMPLE.read_text())
    limits = {
        name: Limit.from_mapping(entry, name=name, source=str(EXAMPLE))
        for name, entry in document["limits"].items()
    }
    assert limits["github"].algorithm is Algorithm.GCRA
    assert limits["github"].rate_per_s == 5000 / 3600
    assert limits["stripe"].burst == 1
    assert limits["openai-requests"].burst == 100
    assert limits["mail-daily"].period_s == 86400
    assert limits["llm-streams"].capacity == 8
