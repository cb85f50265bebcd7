"""A mock of Anthropic's Messages API (``POST /v1/messages``), with its rate limits.

* JSON replies (``"type": "message"``) with ``usage.input_tokens`` and
  ``usage.output_tokens``: the input counts one token per 4 characters of the messages (and
  ``system``), the output ``fill`` x ``max_tokens``. With ``"stream": true``, the
  server-sent events of a streamed message: ``message_start`` (the input tokens),
  ``content_block_*``, ``message_delta`` (the output tokens, cumulative), ``message_stop``.
* Limits per minute on any of ``requests``, ``tokens`` (input + output),
  ``input-tokens`` and ``output-tokens`` (each optional). A call charges each of them at
  its arrival.
* Every answer carries Anthropic's headers for each limit it enforces:
  ``anthropic-ratelimit-{dimension}-limit`` (per minute), ``-remaining``, ``-reset`` (when
  the bucket is full again, an RFC 3339 time). A refusal is a 429 with ``retry-after``
  (whole seconds) and ``{"type": "error", "error": {"type": "rate_limit_error", ...}}``.
"""

from __future__ import annotations

import datetime
import json
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

from workers.providers.base import Bucket, Provider, Reply, json_body

__all__ = ["AnthropicMock"]

DIMENSIONS = ("requests", "tokens", "input-tokens", "output-tokens")


def rfc3339(epoch_s: float) -> str:
    """``2026-11-25T20:13:11Z``, as Anthropic's reset headers (whole seconds, rounded up)."""
    moment = datetime.datetime.fromtimestamp(math.ceil(epoch_s), tz=datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def input_tokens(request: Mapping[str, Any]) -> int:
    system = request.get("system")
    chars = 0 if not system else len(system) if isinstance(system, str) else len(json.dumps(system))
    for message in request.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        chars += len(content) if isinstance(content, str) else len(json.dumps(content))
    return max(math.ceil(chars / 4), 1)


class AnthropicMock(Provider):
    """``AnthropicMock({"requests": 600, "tokens": 120_000})``: limits per minute by
    dimension (:data:`DIMENSIONS`)."""

    name = "anthropic"

    def __init__(
        self, limits: Mapping[str, float], *, burst_s: float = 60.0, fill: float = 0.75
    ) -> None:
        unknown = set(limits) - set(DIMENSIONS)
        if unknown:
            raise ValueError(f"unknown dimensions {sorted(unknown)} (known: {DIMENSIONS})")
        super().__init__(limits, burst_s=burst_s)
        self.fill = fill

    def rate_headers(self, buckets: Mapping[str, Bucket]) -> dict[str, str]:
        now = time.time()
        headers: dict[str, str] = {}
        for dim in DIMENSIONS:
            bucket = buckets.get(dim)
            if bucket is None:
                continue
            prefix = f"anthropic-ratelimit-{dim}"
            headers[f"{prefix}-limit"] = f"{bucket.per_minute:.0f}"
            headers[f"{prefix}-remaining"] = str(bucket.remaining)
            headers[f"{prefix}-reset"] = rfc3339(now + bucket.full_in_s())
        return headers

    def answer(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        if method != "POST" or path.split("?", 1)[0].rstrip("/") != "/v1/messages":
            error = {"type": "not_found_error", "message": f"no such path {path}"}
            return Reply(404, {}, {"type": "error", "error": error})
        request = json_body(body)
        given = input_tokens(request)
        output = max(round(int(request.get("max_tokens") or 16) * self.fill), 1)
        amounts = {"requests": 1, "tokens": given + output, "input-tokens": given,
                   "output-tokens": output}  # fmt: skip
        refused_by, wait_s, buckets = self.take(headers.get("x-task-id"), amounts)
        rate = self.rate_headers(buckets)
        rate["request-id"] = f"req_{uuid.uuid4().hex[:24]}"
        if refused_by is not None:
            rate["retry-after"] = str(max(math.ceil(wait_s), 1))
            message = (
                f"This request would exceed your organization's rate limit of "
                f"{buckets[refused_by].per_minute:.0f} {refused_by} per minute."
            )
            error = {"type": "rate_limit_error", "message": message}
            return Reply(429, rate, {"type": "error", "error": error})
        text = " ".join(["token"] * output)
        message_body = {
            "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": str(request.get("model") or "mock-model"),
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": given, "output_tokens": output},
        }  # fmt: skip
        if request.get("stream"):
            raw = _stream(message_body, text.split(" "), given, output)
            return Reply(200, rate, raw=raw, content_type="text/event-stream")
        return Reply(200, rate, message_body)


def _stream(message: dict[str, Any], words: list[str], given: int, output: int) -> bytes:
    """The events of a streamed message, as Anthropic sends them."""

    def event(name: str, data: dict[str, Any]) -> bytes:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()

    start = {**message, "content": [], "stop_reason": None,
             "usage": {"input_tokens": given, "output_tokens": 1}}  # fmt: skip
    block = {"type": "text", "text": ""}
    parts = [event("message_start", {"message": start}),
             event("content_block_start", {"index": 0, "content_block": block})]  # fmt: skip
    for i, word in enumerate(words):
        delta = {"type": "text_delta", "text": word if i == 0 else " " + word}
        parts.append(event("content_block_delta", {"index": 0, "delta": delta}))
    parts.append(event("content_block_stop", {"index": 0}))
    parts.append(event("message_delta", {"delta": {"stop_reason": "end_turn",
                                                   "stop_sequence": None},
                                         "usage": {"output_tokens": output}}))  # fmt: skip
    parts.append(event("message_stop", {}))
    return b"".join(parts)
