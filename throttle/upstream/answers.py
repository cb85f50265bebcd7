"""What counts as an upstream's answer: an HTTP response, or the exception an SDK raised
for one, read as a status code and headers.

Users hand :func:`throttle.upstream.report_upstream` whatever they hold: a
``requests.Response``, an ``httpx``/``httpx2`` response, or the error an SDK raised for a
refused call. Each SDK spells the two fields its own way; they are read by duck typing, so
that no SDK is imported (none is a dependency):

- ``requests`` and ``httpx``/``httpx2`` responses: ``status_code`` and ``headers``;
- ``openai``'s and ``anthropic``'s ``APIStatusError`` (``RateLimitError``...):
  ``status_code``, and the headers of its ``response``;
- ``stripe``'s errors (``RateLimitError``...): ``http_status`` and ``headers``;
- PyGithub's ``GithubException`` (``RateLimitExceededException``...): ``status`` and
  ``headers``;
- ``requests.HTTPError``, ``httpx.HTTPStatusError``: their ``response``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Answer", "answer_of"]

_STATUS_NAMES = ("status_code", "http_status", "status")
"""Where a status code is found, in this order (responses; Stripe; PyGithub, aiohttp)."""


@dataclass(frozen=True)
class Answer:
    """An SDK exception's answer as the parser reads a response: a status code, the
    headers, and the body's text when the exception kept it (GitHub's secondary limit is
    told by its message)."""

    status_code: int
    headers: Any
    text: str | None = None


def _status(obj: Any, names: tuple[str, ...] = _STATUS_NAMES) -> int | None:
    for name in names:
        try:
            value = getattr(obj, name, None)
        except Exception:  # a property that fails
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _headers(obj: Any) -> Any:
    return _attribute(obj, "headers")


def _attribute(obj: Any, name: str) -> Any:
    """``obj.name``, or None when it has none or its property fails."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def _text(obj: Any) -> str | None:
    """The body an SDK exception kept: Stripe's ``http_body``, PyGithub's ``data``."""
    body = _attribute(obj, "http_body")
    if body is None:
        body = _attribute(obj, "data")
    if isinstance(body, bytes):
        return body.decode("utf-8", "replace")
    if isinstance(body, str):
        return body
    if isinstance(body, (dict, list)):
        try:
            return json.dumps(body, default=str)
        except (TypeError, ValueError):  # a circular body
            return None
    return None


def answer_of(obj: Any) -> Any | None:
    """What the parser reads of ``obj``: ``obj`` itself when it is a response
    (``status_code`` and ``headers``); the HTTP response an SDK's exception carries
    (``openai``'s and ``anthropic``'s ``response``, ``requests``' and ``httpx``'s
    errors'); else an :class:`Answer` made of the exception's status, headers and kept
    body (Stripe, PyGithub); None when it has none of these. Never raises."""
    if _status(obj, ("status_code",)) is not None and _headers(obj) is not None:
        return obj
    response = _attribute(obj, "response")
    if _status(response, ("status_code",)) is not None and _headers(response) is not None:
        return response
    status, headers = _status(obj), _headers(obj)
    if status is None or headers is None:
        return None
    return Answer(status, headers, _text(obj))
