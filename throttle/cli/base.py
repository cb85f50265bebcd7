"""What every command of ``celery throttle`` shares: the app and its throttler, the limits
the command knows, errors as one line, and how numbers, rates and times are written.

The limits a command knows are the limits file's and the inline limits of the app's tasks
(``@throttled("20/s")``); a name outside them is a usage error (exit 2) that lists them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

import click

from throttle.celery.runtime import Throttler, declared_by
from throttle.errors import ThrottleError
from throttle.rules import Rule, key_problem
from throttle.spec import Limit

EXIT_ERRORS = 1
"""Errors found: a bad limits file, Redis unreachable, a reset not confirmed."""
EXIT_USAGE = 2
"""Usage: an unknown limit, a bad rate, a missing argument (click's own code for these)."""

_UNITS = (("d", 86400.0), ("h", 3600.0), ("m", 60.0), ("s", 1.0), ("ms", 0.001))


# -- the app, its throttler and its limits --------------------------------------------------


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """The package's errors as one line and exit code 1, not a traceback."""
    try:
        yield
    except ThrottleError as exc:
        raise click.ClickException(str(exc)) from None


def app_of(ctx: click.Context) -> Any:
    """The app of ``celery -A``, with the modules of its ``imports`` and ``include`` imported;
    a usage error when the command runs outside the ``celery`` program."""
    app = getattr(ctx.obj, "app", None)
    if app is None:
        raise click.UsageError("run it as a celery command: celery -A proj throttle ...")
    # What `celery report` does: the modules of the app's `imports`/`include`, whose tasks
    # may carry inline limits.
    app.loader.import_default_modules()
    return app


def app_option(ctx: click.Context) -> str:
    """The ``-A`` of the command line, to repeat in a command it suggests (" -A proj")."""
    given = ctx.find_root().params.get("app")
    return f" -A {given}" if isinstance(given, str) and given else ""


def throttler_of(ctx: click.Context) -> tuple[Any, Throttler]:
    """The app and its :class:`Throttler`, as a worker of the app builds it (its limits
    file, its Redis); a bad limits file is one line and exit code 1."""
    app = app_of(ctx)
    with one_line_errors():
        return app, Throttler.of(app)


@dataclass(frozen=True)
class Known:
    """A limit the command can name: from the limits file, or inline on a task."""

    rule: Rule
    task: str | None = None
    """The task an inline limit belongs to (None: the limits file)."""


def known_limits(app: Any, throttler: Throttler) -> dict[str, Known]:
    """The file's limits in its order, then the tasks' inline limits by name."""
    known = {name: Known(rule) for name, rule in throttler.config.rules.items()}
    for task in sorted(app.tasks.values(), key=lambda task: str(task.name)):
        spec = declared_by(task)
        for rule in spec.rules if spec is not None else ():
            known.setdefault(rule.name, Known(rule, str(task.name)))
    return known


def lookup(known: Mapping[str, Known], name: str) -> Known:
    """The limit called ``name``; a usage error (exit 2) lists the known ones."""
    if name in known:
        return known[name]
    listed = ", ".join(known) or "none (no limits file, no @throttled inline limits)"
    raise click.BadParameter(f"unknown limit {name!r}; known limits: {listed}", param_hint="LIMIT")


def checked_key(rule: Rule, key: str | None, hint: str) -> str | None:
    """``key`` when ``rule``'s tasks can have it; a usage error (exit 2) that says why not
    (:func:`throttle.rules.key_problem`: an empty key, a limit without a key, a composite
    key not percent-encoded), rather than a command that names nothing."""
    if key is None:
        return None
    problem = "a key must not be empty" if not key else key_problem(rule, key)
    if problem is not None:
        raise click.BadParameter(problem, param_hint=hint)
    return key


# -- formatting -----------------------------------------------------------------------------


def plain(number: float) -> str:
    """A number as the limit grammar reads it: no exponent, no trailing ``.0``."""
    text = format(Decimal(repr(float(number))), "f")
    return text[:-2] if text.endswith(".0") else text


def rate_spec(limit: Limit) -> str:
    """The rate of ``limit`` in the grammar of :meth:`Limit.parse`, without its burst:
    ``50/s``, ``1/3h``, ``8 concurrent``."""
    if limit.algorithm.holds_units:
        return f"{plain(limit.count)} concurrent"
    for unit, size in _UNITS:
        multiple = limit.period_s / size
        if multiple >= 1 and abs(multiple - round(multiple)) < 1e-9 * multiple:
            every = "" if round(multiple) == 1 else plain(round(multiple))
            return f"{plain(limit.count)}/{every}{unit}"
    return f"{plain(limit.count)}/{plain(limit.period_s)}s"


def duration(seconds: float) -> str:
    """A duration in s as people read it: ``250ms``, ``1.5s``, ``2m05s``, ``3h20m``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}".removesuffix(".0") + "s"
    if seconds < 7200:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


def counted(n: int, noun: str) -> str:
    """``1 task``, ``2 tasks``: ``n`` and the noun, plural unless ``n`` is 1."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def amount(value: float) -> str:
    """A count of tokens or slots: a whole number when it is one, else two decimals."""
    return str(round(value)) if abs(value - round(value)) < 0.005 else f"{value:.2f}"


def moment(due_us: int, now_us: int) -> str:
    """A time in epoch us as the local date and time, and how far it is from ``now_us``:
    ``2026-01-02 10:00:00 (in 30s)``, ``... (5m00s ago)``."""
    stamp = datetime.fromtimestamp(due_us / 1e6).strftime("%Y-%m-%d %H:%M:%S")
    left = (due_us - now_us) / 1e6
    return f"{stamp} ({'in ' + duration(left) if left >= 0 else duration(-left) + ' ago'})"
