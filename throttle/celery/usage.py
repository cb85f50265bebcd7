"""What an LLM call really cost, read from the SDK's reply: :func:`report_usage` for a
reply, :func:`metered` for a streamed one.

A tokens limit reserves an estimate before the call (``cost: estimate``: the prompt plus
``max_tokens``, say); the reply says what the call used, and :func:`report_cost` settles
the difference when the task returns. These read the usage as the SDKs give it, by duck
typing (no SDK is imported):

- ``openai``: ``usage.total_tokens`` (a streamed completion has it in its last chunk,
  with ``stream_options={"include_usage": True}``; a Responses API stream in its
  ``response.completed`` event, ``event.response.usage``);
- ``anthropic``: ``usage.input_tokens`` + ``usage.output_tokens`` (+
  ``cache_creation_input_tokens``); a stream has the input in ``message_start`` and the
  output, cumulative, in each ``message_delta``.

Inside a throttled task::

    reply = client.chat.completions.create(model=..., messages=..., max_tokens=300)
    report_usage(reply, limit="openai-tokens")

    stream = client.chat.completions.create(..., stream=True,
                                            stream_options={"include_usage": True})
    for chunk in metered(stream, limit="openai-tokens"):
        ...   # when the stream ends, its usage is reported

A stream left before its end (an exception, a ``break``) reports nothing: the call's
estimate stays charged, which errs on the safe side.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from throttle.celery.task import report_cost

__all__ = ["Metered", "metered", "report_usage", "tokens_of"]

_FIELDS = (
    "total_tokens",
    "prompt_tokens",
    "completion_tokens",
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
)


def _fields(usage: Any) -> dict[str, float]:
    """The token counts of a usage object or dict that are numbers."""
    found: dict[str, float] = {}
    for name in _FIELDS:
        value = usage.get(name) if isinstance(usage, Mapping) else getattr(usage, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            found[name] = float(value)
    return found


def _total(fields: Mapping[str, float]) -> float | None:
    if "total_tokens" in fields:
        return fields["total_tokens"]
    parts = [
        fields.get(name)
        for name in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens",
                     "cache_creation_input_tokens")
    ]  # fmt: skip
    numbers = [part for part in parts if part is not None]
    return sum(numbers) if numbers else None


def tokens_of(usage: Any) -> float | None:
    """The tokens a usage object (or dict) counts: ``total_tokens``, else the sum of the
    prompt/completion or input/output counts; None when it has none."""
    return None if usage is None else _total(_fields(usage))


def _usage_in(item: Any) -> Any:
    """The usage an SDK reply, chunk or stream event carries (``usage``; ``message.usage``
    for Anthropic's ``message_start``; ``response.usage`` for the events of OpenAI's
    Responses API, where only the last, ``response.completed``, has it), or None."""
    usage = item.get("usage") if isinstance(item, Mapping) else getattr(item, "usage", None)
    for holder in ("message", "response"):
        if usage is None:
            usage = getattr(getattr(item, holder, None), "usage", None)
    return usage


def report_usage(reply: Any, limit: str | None = None) -> float | None:
    """Report the tokens ``reply`` (an SDK's completion or message) says it used, as the
    actual cost of one of the running task's calls (:func:`throttle.celery.report_cost`;
    ``limit`` as there: the reports of several calls add up).
    Returns the tokens, or None (and reports nothing) when the reply has no usage."""
    tokens = tokens_of(_usage_in(reply))
    if tokens is not None:
        report_cost(tokens, limit)
    return tokens


class Metered:
    """A stream (iterated, or async-iterated) whose usage is reported when it ends: the
    chunks pass through unchanged; the usage fields seen in them are merged (a later
    value of a field replaces the earlier: Anthropic's output count is cumulative), and
    when the stream is exhausted their total goes to :func:`report_cost`. ``with`` and
    ``async with`` close the stream underneath, as the SDKs' own streams do."""

    def __init__(self, stream: Any, limit: str | None = None) -> None:
        self.stream = stream
        self.limit = limit
        self.fields: dict[str, float] = {}
        self.tokens: float | None = None
        """The tokens reported when the stream ended (None until then, or without usage)."""

    def _see(self, item: Any) -> None:
        usage = _usage_in(item)
        if usage is not None:
            self.fields.update(_fields(usage))

    def _end(self) -> None:
        self.tokens = _total(self.fields)
        if self.tokens is not None:
            report_cost(self.tokens, self.limit)

    def __iter__(self) -> Iterator[Any]:
        for item in self.stream:
            self._see(item)
            yield item
        self._end()

    async def _aiter(self) -> AsyncIterator[Any]:
        async for item in self.stream:
            self._see(item)
            yield item
        self._end()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._aiter()

    def __enter__(self) -> Metered:
        return self

    def __exit__(self, *exc: object) -> None:
        close = getattr(self.stream, "close", None)
        if callable(close):
            close()

    async def __aenter__(self) -> Metered:
        return self

    async def __aexit__(self, *exc: object) -> None:
        close = getattr(self.stream, "close", None)
        if callable(close):
            await close()


def metered(stream: Any, limit: str | None = None) -> Metered:
    """``stream`` (an SDK's streamed reply) with its usage reported when it ends: see
    :class:`Metered`."""
    return Metered(stream, limit)
