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

from dataclasses import dataclass
from typing import Any

__all__ = ["Answer", "answer_of"]

_STATUS_NAMES = ("status_code", "http_status", "status")
"""Where a status code is found, in this order (responses; Stripe; PyGithub, aiohttp)."""


@dataclass(frozen=True)
class Answer:
    """An upstream's answer as the parser reads it: a status code and the headers."""

    status_code: int
    headers: Any


def _status(obj: Any) -> int | None:
    for name in _STATUS_NAMES:
        try:
            value = getattr(obj, name, None)
        except Exception:  # a property that fails (PyGithub's on a bare exception)
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def answer_of(obj: Any) -> Answer | None:
    """The status code and headers of ``obj`` (a response, or an SDK's exception for one),
    or None when it has neither. Looks at ``obj`` itself, then at its ``response``
    attribute (``openai``'s and ``anthropic``'s errors carry the HTTP response there).
    Never raises."""
    for candidate in (obj, getattr(obj, "response", None)):
        if candidate is None:
            continue
        try:
            headers = getattr(candidate, "headers", None)
        except Exception:
            continue
        status = _status(candidate)
        if headers is not None and status is not None:
            return Answer(status, headers)
    return None
