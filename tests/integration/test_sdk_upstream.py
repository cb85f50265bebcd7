"""The real SDKs (``openai``, ``anthropic``, ``stripe``, PyGithub, ``httpx2``) against the
mock providers of workers/providers/: each SDK reads its provider's wire format, its
errors carry the headers ``report_upstream`` reads, and a real ``celery worker`` whose tasks
call them runs every task once, whatever the SDK does with the hook's exception.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import github
import httpx
import httpx2
import openai
import pytest
import redis
import stripe
from celery import Celery

from tests.support.eager import eager_app
from tests.support.servers import RedisServer
from throttle import Limit, Limiter, Throttled, UpstreamFinal
from throttle.celery import metered, report_usage, throttled
from throttle.upstream import report_upstream, upstream_hook
from throttle.upstream.answers import answer_of
from workers.harness import Worker, wait_ready
from workers.providers.anthropic_api import AnthropicMock
from workers.providers.base import Running, go_duration, start
from workers.providers.github_api import GitHubMock
from workers.providers.openai_api import OpenAIMock
from workers.providers.stripe_api import StripeMock

# -- the SDKs against the mocks, without Celery ---------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.02, "20ms"), (0.0004, "0ms"), (1.5, "1.5s"), (360, "6m0s"), (3723.5, "1h2m3.5s")],
)
def test_go_durations_as_openai_sends_them(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_a_mock_provider_runs_as_a_process_and_halves_its_limit_when_told() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.providers", "anthropic", "--port", "0",
         "--tokens-per-min", "6000", "--halve-after", "0.2"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]
        time.sleep(0.5)
        with urllib.request.urlopen(url + "/_mock/stats", timeout=10) as response:
            stats = json.loads(response.read())
        assert stats["limits"] == {"requests": 600, "tokens": 3000}
        assert [change[1:] for change in stats["changes"]] == [["tokens", 3000]]
    finally:
        proc.terminate()
        proc.communicate(timeout=10)  # waits, and closes its stdout


@pytest.fixture
def openai_mock() -> Iterator[Running]:
    running = start(OpenAIMock(requests_per_min=120, tokens_per_min=6000, burst_s=1))
    yield running
    running.stop()


def test_openai_sdk_reads_the_mock_and_its_429_carries_openai_headers(
    openai_mock: Running,
) -> None:
    client = openai.OpenAI(base_url=openai_mock.url + "/v1", api_key="sk-test", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "x" * 40}], max_tokens=20
    )
    reply = raw.parse()
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (10, 15)
    assert raw.headers["x-ratelimit-limit-tokens"] == "6000"
    assert raw.headers["x-ratelimit-reset-requests"].endswith("ms")
    with pytest.raises(openai.RateLimitError) as info:
        for _ in range(3):  # a bucket of 2 requests
            client.chat.completions.create(model="m", messages=[], max_tokens=1)
    error = info.value
    assert int(error.response.headers["retry-after-ms"]) > 0
    assert error.body["type"] == "requests"  # type: ignore[index]
    answer = answer_of(error)
    assert answer is not None and answer.status_code == 429
    assert answer.headers["x-ratelimit-remaining-requests"] == "0"
    # The provider halves its token limit, and says so in the next answer
    openai_mock.provider.halve("tokens")
    openai_mock.provider.reset()
    raw = client.chat.completions.with_raw_response.create(model="m", messages=[], max_tokens=1)
    assert raw.headers["x-ratelimit-limit-tokens"] == "3000"
    stats = openai_mock.provider.stats()
    assert stats["refused"] == 0 and stats["limits"] == {"requests": 120, "tokens": 3000}


def test_openai_streaming_ends_with_the_usage_chunk(openai_mock: Running) -> None:
    client = openai.OpenAI(base_url=openai_mock.url + "/v1", api_key="sk-test", max_retries=0)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "abcd"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = metered(stream)  # outside a task: reads the usage, reports to no one
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == ["token"] * 6
    assert chunks.tokens == 7


def test_anthropic_sdk_reads_the_mock_and_its_429_carries_anthropic_headers() -> None:
    running = start(AnthropicMock({"requests": 60, "tokens": 6000}, burst_s=1))
    try:
        client = anthropic.Anthropic(base_url=running.url, api_key="k", max_retries=0)
        message = client.messages.create(
            model="m", max_tokens=20, messages=[{"role": "user", "content": "x" * 40}]
        )
        assert (message.usage.input_tokens, message.usage.output_tokens) == (10, 15)
        assert report_usage(message) == 25.0  # outside a task: read, reported to no one
        with pytest.raises(anthropic.RateLimitError) as info:
            client.messages.create(model="m", max_tokens=1, messages=[])
        headers = info.value.response.headers
        assert headers["retry-after"] == "1"
        assert headers["anthropic-ratelimit-requests-remaining"] == "0"
        assert headers["anthropic-ratelimit-tokens-reset"].endswith("Z")
        assert answer_of(info.value) is not None
    finally:
        running.stop()


def test_stripe_sdk_rate_limit_error_carries_the_reason_and_idempotency_replays() -> None:
    running = start(StripeMock(requests_per_min=6, burst_s=10, should_retry=False))
    mock = running.provider
    assert isinstance(mock, StripeMock)
    try:
        client = stripe.StripeClient(
            "sk_test_x", base_addresses={"api": running.url}, max_network_retries=0
        )
        params: Any = {"amount": 100, "currency": "usd", "metadata": {"task_id": "t1"}}
        first = client.v1.payment_intents.create(params=params, options={"idempotency_key": "k1"})
        again = client.v1.payment_intents.create(params=params, options={"idempotency_key": "k1"})
        assert first.id == again.id and mock.charges() == {"t1": 1}
        with pytest.raises(stripe.RateLimitError) as info:
            client.v1.payment_intents.create(params={**params, "metadata": {"task_id": "t2"}})
        error = info.value
        assert error.http_status == 429 and error.json_body["error"]["code"] == "rate_limit"  # type: ignore[index]
        assert error.headers is not None
        assert error.headers["Stripe-Rate-Limited-Reason"] == "global-rate"
        assert error.headers["Stripe-Should-Retry"] == "false"
        answer = answer_of(error)
        assert answer is not None and answer.status_code == 429
        signal = report_upstream(error)
        assert signal is not None and signal.refused
        assert signal.final and not signal.comes_back  # Stripe-Should-Retry: false
        with pytest.raises(UpstreamFinal):
            report_upstream(error, retry=True)  # outside a task too: not Throttled
        assert mock.charges() == {"t1": 1} and mock.stats()["refused"] == 1
    finally:
        running.stop()


def test_pygithub_primary_and_secondary_limits() -> None:
    primary = start(GitHubMock(per_window=2, window_s=60, secondary_per_min=6000))
    secondary = start(GitHubMock(secondary_per_min=60, secondary_burst_s=1))
    try:
        client = github.Github(base_url=primary.url, auth=github.Auth.Token("t"), retry=None)
        assert client.get_repo("octo/hello").full_name == "octo/hello"
        client.get_repo("octo/hello")
        with pytest.raises(github.RateLimitExceededException) as info:
            client.get_repo("octo/hello")
        error = info.value
        assert error.status == 403
        assert error.headers is not None
        assert error.headers["x-ratelimit-remaining"] == "0"
        assert error.headers["x-ratelimit-resource"] == "core"
        assert answer_of(error) is not None
        client = github.Github(base_url=secondary.url, auth=github.Auth.Token("t"), retry=None)
        client.get_repo("octo/hello")
        with pytest.raises(github.GithubException) as info:
            client.get_repo("octo/hello")
        assert info.value.status == 403 and "secondary" in str(info.value.data)
        assert info.value.headers is not None and "retry-after" not in info.value.headers
        # read by report_upstream (outside a task: the signal alone): a secondary limit
        # without Retry-After, told by its message, waits a minute
        signal = report_upstream(info.value)
        assert signal is not None and signal.refused and signal.hold_s == 60.0
    finally:
        primary.stop()
        secondary.stop()


# -- httpx2 clients and SDK exceptions in a task, in eager mode (in process) ----------------


@pytest.fixture
def eager(redis_url: str, prefix: str) -> Iterator[Celery]:
    limits = {
        "api": {"algorithm": "gcra", "rate": "30/s", "burst": 1},
        "tokens": {"algorithm": "fixed_window", "rate": "100000/h", "cost": "estimate"},
    }
    with eager_app("sdk-eager", redis_url, prefix, limits) as app:
        yield app


@pytest.mark.parametrize("module", [httpx2, httpx], ids=["httpx2", "httpx"])
def test_one_hook_on_sync_and_async_clients(
    eager: Celery, openai_mock: Running, module: Any
) -> None:
    url = openai_mock.url + "/v1/chat/completions"
    body = {"model": "m", "messages": [], "max_tokens": 1}

    @eager.task(shared=False)
    @throttled("api")
    def sync_call() -> int:
        with module.Client(event_hooks={"response": [upstream_hook(retry=True)]}) as http:
            return int(http.post(url, json=body).status_code)

    @eager.task(shared=False)
    @throttled("api")
    def async_call() -> int:
        async def call() -> int:
            hooks = {"response": [upstream_hook(retry=True)]}
            async with module.AsyncClient(event_hooks=hooks) as http:
                return int((await http.post(url, json=body)).status_code)

        return asyncio.run(call())

    assert sync_call.delay().get() == 200
    assert async_call.delay().get() == 200
    # The mock's bucket of 2 requests is spent: each client's 429 is the task's Throttled
    with pytest.raises(Throttled):
        sync_call.delay().get()
    with pytest.raises(Throttled):
        async_call.delay().get()
    assert openai_mock.provider.stats()["refused"] == 2


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("module", [httpx2, httpx], ids=["httpx2", "httpx"])
def test_a_hook_without_retry_holds_for_githubs_secondary_limit_on_any_client(
    eager: Celery, client: redis.Redis, prefix: str, module: Any, kind: str
) -> None:
    # Given GitHub's secondary limit (a 403 with quota left and no Retry-After, told by
    # its message), met through upstream_hook() without retry on a sync or async client
    mock = start(GitHubMock(secondary_per_min=60, secondary_burst_s=1))
    url = mock.url + "/repos/octo/hello"

    @eager.task(shared=False)
    @throttled("api")
    def fetch() -> list[int]:
        hooks = {"response": [upstream_hook()]}
        if kind == "sync":
            with module.Client(event_hooks=hooks) as http:
                return [int(http.get(url).status_code) for _ in range(2)]

        async def call() -> list[int]:
            async with module.AsyncClient(event_hooks=hooks) as http:
                return [int((await http.get(url)).status_code) for _ in range(2)]

        return asyncio.run(call())

    try:
        assert fetch.delay().get() == [200, 403]
    finally:
        mock.stop()
    # Then the limit is held for GitHub's minute, whichever the client
    holds = Limiter(client, prefix=prefix).holds()
    assert 55 < holds.get(("api", None), 0.0) <= 60, holds


@pytest.mark.parametrize(
    ("after", "outcome"),
    [
        pytest.param("return", "returned", id="swallowed-then-returns: not run again"),
        pytest.param("raise", Throttled, id="swallowed-then-raises: comes back"),
        pytest.param("served-then-raise", ValueError, id="served-later-then-raises: fails"),
    ],
)
def test_what_the_body_does_after_a_refusal_decides(
    eager: Celery, openai_mock: Running, after: str, outcome: Any
) -> None:
    url = openai_mock.url + "/v1/chat/completions"
    body = {"model": "m", "messages": [], "max_tokens": 1}

    @eager.task(shared=False)
    @throttled("api")
    def call() -> str:
        with httpx2.Client(event_hooks={"response": [upstream_hook(retry=True)]}) as http:
            for _ in range(3):  # the mock's bucket holds 2: the third is refused
                with contextlib.suppress(Exception):  # a client that swallows the exception
                    http.post(url, json=body)
            if after == "return":
                return "returned"
            if after == "served-then-raise":
                time.sleep(0.6)  # the mock's bucket refills one call in 0.5 s
                assert http.post(url, json=body).status_code == 200
            raise ValueError("the body's own error")

    if isinstance(outcome, str):
        assert call.delay().get() == outcome
    else:
        # eager mode: Throttled stands for the task coming back (re-published by a worker)
        with pytest.raises(outcome):
            call.delay().get()
    assert openai_mock.provider.stats()["refused"] == 1


def test_sdk_exceptions_are_read_by_report_upstream_in_a_task(
    eager: Celery, openai_mock: Running, client: redis.Redis, prefix: str
) -> None:
    sdk = openai.OpenAI(base_url=openai_mock.url + "/v1", api_key="sk-test", max_retries=0)

    @eager.task(shared=False)
    @throttled("api")
    def call() -> str:
        try:
            sdk.chat.completions.create(model="m", messages=[], max_tokens=1)
        except openai.RateLimitError as exc:
            signal = report_upstream(exc)
            assert signal is not None and signal.refused
            return "refused"
        return "served"

    assert [call.delay().get() for _ in range(3)] == ["served", "served", "refused"]


@pytest.mark.parametrize("how", ["hook", "by-hand"])
def test_openais_insufficient_quota_is_final_not_a_rate_refusal(
    eager: Celery, openai_mock: Running, how: str
) -> None:
    # Given an OpenAI account whose credit is used up: every call is a 429
    # insufficient_quota, which no wait ends
    assert isinstance(openai_mock.provider, OpenAIMock)
    openai_mock.provider.credit_spent = True
    hooks = {"response": [upstream_hook(retry=True)]} if how == "hook" else {}
    sdk = openai.OpenAI(
        base_url=openai_mock.url + "/v1", api_key="sk-test", max_retries=0,
        http_client=openai.DefaultHttpxClient(event_hooks=hooks),
    )  # fmt: skip

    @eager.task(shared=False)
    @throttled("api")
    def call() -> str:
        try:
            sdk.chat.completions.create(model="m", messages=[], max_tokens=1)
        except openai.RateLimitError as exc:
            report_upstream(exc, retry=True)
            raise
        return "served"

    # Then the task fails with UpstreamFinal saying why, instead of coming back
    # (Throttled, in eager mode) for a refusal that a worker would re-run for ever
    try:
        with pytest.raises(UpstreamFinal, match="insufficient_quota"):
            call.delay().get()
    finally:
        sdk.close()
    assert openai_mock.provider.stats()["calls"] == 1


def test_a_streamed_completion_settles_its_usage_when_the_stream_ends(
    eager: Celery, openai_mock: Running, client: redis.Redis, prefix: str
) -> None:
    sdk = openai.OpenAI(base_url=openai_mock.url + "/v1", api_key="sk-test", max_retries=0)

    @eager.task(shared=False)
    @throttled("tokens")
    def complete(estimate: int) -> float | None:
        stream = sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "abcd"}], max_tokens=40,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        with metered(stream) as chunks:
            for _ in chunks:
                pass
        return chunks.tokens

    # Given a call estimated at 1000 tokens, when its stream says it used 31 (1 + 30)
    assert complete.delay(1000).get() == 31
    # Then the tokens limit was charged the usage, not the estimate
    limit = Limit.parse("100000/h", name="tokens", algorithm="fixed_window")
    remaining = Limiter(client, prefix=prefix).peek(limit).remaining
    assert remaining == 100000 - 31


@pytest.mark.parametrize("kind", ["stream", "helper", "reply"])
def test_an_openai_responses_api_call_settles_its_usage(
    eager: Celery, openai_mock: Running, client: redis.Redis, prefix: str, kind: str
) -> None:
    # Given the Responses API, whose stream carries its usage only in its last event
    # (response.completed: event.response.usage), not in a chunk's own usage
    sdk = openai.OpenAI(base_url=openai_mock.url + "/v1", api_key="sk-test", max_retries=0)

    @eager.task(shared=False)
    @throttled("tokens")
    def respond(estimate: int) -> tuple[str, float | None]:
        if kind == "reply":
            reply = sdk.responses.create(model="m", input="abcd", max_output_tokens=40)
            return reply.output_text, report_usage(reply)
        if kind == "helper":  # the SDK's stream helper, iterated through metered
            with sdk.responses.stream(model="m", input="abcd", max_output_tokens=40) as events:
                metered_events = metered(events)
                text = "".join(e.delta for e in metered_events if e.type.endswith("text.delta"))
                return text, metered_events.tokens
        stream = sdk.responses.create(model="m", input="abcd", max_output_tokens=40, stream=True)
        with metered(stream) as events:
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        return text, events.tokens

    # When a call estimated at 1000 tokens says it used 31 (1 in, 30 out)
    text, tokens = respond.delay(1000).get()
    assert text.split() == ["token"] * 30 and tokens == 31
    # Then the tokens limit was charged the usage, not the estimate
    limit = Limit.parse("100000/h", name="tokens", algorithm="fixed_window")
    assert Limiter(client, prefix=prefix).peek(limit).remaining == 100000 - 31


def test_an_anthropic_stream_settles_its_usage_when_it_ends(
    eager: Celery, client: redis.Redis, prefix: str
) -> None:
    running = start(AnthropicMock({"requests": 600}, burst_s=1))
    sdk = anthropic.Anthropic(base_url=running.url, api_key="k", max_retries=0)

    @eager.task(shared=False)
    @throttled("tokens")
    def write(estimate: int) -> tuple[str, float | None]:
        stream = sdk.messages.create(
            model="m", max_tokens=40, stream=True, messages=[{"role": "user", "content": "abcd"}]
        )
        with metered(stream) as events:
            text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        return text, events.tokens

    try:
        # Given a message estimated at 1000 tokens, when its stream says 1 in and 30 out
        text, tokens = write.delay(1000).get()
    finally:
        running.stop()
    assert text.split() == ["token"] * 30 and tokens == 31
    # Then the tokens limit was charged the usage, not the estimate
    limit = Limit.parse("100000/h", name="tokens", algorithm="fixed_window")
    assert Limiter(client, prefix=prefix).peek(limit).remaining == 100000 - 31


# -- a real worker: every task once, whatever the SDK does with the hook's exception ------

SDK_CONFIG = """
settings:
  refresh: 0.5s
  sleep_max: 0.5s
  park_after: 3s
  park_lead: 1s
limits:
  openai-requests: {algorithm: gcra, rate: 8/s, burst: 1}
  openai-tokens: {rate: 600000/m, cost: max_tokens}
  anthropic-requests: {algorithm: gcra, rate: 8/s, burst: 1}
  stripe: {algorithm: gcra, rate: 8/s, burst: 1}
  github: {algorithm: gcra, rate: 8/s, burst: 1}
"""


class Fleet:
    def __init__(self, server: RedisServer, mocks: dict[str, Running], worker: Worker) -> None:
        self.server, self.mocks, self.worker = server, mocks, worker
        self.client = redis.Redis.from_url(server.url)

    def log(self, tail: int = 4000) -> str:
        log = self.worker.log
        return "" if log is None else Path(log).read_text()[-tail:]

    def allowed_by_id(self, name: str) -> collections.Counter[str]:
        arrivals = self.mocks[name].provider.arrivals_json()
        return collections.Counter(a["task_id"] for a in arrivals if a["allowed"])

    def refused_by_id(self, name: str) -> collections.Counter[str]:
        arrivals = self.mocks[name].provider.arrivals_json()
        return collections.Counter(a["task_id"] for a in arrivals if not a["allowed"])

    def executions(self, task_id: str, timeout_s: float = 10.0) -> tuple[int, int, dict[str, int]]:
        """(messages published, body runs, executions by end state) of one task id, once
        every message published has ended (or after ``timeout_s``): Celery stores a
        task's result before its ``task_postrun``, so a result read can come first."""
        deadline = time.monotonic() + timeout_s
        while True:
            published = int(self.client.get(f"test:published:{task_id}") or 0)
            runs = int(self.client.get(f"test:runs:{task_id}") or 0)
            raw = self.client.hgetall(f"test:ends:{task_id}")
            ends = {key.decode(): int(value) for key, value in raw.items()}
            if sum(ends.values()) >= published or time.monotonic() > deadline:
                return published, runs, ends
            time.sleep(0.05)

    def assert_each_once(
        self, ids: list[str], refused: collections.Counter[str] | None = None
    ) -> None:
        """Every task ended once in success and every other execution of it in one
        re-publish (its body's refusal, or the gate's own deferral): as many messages as
        executions, never two copies of a task alive, none failed. With ``refused`` (the
        refusals per task id, for a client that calls once per execution), the body ran
        once more per refusal."""
        for task_id in ids:
            published, runs, ends = self.executions(task_id)
            assert ends.get("SUCCESS") == 1, (task_id, ends, self.log())
            assert set(ends) <= {"SUCCESS", "RETRY"}, (task_id, ends, self.log())
            assert published == sum(ends.values()), (task_id, published, ends)
            if refused is not None:
                assert runs == 1 + refused[task_id], (task_id, runs, refused[task_id])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("sdk")
    config = tmp / "limits.yaml"
    config.write_text(SDK_CONFIG)
    # Each mock allows 2 calls a second (burst 2) while the fleet calls at 8/s: refusals.
    mocks = {
        "openai": start(OpenAIMock(requests_per_min=120, tokens_per_min=600_000, burst_s=1)),
        "anthropic": start(AnthropicMock({"requests": 120}, burst_s=1)),
        "stripe": start(StripeMock(requests_per_min=120, burst_s=1)),
        "github": start(GitHubMock(secondary_per_min=120, secondary_burst_s=1,
                                   secondary_retry_after=1)),
    }  # fmt: skip
    env = {"THROTTLE_CONFIG": str(config)}
    env.update({f"MOCK_{name.upper()}_URL": mock.url for name, mock in mocks.items()})
    with RedisServer() as server, pytest.MonkeyPatch.context() as patch:
        env["SDK_BROKER_URL"] = server.url
        worker = Worker("sdk1", env, app="tests.apps.sdk_app", queues="sdk", log=tmp / "sdk1.log")
        for name, value in env.items():
            patch.setenv(name, value)  # the test process is the producer, of the same app
        from tests.apps.sdk_app import app  # noqa: PLC0415

        app.conf.broker_url = app.conf.result_backend = server.url
        fleet = Fleet(server, mocks, worker)
        try:
            worker.start()
            wait_ready(app, [worker])
            yield fleet
        finally:
            worker.stop()
            for mock in mocks.values():
                mock.stop()
            fleet.client.close()
            # Results caught in reference cycles (the tracebacks of pytest.raises) are
            # finalized now, while their backend still answers: later, their __del__ met a
            # stopped server, as an unraisable error in whichever test the GC ran in.
            gc.collect()


def _run_all(handles: list[Any], timeout_s: float = 60) -> list[dict[str, Any]]:
    return [handle.get(timeout=timeout_s) for handle in handles]


def test_openai_refused_tasks_run_once_and_report_their_usage(fleet: Fleet) -> None:
    from tests.apps.sdk_app import openai_chat, openai_stream  # noqa: PLC0415

    fleet.mocks["openai"].provider.reset()
    handles = [openai_chat.delay(n, 40) for n in range(6)]
    handles += [openai_stream.delay(n, 40) for n in range(6, 10)]
    done = _run_all(handles)
    ids = [h.id for h in handles]
    assert [r["n"] for r in done] == list(range(10)), fleet.log()
    assert all(r["retries"] == 0 for r in done)
    assert fleet.allowed_by_id("openai") == dict.fromkeys(ids, 1)
    refused = fleet.refused_by_id("openai")
    assert sum(refused.values()) >= 1  # the test saw refusals
    fleet.assert_each_once(ids, refused)
    # usage: prompt "task N" (2 tokens) + 30 of max_tokens 40, whole or streamed
    assert {r["tokens"] for r in done} == {32.0}
    assert all(r["words"] == 30 for r in done[6:])


def test_openais_insufficient_quota_fails_each_task_once_instead_of_re_running_it(
    fleet: Fleet,
) -> None:
    # Given the OpenAI account's credit used up (every call: 429 insufficient_quota),
    # met through the hook on the SDK's client
    from tests.apps.sdk_app import openai_chat  # noqa: PLC0415

    mock = fleet.mocks["openai"].provider
    assert isinstance(mock, OpenAIMock)
    mock.reset()
    mock.credit_spent = True
    try:
        handles = [openai_chat.delay(n, 40) for n in range(3)]
        for handle in handles:
            with pytest.raises(UpstreamFinal, match="insufficient_quota"):
                handle.get(timeout=30)
    finally:
        mock.credit_spent = False
    # Then each task reached OpenAI once and failed once: never re-published for it
    # (each came back every second, for ever, with no error to see)
    assert fleet.refused_by_id("openai") == {h.id: 1 for h in handles}
    for handle in handles:
        published, runs, ends = fleet.executions(handle.id)
        assert (runs, ends.get("FAILURE")) == (1, 1), (handle.id, ends, fleet.log())
        assert set(ends) <= {"FAILURE", "RETRY"} and published == sum(ends.values())


@pytest.mark.parametrize("max_retries", [2, 0], ids=["sdk-retries-2", "max-retries-0"])
def test_anthropic_wrapping_and_retrying_the_hooks_exception_runs_every_task_once(
    fleet: Fleet, max_retries: int
) -> None:
    # Given the anthropic SDK, which wraps any exception of its HTTP client (the hook's
    # Throttled) as APIConnectionError and retries the request (max_retries=2, its default)
    from tests.apps.sdk_app import anthropic_message  # noqa: PLC0415

    fleet.mocks["anthropic"].provider.reset()
    handles = [anthropic_message.delay(n, max_retries) for n in range(8)]
    done = _run_all(handles)
    ids = [h.id for h in handles]
    # Then every task succeeded once at the provider, and each execution the provider
    # refused was re-published once, even when the SDK's own retry met a 429 again
    assert sorted(r["n"] for r in done) == list(range(8)), fleet.log()
    assert fleet.allowed_by_id("anthropic") == dict.fromkeys(ids, 1)
    refused = fleet.refused_by_id("anthropic")
    fleet.assert_each_once(ids, None if max_retries else refused)
    assert sum(refused.values()) >= 1
    retried = "called the upstream again inside its body (retry" in fleet.log(tail=10**7)
    if max_retries:
        # and the SDK's retries (calls that took no slot) were warned of in the log
        assert retried, fleet.log()


def test_a_client_that_swallows_the_hooks_exception_and_retries_runs_every_task_once(
    fleet: Fleet,
) -> None:
    # Given an SDK stand-in that catches Exception around each call, waits and tries
    # again, then gives up with an error of its own
    from tests.apps.sdk_app import stand_in  # noqa: PLC0415

    fleet.mocks["openai"].provider.reset()
    handles = [stand_in.delay(n) for n in range(8)]
    done = _run_all(handles)
    ids = [h.id for h in handles]
    assert all(r["status"] == 200 for r in done), fleet.log()
    assert fleet.allowed_by_id("openai") == dict.fromkeys(ids, 1)
    assert max(fleet.refused_by_id("openai").values()) >= 2  # a retry met a 429 again
    fleet.assert_each_once(ids)


def test_stripe_and_github_errors_handed_to_report_upstream_run_every_task_once(
    fleet: Fleet,
) -> None:
    from tests.apps.sdk_app import charge, repo  # noqa: PLC0415

    stripe_mock, github_mock = fleet.mocks["stripe"].provider, fleet.mocks["github"].provider
    assert isinstance(stripe_mock, StripeMock)
    stripe_mock.reset()
    github_mock.reset()
    charges = [charge.delay(n) for n in range(6)]
    repos = [repo.delay(n) for n in range(6)]
    done = _run_all(charges + repos)
    assert [r["name"] for r in done[6:]] == [f"octo/repo-{n}" for n in range(6)], fleet.log()
    # one payment intent per task: nothing charged twice
    assert stripe_mock.charges() == {h.id: 1 for h in charges}
    assert stripe_mock.stats()["refused"] >= 1 and github_mock.stats()["refused"] >= 1
    assert github_mock.stats()["allowed"] == 6
    fleet.assert_each_once([h.id for h in charges + repos])


def test_stripe_should_retry_false_fails_the_task_once_and_true_runs_it_again(
    fleet: Fleet,
) -> None:
    from tests.apps.sdk_app import charge  # noqa: PLC0415

    stripe_mock = fleet.mocks["stripe"].provider
    assert isinstance(stripe_mock, StripeMock)
    stripe_mock.reset()
    # Given Stripe refusing calls over its rate and saying not to retry them
    stripe_mock.should_retry = False
    try:
        handles = [charge.delay(n) for n in range(6)]
        outcomes: dict[str, str] = {}
        for handle in handles:
            try:
                handle.get(timeout=60)
                outcomes[handle.id] = "charged"
            except UpstreamFinal:
                outcomes[handle.id] = "final"
    finally:
        stripe_mock.should_retry = True
    # Then each refused task failed with UpstreamFinal, ran once, and was never
    # re-published; the others charged once
    final = [task_id for task_id, outcome in outcomes.items() if outcome == "final"]
    assert final, fleet.log()  # the mock refused some (2 a second, called at 8)
    charges = stripe_mock.charges()  # (of every test: reset() keeps the intents)
    assert {t: charges.get(t, 0) for t in outcomes} == {
        t: int(o == "charged") for t, o in outcomes.items()
    }
    for task_id in final:
        # (the gate's own deferrals before the body ran are executions that end in RETRY)
        published, runs, ends = fleet.executions(task_id)
        assert (runs, ends.get("FAILURE")) == (1, 1), (task_id, ends, fleet.log())
        assert set(ends) <= {"FAILURE", "RETRY"} and published == sum(ends.values())
    # Given a 409 lock_timeout that Stripe says to retry (no refusal for the rate)
    stripe_mock.reset()
    stripe_mock.lock_timeouts = 2
    handles = [charge.delay(n) for n in range(2)]
    done = _run_all(handles)
    # Then each task ran again after it and charged once
    assert [r["n"] for r in done] == [0, 1], fleet.log()
    charges = stripe_mock.charges()
    assert [charges.get(h.id) for h in handles] == [1, 1]
    fleet.assert_each_once([h.id for h in handles])
    assert sum(fleet.executions(h.id)[1] for h in handles) == 4  # the 409s' runs, again
