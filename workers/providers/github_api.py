"""A mock of GitHub's REST API for one read, ``GET /repos/{owner}/{repo}``, with GitHub's
two kinds of limit.

* **Primary**: ``per_window`` calls per fixed window of ``window_s`` (5000 an hour by
  default), the ``core`` resource. Every answer says ``x-ratelimit-limit``,
  ``x-ratelimit-remaining``, ``x-ratelimit-used``, ``x-ratelimit-reset`` (epoch s of the
  window's end) and ``x-ratelimit-resource: core``. A call past the quota: 403 (``status``
  429 if asked), ``remaining`` 0, ``"API rate limit exceeded"``.
* **Secondary**: at most ``secondary_per_min`` calls a minute in bursts of
  ``secondary_burst_s`` seconds' worth; past it, 403 ``"You have exceeded a secondary rate
  limit"`` with ``retry-after`` when ``secondary_retry_after`` is set, else without it
  (GitHub then asks clients to wait at least a minute).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from workers.providers.base import Arrival, Provider, Reply

__all__ = ["GitHubMock"]

DOCS = "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api"


class GitHubMock(Provider):
    name = "github"

    def __init__(
        self,
        per_window: int = 5000,
        window_s: float = 3600.0,
        *,
        secondary_per_min: float = 900,
        secondary_burst_s: float = 1.0,
        secondary_retry_after: int | None = None,
        primary_status: int = 403,
    ) -> None:
        super().__init__({"secondary": secondary_per_min}, burst_s=secondary_burst_s)
        self.per_window, self.window_s = per_window, window_s
        self.secondary_retry_after = secondary_retry_after
        self.primary_status = primary_status
        self.window_end = time.time() + window_s
        self.used = 0

    def reset(self) -> None:
        super().reset()
        with self.lock:
            self.window_end, self.used = time.time() + self.window_s, 0

    def _primary(self) -> tuple[bool, dict[str, str]]:
        """Count one call in the window: (allowed, the headers)."""
        with self.lock:
            now = time.time()
            if now >= self.window_end:
                self.window_end, self.used = now + self.window_s, 0
            allowed = self.used < self.per_window
            self.used += allowed
            headers = {
                "x-ratelimit-limit": str(self.per_window),
                "x-ratelimit-remaining": str(self.per_window - self.used),
                "x-ratelimit-used": str(self.used),
                "x-ratelimit-reset": str(math.ceil(self.window_end)),
                "x-ratelimit-resource": "core",
            }
            return allowed, headers

    def answer(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        parts = path.split("?", 1)[0].strip("/").split("/")
        if method != "GET" or len(parts) != 3 or parts[0] != "repos":
            return Reply(404, {}, {"message": "Not Found", "documentation_url": DOCS})
        task_id = headers.get("x-task-id")
        allowed, rate = self._primary()
        if not allowed:
            with self.lock:
                self.arrivals.append(
                    Arrival(time.monotonic() - self.started, False, task_id, "core")
                )
            message = "API rate limit exceeded for 127.0.0.1."
            return Reply(self.primary_status, rate, {"message": message, "documentation_url": DOCS})
        refused_by, _, _ = self.take(task_id, {"secondary": 1})
        if refused_by is not None:
            with self.lock:
                self.used -= 1  # a refused call is not counted in the primary quota
            if self.secondary_retry_after is not None:
                rate["retry-after"] = str(self.secondary_retry_after)
            message = (
                "You have exceeded a secondary rate limit. "
                "Please wait a few minutes before you try again."
            )
            return Reply(403, rate, {"message": message, "documentation_url": DOCS})
        owner, repo = parts[1], parts[2]
        return Reply(200, rate, _repo(owner, repo))


def _repo(owner: str, repo: str) -> dict[str, Any]:
    url = f"https://api.github.com/repos/{owner}/{repo}"
    return {
        "id": abs(hash((owner, repo))) % 10**9, "name": repo, "full_name": f"{owner}/{repo}",
        "private": False, "url": url, "html_url": f"https://github.com/{owner}/{repo}",
        "owner": {"login": owner, "id": 1, "type": "Organization"},
        "stargazers_count": 42, "default_branch": "main",
    }  # fmt: skip
