"""``python -m workers.providers KIND [--port N] [--requests-per-min R] [--tokens-per-min T]
[--burst-s S] [--halve-after S] [--fill F]``: one mock provider on a port, in a process of
its own (as the benchmarks run it, so that its clock and threads are not the benchmark's).

KIND is ``openai``, ``anthropic``, ``stripe`` or ``github``. ``--halve-after S`` halves the
``tokens`` limit S seconds after the start (``requests`` for Stripe, ``secondary`` for
GitHub); ``POST /_mock/limit`` does the same at any time.
"""

from __future__ import annotations

import argparse
import threading

from workers.providers.anthropic_api import AnthropicMock
from workers.providers.base import Provider, start
from workers.providers.github_api import GitHubMock
from workers.providers.openai_api import OpenAIMock
from workers.providers.stripe_api import StripeMock


def build(args: argparse.Namespace) -> tuple[Provider, str]:
    """The provider asked for, and the dimension ``--halve-after`` halves."""
    if args.kind == "openai":
        mock = OpenAIMock(
            args.requests_per_min, args.tokens_per_min, burst_s=args.burst_s, fill=args.fill
        )
        return mock, "tokens"
    if args.kind == "anthropic":
        limits = {"requests": args.requests_per_min, "tokens": args.tokens_per_min}
        return AnthropicMock(limits, burst_s=args.burst_s), "tokens"
    if args.kind == "stripe":
        return StripeMock(args.requests_per_min, burst_s=args.burst_s), "requests"
    return GitHubMock(secondary_per_min=args.requests_per_min, secondary_burst_s=args.burst_s), (
        "secondary"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A mock provider that enforces its limits.")
    parser.add_argument("kind", choices=["openai", "anthropic", "stripe", "github"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    parser.add_argument("--requests-per-min", type=float, default=600.0)
    parser.add_argument("--tokens-per-min", type=float, default=120_000.0)
    parser.add_argument("--burst-s", type=float, default=60.0, help="seconds' worth a bucket holds")
    parser.add_argument("--halve-after", type=float, default=None, metavar="S")
    parser.add_argument(
        "--fill", type=float, default=0.75,
        help="openai: the reply's share of max_tokens (the usage a task reports)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    provider, dimension = build(args)
    running = start(provider, args.host, args.port)
    print(f"mock {args.kind} on {running.url}", flush=True)
    if args.halve_after is not None:
        provider.halve_later(args.halve_after, dimension)
    try:
        threading.Event().wait()  # start() serves in a thread; SIGTERM ends the process
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
