"""The SDKs' own objects, built here without a server: their exceptions read as an upstream's
answer (throttle/upstream/answers.py), their replies and streams read for their usage
(throttle/celery/usage.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import anthropic
import github
import httpx
import httpx2
import openai
import pytest
import requests
import stripe
from anthropic.types import RawMessageDeltaEvent, RawMessageStartEvent
from openai.types.chat import ChatCompletionChunk
from openai.types.completion_usage import CompletionUsage

from throttle.celery.usage import metered, report_usage, tokens_of
from throttle.upstream import parse_upstream
from throttle.upstream.answers import Answer, answer_of
from throttle.upstream.headers import read_response

HEADERS = {"retry-after": "7", "x-ratelimit-remaining-tokens": "0"}


def _openai_error() -> openai.RateLimitError:
    request = httpx2.Request("POST", "https://api.openai.com/v1/chat/completions")
    response = httpx2.Response(429, headers=HEADERS, request=request)
    return openai.RateLimitError("rate limited", response=response, body=None)


def _openai_status_error() -> openai.APIStatusError:
    """Any status error, not only RateLimitError: a 503 with Retry-After is a refusal."""
    request = httpx2.Request("POST", "https://api.openai.com/v1/chat/completions")
    response = httpx2.Response(503, headers=HEADERS, request=request)
    return openai.APIStatusError("unavailable", response=response, body=None)


def _anthropic_error() -> anthropic.RateLimitError:
    request = httpx2.Request("POST", "https://api.anthropic.com/v1/messages")
    response = httpx2.Response(429, headers=HEADERS, request=request)
    return anthropic.RateLimitError("rate limited", response=response, body=None)


def _requests_error() -> requests.HTTPError:
    response = requests.Response()
    response.status_code = 429
    response.headers.update(HEADERS)
    return requests.HTTPError(response=response)


def _httpx_error() -> httpx.HTTPStatusError:
    request = httpx.Request("GET", "https://example.com/")
    response = httpx.Response(429, headers=HEADERS, request=request)
    return httpx.HTTPStatusError("429", request=request, response=response)


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(_openai_error(), id="openai"),
        pytest.param(_openai_status_error(), id="openai-status"),
        pytest.param(_anthropic_error(), id="anthropic"),
        pytest.param(
            stripe.RateLimitError("too many", http_status=429, headers=HEADERS), id="stripe"
        ),
        pytest.param(github.GithubException(429, {"message": "slow"}, HEADERS), id="pygithub"),
        pytest.param(_requests_error(), id="requests"),
        pytest.param(_httpx_error(), id="httpx"),
    ],
)
def test_an_sdks_exception_reads_as_its_answer(error: Exception) -> None:
    answer = answer_of(error)
    assert answer is not None
    signal = read_response(answer)
    assert signal is not None and signal.refused and signal.hold_s == 7.0
    # read_response takes the exception itself, as apply_upstream and the asyncio twin do
    assert read_response(error) == signal


def test_a_response_is_its_own_answer_and_other_objects_none() -> None:
    response = httpx.Response(200)
    assert answer_of(response) is response
    assert answer_of(ValueError("no status")) is None
    assert answer_of(object()) is None
    assert answer_of(stripe.RateLimitError("no status")) is None  # http_status None


def test_an_exception_whose_properties_fail_is_no_answer_and_raises_nothing() -> None:
    class Broken(Exception):
        status = 429
        headers: ClassVar[dict[str, str]] = {"Retry-After": "1"}

        @property
        def response(self) -> object:
            raise RuntimeError("the response was closed")

        @property
        def http_body(self) -> object:
            raise RuntimeError("the body was closed")

    answer = answer_of(Broken())
    assert answer == Answer(429, {"Retry-After": "1"}, None)


def test_pygithub_keeps_the_body_that_tells_a_secondary_limit() -> None:
    headers = {"x-ratelimit-remaining": "4000", "x-ratelimit-resource": "core"}
    secondary = github.GithubException(
        403, {"message": "You have exceeded a secondary rate limit."}, headers
    )
    forbidden = github.GithubException(403, {"message": "Resource not accessible"}, headers)
    answer = answer_of(secondary)
    assert isinstance(answer, Answer) and answer.text is not None
    signal = read_response(answer)
    assert signal is not None and signal.refused and signal.hold_s == 60.0
    assert read_response(answer_of(forbidden)) is None
    assert parse_upstream(403, headers) is None  # without the body: a plain 403


def test_usage_of_each_sdks_reply() -> None:
    assert tokens_of(CompletionUsage(prompt_tokens=3, completion_tokens=4, total_tokens=7)) == 7
    assert tokens_of(anthropic.types.Usage(input_tokens=10, output_tokens=5)) == 15
    assert tokens_of({"input_tokens": 1, "output_tokens": 2, "cache_creation_input_tokens": 3})
    assert tokens_of({"prompt_tokens": 2}) == 2
    assert tokens_of({"total_tokens": True}) is None  # not a number
    assert tokens_of(None) is None
    assert report_usage({"usage": {"total_tokens": 9}}) == 9  # outside a task: read only
    assert report_usage(object()) is None


def _openai_chunks() -> list[ChatCompletionChunk]:
    base: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "created": 0,
                            "model": "m"}  # fmt: skip
    delta = {"index": 0, "delta": {"content": "hi"}, "finish_reason": None}
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    return [
        ChatCompletionChunk.model_validate({**base, "choices": [delta]}),
        ChatCompletionChunk.model_validate({**base, "choices": [], "usage": usage}),
    ]


def _anthropic_events() -> list[Any]:
    message = {"id": "m", "type": "message", "role": "assistant", "model": "m", "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 20, "output_tokens": 1}}  # fmt: skip
    start = RawMessageStartEvent.model_validate({"type": "message_start", "message": message})
    deltas = [
        RawMessageDeltaEvent.model_validate(
            {
                "type": "message_delta",
                "delta": {"stop_reason": None},
                "usage": {"output_tokens": n},
            }
        )
        for n in (5, 12)
    ]
    return [start, *deltas]


def test_a_stream_reports_its_usage_when_it_ends() -> None:
    chunks = metered(_openai_chunks())
    assert chunks.tokens is None
    assert len(list(chunks)) == 2
    assert chunks.tokens == 7
    # Anthropic: the input in message_start, the output cumulative in each message_delta
    events = metered(_anthropic_events())
    for _ in events:
        pass
    assert events.tokens == 20 + 12


def test_a_stream_left_before_its_end_reports_nothing() -> None:
    chunks = metered(_openai_chunks())
    for _ in chunks:
        break
    assert chunks.tokens is None


def test_an_async_stream_reports_its_usage_when_it_ends() -> None:
    async def stream() -> AsyncIterator[Any]:
        for event in _anthropic_events():
            yield event

    async def consume() -> float | None:
        events = metered(stream())
        async for _ in events:
            pass
        return events.tokens

    assert asyncio.run(consume()) == 32
