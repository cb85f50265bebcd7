"""Small HTTP helpers for tests of the project's own servers (the limits page)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def post_json(url: str, body: object, token: str | None = None) -> tuple[int, Any]:
    """POST ``body`` as JSON (with ``Authorization: Bearer TOKEN`` when given); the status
    and the decoded JSON answer, error statuses included."""
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        with exc:  # it holds the response's socket
            return exc.code, json.load(exc)
