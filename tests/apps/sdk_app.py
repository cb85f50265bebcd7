"""The Celery app of tests/integration/test_sdk_upstream.py's worker: tasks that call the
mock providers (workers/providers/) through the real SDKs, with the upstream hook.

Each execution is counted in Redis, per task id: the body's runs (``runs``), the messages
published for it by producer and worker (``published``: a ``before_task_publish``
receiver), and how each execution ended (``ends``: the ``task_postrun`` state). The URLs
come from the environment (``MOCK_OPENAI_URL``...), the limits file from
``THROTTLE_CONFIG``, broker, backend and limiter from ``SDK_BROKER_URL``.
"""

from __future__ import annotations

import os
from typing import Any

import anthropic
import github
import openai
import redis
import requests
import stripe
from celery import Celery, signals

from throttle.celery import install, metered, report_usage, throttled
from throttle.upstream import report_upstream, upstream_hook
from workers.harness import WORKER_SETTINGS

BROKER = os.environ["SDK_BROKER_URL"]  # the test's own redis-server, never the machine's

app = Celery("sdk_tests", broker=BROKER, backend=BROKER)
app.conf.update(
    WORKER_SETTINGS, task_default_queue="sdk", throttle_config=os.environ.get("THROTTLE_CONFIG")
)
install(app)

_clients: dict[str, Any] = {}
"""One client of each kind per process, made on first use (after the fork)."""


def _redis() -> redis.Redis:
    client: redis.Redis = _clients.get("redis") or _clients.setdefault(
        "redis", redis.Redis.from_url(BROKER)
    )
    return client


def _count(kind: str, task_id: str | None, field: str | None = None) -> None:
    if not task_id:
        return
    key = f"test:{kind}:{task_id}"
    if field is None:
        _redis().incr(key)
    else:
        _redis().hincrby(key, field, 1)
    _redis().expire(key, 600)


def _ours(name: object) -> bool:
    """Whether a task name is one of this module's: the receivers below stay connected in
    the test process after the fleet's server is gone, and other tests' tasks pass by."""
    return isinstance(name, str) and name.startswith(f"{__name__}.")


@signals.before_task_publish.connect
def _published(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    if _ours(sender):
        _count("published", (headers or {}).get("id"))


@signals.task_postrun.connect
def _ended(
    sender: Any = None, task_id: str | None = None, state: str | None = None, **_: Any
) -> None:
    if _ours(getattr(sender, "name", None)):
        _count("ends", task_id, state or "?")


def _hooked(**kwargs: Any) -> dict[str, Any]:
    return {"event_hooks": {"response": [upstream_hook(retry=True)]}, **kwargs}


def _openai() -> openai.OpenAI:
    if "openai" not in _clients:
        _clients["openai"] = openai.OpenAI(
            base_url=os.environ["MOCK_OPENAI_URL"] + "/v1", api_key="sk-test", max_retries=0,
            http_client=openai.DefaultHttpxClient(**_hooked()),
        )  # fmt: skip
    client: openai.OpenAI = _clients["openai"]
    return client


def _anthropic(max_retries: int) -> anthropic.Anthropic:
    name = f"anthropic-{max_retries}"
    if name not in _clients:
        _clients[name] = anthropic.Anthropic(
            base_url=os.environ["MOCK_ANTHROPIC_URL"], api_key="sk-ant-test",
            max_retries=max_retries, http_client=anthropic.DefaultHttpxClient(**_hooked()),
        )  # fmt: skip
    client: anthropic.Anthropic = _clients[name]
    return client


def _task_header(task: Any) -> dict[str, str]:
    return {"X-Task-Id": task.request.id}


def _result(task: Any, n: int) -> dict[str, Any]:
    return {"n": n, "id": task.request.id, "retries": task.request.retries}


def _run(task: Any) -> None:
    _count("runs", task.request.id)


@app.task(bind=True, max_retries=0)
@throttled("openai-requests", "openai-tokens")
def openai_chat(self: Any, n: int, max_tokens: int) -> dict[str, Any]:
    """A completion through the ``openai`` SDK (max_retries=0, the hook on its client)."""
    _run(self)
    reply = _openai().chat.completions.create(
        model="mock", messages=[{"role": "user", "content": f"task {n}"}],
        max_tokens=max_tokens, extra_headers=_task_header(self),
    )  # fmt: skip
    return {**_result(self, n), "tokens": report_usage(reply, limit="openai-tokens")}


@app.task(bind=True, max_retries=0)
@throttled("openai-requests", "openai-tokens")
def openai_stream(self: Any, n: int, max_tokens: int) -> dict[str, Any]:
    """A streamed completion: its usage is reported when the stream ends."""
    _run(self)
    stream = _openai().chat.completions.create(
        model="mock", messages=[{"role": "user", "content": f"task {n}"}],
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
        extra_headers=_task_header(self),
    )  # fmt: skip
    with metered(stream, limit="openai-tokens") as chunks:
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return {**_result(self, n), "tokens": chunks.tokens, "words": len(text.split())}


@app.task(bind=True, max_retries=0)
@throttled("anthropic-requests")
def anthropic_message(self: Any, n: int, max_retries: int) -> dict[str, Any]:
    """A message through the ``anthropic`` SDK with ``max_retries`` of its own (its default
    is 2): it wraps the hook's exception as APIConnectionError and retries the request."""
    _run(self)
    message = _anthropic(max_retries).messages.create(
        model="mock", max_tokens=16, messages=[{"role": "user", "content": f"task {n}"}],
        extra_headers=_task_header(self),
    )  # fmt: skip
    return {**_result(self, n), "tokens": message.usage.output_tokens}


class StandInError(Exception):
    """What the stand-in SDK raises once it gives up."""


def _stand_in_call(url: str, task_id: str, attempts: int = 3) -> requests.Response:
    """An SDK stand-in: catches ``Exception`` around the call (the hook's too) and tries
    again at once (so a refused call meets the provider's 429 again); after ``attempts``
    it raises an error of its own."""
    session: requests.Session | None = _clients.get("stand-in")
    if session is None:
        session = _clients["stand-in"] = requests.Session()
        session.hooks["response"].append(upstream_hook(retry=True))
    for _ in range(attempts):
        try:
            return session.post(url, json={"model": "mock", "messages": [], "max_tokens": 8},
                                headers={"X-Task-Id": task_id}, timeout=10)  # fmt: skip
        except Exception:
            continue
    raise StandInError(f"gave up after {attempts} attempts")


@app.task(bind=True, max_retries=0)
@throttled("openai-requests")
def stand_in(self: Any, n: int) -> dict[str, Any]:
    _run(self)
    response = _stand_in_call(os.environ["MOCK_OPENAI_URL"] + "/v1/chat/completions",
                              self.request.id)  # fmt: skip
    return {**_result(self, n), "status": response.status_code}


@app.task(bind=True, max_retries=0)
@throttled("stripe")
def charge(self: Any, n: int) -> dict[str, Any]:
    """A payment intent through ``stripe`` (no retries of its own): its errors are handed
    to report_upstream, which re-runs the task for a refusal or an error Stripe says to
    retry, and fails it with UpstreamFinal for one Stripe says not to."""
    _run(self)
    client = stripe.StripeClient(
        "sk_test_mock", base_addresses={"api": os.environ["MOCK_STRIPE_URL"]},
        max_network_retries=0,
    )  # fmt: skip
    try:
        intent = client.v1.payment_intents.create(
            params={"amount": 100 + n, "currency": "usd", "metadata": {"task_id": self.request.id}}
        )
    except stripe.StripeError as exc:
        report_upstream(exc, retry=True)
        raise
    return {**_result(self, n), "intent": intent.id}


@app.task(bind=True, max_retries=0)
@throttled("github")
def repo(self: Any, n: int) -> dict[str, Any]:
    """A repository through PyGithub (retry=None): its GithubException goes to
    report_upstream."""
    _run(self)
    client = github.Github(
        base_url=os.environ["MOCK_GITHUB_URL"], auth=github.Auth.Token("ghp_mock"), retry=None
    )
    try:
        found = client.get_repo(f"octo/repo-{n}")
    except github.GithubException as exc:
        report_upstream(exc, retry=True)
        raise
    return {**_result(self, n), "name": found.full_name}
