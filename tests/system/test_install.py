"""The package as users get it: built, installed from its wheel into a fresh virtualenv, and
run there as the README says.

* The sdist is built from the working tree and the wheel from the unpacked sdist (what
  ``python -m build`` does), once per session, with the dev venv's hatchling (no build
  isolation, so no download). Both are checked for what they must carry: the Lua scripts,
  ``py.typed``, the annotated limits file, the README, LICENSE and CHANGELOG.
* For this interpreter and for Python 3.10 (the oldest ``requires-python`` admits; skipped
  when no ``python3.10`` is found), a fresh venv under a temp dir gets ``pip install
  WHEEL`` (dependencies from the index, through pip's cache), then the README's quick start
  literally (its ``proj/celery.py`` and ``limits.yaml`` blocks, the broker URL pointed at a
  private ``redis-server``): a prefork ``celery worker``, two throttled tasks and their
  results, ``celery -A proj throttle status`` listing the limits, ``throttle check`` on the
  limits file shipped in the wheel, and every module of the package imported.
* The oldest dependencies the wheel admits (each lower bound of ``pyproject.toml``
  pinned, on Python 3.10): a worker holds tasks of a binding limit and runs each once.
* Django (the blocks of docs/getting-started.md, run in this venv):
  ``CELERY_THROTTLE_CONFIG`` and ``CELERY_THROTTLE_REDIS_URL`` in a project's settings reach
  the throttler through ``config_from_object("django.conf:settings", namespace="CELERY")``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import RedisServer

pytestmark = pytest.mark.slow


def _repo_root() -> Path:
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file() and (parent / "lua").is_dir():
            return parent
    raise RuntimeError("no pyproject.toml above tests/test_install.py")


ROOT = _repo_root()
LUA = sorted(path.name for path in (ROOT / "lua").glob("*.lua"))


def _python310() -> str | None:
    """A working Python 3.10: pyenv's builds first (its shim on PATH may point elsewhere)."""
    candidates = [
        *map(str, sorted(Path("/root/.pyenv/versions").glob("3.10.*/bin/python3.10"))),
        *filter(None, [shutil.which("python3.10")]),
    ]
    for candidate in candidates:
        probe = subprocess.run(
            [candidate, "-c", "import sys, venv, ensurepip; print(sys.version_info[:2])"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == "(3, 10)":
            return candidate
    return None


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: nothing of this checkout, this venv or the tests'
    settings (no PYTHONPATH, VIRTUAL_ENV, THROTTLE_* or CELERY_* variables)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}
        and not name.startswith(("THROTTLE_", "CELERY_"))
    }
    return {**env, **extra}


def _run(
    argv: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        argv, cwd=cwd, env=env if env is not None else _clean_env(),
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (
        f"{' '.join(argv)} exited with {done.returncode}\n"
        f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    )
    return done


def _stop(worker: subprocess.Popen[bytes]) -> None:
    """A warm shutdown, then a kill if the worker is still there 30 s later."""
    worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(30)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait(10)


# --- the distributions ---------------------------------------------------------------


@dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path


@pytest.fixture(scope="session")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    out = tmp_path_factory.mktemp("dist")
    hatchling = [sys.executable, "-m", "hatchling", "build", "-d", str(out)]
    _run([*hatchling, "-t", "sdist"], cwd=ROOT, env=None)
    (sdist,) = out.glob("*.tar.gz")
    unpacked = tmp_path_factory.mktemp("sdist")
    with tarfile.open(sdist) as archive:
        archive.extractall(unpacked, filter="data")
    (tree,) = unpacked.iterdir()
    _run([*hatchling, "-t", "wheel"], cwd=tree, env=None)
    (wheel,) = out.glob("*.whl")
    return Dists(sdist=sdist, wheel=wheel)


def test_sdist_carries_the_sources_docs_and_example(dists: Dists) -> None:
    with tarfile.open(dists.sdist) as archive:
        top = f"{dists.sdist.name.removesuffix('.tar.gz')}/"
        names = {name.removeprefix(top) for name in archive.getnames()}
    wanted = {
        "pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "configs/limits.yaml",
        "throttle/__init__.py", "throttle/py.typed", "throttle/celery/__init__.py",
        *(f"lua/{name}" for name in LUA),
    }  # fmt: skip
    assert wanted <= names, sorted(wanted - names)
    assert not any(name.startswith(("tests/", "bench/", "workers/")) for name in names)


def test_wheel_carries_scripts_types_example_and_metadata(dists: Dists) -> None:
    with zipfile.ZipFile(dists.wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(metadata_name).decode()
        (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
        commands = archive.read(entry_points).decode()
        example = archive.read("throttle/examples/limits.yaml")
    wanted = {"throttle/py.typed", *(f"throttle/lua/{name}" for name in LUA)}
    assert wanted <= names, sorted(wanted - names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert example == (ROOT / "configs" / "limits.yaml").read_bytes()
    assert "[celery.commands]\nthrottle = throttle.cli:throttle" in commands
    assert "[pytest11]\nthrottle = throttle.pytest_plugin" in commands
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.MULTILINE)
    assert any(re.fullmatch(r"celery\[redis\]\s*>=\s*5\.3", r) for r in requires), requires
    for line in (
        "Requires-Python: >=3.10",
        "License-Expression: MIT",
        "Classifier: Framework :: Celery",
        "Classifier: Programming Language :: Python :: 3.10",
        "Classifier: Typing :: Typed",
        "Project-URL: Changelog, ",
    ):
        assert line in metadata


# --- the quick start, installed ---------------------------------------------------------


def _readme_block(first_line: str, page: str = "README.md") -> str:
    """The fenced code block of the README (or of another page, e.g. the docs' getting
    started) whose first line is ``first_line``."""
    readme = (ROOT / page).read_text()
    for block in re.findall(r"^```\w*\n(.*?)^```", readme, re.MULTILINE | re.DOTALL):
        if block.splitlines()[0].strip() == first_line:
            return str(block)
    raise AssertionError(f"{page} has no code block starting with {first_line!r}")


# The Django blocks live in the docs' getting started page (the README links to it).
DJANGO_PAGE = "docs/getting-started.md"


README_LIMITS = "# limits.yaml (configs/limits.yaml is the annotated example)"

PRODUCER = """
import json
from proj.celery import charge, complete

done = complete.delay("tenant-1", "hello fleet", 100)
charged = charge.delay("acct-9", 5)
print(json.dumps({
    "ids": [done.id, charged.id],
    "complete": done.get(timeout=90), "complete_state": done.state,
    "charge": charged.get(timeout=90), "charge_state": charged.state,
}))
"""

IMPORT_ALL = """
import importlib, importlib.util, json, pathlib, pkgutil
import throttle
names = sorted(m.name for m in pkgutil.walk_packages(throttle.__path__, "throttle."))
for name in names:
    if name == "throttle.pytest_plugin" and importlib.util.find_spec("pytest") is None:
        continue  # loaded by pytest only (entry point pytest11), which this venv lacks
    importlib.import_module(name)
home = pathlib.Path(throttle.__file__).parent
print(json.dumps({"home": str(home), "modules": names}))
"""


def _pythons() -> list[Any]:
    py310 = _python310()
    return [
        pytest.param(sys.executable, id="current"),
        pytest.param(
            py310 or "python3.10", id="py3.10",
            marks=pytest.mark.skipif(py310 is None, reason="no python3.10 on this machine"),
        ),
    ]  # fmt: skip


@pytest.fixture(params=_pythons())
def installed(request: pytest.FixtureRequest, dists: Dists, tmp_path: Path) -> Path:
    """A fresh venv (its ``bin`` directory) with the wheel installed, not editable."""
    venv = tmp_path / "venv"
    python = str(request.param)
    # From this venv, `-m venv` builds on the base interpreter, as a user's would.
    _run([python, "-m", "venv", str(venv)], cwd=tmp_path)
    _run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(dists.wheel)],
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    return venv / "bin"


@pytest.fixture
def broker() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def test_readme_quick_start_from_the_wheel(
    installed: Path, broker: RedisServer, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    (project / "proj").mkdir(parents=True)
    (project / "proj" / "__init__.py").write_text("")
    code = _readme_block("# proj/celery.py")
    # The quick start's broker and result backend, pointed at a private redis-server.
    assert code.count("redis://localhost:6379/") == 2, "the quick start's Redis URLs changed"
    code = code.replace("localhost:6379", f"127.0.0.1:{broker.port}")
    (project / "proj" / "celery.py").write_text(code)
    (project / "limits.yaml").write_text(_readme_block(README_LIMITS))
    env = _clean_env()
    python, celery = str(installed / "python"), str(installed / "celery")

    imported = json.loads(_run([python, "-c", IMPORT_ALL], cwd=project, env=env).stdout)
    home = Path(imported["home"])
    assert home.is_relative_to(installed.parent), home  # the wheel's copy, not this checkout
    assert "throttle.celery.runtime" in imported["modules"]
    assert (home / "py.typed").is_file()
    assert sorted(p.name for p in (home / "lua").glob("*.lua")) == LUA
    _run([celery, "-A", "proj", "throttle", "check", str(home / "examples" / "limits.yaml")],
         cwd=project, env=env)  # fmt: skip

    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [celery, "-A", "proj", "worker", "-c", "1", "-n", "smoke@%h",
             "--without-mingle", "--without-gossip", "-l", "INFO"],  # the README's, plus these
            cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        results = json.loads(
            _run([python, "-c", PRODUCER], cwd=project, env=env, timeout=120).stdout
        )
        status = _run(
            [celery, "-A", "proj", "throttle", "status", "--timeout", "5"],
            cwd=project, env=env,
        ).stdout  # fmt: skip
    finally:
        _stop(worker)
    output = log.read_text(errors="replace")
    task_ids = results.pop("ids")
    assert results == {
        "complete": "HELLO FLEET", "complete_state": "SUCCESS",
        "charge": "charged 5 to acct-9", "charge_state": "SUCCESS",
    }, output[-4000:]  # fmt: skip
    assert "Traceback" not in output, output[-4000:]
    # The limits of the file and the inline one, with their rates, and the worker.
    rows = {line.split()[0]: line for line in status.splitlines() if line.strip()}
    assert "3500/m" in rows["openai-requests"], status
    assert "90000/m" in rows["openai-tokens"], status
    assert "gcra" in rows["github"] and "5000/h" in rows["github"], status
    assert "20/s" in rows["proj.celery.charge"], status
    assert re.search(r"^workers\s+1 replied", status, re.MULTILINE), status
    assert f"127.0.0.1:{broker.port}/0" in rows["redis"], status
    # The limiter ran in Redis, under its default prefix: each task's acquisition left its
    # lease record (the states of these fast-refilling limits are gone once full again).
    client = broker.client()
    try:
        keys = {key.decode() for key in client.scan_iter(match="throttle:*")}
    finally:
        client.close()
    assert {f"throttle:{{default}}:lease:{task_id}" for task_id in task_ids} <= keys, keys


# --- Django ---------------------------------------------------------------------------


DJANGO_TASKS = """
from celery import shared_task
from throttle.celery import throttled


@shared_task
@throttled("mail")
def send_mail(to):
    return to
"""

DJANGO_CHECK = """
import json

import django

django.setup()
from mysite.tasks import send_mail  # as a view would: mysite/__init__.py loads the app
from throttle.celery import Throttler, ThrottledTask

app = send_mail.app

throttler = Throttler.from_app(app)
pool = throttler.limiter.client.connection_pool.connection_kwargs
decision = throttler.limiter.acquire(throttler.config.rule("mail").limit)
print(json.dumps({
    "source": throttler.config.source, "prefix": throttler.settings.prefix,
    "limits": sorted(throttler.config.rules), "port": pool["port"], "db": pool["db"],
    "allowed": decision.allowed, "throttled_task": isinstance(send_mail, ThrottledTask),
    "app": app.main,
}))
"""


def test_django_settings_reach_the_throttler(tmp_path: Path) -> None:
    """The Django blocks of the getting started page: the app loaded with the project
    (a shared task is bound to it), ``CELERY_THROTTLE_CONFIG`` and
    ``CELERY_THROTTLE_REDIS_URL`` in the settings, read through
    ``config_from_object("django.conf:settings", namespace="CELERY")``."""
    package = tmp_path / "mysite"
    package.mkdir()
    (package / "__init__.py").write_text(_readme_block("# mysite/__init__.py", DJANGO_PAGE))
    (package / "celery.py").write_text(_readme_block("# mysite/celery.py", DJANGO_PAGE))
    (package / "tasks.py").write_text(DJANGO_TASKS)
    limits = tmp_path / "limits.yaml"
    limits.write_text("settings: {prefix: django-site}\nlimits:\n  mail: {rate: 5/s}\n")
    settings = _readme_block("# mysite/settings.py", DJANGO_PAGE)
    assert settings.count("redis://localhost:6379/") == 2, "the Django block's URLs changed"
    with RedisServer() as server:
        settings = settings.replace("localhost:6379", f"127.0.0.1:{server.port}")
        (package / "settings.py").write_text(
            "from pathlib import Path\n\nBASE_DIR = Path(__file__).resolve().parent.parent\n"
            'SECRET_KEY = "not-secret"\nINSTALLED_APPS = []\n' + settings
        )
        env = _clean_env(PYTHONPATH=str(tmp_path), DJANGO_SETTINGS_MODULE="mysite.settings")
        seen = json.loads(_run([sys.executable, "-c", DJANGO_CHECK], cwd=tmp_path, env=env).stdout)
        assert seen == {
            "source": str(limits.resolve()), "prefix": "django-site", "limits": ["mail"],
            "port": server.port, "db": 1, "allowed": True, "throttled_task": True,
            "app": "mysite",
        }  # fmt: skip
        status = _run(
            [sys.executable, "-m", "celery", "-A", "mysite", "throttle", "status",
             "--timeout", "0"],
            cwd=tmp_path, env=env,
        ).stdout  # fmt: skip
        assert re.search(r"^mail\s+token_bucket\s+5/s", status, re.MULTILINE), status
        assert f"127.0.0.1:{server.port}/1" in status and "prefix django-site" in status, status


# --- the oldest versions the wheel admits --------------------------------------------


OLDEST_APP = """
import os

import redis
from celery import Celery
from throttle.celery import ThrottledTask, install, throttled

URL = os.environ["OLDEST_REDIS"]
app = Celery("oldest", broker=URL + "/0", backend=URL + "/1", task_cls=ThrottledTask)
install(app)
clock = redis.Redis.from_url(URL + "/2")


@app.task
@throttled("10/s burst 1", algorithm="gcra", key="{tenant}")
def hit(tenant, i):
    seconds, micros = clock.time()
    return [tenant, i, seconds + micros / 1e6]
"""

OLDEST_PRODUCER = """
import json
from oldest import hit

sent = [hit.delay(tenant, i) for tenant in ("a", "b") for i in range(6)]
print(json.dumps({"ids": [r.id for r in sent], "results": [r.get(timeout=90) for r in sent],
                  "states": [r.state for r in sent]}))
"""


def _oldest_pins() -> list[str]:
    """The lower bounds of the wheel's dependencies (``pyproject.toml``), pinned, and the
    kombu of that Celery: what a user's resolver may pick with older packages around."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*)\]$", text, re.MULTILINE)
    assert deps is not None, "pyproject.toml has no dependencies line"
    pins = [spec.replace(">=", "==") for spec in re.findall(r'"([^"]+)"', deps.group(1))]
    assert all("==" in pin for pin in pins), pins  # each dependency has a lower bound
    celery = next(pin for pin in pins if pin.startswith("celery"))
    return [*pins, "kombu==" + celery.partition("==")[2]]


def test_oldest_dependencies_hold_and_run_tasks(
    dists: Dists, broker: RedisServer, tmp_path: Path
) -> None:
    """The wheel with the oldest Celery, kombu, redis-py and PyYAML its metadata admits
    (on Python 3.10 where found): a binding limit holds tasks in the worker's consumer, as
    Celery 5.7 and older releases each keep their own ETA tasks, and every task runs once,
    spaced on the Redis clock."""
    venv = tmp_path / "venv"
    _run([_python310() or sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python, celery = str(venv / "bin" / "python"), str(venv / "bin" / "celery")
    _run([python, "-m", "pip", "install", "-q", str(dists.wheel), *_oldest_pins()],
         cwd=tmp_path, timeout=300)  # fmt: skip
    (tmp_path / "oldest.py").write_text(OLDEST_APP)
    env = _clean_env(OLDEST_REDIS=f"redis://127.0.0.1:{broker.port}")
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [celery, "-A", "oldest", "worker", "-c", "2", "-n", "oldest@%h",
             "--without-mingle", "--without-gossip", "-l", "INFO"],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        # Celery before 5.7 hands a result that came while the client waited for another
        # up to a second late: twelve results stay well within the timeout.
        sent = json.loads(_run([python, "-c", OLDEST_PRODUCER], cwd=tmp_path, env=env).stdout)
    finally:
        _stop(worker)
    output = log.read_text(errors="replace")
    assert "Traceback" not in output and "CRITICAL" not in output, output[-4000:]
    assert sent["states"] == ["SUCCESS"] * 12, output[-4000:]
    assert sorted((t, i) for t, i, _ in sent["results"]) == [
        (t, i) for t in ("a", "b") for i in range(6)
    ]
    for tenant in ("a", "b"):
        starts = sorted(at for t, _, at in sent["results"] if t == tenant)
        # 10/s burst 1: six tasks of one key span five slots, 0.5 s of Redis time; a task
        # starts at its slot, at most a few ms early (the worker's clock against Redis's).
        assert starts[-1] - starts[0] >= 0.45, (tenant, starts)
