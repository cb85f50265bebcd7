"""A worker started on a bad limits file: one line per error, as ``celery throttle check``
prints them, and exit code 1; no traceback. A real ``celery worker`` process (no server
needed: it stops before connecting anywhere)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

APP = """
from celery import Celery
from throttle.celery import ThrottledTask, install

app = Celery("proj", broker="memory://", task_cls=ThrottledTask)
app.conf.throttle_config = "limits.yaml"
app.conf.throttle_redis_url = "memory://"
install(app)
"""


def _worker(
    project: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    own = {k: v for k, v in os.environ.items() if not k.startswith(("THROTTLE_", "CELERY_"))}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "proj", "worker", "--without-mingle",
         "--without-gossip", *args],
        cwd=project, env={**own, **(env or {}), "PYTHONPATH": str(project)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_a_bad_limits_file_stops_the_worker_with_one_line_per_error(tmp_path: Path) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "celery.py").write_text(APP)
    (tmp_path / "limits.yaml").write_text(
        "settings: {refrsh: 2}\nlimits:\n  api: {rate: 10/minuts, on_eror: refund}\n"
    )
    done = _worker(tmp_path, "-P", "solo")
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("throttle: ")]
    assert lines == [
        "throttle: limits.yaml: field 'settings.refrsh': unknown setting (did you mean "
        f"'refresh'?); expected one of {', '.join(_settings())} (got 2)",
        "throttle: limits.yaml: limit 'api': field 'on_eror': unknown field (did you mean "
        f"'on_error'?); expected one of {', '.join(_fields())} (got 'refund')",
        "throttle: limits.yaml: limit 'api': field 'rate': unknown time unit 'minuts' (did you "
        f"mean 'minutes'?); use {_units()} (got '10/minuts')",
        "throttle: 3 errors: the worker does not start",
    ]
    assert "Traceback" not in done.stderr + done.stdout

    (tmp_path / "limits.yaml").unlink()
    done = _worker(tmp_path, "-P", "solo")
    assert done.returncode == 1
    assert (
        f"throttle: limits.yaml: cannot read the limits file '{tmp_path / 'limits.yaml'}': "
        "No such file or directory" in done.stderr
    ), done.stderr

    # A prefork pool of two children refuses the in-memory limiter, naming its pool
    (tmp_path / "limits.yaml").write_text("limits: {}\n")
    done = _worker(tmp_path, "-P", "prefork", "-c", "2")
    assert done.returncode == 1
    assert (
        "throttle: app.conf.throttle_redis_url: the in-memory limiter serves one process: the "
        "prefork pool with 2 child" in done.stderr  # where the URL was set, not the file
    ), done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    # and that one error alone (the setting's name is not a file to read)
    assert "throttle: 1 error: the worker does not start" in done.stderr, done.stderr

    # A throttle_config mapping with two errors: both, as for a file
    (tmp_path / "proj" / "celery.py").write_text(
        APP.replace(
            'app.conf.throttle_config = "limits.yaml"',
            'app.conf.throttle_config = {"limits": {"a": {"rate": "1/fortnight"}, '
            '"b": {"rate": "1/s", "on_eror": "refund"}}}',
        )
    )
    done = _worker(tmp_path, "-P", "solo")
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.startswith("throttle: ")]
    assert [line.partition(": field")[0] for line in lines] == [
        "throttle: <mapping>: limit 'a'",
        "throttle: <mapping>: limit 'b'",
        "throttle: 2 errors: the worker does not start",
    ], done.stderr
    (tmp_path / "proj" / "celery.py").write_text(APP)

    # A metrics directory that cannot be made (a file stands in its way): one error line
    (tmp_path / "taken").write_text("")
    (tmp_path / "limits.yaml").write_text(
        f"settings: {{metrics: true, metrics_dir: '{tmp_path / 'taken' / 'm'}'}}\nlimits: {{}}\n"
    )
    done = _worker(tmp_path, "-P", "solo")
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.startswith("throttle: ")]
    assert [line.partition(": cannot")[0] for line in lines] == [
        "throttle: limits.yaml: field 'settings.metrics_dir'",
        "throttle: 1 error: the worker does not start",
    ], done.stderr
    assert "Traceback" not in done.stderr + done.stdout

    # A metrics port taken by another process, given by the environment: named there
    (tmp_path / "limits.yaml").write_text(
        f"settings: {{metrics: true, metrics_dir: '{tmp_path / 'metrics'}'}}\nlimits: {{}}\n"
    )
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _worker(tmp_path, "-P", "solo", env={"THROTTLE_METRICS_PORT": str(port)})
    assert done.returncode == 1
    assert (
        f"ConfigError(\"field 'THROTTLE_METRICS_PORT': cannot serve metrics on port {port}"
        in done.stderr
    ), done.stderr


def _settings() -> list[str]:
    from throttle.config import _SETTINGS_FIELDS  # noqa: PLC0415

    return list(_SETTINGS_FIELDS)


def _fields() -> list[str]:
    from throttle.adaptive import ADAPTIVE_FIELDS  # noqa: PLC0415
    from throttle.config import _LIMIT_FIELDS, _RULE_FIELDS  # noqa: PLC0415

    return [*_LIMIT_FIELDS, *_RULE_FIELDS, *ADAPTIVE_FIELDS]


def _units() -> str:
    from throttle.spec import UNIT_NAMES  # noqa: PLC0415

    return UNIT_NAMES


TASKS = (
    APP
    + '''
from throttle.celery import throttled


@app.task
@throttled("api")
def call(tenant_id, plan, **options):
    """Takes any keyword: its names are not checked."""


@app.task
@throttled("api", "tokens")
def complete(tenant_id, plan, max_tokens=100):
    pass
'''
)


def test_a_template_or_cost_naming_a_missing_argument_is_an_error_at_start(
    tmp_path: Path,
) -> None:
    """Every call would fail on the key (or fall back to the limit's rate for the plan):
    the worker logs an error at start naming the task, the limit and the field (it starts:
    a shared task of another module may be in the app without ever running there), and
    ``celery throttle check -A`` counts every such place as an error."""
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "celery.py").write_text(TASKS)
    (tmp_path / "limits.yaml").write_text(
        "limits:\n"
        "  api: {rate: 10/s, key: '{tenant}', plan: '{tier}', plans: {free: 1/s}}\n"
        "  tokens: {rate: 1000/m, cost: max_token}\n"
        "tasks:\n  proj.celery.compete: [api]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THROTTLE_", "CELERY_"))}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "proj", "worker", "--without-mingle",
         "--without-gossip", "-P", "solo"],
        cwd=tmp_path, env={**env, "PYTHONPATH": str(tmp_path)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    watchdog = threading.Timer(60, worker.kill)  # a worker that never says it: no hang
    watchdog.start()
    try:
        assert worker.stderr is not None
        seen = []
        for line in worker.stderr:  # the worker logs to stderr; ends when it is killed
            seen.append(line)
            if "does not register" in line:  # logged after the argument errors
                break
    finally:
        watchdog.cancel()
        worker.kill()
        worker.communicate(timeout=30)  # and closes its stderr
    assert any(
        line.rstrip().endswith(
            "throttle: limits.yaml: limit 'api': field 'key': task 'proj.celery.complete' has "
            "no argument 'tenant' for the key template (its arguments: max_tokens, plan, "
            "tenant_id) (got '{tenant}'): every call of that task will fail or fall back"
        )
        for line in seen
    ), seen[-4:]
    unregistered = (
        "limits.yaml: tasks: names a task that app 'proj' does not register (did you mean "
        "'proj.celery.complete'?): its limits apply to no task of it (got 'proj.celery.compete')"
    )
    assert seen[-1].rstrip().endswith(f"WARNING/MainProcess] throttle: {unregistered}"), seen[-2:]

    checked = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "proj", "throttle", "check", "limits.yaml"],
        cwd=tmp_path, env={**env, "PYTHONPATH": str(tmp_path)}, capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip
    assert checked.returncode == 1, checked.stderr
    place = "limits.yaml: limit '{}': field '{}': task 'proj.celery.complete' has "
    arguments = "(its arguments: max_tokens, plan, tenant_id)"
    assert checked.stdout.splitlines() == [
        f"warning: {unregistered}",
        place.format("api", "key") + f"no argument 'tenant' for the key template {arguments} "
        "(got '{tenant}')",
        place.format("api", "plan") + f"no argument 'tier' for the plan template {arguments} "
        "(got '{tier}')",
        place.format("tokens", "cost") + f"no argument of this name for the cost {arguments} "
        "(got 'max_token')",
    ]

    # Fixed: the check passes
    (tmp_path / "limits.yaml").write_text(
        "limits:\n"
        "  api: {rate: 10/s, key: '{tenant_id}', plan: '{plan}', plans: {free: 1/s}}\n"
        "  tokens: {rate: 1000/m, cost: max_tokens}\n"
    )
    checked = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "proj", "throttle", "check", "limits.yaml"],
        cwd=tmp_path, env={**env, "PYTHONPATH": str(tmp_path)}, capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_limit_a_task_names_that_the_file_lacks_stops_the_worker_naming_the_task(
    tmp_path: Path,
) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "celery.py").write_text(TASKS)
    (tmp_path / "limits.yaml").write_text("limits:\n  api: {rate: 10/s}\n")
    done = _worker(tmp_path, "-P", "solo")
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("throttle: ")]
    assert lines[0] == (
        "throttle: limits.yaml: task 'proj.celery.complete' names a limit the file does not "
        "define; it defines api (got 'tokens')"
    ), done.stderr


def test_a_limiter_redis_that_evicts_keys_is_named_at_start_and_in_status(
    tmp_path: Path,
) -> None:
    """Under an evicting ``maxmemory-policy`` a limit's state, a lease or a parked task can
    vanish without a trace: the worker warns when it starts, and ``status`` says so; a
    Redis that does not evict (no ``maxmemory``) gets neither."""
    from tests.support.servers import RedisServer  # noqa: PLC0415

    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "celery.py").write_text(
        APP.replace('"memory://"', 'os.environ["LIMITER_URL"]').replace(
            "from celery import Celery", "import os\n\nfrom celery import Celery"
        )
    )
    (tmp_path / "limits.yaml").write_text("limits:\n  api: {rate: 10/s}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THROTTLE_", "CELERY_"))}
    env["PYTHONPATH"] = str(tmp_path)
    warning = "the limiter's Redis evicts keys when it is full (maxmemory-policy allkeys-lru)"
    for args, evicts in (
        (("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"), True),
        ((), False),
    ):
        with RedisServer(args) as server:
            env["LIMITER_URL"] = server.url
            status = subprocess.run(
                [sys.executable, "-m", "celery", "-A", "proj", "throttle", "status",
                 "--timeout", "0"],
                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                check=False,
            )  # fmt: skip
            assert status.returncode == 0, status.stderr
            assert (f"WARNING  {warning}" in status.stdout) is evicts, status.stdout
            worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "proj", "worker", "--without-mingle",
                 "--without-gossip", "-P", "solo", "-l", "INFO"],
                cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            watchdog = threading.Timer(60, worker.kill)  # a worker that never starts: no hang
            watchdog.start()
            try:
                assert worker.stderr is not None
                seen = []
                for line in worker.stderr:  # ends when it is killed
                    seen.append(line)
                    if " ready." in line:  # Celery's own line, once its steps started
                        break
            finally:
                watchdog.cancel()
                worker.kill()
                worker.communicate(timeout=30)
            assert any(" ready." in line for line in seen), seen[-4:]
            assert any(warning in line for line in seen) is evicts, seen
