"""The Celery app of bench/providers.py: one task per SDK, calling a mock provider
(``MOCK_PROVIDER_URL``) through the real ``openai`` or ``anthropic`` SDK as the provider
pages of the docs set them up (``max_retries=0``, ``upstream_hook(retry=True)`` on the
SDK's ``http_client``), with a requests limit and a tokens limit (cost estimate reserved,
the usage reported). Limits from ``THROTTLE_CONFIG``; broker, results and limiter: the
benchmark's private redis-server (``DEMO_BROKER_URL``). Each served task counts one in
``bench:done``; each execution's end state in ``bench:ends`` (a hash).
"""

from __future__ import annotations

import os
from typing import Any

import anthropic
import openai
import redis
from celery import Celery, signals

from throttle.celery import install, report_usage, throttled
from throttle.upstream import upstream_hook
from workers.harness import WORKER_SETTINGS

BROKER = os.environ["DEMO_BROKER_URL"]  # the benchmark's own redis-server
URL = os.environ.get("MOCK_PROVIDER_URL", "http://127.0.0.1:8080")
SDK_RETRIES = int(os.environ.get("SDK_MAX_RETRIES", "0"))

app = Celery("providers", broker=BROKER, backend=BROKER)
app.conf.update(
    WORKER_SETTINGS, throttle_config=os.environ.get("THROTTLE_CONFIG"), task_ignore_result=True
)
install(app)

if os.environ.get("BENCH_WHOLE_ESTIMATE"):
    # The control of bench/providers.py's openai-halve-whole-estimate: every call reserves
    # its whole estimate, as before the learned share (throttle/celery/estimates.py).
    from throttle.celery.estimates import Estimates

    Estimates.share = lambda self, name: 1.0  # type: ignore[method-assign]

_clients: dict[str, Any] = {}
"""Per pool child, made on first use (after the fork)."""


def _redis() -> redis.Redis:
    client: redis.Redis = _clients.get("redis") or _clients.setdefault(
        "redis", redis.Redis.from_url(BROKER)
    )
    return client


@signals.task_postrun.connect
def _ended(state: str | None = None, **_: Any) -> None:
    _redis().hincrby("bench:ends", state or "?", 1)


def _hooks() -> dict[str, Any]:
    return {"response": [upstream_hook(retry=True)]}


def _openai() -> openai.OpenAI:
    if "openai" not in _clients:
        _clients["openai"] = openai.OpenAI(
            base_url=URL + "/v1", api_key="sk-bench", max_retries=SDK_RETRIES,
            http_client=openai.DefaultHttpxClient(event_hooks=_hooks()),
        )  # fmt: skip
    client: openai.OpenAI = _clients["openai"]
    return client


def _anthropic() -> anthropic.Anthropic:
    if "anthropic" not in _clients:
        _clients["anthropic"] = anthropic.Anthropic(
            base_url=URL, api_key="sk-ant-bench", max_retries=SDK_RETRIES,
            http_client=anthropic.DefaultHttpxClient(event_hooks=_hooks()),
        )  # fmt: skip
    client: anthropic.Anthropic = _clients["anthropic"]
    return client


@app.task(bind=True)
@throttled("llm-requests", "llm-tokens")
def openai_call(self: Any, prompt: str, estimate: int, max_tokens: int) -> float | None:
    """One chat completion; its usage settles the tokens limit's estimate."""
    reply = _openai().chat.completions.create(
        model="mock", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        extra_headers={"X-Task-Id": self.request.id},
    )  # fmt: skip
    _redis().incr("bench:done")
    return report_usage(reply, limit="llm-tokens")


@app.task(bind=True)
@throttled("llm-requests", "llm-tokens")
def anthropic_call(self: Any, prompt: str, estimate: int, max_tokens: int) -> float | None:
    """One message; its usage settles the tokens limit's estimate."""
    message = _anthropic().messages.create(
        model="mock", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        extra_headers={"X-Task-Id": self.request.id},
    )  # fmt: skip
    _redis().incr("bench:done")
    return report_usage(message, limit="llm-tokens")
