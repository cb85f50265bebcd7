"""The docs run as written: every code block of the README and of every page under docs/,
against the quick start's own project.

The runner lays out the README's quick start (its ``# proj/celery.py`` and ``#
limits.yaml`` blocks) as a project in a temp dir, then, for each page in turn, a fresh copy
of it: Python blocks execute there in one namespace per page (top-level ``await``
allowed), YAML limits blocks are loaded by the real loader, shell blocks run (``celery -A
proj throttle ...`` with this venv's ``celery``), and the outputs a page shows after ``$
command`` must be the real run's. See :mod:`tests.support.docblocks` for the markers a page
uses (``docs: skip: REASON``, ``docs: worker``, ``docs: setup``).

Every ``localhost:6379`` of a block is pointed at a private ``redis-server``, emptied before
each page (and its address shown back as ``localhost:6379`` in outputs): the docs show the
address a reader has, the runner never touches a Redis it did not start.

``DOCS_UPDATE=1 pytest tests/integration/test_docs_run.py`` rewrites the outputs shown in
the pages from the real run (then read the diff before committing it).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib
import inspect
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from celery import _state as celery_state

from tests.support.docblocks import Block, blocks, commands, matches, pages, session
from tests.support.servers import RedisServer
from throttle.config import ThrottleConfig

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
README_FILES = ("proj/celery.py", "limits.yaml")
LIMITS_SECTIONS = {"settings", "limits", "queues", "tasks"}
UPDATE = os.environ.get("DOCS_UPDATE") == "1"
SKIP_REASON_MIN = 15
"""A skip marker's reason must say something (characters)."""


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def quick_start(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's quick start as a project: ``proj/`` and ``limits.yaml``."""
    project = tmp_path_factory.mktemp("quickstart")
    found = {b.path: b for b in blocks(ROOT / "README.md", ROOT) if b.path}
    missing = [name for name in README_FILES if name not in found]
    assert not missing, f"the README's quick start lacks the blocks {missing}"
    (project / "proj").mkdir()
    (project / "proj" / "__init__.py").write_text("")
    for name in README_FILES:
        (project / name).write_text(found[name].text)
    return project


class Page:
    """One page's run: its project, its namespace, its worker."""

    def __init__(self, project: Path, server: RedisServer, monkeypatch: pytest.MonkeyPatch):
        self.project = project
        self.server = server
        self.local = f"127.0.0.1:{server.port}"
        self.namespace: dict[str, Any] = {"__name__": "__docs__"}
        self.loop = asyncio.new_event_loop()
        self.worker: subprocess.Popen[bytes] | None = None
        self.worker_log = project / "worker.log"
        self.tests: list[str] = []
        self.env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("THROTTLE_", "CELERY_"))
            and name not in {"PYTHONPATH", "VIRTUAL_ENV"}
        }
        self.env["PATH"] = f"{BIN}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["PYTHONPATH"] = str(project)
        for name in os.environ:
            if name.startswith(("THROTTLE_", "CELERY_")):
                monkeypatch.delenv(name)
        # Belt and braces: Celery reads these before any URL in code, so no block can reach
        # a broker or backend other than ours, whatever its text.
        for name, db in (("CELERY_BROKER_URL", 0), ("CELERY_RESULT_BACKEND", 1)):
            self.env[name] = f"redis://{self.local}/{db}"
            monkeypatch.setenv(name, self.env[name])
        for path in project.rglob("*"):  # the quick start's files: at our server
            if path.is_file() and path.suffix in (".py", ".yaml"):
                path.write_text(self.local_text(path.read_text()))
        monkeypatch.chdir(project)
        monkeypatch.syspath_prepend(str(project))

    def local_text(self, text: str) -> str:
        """``text`` with the docs' Redis (``localhost:6379``) pointed at ours; any other
        address of port 6379 (this machine's own Redis) is refused."""
        text = text.replace("localhost:6379", self.local)
        assert ":6379" not in text, f"a Redis at port 6379 that the runner did not start:\n{text}"
        return text

    def shown_text(self, text: str) -> str:
        """An output as the page shows it: the private server as ``localhost:6379``."""
        text = text.replace(self.local, "localhost:6379").replace(str(self.project) + "/", "")
        return text.replace(f"127.0.0.1:{self.server.port}", "localhost:6379")

    # --- the kinds of block --------------------------------------------------------------

    def python(self, block: Block) -> None:
        self.execute(block.text, block)

    def execute(self, code: str, block: Block) -> None:
        compiled = compile(
            self.local_text(code), block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        )
        before = dict(self.namespace)
        if compiled.co_flags & inspect.CO_COROUTINE:
            self.loop.run_until_complete(eval(compiled, self.namespace))
        else:
            exec(compiled, self.namespace)
        kept = {id(value) for value in self.namespace.values()}
        for name, value in before.items():  # a name given to a new client: the old one ends
            if id(value) not in kept and not name.startswith("__"):
                self.release(value)

    def file(self, block: Block) -> None:
        assert block.path is not None
        target = self.project / block.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.local_text(block.text))
        if block.kind == "yaml":
            self.yaml(block, target)
            return
        compile(target.read_text(), block.where, "exec")
        name = Path(block.path).name
        if name.startswith("test_"):
            self.tests.append(block.path)
        elif block.path.startswith("proj/"):
            for parent in target.relative_to(self.project).parents:
                init = self.project / parent / "__init__.py"
                if parent != Path(".") and not init.exists():
                    init.write_text("")
            module = block.path.removesuffix(".py").replace("/", ".")
            if module in sys.modules:
                importlib.reload(sys.modules[module])
            else:
                importlib.import_module(module)

    def yaml(self, block: Block, path: Path | None = None) -> None:
        text = self.local_text(block.text)
        document = yaml.safe_load(text)
        assert isinstance(document, dict) and set(document) <= LIMITS_SECTIONS, (
            f"{block.where}: a YAML block is a limits file (sections "
            f"{', '.join(sorted(LIMITS_SECTIONS))}); mark another with <!-- docs: skip: ... -->"
        )
        if path is None:
            path = self.project / f"block-{block.line}.yaml"
            path.write_text(text)
        ThrottleConfig.load(path)  # the loader's own errors name the place

    def shell(self, block: Block) -> None:
        for command in commands(block.text):
            done = self.run(command)
            assert done.returncode == 0, (
                f"{block.where}: `{command}` exited with {done.returncode}:\n{done.stdout}"
            )

    def session(self, block: Block, updates: list[tuple[Block, str]]) -> None:
        shown: list[str] = []
        ok = True
        for step in session(block.text):
            done = self.run(step.command)
            actual = self.shown_text(done.stdout)
            shown.append(f"$ {step.command}\n{actual}")
            if not matches(step.output, actual):
                ok = False
                if not UPDATE:
                    raise AssertionError(
                        f"{block.where}: the output of `{step.command}` is not the page's\n"
                        f"--- the page\n{step.output}--- the real run\n{actual}"
                    )
        if not ok:
            updates.append((block, "".join(shown)))

    def run(self, command: str) -> subprocess.CompletedProcess[str]:
        """``command`` in the project, by bash; an UPPER_CASE string of the page's Python
        (``TASK_ID = result.id``) is in its environment (``$TASK_ID``)."""
        shared = {
            name: value
            for name, value in self.namespace.items()
            if name.isupper() and isinstance(value, str)
        }
        return subprocess.run(
            ["bash", "-c", self.local_text(command)], cwd=self.project, env={**self.env, **shared},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60,
            check=False,
        )  # fmt: skip

    def pytest(self) -> None:
        if not self.tests:
            return
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error",
             "--rootdir", str(self.project), *self.tests],
            # As a user runs them: the app's own settings (its files point at our server),
            # none from the environment.
            cwd=self.project, capture_output=True, text=True, timeout=60,
            env={k: v for k, v in self.env.items() if not k.startswith("CELERY_")},
            check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"the page's tests failed:\n{done.stdout[-6000:]}"

    # --- the worker ----------------------------------------------------------------------

    def start_worker(self) -> None:
        if self.worker is not None:
            return
        with open(self.worker_log, "wb") as log:
            self.worker = subprocess.Popen(
                [str(BIN / "celery"), "-A", "proj", "worker", "-P", "solo", "-l", "INFO",
                 "-n", "docs@%h", "--without-mingle", "--without-gossip"],
                cwd=self.project, env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while b" ready." not in self.worker_log.read_bytes():
            assert self.worker.poll() is None, self.worker_log.read_text()[-3000:]
            assert time.monotonic() < deadline, self.worker_log.read_text()[-3000:]
            time.sleep(0.1)

    def release(self, value: Any) -> None:
        """Close ``value`` if it is a client or a session (or holds one as ``client``)."""
        for thing in (getattr(value, "client", None), value):
            if thing is None or isinstance(thing, type) or inspect.ismodule(thing):
                continue
            closer = getattr(thing, "aclose", None)
            if callable(closer) and inspect.iscoroutinefunction(closer):
                self.loop.run_until_complete(closer())
                continue
            closer = getattr(thing, "close", None)
            if callable(closer) and not inspect.iscoroutinefunction(closer):
                with contextlib.suppress(TypeError):  # a close() wanting arguments: no resource
                    closer()

    def close(self) -> None:
        """Close what the page's code left open (clients, sessions: a reader's script
        exits there), its event loop and its worker."""
        for value in list(self.namespace.values()):
            self.release(value)
        self.namespace.clear()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()
        if self.worker is not None:
            self.worker.send_signal(signal.SIGTERM)
            try:
                self.worker.wait(20)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait(10)
        for name in [m for m in sys.modules if m == "proj" or m.startswith("proj.")]:
            del sys.modules[name]


def _pages() -> list[Any]:
    return [pytest.param(page, id=str(page.relative_to(ROOT))) for page in pages(ROOT)]


@pytest.mark.parametrize("page", _pages())
def test_page_runs_as_written(
    page: Path,
    quick_start: Path,
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = blocks(page, ROOT)
    runnable = [b for b in found if b.kind != "text"]
    if not runnable:
        return  # a page of prose, tables and outputs
    project = tmp_path / "project"
    shutil.copytree(quick_start, project)
    client = redis_server.client()
    client.flushall()  # ours: started by this module
    client.close()
    run = Page(project, redis_server, monkeypatch)
    updates: list[tuple[Block, str]] = []
    environ = dict(os.environ)  # a page's hidden setup may point an SDK at a mock
    # A page's tasks are shared tasks (Celery's default): every app made later would take
    # them, and the next page's copy of the same name warns. They end with the page.
    finalizers = set(celery_state._on_app_finalizers)
    try:
        for block in runnable:
            if block.skip is not None:
                assert len(block.skip) >= SKIP_REASON_MIN, f"{block.where}: say why it is skipped"
                continue
            if block.worker:
                run.start_worker()
            try:
                for code in block.setup:
                    run.execute(code, block)
                if block.path is not None:
                    run.file(block)
                elif block.kind == "python":
                    run.python(block)
                elif block.kind == "yaml":
                    run.yaml(block)
                elif block.kind == "shell":
                    run.shell(block)
                else:
                    run.session(block, updates)
            except AssertionError:
                raise
            except Exception as exc:
                log = run.worker_log.read_text()[-3000:] if run.worker else ""
                raise AssertionError(f"{block.where}: {type(exc).__name__}: {exc}\n{log}") from exc
        run.pytest()
    finally:
        run.close()
        os.environ.clear()
        os.environ.update(environ)
        celery_state._on_app_finalizers.intersection_update(finalizers)
    if updates:
        text = page.read_text()
        for block, output in sorted(updates, key=lambda u: -u[0].span[0]):
            start, end = block.span
            text = text[:start] + output + text[end:]
        page.write_text(text)
        pytest.fail(f"{page.name}: {len(updates)} output(s) rewritten from the real run")


def test_every_block_has_a_known_kind_and_skips_say_why() -> None:
    skipped = []
    for page in pages(ROOT):
        for block in blocks(page, ROOT):
            assert block.kind  # raises on an unknown language
            if block.skip is not None:
                skipped.append(f"{block.where}: {block.skip}")
                assert len(block.skip) >= SKIP_REASON_MIN, block.where
    # The skip list stays small: most blocks run.
    assert len(skipped) <= 12, "\n".join(skipped)
