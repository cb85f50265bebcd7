"""The limits page's HTTP server: the page, its data as JSON, and (only when asked for)
pause and resume. Standard library only (``http.server``), one process, no CDN: the
page, its script and its style are files of this package.

Routes:

=====================  ========================================================
``GET /``              the page (``page.html``; ``page.js`` and ``page.css``)
``GET /api/state``     the last snapshot (:class:`throttle.web.snapshot.Sampler`)
                       with the chart's history, as JSON
``POST /api/pause``    ``{"limit": NAME, "key": KEY or null}``: pause, as
                       ``celery throttle pause`` does
``POST /api/resume``   the same body: lift the pause (or a timed hold)
=====================  ========================================================

Safety. Read-only unless the server was built with a control token (the command's
``--allow-control``): then the two POST routes want ``Authorization: Bearer TOKEN``,
compared in constant time (:func:`hmac.compare_digest`); without control they answer
403, without the right token 401, each with a JSON ``error`` that says what is missing.
A custom header is also what keeps a form on another site from posting here (a browser
sends one only after a CORS preflight, which this server never grants). The ``Host``
header must name the address the server listens on, or ``localhost`` on a loopback
address, so that a page of another site cannot read the state through DNS rebinding;
the page may not be framed (clickjacking of the buttons).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from throttle.errors import ThrottleError
from throttle.web.snapshot import Sampler

__all__ = ["ASSETS", "LimitsPage"]

logger = logging.getLogger("throttle")

ASSETS = {
    "/": ("page.html", "text/html; charset=utf-8"),
    "/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/page.css": ("page.css", "text/css; charset=utf-8"),
}
"""The files the page is made of: path -> (file of this package, content type)."""
MAX_BODY = 4096
"""The largest POST body read, in bytes (a limit name and a key)."""
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


class _IPv6Server(ThreadingHTTPServer):
    """The server on an IPv6 address (``--host ::1``, ``--host ::``): ``http.server``
    makes IPv4 sockets unless told, which refuse such an address ("Address family for
    hostname not supported")."""

    address_family = socket.AF_INET6


class LimitsPage:
    """The page of one fleet: a sampler thread and an HTTP server.

    Parameters
    ----------
    sampler:
        Takes the snapshots.
    interval_s:
        Seconds between two snapshots (the page polls at the same pace).
    control_token:
        None: read-only (the POST routes answer 403). Else the token they want.
    """

    def __init__(
        self, sampler: Sampler, *, interval_s: float = 2.0, control_token: str | None = None
    ) -> None:
        if control_token is not None and len(control_token) < 16:
            raise ValueError("the control token must have at least 16 characters")
        self.sampler = sampler
        self.interval_s = interval_s
        self.control_token = control_token
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        self.address: tuple[str, int] = ("", 0)
        """Where the server listens, once started."""

    def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (port 0: a free one) and start sampling; returns the
        address listened on. Raises OSError when the address cannot be bound."""
        page = self

        class Handler(_Handler):
            owner = page

        # An IPv6 literal (never a host name: those have no colon) needs an IPv6 socket.
        server_class = _IPv6Server if ":" in host else ThreadingHTTPServer
        server = server_class((host, port), Handler)
        server.daemon_threads = True
        self._server = server
        self._threads = [
            threading.Thread(target=self._sample_loop, name="throttle-web-sampler", daemon=True),
            threading.Thread(target=server.serve_forever, name="throttle-web", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        bound = server.server_address
        self.address = (str(bound[0]), int(bound[1]))
        return self.address

    def stop(self) -> None:
        """Stop serving and sampling."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)

    def wait(self) -> None:
        """Block until :meth:`stop` (or Ctrl-C in the caller)."""
        while not self._stop.wait(0.5):
            pass

    def _sample_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sampler.sample()
            except Exception:  # the page says so; the sampler keeps going
                logger.exception("throttle: the limits page could not take a snapshot")
            self._stop.wait(self.interval_s)

    # -- what the routes answer -----------------------------------------------------------

    def state(self) -> dict[str, Any]:
        latest = self.sampler.latest()
        data: dict[str, Any] = latest if latest is not None else {"limits": [], "history": []}
        data["control"] = self.control_token is not None
        data["interval_s"] = self.interval_s
        return data

    def control(
        self, action: str, authorization: str | None, body: bytes
    ) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer) of a pause or resume request."""
        if self.control_token is None:
            return HTTPStatus.FORBIDDEN, {
                "error": "control is off: this page is read-only; start it with "
                "`celery throttle web --allow-control` (and a token) to pause and resume"
            }
        given = ""
        if authorization and authorization.startswith("Bearer "):
            given = authorization[len("Bearer ") :].strip()
        if not given or not hmac.compare_digest(given.encode(), self.control_token.encode()):
            return HTTPStatus.UNAUTHORIZED, {
                "error": "a control token is required: send it as 'Authorization: Bearer "
                "TOKEN' (the page asks for it); this one is missing or wrong"
            }
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            return HTTPStatus.BAD_REQUEST, {"error": "the body is not JSON"}
        limit = request.get("limit") if isinstance(request, dict) else None
        key = request.get("key") if isinstance(request, dict) else None
        known = self.sampler.names()
        if not isinstance(limit, str) or limit not in known:
            return HTTPStatus.BAD_REQUEST, {
                "error": f"unknown limit {limit!r}; known limits: {', '.join(known)}"
            }
        if key is not None and (not isinstance(key, str) or not key):
            return HTTPStatus.BAD_REQUEST, {"error": "key must be a non-empty string or null"}
        problem = None if key is None or action != "pause" else self.sampler.key_problem(limit, key)
        if problem is not None:  # a pause that would pause nothing
            return HTTPStatus.BAD_REQUEST, {"error": problem}
        try:
            if action == "pause":
                self.sampler.pause(limit, key)
            else:
                self.sampler.resume(limit, key)
        except ThrottleError as exc:
            return HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)}
        logger.warning("throttle: the limits page %sd %s%s", action, limit,
                       f" key {key!r}" if key is not None else "")  # fmt: skip
        try:
            self.sampler.sample()  # the page shows it at its next poll, not a round later
        except Exception:
            logger.debug("throttle: a snapshot after %s failed", action, exc_info=True)
        return HTTPStatus.OK, {"ok": True, "action": action, "limit": limit, "key": key}


class _Handler(BaseHTTPRequestHandler):
    owner: LimitsPage
    server_version = "celery-throttled"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("throttle: web %s - %s", self.address_string(), format % args)

    def _host_ok(self) -> bool:
        host = (self.headers.get("Host") or "").strip()
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        name = name.strip("[]").lower()
        bound = str(self.owner.address[0]).lower()
        if bound in ("0.0.0.0", "::"):
            return True
        return name == bound or (bound in _LOOPBACK and name in _LOOPBACK)

    head_only = False
    """Answering a HEAD: GET's status and headers, without the body."""

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in _HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        if not self.head_only:
            self.wfile.write(body)

    def _json(self, status: int, data: Any) -> None:
        body = json.dumps(_finite(data), allow_nan=False).encode()
        self._send(status, body, "application/json")

    def do_GET(self) -> None:
        if not self._host_ok():
            self._json(HTTPStatus.MISDIRECTED_REQUEST, {"error": "unexpected Host header"})
            return
        path = self.path.split("?", 1)[0]
        if path == "/api/state":
            self._json(HTTPStatus.OK, self.owner.state())
            return
        asset = ASSETS.get(path)
        if asset is None:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {path}"})
            return
        name, content_type = asset
        body = resources.files("throttle.web").joinpath(name).read_bytes()
        self._send(HTTPStatus.OK, body, content_type)

    def do_HEAD(self) -> None:
        """What a health check sends: GET's answer without its body."""
        self.head_only = True
        self.do_GET()

    def do_POST(self) -> None:
        if not self._host_ok():
            self._json(HTTPStatus.MISDIRECTED_REQUEST, {"error": "unexpected Host header"})
            return
        path = self.path.split("?", 1)[0]
        if path not in ("/api/pause", "/api/resume"):
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such action: {path}"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            self._json(HTTPStatus.BAD_REQUEST, {"error": f"a body of 0 to {MAX_BODY} bytes"})
            return
        body = self.rfile.read(length)
        status, answer = self.owner.control(
            path.rsplit("/", 1)[1], self.headers.get("Authorization"), body
        )
        self._json(status, answer)


def _finite(value: Any) -> Any:
    """JSON has no infinity: a pause's ``inf`` seconds become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
