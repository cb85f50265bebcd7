"""The code blocks of the README and of every page under docs/, as the docs runner
(``tests/integration/test_docs_run.py``) runs them.

A fenced block's language says what it is:

* ``python``: executed. A block whose first line is a path comment (``# proj/tasks.py``,
  ``# tests/test_tasks.py``) is a file of the project instead: written there (a module of
  ``proj`` is then imported, a test file run by pytest).
* ``yaml``: a limits file (or a fragment of one under ``limits:``/``settings:``), loaded and
  validated by the real loader; ``# name.yaml`` writes it into the project as well.
* ``sh``, ``bash``, ``console``: commands, run in the project. A block whose first line
  starts with ``$ `` is a session: each ``$ command`` is followed by its output, which must
  match the real run's (``...`` on a line of its own stands for any lines).
* ``text`` or no language: a diagram, a listing or an output, not run.

Markers go in an HTML comment right before a block (blank lines between are fine), so
that a page says itself what the runner does with it, and a new page needs no registering:

* ``<!-- docs: skip: REASON -->``: not run, for the reason given (``pip install``, a
  long-running ``celery worker`` that another test covers, a service this machine lacks).
* ``<!-- docs: worker -->``: a worker of the page's project runs from this block on (a
  solo pool, in the background), for blocks that send tasks and wait for results.
* ``<!-- docs: setup ... -->``: Python the reader need not see (a stand-in response, a
  variable of an earlier page), executed before the block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

FENCE = re.compile(
    r"^(?P<indent>[ ]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$", re.M | re.S
)
MARKER = re.compile(r"<!--\s*docs:\s*(?P<kind>skip|worker|setup)\b(?P<rest>.*?)-->", re.S)
PATH_COMMENT = re.compile(r"#\s*(?P<path>[\w./-]+\.(?:py|ya?ml|cfg|toml|ini))\b")

RUN = {"python": "python", "py": "python", "yaml": "yaml", "yml": "yaml"}
SHELL = {"sh", "bash", "console", "shell"}
TEXT = {"", "text", "txt", "plain", "output"}


@dataclass
class Block:
    page: str
    line: int
    """The line of the opening fence, from 1."""
    lang: str
    text: str
    skip: str | None = None
    """The reason given in a ``docs: skip`` marker; None: the block runs."""
    worker: bool = False
    setup: list[str] = field(default_factory=list)
    span: tuple[int, int] = (0, 0)
    """Where the block's body is in the page (offsets), for rewriting an output."""

    @property
    def kind(self) -> str:
        """``python``, ``yaml``, ``shell``, ``session`` (``$ `` commands and outputs), or
        ``text``."""
        lang = self.lang.lower()
        if self.text.startswith("$ "):
            return "session"
        if lang in RUN:
            return RUN[lang]
        if lang in SHELL:
            return "shell"
        if lang in TEXT:
            return "text"
        raise ValueError(f"{self.where}: unknown block language {self.lang!r}")

    @property
    def path(self) -> str | None:
        """The project file a block stands for (its first line ``# proj/tasks.py``)."""
        first = self.text.split("\n", 1)[0]
        match = PATH_COMMENT.match(first.strip())
        return match["path"] if match and self.kind in ("python", "yaml") else None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path, root: Path) -> list[Block]:
    """The fenced blocks of ``page`` with their markers, in order."""
    text = page.read_text()
    name = str(page.relative_to(root))
    found: list[Block] = []
    last_end = 0
    for match in FENCE.finditer(text):
        indent = match["indent"]
        body = match["body"]
        if indent:  # a block inside a list item: dedent it
            body = "\n".join(
                line[len(indent) :] if line.startswith(indent) else line
                for line in body.split("\n")
            )
        block = Block(
            page=name,
            line=text.count("\n", 0, match.start()) + 1,
            lang=match["lang"],
            text=body,
            span=(match.start("body"), match.end("body")),
        )
        # The markers between the previous block and this one, when nothing but blank
        # lines and other markers separate them from this block.
        before = text[last_end : match.start()]
        tail = before
        while True:
            stripped = tail.rstrip()
            marker = None
            for candidate in MARKER.finditer(stripped):
                if candidate.end() == len(stripped):
                    marker = candidate
            if marker is None:
                break
            kind, rest = marker["kind"], marker["rest"]
            if kind == "skip":
                block.skip = rest.lstrip(":").strip()
            elif kind == "worker":
                block.worker = True
            else:
                block.setup.insert(0, _dedent(rest))
            tail = stripped[: marker.start()]
        found.append(block)
        last_end = match.end()
    return found


def _dedent(code: str) -> str:
    lines = code.strip("\n").split("\n")
    margin = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[margin:] for line in lines) + "\n"


def pages(root: Path) -> list[Path]:
    """The README and every Markdown page under docs/ (not the site hooks)."""
    docs = sorted(p for p in (root / "docs").rglob("*.md") if "_hooks" not in p.parts)
    return [root / "README.md", *docs]


def commands(text: str) -> list[str]:
    """The commands of a shell block: one per line (a trailing backslash continues it),
    comments and blank lines left out."""
    out: list[str] = []
    pending = ""
    for raw in text.split("\n"):
        line = raw.rstrip()
        if pending:
            line = pending + " " + line.strip()
            pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip()
            continue
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        out.append(line.strip())
    return out


@dataclass
class Step:
    command: str
    output: str
    """The output the page shows (lines after the command, up to the next ``$ ``)."""


def session(text: str) -> list[Step]:
    """The ``$ command`` / output pairs of a session block."""
    steps: list[Step] = []
    for line in text.split("\n"):
        if line.startswith("$ "):
            command = line[2:]
            if "  #" in command:  # a comment after the command, for the reader
                command = command.split("  #", 1)[0]
            steps.append(Step(command.strip(), ""))
        elif steps:
            steps[-1].output += line + "\n"
    for step in steps:
        step.output = step.output.rstrip("\n") + "\n" if step.output.strip() else ""
    return steps


def matches(expected: str, actual: str) -> bool:
    """Whether ``actual`` output matches the page's ``expected``: line by line, trailing
    spaces ignored; a line ``...`` matches any lines (none included), and ``...`` within
    a line any text (an id, a time)."""
    want = [line.rstrip() for line in expected.rstrip("\n").split("\n")]
    got = [line.rstrip() for line in actual.rstrip("\n").split("\n")]
    return _match(want, got)


def _match(want: list[str], got: list[str]) -> bool:
    if not want:
        return not got
    if want[0] == "...":
        return any(_match(want[1:], got[i:]) for i in range(len(got) + 1))
    return bool(got) and _line(want[0], got[0]) and _match(want[1:], got[1:])


def _line(want: str, got: str) -> bool:
    if "..." not in want:
        return want == got
    pattern = ".*".join(re.escape(part) for part in want.split("..."))
    return re.fullmatch(pattern, got) is not None
