"""A mock third-party API that enforces its own rate limit: ``python -m workers.mock_api``.

It stands for the rate-capped upstream (an LLM provider, GitHub, a payment gateway) that a
fleet of throttled workers calls. It is deliberately independent of the ``throttle``
package: it judges each request by the moment it really arrives (its own monotonic clock)
with its own limiter, as the real API would, so it can tell whether the fleet's shaping
worked.

* ``GET|POST /call``: one call. 200 with a JSON body when the limit allows it; 429 when it
  breaks the limit, with ``Retry-After`` (whole seconds until the next call is allowed,
  rounded up). Both carry the rate-limit headers real APIs send, in their common dialects:
  ``RateLimit-Limit`` (the burst), ``RateLimit-Remaining``, ``RateLimit-Reset`` (delta s
  until full), ``X-RateLimit-Limit`` (the quota of the policy), ``X-RateLimit-Remaining``,
  ``X-RateLimit-Reset`` (epoch s when full, as GitHub sends) and
  ``RateLimit-Policy: "default";q=20;w=1`` (IETF draft). A ``X-Task-Id`` header, if sent,
  is recorded with the arrival.
* ``GET /stats``: calls, violations (429s), the limit, the first and last arrival, and
  the changes of the limit (s since the start, rate, burst).
* ``GET /arrivals``: every arrival: time (s since the server started), allowed, task id.
* ``POST /limit`` with ``{"rate": 10, "burst": 1}``: change the limit mid-run (the upstream
  lowering its limit); with ``"tenant": "acme"`` as well, the limit of that tenant alone:
  a call that sends ``X-Tenant: acme`` is then judged by it instead (an API that sells
  plans); ``POST /reset``: forget the arrivals and refill the bucket. From the
  command line, ``--lower-to 10 --lower-after 30`` does the same 30 s after the start.

With ``--retry-after-only`` (``MockApi(..., retry_after_only=True)``) it answers as many
real APIs do: no rate-limit header at all, and a 429 with nothing but ``Retry-After``.

The limit is a token bucket of ``burst`` tokens refilled at ``rate`` per second; with
``burst`` 1 that is strict spacing (one call every 1/rate s), the strictest upstream.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["MockApi", "UpstreamLimit", "policy_of", "serve"]


@functools.lru_cache(maxsize=64)  # asked on every call, with one or two rates per run
def policy_of(rate: float) -> tuple[int, int]:
    """The policy a rate is stated as: (quota, window in whole s), integers as the IETF draft
    wants, with the shortest window that states the rate exactly (20/s: 20 per 1 s; 0.5/s:
    1 per 2 s). When no window up to an hour does: a minute's worth rounded down, or 1 per
    the interval rounded up (never more than the rate)."""
    for window in range(1, 3601):
        quota = rate * window
        if quota >= 1 and abs(quota - round(quota)) < 1e-9:
            return round(quota), window
    if rate * 60 >= 1:
        return math.floor(rate * 60), 60
    return 1, math.ceil(1 / rate - 1e-9)


@dataclass
class UpstreamLimit:
    """The upstream's own limit: a bucket of ``burst`` calls refilled at ``rate`` per second.

    Kept in seconds of ``time.monotonic()``; a call conforms when a whole token is there.
    """

    rate: float
    burst: float = 1.0
    tokens: float = field(init=False)
    stamp: float = field(init=False)

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.burst >= 1 and math.isfinite(self.rate * self.burst)):
            raise ValueError(f"rate must be > 0 and burst >= 1 (got {self.rate}, {self.burst})")
        self.tokens = self.burst
        self.stamp = time.monotonic()

    def take(self, now: float) -> tuple[bool, float]:
        """Take one token at ``now``: (allowed, seconds until a token is there)."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True, 0.0
        return False, (1 - self.tokens) / self.rate


@dataclass
class Arrival:
    at_s: float
    allowed: bool
    task_id: str | None
    tenant: str | None = None


class MockApi:
    """The state of the mock API: its limit and every arrival, behind one lock."""

    def __init__(self, rate: float, burst: float = 1.0, *, retry_after_only: bool = False) -> None:
        self.retry_after_only = retry_after_only
        """Send no rate-limit header: a 429 says only ``Retry-After``."""
        self.latency_s = 0.0
        """How long each call takes to answer, in s (judged when it arrives; the server
        answers calls in threads of their own, so this latency overlaps)."""
        self.lock = threading.Lock()
        self.limit = UpstreamLimit(rate, burst)
        self.started = time.monotonic()
        self.arrivals: list[Arrival] = []
        self.changes: list[tuple[float, float, float]] = []
        """Each change of the limit: (s since the start, rate, burst)."""
        self.tenants: dict[str, UpstreamLimit] = {}
        """Limits of single tenants (``X-Tenant``): a tenant listed here is judged by its own."""

    def call(
        self, task_id: str | None, tenant: str | None = None
    ) -> tuple[bool, float, float, UpstreamLimit]:
        """Judge one call at its arrival: (allowed, retry after s, tokens left, the limit)."""
        with self.lock:
            now = time.monotonic()
            limit = self.tenants.get(tenant, self.limit) if tenant is not None else self.limit
            allowed, retry_after_s = limit.take(now)
            self.arrivals.append(Arrival(now - self.started, allowed, task_id, tenant))
            return allowed, retry_after_s, limit.tokens, limit

    def set_tenant_limit(self, tenant: str, rate: float, burst: float) -> None:
        """Judge ``tenant``'s calls by a limit of its own from now on."""
        with self.lock:
            self.tenants[tenant] = UpstreamLimit(rate, burst)

    def set_limit(self, rate: float, burst: float) -> None:
        with self.lock:
            self.limit = UpstreamLimit(rate, burst)
            self.changes.append((time.monotonic() - self.started, rate, burst))

    def set_limit_later(self, after_s: float, rate: float, burst: float) -> threading.Timer:
        """Change the limit ``after_s`` seconds from now (the upstream lowering its limit
        mid-run); the limit is checked now, so that a bad one fails at once."""
        UpstreamLimit(rate, burst)
        timer = threading.Timer(after_s, self.set_limit, (rate, burst))
        timer.daemon = True
        timer.start()
        return timer

    def reset(self) -> None:
        with self.lock:
            self.limit = UpstreamLimit(self.limit.rate, self.limit.burst)
            self.tenants = {
                t: UpstreamLimit(lim.rate, lim.burst) for t, lim in self.tenants.items()
            }
            self.arrivals.clear()
            self.changes.clear()
            self.started = time.monotonic()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            arrivals = list(self.arrivals)
            changes = list(self.changes)
            rate, burst = self.limit.rate, self.limit.burst
        return {
            "calls": len(arrivals),
            "allowed": sum(a.allowed for a in arrivals),
            "violations": sum(not a.allowed for a in arrivals),
            "rate": rate,
            "burst": burst,
            "first_s": arrivals[0].at_s if arrivals else None,
            "last_s": arrivals[-1].at_s if arrivals else None,
            "changes": [list(change) for change in changes],
        }

    def arrivals_json(self) -> list[dict[str, Any]]:
        with self.lock:
            return [
                {"at_s": a.at_s, "allowed": a.allowed, "task_id": a.task_id, "tenant": a.tenant}
                for a in self.arrivals
            ]


def _handler(api: MockApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: clients reuse connections, as with a real API
        # An answer goes out as two writes (headers, body); with Nagle's algorithm the body
        # waited for the client's delayed ACK of the headers, up to 40 ms on Linux, on about
        # half the calls. Real servers set TCP_NODELAY, as this does.
        disable_nagle_algorithm = True

        def _reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def _call(self) -> None:
            allowed, retry_after_s, tokens, limit = api.call(
                self.headers.get("X-Task-Id"), self.headers.get("X-Tenant")
            )
            if api.latency_s > 0:
                time.sleep(api.latency_s)  # judged at arrival; this request's thread waits
            full_in_s = (limit.burst - tokens) / limit.rate
            remaining = str(max(math.floor(tokens), 0))
            quota, window = policy_of(limit.rate)
            headers = {
                "RateLimit-Limit": f"{limit.burst:g}",
                "RateLimit-Remaining": remaining,
                "RateLimit-Reset": str(math.ceil(full_in_s)),
                "RateLimit-Policy": f'"default";q={quota};w={window}',
                "X-RateLimit-Limit": str(quota),
                "X-RateLimit-Remaining": remaining,
                "X-RateLimit-Reset": str(math.ceil(time.time() + full_in_s)),
            }
            if api.retry_after_only:
                headers = {}
            if allowed:
                self._reply(200, {"ok": True}, headers)
            else:
                headers["Retry-After"] = str(max(math.ceil(retry_after_s), 1))
                self._reply(429, {"error": "rate_limit_exceeded"}, headers)

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            loaded = json.loads(self.rfile.read(length) or b"{}")
            return loaded if isinstance(loaded, dict) else {}

        def do_GET(self) -> None:
            if self.path == "/call":
                self._call()
            elif self.path == "/stats":
                self._reply(200, api.stats())
            elif self.path == "/arrivals":
                self._reply(200, api.arrivals_json())
            else:
                self._reply(404, {"error": f"no such path {self.path}"})

        def do_POST(self) -> None:
            if self.path == "/call":
                self._body()  # drain it: the connection is reused
                self._call()
            elif self.path == "/limit":
                try:
                    body = self._body()
                    rate, burst = float(body["rate"]), float(body.get("burst", 1))
                    if body.get("tenant") is not None:
                        api.set_tenant_limit(str(body["tenant"]), rate, burst)
                    else:
                        api.set_limit(rate, burst)
                except (KeyError, TypeError, ValueError) as exc:
                    self._reply(400, {"error": f"bad limit: {exc}"})
                    return
                self._reply(200, api.stats())
            elif self.path == "/reset":
                self._body()
                api.reset()
                self._reply(200, api.stats())
            else:
                self._reply(404, {"error": f"no such path {self.path}"})

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per call would drown a run of thousands

    return Handler


BACKLOG = 1024
"""The server's listen backlog. socketserver's default, 5, is too short for a large pool of
clients that each open a connection per call (``requests.get`` without a session): the
kernel drops the connections beyond it, and the clients retry them a second later."""


def serve(
    api: MockApi, host: str = "127.0.0.1", port: int = 0, backlog: int = BACKLOG
) -> ThreadingHTTPServer:
    """A server for ``api`` bound to ``host:port`` (0: a free port); call serve_forever()."""
    server_class = type("Server", (ThreadingHTTPServer,), {"request_queue_size": backlog})
    server: ThreadingHTTPServer = server_class((host, port), _handler(api))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A mock API that enforces its own limit.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    parser.add_argument("--rate", type=float, default=20.0, help="calls per second")
    parser.add_argument("--burst", type=float, default=1.0, help="1 = strict spacing")
    parser.add_argument(
        "--lower-to", type=float, metavar="RATE", help="change the rate to RATE mid-run"
    )
    parser.add_argument(
        "--lower-after", type=float, default=30.0, metavar="S",
        help="... this many seconds after the start (default 30)",
    )  # fmt: skip
    parser.add_argument(
        "--retry-after-only", action="store_true",
        help="no rate-limit headers: a 429 says only Retry-After",
    )  # fmt: skip
    parser.add_argument(
        "--latency", type=float, default=0.0, metavar="S",
        help="answer each call after S seconds (calls overlap: one thread each)",
    )  # fmt: skip
    parser.add_argument("--backlog", type=int, default=BACKLOG, help="the listen backlog")
    args = parser.parse_args(argv)
    api = MockApi(args.rate, args.burst, retry_after_only=args.retry_after_only)
    api.latency_s = max(args.latency, 0.0)
    server = serve(api, args.host, args.port, args.backlog)
    host, port = server.server_address[:2]
    print(f"mock API on http://{host!s}:{port} ({args.rate:g}/s burst {args.burst:g})", flush=True)
    if args.lower_to is not None:
        api.set_limit_later(args.lower_after, args.lower_to, args.burst)
        print(f"the rate becomes {args.lower_to:g}/s after {args.lower_after:g} s", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
