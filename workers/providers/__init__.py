"""Mock providers that speak real APIs' wire formats and enforce their rate limits, for the
tests and benchmarks that call them through the official SDKs (``openai``, ``anthropic``,
``stripe``, PyGithub) with ``base_url`` on loopback:

- :mod:`~workers.providers.openai_api`: chat completions (JSON and SSE), requests and
  tokens per minute, OpenAI's ``x-ratelimit-*`` headers;
- :mod:`~workers.providers.anthropic_api`: Messages, Anthropic's ``anthropic-ratelimit-*``;
- :mod:`~workers.providers.stripe_api`: payment intents, ``Stripe-Rate-Limited-Reason``;
- :mod:`~workers.providers.github_api`: a repository, primary and secondary limits.

:mod:`~workers.providers.base` holds what they share (limits per dimension stated per
minute, the arrivals, the server, :func:`~workers.providers.base.start`). Unlike
:mod:`workers.mock_api` (one generic limit in the common dialects), each speaks one
provider's dialect only.
"""
