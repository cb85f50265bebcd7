"""What every mock provider shares: limits per dimension, the arrivals, the HTTP server.

A provider limits one or more *dimensions* (``requests``, ``tokens``, ``input-tokens``...),
each a bucket stated per minute, as the real APIs state theirs (600 requests/min, 120,000
tokens/min). A call charges each dimension its amount (1 request, the tokens of its
prompt and reply) and is admitted only when every bucket holds that much, judged at its
arrival on the server's monotonic clock; a refused call charges nothing and names the
dimension that refused it. Like :mod:`workers.mock_api`, it knows nothing of ``throttle``.

The wire formats (:mod:`workers.providers.openai_api`, ...) subclass :class:`Provider`
with ``answer()``; each server also serves, beside its API:

* ``GET /_mock/stats``: calls, refusals (by dimension), the limits, the changes;
* ``GET /_mock/arrivals``: every arrival (s since the start, allowed, task id, the
  dimension that refused it, what it charged);
* ``POST /_mock/limit`` with ``{"dimension": "tokens", "per_minute": 60000}``: a new limit
  (announced in the headers of the next answers); ``POST /_mock/reset``: forget the
  arrivals, refill the buckets.

A task id travels in the ``X-Task-Id`` header (or, for Stripe, ``metadata[task_id]``).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl

__all__ = ["Arrival", "Bucket", "Provider", "Reply", "Running", "go_duration", "start"]


@dataclass
class Bucket:
    """One dimension's limit: ``per_minute`` units a minute, refilled continuously, holding
    at most ``burst_s`` seconds' worth (60: a whole minute, as OpenAI's and Anthropic's
    buckets; less: a stricter upstream that refuses bursts)."""

    per_minute: float
    burst_s: float = 60.0
    tokens: float = field(init=False)
    stamp: float = field(init=False)

    def __post_init__(self) -> None:
        if not (self.per_minute > 0 and self.burst_s > 0):
            raise ValueError(
                f"per_minute and burst_s must be > 0 ({self.per_minute}, {self.burst_s})"
            )
        self.tokens = self.capacity
        self.stamp = time.monotonic()

    @property
    def rate_per_s(self) -> float:
        return self.per_minute / 60.0

    @property
    def capacity(self) -> float:
        return self.rate_per_s * self.burst_s

    def refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate_per_s)
        self.stamp = now

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` units are there (after :meth:`refill`); an amount above
        the capacity waits for a full bucket."""
        return max(min(amount, self.capacity) - self.tokens, 0.0) / self.rate_per_s

    def full_in_s(self) -> float:
        """Seconds until the bucket is full again (the ``reset`` of the headers)."""
        return (self.capacity - self.tokens) / self.rate_per_s

    @property
    def remaining(self) -> int:
        return max(math.floor(self.tokens), 0)


@dataclass
class Arrival:
    at_s: float
    allowed: bool
    task_id: str | None
    refused_by: str | None = None
    charged: dict[str, float] = field(default_factory=dict)


@dataclass
class Reply:
    """An answer: status, headers, and a JSON body or raw bytes (an SSE stream)."""

    status: int
    headers: dict[str, str]
    body: Any = None
    raw: bytes | None = None
    content_type: str = "application/json"


def go_duration(seconds: float) -> str:
    """A duration as Go prints it, as OpenAI's ``x-ratelimit-reset-*`` headers do: ``20ms``,
    ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(round(seconds * 1000), 0)}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{text}"
    if minutes >= 1:
        return f"{int(minutes)}m{text}"
    return text


class Provider:
    """A mock provider's state: its buckets and every arrival, behind one lock."""

    name = "provider"

    def __init__(self, limits: Mapping[str, float], *, burst_s: float = 60.0) -> None:
        self.lock = threading.Lock()
        self.burst_s = burst_s
        self.limits = {dim: Bucket(per_min, burst_s) for dim, per_min in limits.items()}
        self.started = time.monotonic()
        self.arrivals: list[Arrival] = []
        self.changes: list[tuple[float, str, float]] = []
        """Each change of a limit: (s since the start, dimension, per minute)."""

    # -- judging calls ---------------------------------------------------------------

    def take(
        self, task_id: str | None, amounts: Mapping[str, float]
    ) -> tuple[str | None, float, dict[str, Bucket]]:
        """Judge one call charging ``amounts`` per dimension, at its arrival: (the dimension
        that refused it or None, seconds until it would pass, a snapshot of the buckets)."""
        with self.lock:
            now = time.monotonic()
            refused_by, wait_s = None, 0.0
            for dim, bucket in self.limits.items():
                bucket.refill(now)
                need = bucket.wait_s(amounts.get(dim, 0.0))
                if need > wait_s:
                    refused_by, wait_s = dim, need
            charged = {d: a for d, a in amounts.items() if d in self.limits}
            if refused_by is None:
                for dim, amount in charged.items():
                    self.limits[dim].tokens -= amount
            self.arrivals.append(
                Arrival(now - self.started, refused_by is None, task_id, refused_by,
                        charged if refused_by is None else {})
            )  # fmt: skip
            snapshot = {dim: _copy(bucket) for dim, bucket in self.limits.items()}
            return refused_by, wait_s, snapshot

    def set_limit(self, dimension: str, per_minute: float) -> None:
        """A new limit for ``dimension`` (the provider lowering it mid-run); the bucket
        keeps what it holds, up to its new capacity."""
        with self.lock:
            old = self.limits.get(dimension)
            bucket = Bucket(per_minute, self.burst_s)
            if old is not None:
                old.refill(time.monotonic())
                bucket.tokens = min(old.tokens, bucket.capacity)
            self.limits[dimension] = bucket
            self.changes.append((time.monotonic() - self.started, dimension, per_minute))

    def halve(self, dimension: str = "tokens") -> None:
        self.set_limit(dimension, self.limits[dimension].per_minute / 2)

    def halve_later(self, after_s: float, dimension: str = "tokens") -> threading.Timer:
        if dimension not in self.limits:
            raise ValueError(f"{self.name} has no {dimension!r} limit (it has {list(self.limits)})")
        timer = threading.Timer(after_s, self.halve, (dimension,))
        timer.daemon = True
        timer.start()
        return timer

    def reset(self) -> None:
        with self.lock:
            self.limits = {d: Bucket(b.per_minute, self.burst_s) for d, b in self.limits.items()}
            self.arrivals.clear()
            self.changes.clear()
            self.started = time.monotonic()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            arrivals = list(self.arrivals)
            limits = {dim: bucket.per_minute for dim, bucket in self.limits.items()}
            changes = [list(change) for change in self.changes]
        refused: dict[str, int] = {}
        for arrival in arrivals:
            if arrival.refused_by is not None:
                refused[arrival.refused_by] = refused.get(arrival.refused_by, 0) + 1
        return {
            "provider": self.name,
            "calls": len(arrivals),
            "allowed": sum(a.allowed for a in arrivals),
            "refused": sum(refused.values()),
            "refused_by": refused,
            "limits": limits,
            "changes": changes,
        }

    def arrivals_json(self) -> list[dict[str, Any]]:
        with self.lock:
            return [
                {"at_s": a.at_s, "allowed": a.allowed, "task_id": a.task_id,
                 "refused_by": a.refused_by, "charged": dict(a.charged)}
                for a in self.arrivals
            ]  # fmt: skip

    # -- the wire format ---------------------------------------------------------------

    def answer(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        """One request of the provider's API (overridden by each wire format); header names
        lower-cased."""
        return Reply(404, {}, {"error": f"no such path {path}"})


def _copy(bucket: Bucket) -> Bucket:
    clone = Bucket(bucket.per_minute, bucket.burst_s)
    clone.tokens, clone.stamp = bucket.tokens, bucket.stamp
    return clone


def json_body(body: bytes) -> dict[str, Any]:
    """A request's JSON object (an empty one when it is none)."""
    try:
        loaded = json.loads(body or b"{}")
    except ValueError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def form_body(body: bytes) -> dict[str, str]:
    """A form-encoded request body (Stripe's), as a flat dict (``metadata[task_id]``...)."""
    return dict(parse_qsl(body.decode("latin-1"), keep_blank_values=True))


def _handler(provider: Provider) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the SDKs' pooled clients expect

        def _send(self, reply: Reply) -> None:
            data = reply.raw if reply.raw is not None else json.dumps(reply.body).encode()
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            path = self.path.split("?", 1)[0]
            if path == "/_mock/stats":
                self._send(Reply(200, {}, provider.stats()))
            elif path == "/_mock/arrivals":
                self._send(Reply(200, {}, provider.arrivals_json()))
            elif path == "/_mock/limit" and method == "POST":
                try:
                    asked = json_body(body)
                    provider.set_limit(str(asked["dimension"]), float(asked["per_minute"]))
                except (KeyError, TypeError, ValueError) as exc:
                    self._send(Reply(400, {}, {"error": f"bad limit: {exc}"}))
                    return
                self._send(Reply(200, {}, provider.stats()))
            elif path == "/_mock/reset" and method == "POST":
                provider.reset()
                self._send(Reply(200, {}, provider.stats()))
            else:
                lowered = {name.lower(): value for name, value in self.headers.items()}
                self._send(provider.answer(method, self.path, lowered, body))

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per call would drown a run of thousands

    return Handler


@dataclass
class Running:
    """A mock provider serving on a loopback port, in a thread of this process."""

    provider: Provider
    url: str
    server: ThreadingHTTPServer

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    close = stop


def start(provider: Provider, host: str = "127.0.0.1", port: int = 0) -> Running:
    """Serve ``provider`` on ``host:port`` (0: a free port) in a daemon thread."""
    server = ThreadingHTTPServer((host, port), _handler(provider))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=provider.name, daemon=True).start()
    bound_host, bound_port = server.server_address[:2]
    return Running(provider, f"http://{bound_host!s}:{bound_port}", server)
