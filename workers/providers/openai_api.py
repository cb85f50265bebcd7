"""A mock of OpenAI's chat completions API (``POST /v1/chat/completions``) and Responses
API (``POST /v1/responses``), with its rate limits: requests and tokens per minute.

* JSON, or a server-sent-event stream with ``"stream": true`` (``chat.completion.chunk``
  events, the usage in a last chunk with ``stream_options.include_usage``, then
  ``data: [DONE]``), as the ``openai`` SDK reads them. The Responses API answers a
  ``response`` object, or its typed events with ``"stream": true`` (``response.created``
  without usage ... ``response.completed`` whose ``response.usage`` has ``input_tokens``,
  ``output_tokens`` and ``total_tokens``).
* Usage: the prompt counts one token per 4 characters of its messages (or ``input``; at
  least 1), the reply ``fill`` x ``max_tokens`` (``max_completion_tokens``,
  ``max_output_tokens``; default 16). A call charges
  the ``tokens`` limit prompt + reply at its arrival, and ``requests`` 1.
* Every answer carries OpenAI's headers: ``x-ratelimit-limit-{requests,tokens}`` (per
  minute), ``x-ratelimit-remaining-*``, ``x-ratelimit-reset-*`` (until the bucket is full,
  as a Go duration: ``20ms``, ``1.5s``, ``6m0s``). A refusal is a 429 with
  ``retry-after-ms`` and ``retry-after`` and an error body whose ``type`` names the spent
  limit (``requests`` or ``tokens``). A new limit shows in the next answer's headers.
* ``credit_spent = True``: every call is OpenAI's 429 ``insufficient_quota`` (the
  account's credit is used up), which no wait ends.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any

from workers.providers.base import Arrival, Bucket, Provider, Reply, go_duration, json_body

__all__ = ["OpenAIMock"]


def prompt_tokens(request: Mapping[str, Any]) -> int:
    """The prompt's tokens as the mock counts them: one per 4 characters of its messages."""
    chars = 0
    given = request.get("input")  # the Responses API: a string, or a list of messages
    if isinstance(given, str):
        chars += len(given)
    for message in request.get("messages") or (given if isinstance(given, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        chars += len(content) if isinstance(content, str) else len(json.dumps(content))
    return max(math.ceil(chars / 4), 1)


class OpenAIMock(Provider):
    """``OpenAIMock(requests_per_min=600, tokens_per_min=120_000)``."""

    name = "openai"

    def __init__(
        self,
        requests_per_min: float = 600,
        tokens_per_min: float = 120_000,
        *,
        burst_s: float = 60.0,
        fill: float = 0.75,
    ) -> None:
        super().__init__({"requests": requests_per_min, "tokens": tokens_per_min}, burst_s=burst_s)
        self.fill = fill
        self.credit_spent = False
        """The account's credit is used up: every call is refused with OpenAI's 429
        ``insufficient_quota`` (no rate-limit headers, no wait given), charging nothing."""

    def rate_headers(self, buckets: Mapping[str, Bucket]) -> dict[str, str]:
        headers: dict[str, str] = {}
        for dim in ("requests", "tokens"):
            bucket = buckets.get(dim)
            if bucket is None:
                continue
            headers[f"x-ratelimit-limit-{dim}"] = f"{bucket.per_minute:.0f}"
            headers[f"x-ratelimit-remaining-{dim}"] = str(bucket.remaining)
            headers[f"x-ratelimit-reset-{dim}"] = go_duration(bucket.full_in_s())
        return headers

    def answer(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        route = path.split("?", 1)[0].rstrip("/")
        if method != "POST" or route not in ("/v1/chat/completions", "/v1/responses"):
            return Reply(
                404,
                {},
                {"error": {"message": f"no such path {path}", "type": "invalid_request_error"}},
            )
        request = json_body(body)
        if self.credit_spent:
            with self.lock:
                self.arrivals.append(
                    Arrival(time.monotonic() - self.started, False, headers.get("x-task-id"),
                            "insufficient_quota")
                )  # fmt: skip
            error = {
                "message": "You exceeded your current quota, please check your plan and billing "
                "details.",
                "type": "insufficient_quota", "param": None, "code": "insufficient_quota",
            }  # fmt: skip
            return Reply(429, {"x-request-id": f"req_{uuid.uuid4().hex[:16]}"}, {"error": error})
        prompt = prompt_tokens(request)
        max_tokens = (
            request.get("max_completion_tokens")
            or request.get("max_tokens")
            or request.get("max_output_tokens")
            or 16
        )
        completion = max(round(int(max_tokens) * self.fill), 1)
        refused_by, wait_s, buckets = self.take(
            headers.get("x-task-id"), {"requests": 1, "tokens": prompt + completion}
        )
        rate = self.rate_headers(buckets)
        rate["x-request-id"] = f"req_{uuid.uuid4().hex[:16]}"
        if refused_by is not None:
            rate["retry-after-ms"] = str(max(math.ceil(wait_s * 1000), 1))
            rate["retry-after"] = str(max(math.ceil(wait_s), 1))
            limit = buckets[refused_by].per_minute
            message = (
                f"Rate limit reached for mock-model on {refused_by} per min: Limit {limit:.0f}. "
                f"Please try again in {go_duration(wait_s)}."
            )
            error = {
                "message": message,
                "type": refused_by,
                "param": None,
                "code": "rate_limit_exceeded",
            }
            return Reply(429, rate, {"error": error})
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}  # fmt: skip
        model = str(request.get("model") or "mock-model")
        ident = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        text = " ".join(["token"] * completion)
        if route == "/v1/responses":
            return _responses_reply(rate, model, text, prompt, completion, request)
        if request.get("stream"):
            options = request.get("stream_options") or {}
            raw = _stream(ident, model, text, usage if options.get("include_usage") else None)
            return Reply(200, rate, raw=raw, content_type="text/event-stream")
        completion_body = {
            "id": ident, "object": "chat.completion", "created": 1_700_000_000, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": usage,
        }  # fmt: skip
        return Reply(200, rate, completion_body)


def _stream(ident: str, model: str, text: str, usage: dict[str, int] | None) -> bytes:
    """The SSE events of a streamed completion: a role delta, one delta per word, the
    finish, the usage chunk (asked for), ``[DONE]``."""

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        event = {"id": ident, "object": "chat.completion.chunk", "created": 1_700_000_000,
                 "model": model, "choices": choices, **extra}  # fmt: skip
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    def delta(content: dict[str, Any], finish: str | None = None) -> bytes:
        return chunk([{"index": 0, "delta": content, "finish_reason": finish}])

    parts = [delta({"role": "assistant", "content": ""})]
    words = text.split(" ")
    parts += [delta({"content": word if i == 0 else " " + word}) for i, word in enumerate(words)]
    parts.append(delta({}, "stop"))
    if usage is not None:
        parts.append(chunk([], usage=usage))
    parts.append(b"data: [DONE]\n\n")
    return b"".join(parts)


def _response(ident: str, model: str, text: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    """A Responses API ``response`` object: in progress (no output, no usage) or completed."""
    output = [
        {"type": "message", "id": f"msg_{ident}", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": text, "annotations": []}]}
    ] if usage is not None else []  # fmt: skip
    return {
        "id": f"resp_{ident}", "object": "response", "created_at": 1_700_000_000,
        "status": "in_progress" if usage is None else "completed", "model": model,
        "output": output, "usage": usage, "error": None, "incomplete_details": None,
        "instructions": None, "metadata": {}, "parallel_tool_calls": True,
        "tool_choice": "auto", "tools": [], "temperature": 1.0, "top_p": 1.0,
        "text": {"format": {"type": "text"}},
    }  # fmt: skip


def _responses_reply(
    rate: dict[str, str], model: str, text: str, prompt: int, completion: int,
    request: Mapping[str, Any],
) -> Reply:  # fmt: skip
    """The Responses API's answer: a ``response``, or with ``"stream": true`` its events,
    the usage only in the last one (``response.completed``), as OpenAI sends them."""
    ident = uuid.uuid4().hex[:24]
    usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": prompt + completion}  # fmt: skip
    if not request.get("stream"):
        return Reply(200, rate, _response(ident, model, text, usage))
    item = {"type": "message", "id": f"msg_{ident}", "status": "in_progress",
            "role": "assistant", "content": []}  # fmt: skip
    at = {"item_id": f"msg_{ident}", "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": "", "annotations": []}
    words = text.split(" ")
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": _response(ident, model, text, None)},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.content_part.added", **at, "part": part},
        *({"type": "response.output_text.delta", **at, "logprobs": [],
           "delta": word if i == 0 else " " + word} for i, word in enumerate(words)),
        {"type": "response.output_text.done", **at, "logprobs": [], "text": text},
        {"type": "response.content_part.done", **at, "part": {**part, "text": text}},
        {"type": "response.completed", "response": _response(ident, model, text, usage)},
    ]  # fmt: skip
    raw = b"".join(
        f"event: {event['type']}\ndata: ".encode()
        + json.dumps({**event, "sequence_number": n}).encode()
        + b"\n\n"
        for n, event in enumerate(events)
    )
    return Reply(200, rate, raw=raw, content_type="text/event-stream")
