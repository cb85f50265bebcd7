"""Where ``install()`` puts the fleet's metrics on prometheus_client's default registry:
in Flower (tests/system/test_monitoring.py scrapes a real one) and in a worker's main
process, never in another process that imports the app (a Django web process with
django-prometheus), each checked in a fresh Python process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from workers.harness import ROOT

APP = """
import tempfile
import prometheus_client  # loaded first, as django-prometheus does in a web process
from celery import Celery
from throttle.celery import install
app = install(Celery("web"))
app.conf.throttle_config = {
    # a directory of its own: no other run's counter files are read
    "settings": {"metrics": True, "metrics_dir": tempfile.mkdtemp()},
    "limits": {"api": {"rate": "1/s"}},
}
app.conf.throttle_redis_url = "redis://127.0.0.1:9/0"  # nothing listens: never read
def names():
    return sorted(
        metric.name for metric in prometheus_client.REGISTRY.collect()
        if metric.name.startswith("throttle_")
    )
"""


def run(code: str, *argv: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(APP) + textwrap.dedent(code), *argv],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


def test_a_web_process_that_imports_the_app_exports_no_throttle_metrics() -> None:
    # Given a process that loaded prometheus_client, then the app with install(), and
    # whose argv looks like anything (even naming a "flower" queue or command)
    out = run("print(names())", "runserver", "flower")
    # Then its registry has no throttle_ metric: no false "Redis down", no duplicate gauges
    assert out.strip() == "[]"


def test_a_worker_main_process_registers_them_once_at_worker_init() -> None:
    # Given the same process, told by celery that it is a worker of this app (twice:
    # worker_init of another app, then of this one, then of this one again)
    out = run(
        """
        from celery import signals
        class Worker:  # what celery's WorkController sends: itself, with its app
            def __init__(self, app):
                self.app = app
        signals.worker_init.send(sender=Worker(Celery("other")))
        print(names())
        signals.worker_init.send(sender=Worker(app))
        signals.worker_init.send(sender=Worker(app))
        print(names())
        """
    )
    other, worker = out.splitlines()
    assert other == "[]"
    # Then this app's collector is registered once (two would serve every metric twice)
    assert worker == "['throttle_redis_up']"


def test_the_flower_subcommand_of_the_celery_command_registers_them() -> None:
    # Given the app imported inside the `celery ... flower` command's click context (as
    # the celery group's callback imports -A before Flower runs)
    out = run(
        """
        import click
        from throttle.celery.steps import _register_where_it_belongs
        with click.Context(click.Group("celery")) as ctx:
            ctx.invoked_subcommand = "flower"
            flower_app = Celery("flower")
            flower_app.conf.throttle_config = app.conf.throttle_config
            flower_app.conf.throttle_redis_url = app.conf.throttle_redis_url
            _register_where_it_belongs(flower_app)
        print(names())
        """
    )
    assert "'throttle_redis_up'" in out


def test_register_metrics_stays_available_to_ask_for_them() -> None:
    out = run(
        """
        from throttle.celery import register_metrics
        register_metrics(app)
        print(names())
        """
    )
    assert "'throttle_redis_up'" in out
