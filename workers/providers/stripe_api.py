"""A mock of Stripe's API for one write: ``POST /v1/payment_intents`` (form-encoded, as the
``stripe`` SDK sends it), with a request rate limit.

* A created payment intent is a JSON ``payment_intent``; its ``metadata[task_id]`` (or the
  ``X-Task-Id`` header) names the task, and :meth:`StripeMock.charges` counts the intents
  created per task: a task that ran twice charges twice.
* ``Idempotency-Key``: a key seen before returns the intent it created, charging nothing
  and judged by no limit (as Stripe replays it), so an SDK's own retry of a served call
  is not a second charge.
* Over the limit: 429, ``Stripe-Rate-Limited-Reason: global-rate`` and
  ``Stripe-Should-Retry`` (``true`` by default), the error ``{"code": "rate_limit"}``.
* ``lock_timeouts``: that many of the next creates (after the limit admitted them) answer
  409 ``lock_timeout`` with ``Stripe-Should-Retry: true``, creating nothing, as Stripe
  does when another request holds the object: not a refusal for the rate, and an error
  Stripe says to retry.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from workers.providers.base import Provider, Reply, form_body

__all__ = ["StripeMock"]


class StripeMock(Provider):
    """``StripeMock(requests_per_min=1500)``."""

    name = "stripe"

    def __init__(
        self, requests_per_min: float = 1500, *, burst_s: float = 1.0, should_retry: bool = True
    ) -> None:
        super().__init__({"requests": requests_per_min}, burst_s=burst_s)
        self.should_retry = should_retry
        self.lock_timeouts = 0
        """How many of the next admitted creates answer 409 ``lock_timeout``."""
        self.intents: dict[str, dict[str, Any]] = {}
        """Created intents by idempotency key (a fresh key when the request had none)."""

    def charges(self) -> dict[str, int]:
        """Payment intents created, per task id."""
        with self.lock:
            counts: dict[str, int] = {}
            for intent in self.intents.values():
                task = intent["metadata"].get("task_id", "")
                counts[task] = counts.get(task, 0) + 1
            return counts

    def answer(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        if method != "POST" or path.split("?", 1)[0].rstrip("/") != "/v1/payment_intents":
            error = {
                "type": "invalid_request_error",
                "message": f"Unrecognized request URL ({path})",
            }
            return Reply(404, {}, {"error": error})
        form = form_body(body)
        key = headers.get("idempotency-key") or f"none-{uuid.uuid4().hex}"
        request_id = {"request-id": f"req_{uuid.uuid4().hex[:14]}"}
        with self.lock:
            replayed = self.intents.get(key)
        if replayed is not None:
            return Reply(200, {**request_id, "idempotent-replayed": "true"}, replayed)
        metadata = {
            k[len("metadata[") : -1]: v for k, v in form.items() if k.startswith("metadata[")
        }
        task_id = metadata.get("task_id") or headers.get("x-task-id")
        refused_by, _, _ = self.take(task_id, {"requests": 1})
        if refused_by is not None:
            refusal = {
                **request_id,
                "Stripe-Rate-Limited-Reason": "global-rate",
                "Stripe-Should-Retry": "true" if self.should_retry else "false",
            }
            error = {"type": "invalid_request_error", "code": "rate_limit",
                     "message": "Request rate limit exceeded. Learn more about rate limits here "
                                "https://stripe.com/docs/rate-limits."}  # fmt: skip
            return Reply(429, refusal, {"error": error})
        with self.lock:
            conflict = self.lock_timeouts > 0
            self.lock_timeouts -= conflict
        if conflict:
            message = (
                "This object cannot be accessed right now because another API request or "
                "Stripe process is currently accessing it."
            )
            error = {"type": "invalid_request_error", "code": "lock_timeout", "message": message}
            return Reply(409, {**request_id, "Stripe-Should-Retry": "true"}, {"error": error})
        intent = {
            "id": f"pi_{uuid.uuid4().hex[:24]}", "object": "payment_intent",
            "amount": int(form.get("amount") or 0), "currency": form.get("currency", "usd"),
            "status": "requires_payment_method", "livemode": False, "metadata": metadata,
        }  # fmt: skip
        with self.lock:
            self.intents[key] = intent
        return Reply(200, request_id, intent)
