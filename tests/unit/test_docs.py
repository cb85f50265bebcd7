"""The documentation against the code: the configuration reference's generated tables cover
every field the limits-file loader accepts, the README's quick start is the getting started
page's, and the README's links into docs/ name files that exist. (``make test`` also builds
the site with ``mkdocs build --strict``, which fails on a broken link inside the docs.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from types import ModuleType

from throttle import config, rules
from throttle.adaptive import ADAPTIVE_FIELDS

ROOT = Path(__file__).resolve().parents[2]


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reference", ROOT / "docs/_hooks/reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cells(table: str) -> list[str]:
    return [r.split(" | ")[0].strip("| `") for r in table.splitlines()[2:] if r.startswith("|")]


def test_settings_table_has_every_setting_with_its_default() -> None:
    table = _hook().settings_table()
    assert _cells(table) == list(config._SETTINGS_FIELDS)
    assert "| `refresh` | duration | 2 s |" in table
    assert "| `late_tolerance` | duration | 20 ms |" in table
    # every field of Settings is reachable from a limits file, so documented here
    files = {f"{k}_s" if kind == "duration" else k for k, kind in config._SETTINGS_FIELDS.items()}
    assert files == {f.name for f in dataclasses.fields(config.Settings)}


def test_limit_table_has_every_limit_and_rule_field() -> None:
    table = _hook().limit_table()
    assert _cells(table) == [*config._LIMIT_FIELDS, *config._RULE_FIELDS, *ADAPTIVE_FIELDS]
    assert "| `on_redis_down` |" in table and "| `cold_start` |" in table
    init = {f.name for f in dataclasses.fields(rules.Rule) if f.init} - {"limit"}
    assert {"max_wait_s" if k == "max_wait" else k for k in config._RULE_FIELDS} | {
        "adaptive"
    } == init
    assert "| `decrease` |" in table and "| `0.8` |" in table and "| 10 s |" in table


def test_configuration_page_holds_its_tables_up_to_date() -> None:
    """The tables and the annotated example are in the page itself (it reads complete in
    the repository); regenerate them with ``python docs/_hooks/reference.py``."""
    page = (ROOT / "docs/configuration.md").read_text()
    for name in ("sections", "limit", "algorithms", "settings"):
        assert f"<!-- throttle-reference: {name} -->" in page
    assert _hook().render(page) == page, (
        "docs/configuration.md is stale: run .venv/bin/python docs/_hooks/reference.py"
    )
    assert (ROOT / "configs/limits.yaml").read_text() in page
    assert "| `refresh` | duration | 2 s |" in page
    assert "--8<--" not in page


def _blocks(text: str) -> list[str]:
    return re.findall(r"^```\w*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def test_readme_quick_start_is_the_getting_started_pages() -> None:
    readme = _blocks((ROOT / "README.md").read_text())
    page = _blocks((ROOT / "docs/getting-started.md").read_text())
    for first in ("# proj/celery.py", "# limits.yaml (configs/limits.yaml"):
        (ours,) = (b for b in readme if b.startswith(first))
        assert ours in page, f"the README's {first!r} block differs from the docs' one"


def test_readme_links_to_files_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing
    assert "make demo" in readme and "make test" in readme
    assert "pip install celery-throttled" in readme
    assert len(readme.splitlines()) < 200


def test_the_command_synopsis_lists_every_registered_command() -> None:
    from throttle.cli import throttle  # noqa: PLC0415

    for page in ("docs/command.md", "docs/operations.md"):
        (synopsis,) = (
            b for b in _blocks((ROOT / page).read_text()) if "throttle status [--json]" in b
        )
        listed = {line.split()[4] for line in synopsis.splitlines() if line.strip()}
        assert listed == set(throttle.commands), (page, listed ^ set(throttle.commands))


def test_the_readme_links_no_site_that_is_not_published() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "readthedocs" not in readme
    assert "raw.githubusercontent.com" not in readme
    assert "](docs/demo.png)" in readme
