"""The configuration reference's tables, generated from the code into the page itself.

``docs/configuration.md`` holds pairs of markers, ``<!-- throttle-reference: settings -->``
... ``<!-- /throttle-reference -->``; between them, a Markdown table built from the one
source of truth: the fields the limits-file loader accepts (``throttle.config``), the
defaults of ``Settings`` and ``Rule``, and their docstrings (``throttle.config.Settings``,
``throttle.rules.Rule``, ``throttle.spec``). The tables are in the repository's page, so it
reads complete without a site build; ``tests/unit/test_docs.py`` fails when they are stale
(a field added to the loader, a docstring changed), and so does a field without a
docstring entry. Regenerate them with::

    .venv/bin/python docs/_hooks/reference.py

which also copies ``configs/limits.yaml`` into the page's annotated-example block.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from throttle import adaptive, config, rules, spec

MARKER = re.compile(
    r"(?P<open><!-- throttle-reference: (?P<name>\w+) -->\n)(?P<body>.*?)"
    r"(?P<close><!-- /throttle-reference -->)",
    re.DOTALL,
)
EXAMPLE = re.compile(
    r"(?P<open><!-- throttle-example -->\n```yaml\n)(?P<body>.*?)(?P<close>^```)", re.M | re.S
)
ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"


def _markdown(text: str) -> str:
    """A docstring's reST as one line of Markdown, fit for a table cell."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)  # :class:`Limit` -> `Limit`
    text = text.replace("``", "`")
    text = " ".join(text.split())
    return text.replace("|", "\\|")


def parameters(obj: object) -> dict[str, str]:
    """The ``Parameters`` section of a numpy-style docstring: ``{name: text}``; a line
    ``a, b:`` documents both."""
    doc = inspect.getdoc(obj) or ""
    match = re.search(r"^Parameters\n-+\n(.*)", doc, re.MULTILINE | re.DOTALL)
    if not match:
        raise ValueError(f"{obj!r} has no Parameters section")
    found: dict[str, str] = {}
    names: list[str] = []
    for line in match.group(1).splitlines():
        head = re.fullmatch(r"([\w, ]+):", line)
        if head:
            names = [n.strip() for n in head.group(1).split(",")]
            for name in names:
                found[name] = ""
        elif line.startswith("    ") and names:
            for name in names:
                found[name] += " " + line.strip()
        elif line.strip():
            break  # the next section
    return {name: _markdown(text) for name, text in found.items()}


def attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a class's attributes (``X = ...`` then a string)."""
    tree = ast.parse(Path(inspect.getfile(cls)).read_text())
    (node,) = (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    body = node.body
    for first, second in itertools.pairwise(body):
        if (
            isinstance(first, ast.Assign | ast.AnnAssign)
            and isinstance(second, ast.Expr)
            and isinstance(second.value, ast.Constant)
            and isinstance(second.value.value, str)
        ):
            target = first.targets[0] if isinstance(first, ast.Assign) else first.target
            if isinstance(target, ast.Name):
                docs[target.id] = _markdown(inspect.cleandoc(second.value.value))
    return docs


def _duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:g} ms"
    return f"{seconds:g} s"


def _default(value: Any, kind: str) -> str:
    if value is None:
        return "unset"
    if kind == "duration":
        return _duration(value)
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def settings_table() -> str:
    """Every key of a limits file's ``settings:``, with its kind, default and meaning."""
    docs = parameters(config.Settings)
    defaults = {f.name: f.default for f in dataclasses.fields(config.Settings)}
    rows = []
    for key, kind in config._SETTINGS_FIELDS.items():
        attr = f"{key}_s" if kind == "duration" else key
        if attr not in defaults or attr not in docs:
            raise ValueError(f"setting {key!r}: no Settings field or docstring entry {attr!r}")
        rows.append((f"`{key}`", kind, _default(defaults[attr], kind), docs[attr]))
    note = (
        "Durations are seconds, or a string such as `250ms`, `30s`, `10m`, `2h`, `1d`, from 0 "
        "to `3650d` (ten years: longer is a typo, and the limiter refuses it too). "
        "In Python: `throttle.config.Settings`, whose duration fields end in `_s`."
    )
    return _table(("setting", "kind", "default", "meaning"), rows) + "\n\n" + note


def limit_table() -> str:
    """Every field of one entry of ``limits:``: the limit's own (rate, algorithm, burst) and
    the rule's (key, cost, deadline, policies)."""
    limit_doc = parameters(spec.Limit)
    parse_doc = inspect.getdoc(spec.Limit.parse) or ""
    grammar = next(p for p in parse_doc.split("\n\n") if p.startswith("Grammar:"))
    own = {
        "rate": (_markdown(grammar.removeprefix("Grammar:")).split(". ")[0] + ".", "required"),
        "algorithm": (
            "One of "
            + ", ".join(f"`{a.value}`" for a in spec.Algorithm)
            + " (aliases: "
            + ", ".join(f"`{k}`" for k in spec._ALIASES)
            + "); see the algorithms below. `concurrency` for `N concurrent`.",
            f"`{spec.Algorithm.TOKEN_BUCKET.value}`",
        ),
        "burst": (limit_doc["burst"], "the count"),
        "fair": (limit_doc["fair"] + " See [fair limits](concepts.md#fair-limits).", "`false`"),
        "weights": (limit_doc["weights"], "none: every key weighs 1"),
    }
    rule_doc = parameters(rules.Rule)
    defaults = {f.name: f.default for f in dataclasses.fields(rules.Rule)}
    rows = []
    for key in config._LIMIT_FIELDS:
        text, default = own[key]
        rows.append((f"`{key}`", text, default))
    for key in config._RULE_FIELDS:
        attr = "max_wait_s" if key == "max_wait" else key
        if attr not in rule_doc:
            raise ValueError(f"limit field {key!r}: no Rule docstring entry {attr!r}")
        kind = "duration" if attr.endswith("_s") else ""
        rows.append((f"`{key}`", rule_doc[attr], _default(defaults[attr], kind)))
    learning_doc = parameters(adaptive.Adaptive)
    learning = {f.name: f.default for f in dataclasses.fields(adaptive.Adaptive)}
    rows.append(("`adaptive`", rule_doc["adaptive"], "`false`"))
    rows.append(
        ("`floor`", learning_doc["floor_per_s"] + " A rate (`2/s`).", "a tenth of the rate")
    )
    rows.append(("`decrease`", learning_doc["decrease"], _default(learning["decrease"], "")))
    rows.append(
        ("`recover`", learning_doc["recover_s"], _default(learning["recover_s"], "duration"))
    )
    note = (
        "In a file, `max_wait` is a duration: seconds, or a string such as `30s`, `10m`, "
        "`2h`. In Python these are the fields of `throttle.Limit` and `throttle.rules.Rule` "
        "(`max_wait_s`), and the keyword options of `@throttled`."
    )
    return _table(("field", "meaning", "default"), rows) + "\n\n" + note


def algorithms_table() -> str:
    docs = attribute_docs(spec.Algorithm)
    rows = [(f"`{a.value}`", docs[a.name]) for a in spec.Algorithm]
    return _table(("algorithm", "what it does"), rows)


def sections_table() -> str:
    meaning = {
        "settings": "how the throttler runs: the settings below",
        "limits": "named limits: `NAME: {rate: ..., ...}`, the fields below",
        "queues": "`QUEUE: [LIMIT, ...]`: every task consumed from the queue, decorated or not",
        "tasks": "`TASK NAME: [LIMIT, ...]`: every run of the task",
    }
    return _table(("section", "what"), [(f"`{s}`", meaning[s]) for s in config._TOP_FIELDS])


RENDERERS: dict[str, Callable[[], str]] = {
    "sections": sections_table,
    "limit": limit_table,
    "algorithms": algorithms_table,
    "settings": settings_table,
}


def render(markdown: str) -> str:
    """``markdown`` with the table of every pair of markers generated afresh between them
    (an unknown marker is an error), and the annotated example's block made a copy of
    ``configs/limits.yaml``."""
    markdown = MARKER.sub(
        lambda m: m["open"] + "\n" + RENDERERS[m["name"]]() + "\n\n" + m["close"], markdown
    )
    example = (ROOT / "configs" / "limits.yaml").read_text()
    return EXAMPLE.sub(lambda m: m["open"] + example + m["close"], markdown)


if __name__ == "__main__":
    PAGE.write_text(render(PAGE.read_text()))
