"""``celery throttle web``: the limits page, served by the command (:mod:`throttle.web`).

Read-only by default, on 127.0.0.1. ``--allow-control`` adds pause and resume, behind a
token: ``--token-file``, or ``THROTTLE_WEB_TOKEN``, or one made up at start and printed
once (as Jupyter does). A token never goes on the command line, where ``ps`` shows it.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
from pathlib import Path

import click

from throttle.cli.base import one_line_errors, throttler_of
from throttle.cli.status import minutes_option, timeout_option

TOKEN_ENV = "THROTTLE_WEB_TOKEN"
"""The control token, when not in ``--token-file`` (at least 16 characters)."""
DEFAULT_PORT = 5580
"""The page's port unless told: Flower's 5555 plus 25, clear of the Prometheus range."""


def _token(allow: bool, token_file: Path | None) -> tuple[str | None, bool]:
    """The control token and whether it was made up here (to be printed)."""
    if not allow:
        if token_file is not None or os.environ.get(TOKEN_ENV):
            click.echo(
                "note: a token is set but --allow-control is not: the page is read-only",
                err=True,
            )
        return None, False
    if token_file is not None:
        token = token_file.read_text().strip()
        source = f"--token-file {token_file}"
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        source = TOKEN_ENV
        if not token:
            return secrets.token_urlsafe(24), True
    if len(token) < 16:
        raise click.BadParameter(
            f"the token from {source} has {len(token)} characters; use at least 16",
            param_hint="'--allow-control'",
        )
    return token, False


@click.command()
@click.option(
    "--port",
    "-p",
    type=click.IntRange(0, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    help="The port to listen on (0: any free one).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="The address to listen on (IPv4 or IPv6); 0.0.0.0 or :: exposes the page to the network.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0.5),
    default=2.0,
    show_default=True,
    metavar="S",
    help="Seconds between two snapshots of the fleet.",
)
@timeout_option(0.5)
@minutes_option(
    "The tasks the fleet deferred, parked or timed out per minute (refused /min; not those "
    "that waited for their slot in a worker)"
)
@click.option(
    "--allow-control", is_flag=True, help="Allow pause and resume from the page, with a token."
)
@click.option("--token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help=f"Read the control token from this file (else ${TOKEN_ENV}, else a new "
              "one is printed).")  # fmt: skip
@click.pass_context
def web(
    ctx: click.Context,
    port: int,
    host: str,
    interval: float,
    timeout: float,
    minutes: int,
    allow_control: bool,
    token_file: Path | None,
) -> None:
    """Serve the limits page: every limit live, in a browser, until Ctrl-C.

    It shows what `status` shows (the rate in force and the configured one, tokens, next
    slot, holds, the learned rate, tasks running, refusals per minute), the tasks waiting
    and parked per limit and per key for the busiest keys, and a chart of the tasks
    admitted per second against the limit. Read-only unless --allow-control: then pause
    and resume want the token. Everything is served by this command (no CDN).
    """
    # Here, not at the top: throttle.web reads through throttle.cli.status, and this
    # package imports this module while it initialises.
    from throttle.web import LimitsPage, Sampler  # noqa: PLC0415

    app, throttler = throttler_of(ctx)
    token, made_up = _token(allow_control, token_file)
    sampler = Sampler(app, throttler, timeout_s=timeout, minutes=minutes)
    page = LimitsPage(sampler, interval_s=interval, control_token=token)
    with one_line_errors():
        # A Redis URL that does not parse fails here, before the server starts; a Redis
        # that does not answer shows on the page, which keeps sampling until it does.
        sampler.sample()
    try:
        bound_host, bound_port = page.start(host, port)
    except OSError as exc:
        raise click.ClickException(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    click.echo(f"limits page on http://{shown}:{bound_port}/ (Ctrl-C stops it)")
    if token is None:
        click.echo("read-only: pause and resume need --allow-control and a token")
    elif made_up:
        click.echo(f"control allowed; token (printed once, not stored): {token}")
    else:
        click.echo("control allowed, with the given token")
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    previous_term = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)
        page.stop()
    ctx.exit(0)
