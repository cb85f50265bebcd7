"""The ``celery throttle`` command: see and steer a fleet's limits from a shell.

::

    celery -A proj throttle status [--json] [--watch N] [--timeout S]
    celery -A proj throttle set LIMIT RATE [--key KEY]   # or: set LIMIT --default
    celery -A proj throttle clear LIMIT [--key KEY]
    celery -A proj throttle enforce LIMIT [--default]     # or: shadow LIMIT
    celery -A proj throttle reset LIMIT [KEY] [--yes]
    celery -A proj throttle pause LIMIT [KEY]
    celery -A proj throttle resume LIMIT [KEY]
    celery -A proj throttle check FILE
    celery -A proj throttle refusals LIMIT [--key KEY] [--json] [--max N]
    celery -A proj throttle task TASK_ID [--json]
    celery -A proj throttle parked [--queue Q] [--limit L] [--json] [--max N]
    celery -A proj throttle purge (--queue Q | --limit L | --all) [--yes]
    celery -A proj throttle web [--port P] [--host H] [--allow-control]

A subcommand of the ``celery`` program, installed through the ``celery.commands`` entry
point. The app is the one ``-A`` names (celery's ``CLIContext``, ``ctx.obj.app``); its
limits file and the limiter's Redis are found as a worker finds them
(:meth:`throttle.celery.Throttler.from_app`). The limits it knows are the file's and the
inline limits of the app's tasks (``@throttled("20/s")``).

Exit codes: 0 done; 1 errors found (a bad limits file, Redis unreachable, a reset not
confirmed); 2 usage (an unknown limit, a bad rate). Redis passwords are never printed.

Laid out as Celery's ``celery/bin/``: this module is the group and registers each command;
:mod:`throttle.cli.base` holds what they share (the app, its limits, formatting), and
each command family has a module: :mod:`~throttle.cli.status`, :mod:`~throttle.cli.control`
(set, clear, enforce, shadow, reset, pause, resume, check), :mod:`~throttle.cli.parked`
(parked, purge), :mod:`~throttle.cli.task`, :mod:`~throttle.cli.refusals` and
:mod:`~throttle.cli.web` (the limits page).
"""

from __future__ import annotations

import click

from throttle.cli import control, parked, refusals, status, task, web

__all__ = ["throttle"]


@click.group()
def throttle() -> None:
    """Fleet-wide rate limits (celery-throttled): status, set, clear, enforce, shadow, reset,
    pause, resume, check, refusals, task, parked, purge, web."""


throttle.add_command(status.status)
throttle.add_command(control.set_rate)
throttle.add_command(control.clear)
throttle.add_command(control.enforce)
throttle.add_command(control.shadow_mode)
throttle.add_command(control.reset)
throttle.add_command(control.pause)
throttle.add_command(control.resume)
throttle.add_command(control.check)
throttle.add_command(refusals.refusals)
throttle.add_command(task.task)
throttle.add_command(parked.parked)
throttle.add_command(parked.purge)
throttle.add_command(web.web)
