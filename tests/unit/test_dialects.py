"""The providers' rate-limit headers (throttle/upstream/dialects.py, values.py): what each
dialect reads per dimension, how a limit that follows a dimension sees a response, and the
parser fuzzed per dialect (total: never an exception, holds and rates in their bounds)."""

from __future__ import annotations

import email.utils
import math
from datetime import datetime, timezone

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from throttle import Limit
from throttle.adaptive import Learned
from throttle.rates import RateBookBase
from throttle.redis.keys import KeySpace
from throttle.upstream import MAX_HOLD_S, PREEMPT_MIN_S, UpstreamSignal, parse_upstream
from throttle.upstream.dialects import GITHUB_SECONDARY_S, PER_DAY_S, PER_MINUTE_S, Reading
from throttle.upstream.policy import Target, judge, plan
from throttle.upstream.values import go_duration, rfc3339

NOW = 1_763_776_800.0  # epoch s, 2025-11-22 02:00 UTC
DATE = email.utils.formatdate(NOW, usegmt=True)


def iso(offset_s: float) -> str:
    """An RFC 3339 time ``offset_s`` from NOW, as Anthropic writes it."""
    stamp = datetime.fromtimestamp(NOW + offset_s, tz=timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S") + "Z"


def parsed(status: int, headers: dict[str, str], body: str | None = None) -> UpstreamSignal:
    signal = parse_upstream(status, headers, now=NOW, body=body)
    assert signal is not None
    return signal


# -- header values ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("20ms", 0.02),
        ("1.5s", 1.5),
        ("6m0s", 360.0),
        ("1h2m3.5s", 3723.5),
        ("500us", 0.0005),
        ("250µs", 0.00025),
        ("3", 3.0),  # a bare number: seconds
        (" 7.25 ", 7.25),
        ("", None),
        ("-1s", None),
        ("1e3s", None),
        ("1d", None),
        ("s", None),
        ("1.s", None),
    ],
)
def test_go_durations(text: str, seconds: float | None) -> None:
    value = go_duration(text)
    assert value == (None if seconds is None else pytest.approx(seconds))


@pytest.mark.parametrize(
    ("text", "epoch"),
    [
        ("2025-11-22T02:00:30Z", NOW + 30),
        ("2025-11-22T02:00:30.5Z", NOW + 30.5),
        ("2025-11-22T03:00:30+01:00", NOW + 30),
        ("2025-11-22T01:00:30-01:00", NOW + 30),
        ("2025-11-22 02:00:30z", NOW + 30),
        ("2025-11-22T02:00:30", None),  # no offset: not RFC 3339
        ("2025-13-22T02:00:30Z", None),
        ("0000-01-01T00:00:00Z", None),
        ("soon", None),
    ],
)
def test_rfc3339_times(text: str, epoch: float | None) -> None:
    value = rfc3339(text)
    assert value == (None if epoch is None else pytest.approx(epoch))


# -- each dialect ----------------------------------------------------------------------

OPENAI_OK = {
    "x-ratelimit-limit-requests": "600",
    "x-ratelimit-remaining-requests": "599",
    "x-ratelimit-reset-requests": "100ms",
    "x-ratelimit-limit-tokens": "120000",
    "x-ratelimit-remaining-tokens": "118000",
    "x-ratelimit-reset-tokens": "1s",
}


def test_openai_reads_requests_and_tokens_per_minute() -> None:
    signal = parsed(200, OPENAI_OK)
    assert not signal.refused and signal.hold_s == 0
    assert signal.quota is None  # no generic policy: a limit following no dimension sees none
    assert signal.readings == (
        Reading("requests", 600, 599, 0.1, PER_MINUTE_S, source="X-RateLimit-Reset-Requests"),
        Reading("tokens", 120000, 118000, 1.0, PER_MINUTE_S, source="X-RateLimit-Reset-Tokens"),
    )
    tokens = signal.follow("tokens")
    assert (tokens.refused, tokens.hold_s, tokens.dimension) == (False, 0.0, "tokens")
    assert tokens.rate_per_s == pytest.approx(2000.0)  # 120,000 tokens per minute
    assert signal.follow("requests").rate_per_s == pytest.approx(10.0)
    assert signal.follow(None) is signal
    assert signal.follow("core").rate_per_s is None  # not reported: no rate, no hold


def test_openai_429_for_tokens_holds_only_what_follows_tokens() -> None:
    headers = {**OPENAI_OK, "x-ratelimit-remaining-tokens": "0", "retry-after-ms": "1500"}
    headers["retry-after"] = "2"  # the rounded one: retry-after-ms is the precise one
    signal = parsed(429, headers)
    assert (signal.refused, signal.hold_s, signal.source) == (True, 1.5, "Retry-After-Ms")
    tokens, requests = signal.follow("tokens"), signal.follow("requests")
    assert (tokens.refused, tokens.hold_s, tokens.blamed) == (True, 1.5, True)
    assert (requests.refused, requests.hold_s, requests.blamed) == (False, 0.0, False)
    assert requests.rate_per_s == pytest.approx(10.0)  # its stated rate still applies


def test_openai_429_that_blames_no_dimension_is_everyones() -> None:
    signal = parsed(429, {**OPENAI_OK, "retry-after-ms": "800"})
    for dimension in ("tokens", "requests", None):
        seen = signal.follow(dimension)
        assert (seen.refused, seen.hold_s, seen.blamed) == (True, 0.8, False)
    # ...unless the policy blames one: a call of 5,000 tokens with 3,000 left.
    requests = signal.follow("requests", frozenset({"tokens"}))
    assert (requests.refused, requests.hold_s) == (False, 0.0)


def test_openai_spent_tokens_hold_before_the_429_only_when_the_reset_is_far() -> None:
    spent = {**OPENAI_OK, "x-ratelimit-remaining-tokens": "0"}
    far = parsed(200, {**spent, "x-ratelimit-reset-tokens": "6m0s"})
    assert (far.refused, far.hold_s) == (False, 360.0)  # a limit of no dimension holds
    assert far.follow("tokens").hold_s == 360.0
    assert far.follow("requests").hold_s == 0.0
    near = parsed(200, spent)  # reset in 1 s
    assert near.hold_s == 0.0 and near.follow("tokens").hold_s == 0.0
    assert near.readings[1].spent


@pytest.mark.parametrize(
    ("limit", "remaining", "reset", "window"),
    [
        pytest.param(
            "600", "599", "100ms", PER_MINUTE_S, id="per-minute: one of 600 back in 0.1 s"
        ),
        pytest.param(
            "10000", "9999", "8.64s", PER_DAY_S, id="per-day: one of 10,000 back in 8.64 s"
        ),
        pytest.param("200", "199", "7m12s", PER_DAY_S, id="per-day: one of 200 back in 7m12s"),
        pytest.param("10000", "9990", "1m26.4s", PER_DAY_S, id="per-day: ten used"),
        pytest.param("10000", "9997", "8.64s", PER_DAY_S, id="per-day: concurrent calls blur it"),
        pytest.param("10000", "10000", "0s", PER_MINUTE_S, id="nothing used: cannot tell"),
        pytest.param("150000", "149984", "6m0s", PER_MINUTE_S, id="fits neither: a minute"),
        pytest.param("120000", "116000", "1.9s", PER_MINUTE_S, id="a stricter bucket: a minute"),
    ],
)
def test_openai_reset_tells_a_daily_limit_from_a_per_minute_one(
    limit: str, remaining: str, reset: str, window: float
) -> None:
    headers = {
        "x-ratelimit-limit-requests": limit,
        "x-ratelimit-remaining-requests": remaining,
        "x-ratelimit-reset-requests": reset,
    }
    (reading,) = parsed(200, headers).readings
    assert reading.window_s == window
    assert reading.rate_per_s == pytest.approx(float(limit) / window)


def test_a_limit_following_a_daily_dimension_is_not_steered_per_minute() -> None:
    # Given a limit of 600/m following requests, and a model limited to 10,000 a day
    daily = {
        "x-ratelimit-limit-requests": "10000",
        "x-ratelimit-remaining-requests": "9999",
        "x-ratelimit-reset-requests": "8.64s",
    }
    limit = Limit.parse("600/m", name="llm")
    target = Target(limit, limit, None, True, dimension="requests")
    # When an answer states it
    (step,) = plan(parsed(200, daily), [target], RateBookBase(KeySpace()))
    # Then the limit follows 10,000 a day (0.116/s), not 10,000 a minute (166/s, above
    # the limit's own 10/s: it would not have been lowered at all)
    assert step.follow and step.followed is not None
    followed = Limit.parse(step.followed)
    assert followed.rate_per_s == pytest.approx(10000 / 86400)


def test_anthropic_reads_four_dimensions_with_rfc3339_resets() -> None:
    headers = {"date": DATE, "retry-after": "12"}
    for dimension, limit, left, reset in (
        ("requests", "50", "49", 1),
        ("tokens", "90000", "0", 12),
        ("input-tokens", "80000", "0", 12),
        ("output-tokens", "10000", "9000", 3),
    ):
        base = f"anthropic-ratelimit-{dimension}-"
        headers |= {base + "limit": limit, base + "remaining": left, base + "reset": iso(reset)}
    signal = parsed(429, headers)
    assert (signal.refused, signal.hold_s, signal.source) == (True, 12.0, "Retry-After")
    dims = {reading.dimension: reading for reading in signal.readings}
    assert set(dims) == {"requests", "tokens", "input-tokens", "output-tokens"}
    assert dims["output-tokens"].reset_s == pytest.approx(3.0)
    assert dims["input-tokens"].spent and not dims["output-tokens"].spent
    assert signal.follow("input-tokens").hold_s == 12.0
    assert signal.follow("output-tokens").refused is False
    assert signal.follow("output-tokens").rate_per_s == pytest.approx(10000 / 60)


def test_anthropic_reset_in_the_past_is_now() -> None:
    base = "anthropic-ratelimit-tokens-"
    signal = parsed(200, {base + "limit": "100", base + "remaining": "7", base + "reset": iso(-5)})
    assert signal.readings[0].reset_s == 0.0


GITHUB = {
    "x-ratelimit-limit": "5000",
    "x-ratelimit-remaining": "4990",
    "x-ratelimit-used": "10",
    "x-ratelimit-reset": str(int(NOW) + 600),
    "x-ratelimit-resource": "core",
    "x-github-request-id": "A:B:C",
}


def test_github_resource_is_the_dimension_and_states_no_rate() -> None:
    assert parse_upstream(200, GITHUB, now=NOW) is None  # quota left, no window: nothing
    spent = parsed(200, {**GITHUB, "x-ratelimit-remaining": "0", "x-ratelimit-used": "5000"})
    assert spent.readings == (Reading("core", 5000, 0, 600, None, True, 600, "X-RateLimit-Reset"),)
    assert spent.follow("core").hold_s == 600 and spent.follow("search").hold_s == 0
    # remaining from limit - used when GitHub leaves remaining out
    used = parsed(200, {**GITHUB, "x-ratelimit-remaining": "x", "x-ratelimit-used": "5000"})
    assert used.readings[0].remaining == 0 and used.follow("core").hold_s == 600


def test_github_primary_limit_spent_on_403() -> None:
    signal = parsed(403, {**GITHUB, "x-ratelimit-remaining": "0"})
    assert (signal.refused, signal.hold_s, signal.source) == (True, 600, "X-RateLimit-Reset")


def test_github_secondary_limit_waits_a_minute() -> None:
    body = '{"message": "You have exceeded a secondary rate limit. Please wait a few minutes."}'
    secondary = parsed(403, GITHUB, body)
    assert (secondary.refused, secondary.hold_s) == (True, GITHUB_SECONDARY_S)
    assert secondary.source == "GitHub secondary limit"
    # no dimension is to blame: every limit of the call sees it
    assert secondary.follow("core").hold_s == GITHUB_SECONDARY_S
    # a plain 403 (a permission) is no refusal, with or without its body
    plain = '{"message": "Must have admin rights to Repository."}'
    assert parse_upstream(403, GITHUB, now=NOW, body=plain) is None
    assert parse_upstream(403, GITHUB, now=NOW) is None
    # a 429 from GitHub with quota left is the secondary limit, not a wait for the hour's reset
    assert parsed(429, GITHUB).hold_s == GITHUB_SECONDARY_S
    # Retry-After says its own time
    assert parsed(403, {**GITHUB, "retry-after": "30"}, body).hold_s == 30


def test_github_secondary_limit_holds_for_its_retry_after_however_short() -> None:
    # GitHub's secondary limit with a short Retry-After (403 or 429, quota left): not a
    # call a few ms early (which a lone refusal of a short wait is judged to be), but the
    # provider's word to wait: it holds the limit even alone
    limit = Limit.parse("10/s burst 1", name="github", algorithm="gcra")
    target = Target(limit, limit, None, True)
    lone = Learned(10.0, False, False, 1)
    for status in (403, 429):
        signal = parsed(status, {**GITHUB, "retry-after": "1"})
        assert (signal.refused, signal.hold_s, signal.insists) == (True, 1.0, True)
        assert signal.follow("core").insists
        assert judge(signal, target, lone)
    # a bare 429 with a short Retry-After from another API is judged as before
    other = parsed(429, {"retry-after": "1"})
    assert not other.insists and not judge(other, target, lone)
    # and the primary limit spent is no secondary one
    assert not parsed(403, {**GITHUB, "x-ratelimit-remaining": "0", "retry-after": "1"}).insists


def test_stripe_names_the_limit_that_refused() -> None:
    signal = parsed(
        429, {"stripe-rate-limited-reason": "global-rate", "stripe-should-retry": "true"}
    )
    assert (signal.refused, signal.hold_s, signal.should_retry) == (True, 1.0, True)
    assert signal.readings == (
        Reading("global-rate", spent=True, hold_s=1.0, source="Stripe-Rate-Limited-Reason"),
    )
    assert signal.follow("global-rate").refused
    assert not signal.follow("endpoint-concurrency").refused
    assert parsed(429, {"stripe-should-retry": "false"}).should_retry is False
    assert parsed(429, {"stripe-should-retry": "maybe"}).should_retry is None


@pytest.mark.parametrize(
    ("status", "should_retry", "comes_back", "final", "refused"),
    [
        (429, None, True, False, True),  # a refusal comes back
        (429, "true", True, False, True),
        (429, "false", False, True, True),  # ...unless Stripe says not to retry it
        (409, "true", True, False, False),  # a lock timeout Stripe says to retry: no hold
        (500, "true", True, False, False),
        (500, "false", False, True, False),  # an error not to retry
        (400, None, False, False, False),
        (200, "false", False, False, False),  # not an error: nothing to retry
    ],
)
def test_stripe_should_retry_decides_whether_the_call_comes_back(
    status: int, should_retry: str | None, comes_back: bool, final: bool, refused: bool
) -> None:
    headers = {"request-id": "req_1"}
    if should_retry is not None:
        headers["Stripe-Should-Retry"] = should_retry
    signal = parse_upstream(status, headers, now=NOW)
    if not (comes_back or final or refused):
        assert signal is None
        return
    assert signal is not None
    assert (signal.comes_back, signal.final, signal.refused) == (comes_back, final, refused)
    assert signal.hold_s == (1.0 if refused else 0.0)  # only a refusal for the rate holds
    seen = signal.follow("global-rate")
    assert (seen.comes_back, seen.final) == (comes_back, final)  # whatever a limit follows


def test_discord_route_bucket_and_global_limit() -> None:
    bucket = {
        "x-ratelimit-limit": "5",
        "x-ratelimit-remaining": "0",
        "x-ratelimit-reset": str(NOW + 9),
        "x-ratelimit-reset-after": "2.5",
        "x-ratelimit-bucket": "abcd1234",
    }
    spent = parsed(200, bucket)
    assert spent.readings == (
        Reading("route", 5, 0, 2.5, None, True, 2.5, "X-RateLimit-Reset-After"),
    )
    assert spent.hold_s == 2.5 > PREEMPT_MIN_S
    glob = parsed(
        429,
        {**bucket, "x-ratelimit-remaining": "3", "x-ratelimit-global": "true", "retry-after": "4"},
    )
    assert glob.follow("global").hold_s == 4 and glob.follow("global").refused
    assert not glob.follow("route").refused  # the route's bucket has calls left
    shared = parsed(429, {**bucket, "x-ratelimit-scope": "shared", "retry-after": "6"})
    assert {reading.dimension for reading in shared.readings} == {"route", "shared"}
    assert shared.follow("shared").hold_s == 6
    user = parsed(429, {**bucket, "x-ratelimit-remaining": "1", "x-ratelimit-scope": "user"})
    assert user.follow("route").refused  # the route's own limit, its scope says


def test_generic_headers_read_as_before() -> None:
    """A response without a provider's headers has no readings: every limit sees it whole,
    whatever it follows (a proxy's bare 429 holds everything)."""
    signal = parsed(429, {"Retry-After": "30"})
    assert signal.readings == ()
    assert signal.follow("tokens") is signal


# -- fuzzed, per dialect ---------------------------------------------------------------

VALUES = st.one_of(
    st.text(max_size=40),
    st.integers(-(10**20), 10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(["0", "0.0", "1", "20ms", "6m0s", "1h2m3.5s", "true", "false", "core"]),
    st.integers(0, 4 * 10**9).map(lambda offset: iso(offset - 2 * 10**9)),
    st.sampled_from([DATE, "-1", "1e400", "NaN", "inf", '"a";r=0;t=3', "  ", "µs"]),
)
DIALECTS = {
    "openai": [
        f"x-ratelimit-{field}-{dimension}"
        for field in ("limit", "remaining", "reset")
        for dimension in ("requests", "tokens")
    ]
    + ["retry-after-ms", "retry-after"],
    "anthropic": [
        f"anthropic-ratelimit-{dimension}-{field}"
        for dimension in ("requests", "tokens", "input-tokens", "output-tokens")
        for field in ("limit", "remaining", "reset")
    ]
    + ["retry-after", "date"],
    "github": [
        "x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-used", "x-ratelimit-reset",
        "x-ratelimit-resource", "x-github-request-id", "retry-after", "date",
    ],
    "stripe": ["stripe-rate-limited-reason", "stripe-should-retry", "retry-after"],
    "discord": [
        "x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset",
        "x-ratelimit-reset-after", "x-ratelimit-bucket", "x-ratelimit-scope",
        "x-ratelimit-global", "retry-after", "ratelimit", "ratelimit-policy",
    ],
}  # fmt: skip
EVERY_NAME = sorted({name for names in DIALECTS.values() for name in names})
STATUS = st.one_of(st.sampled_from([200, 403, 429, 503, 500]), st.integers(-1, 999))
BODY = st.one_of(
    st.none(),
    st.text(max_size=80),
    st.binary(max_size=80),
    st.just("You have exceeded a secondary rate limit"),
)


def check_total(signal: UpstreamSignal | None) -> None:
    """A signal in its bounds, and so is every view of it a limit can take."""
    if signal is None:
        return
    dimensions = [reading.dimension for reading in signal.readings]
    for seen in [signal, *(signal.follow(name) for name in [*dimensions, "tokens", "x"])]:
        assert 0.0 <= seen.hold_s <= MAX_HOLD_S and not math.isnan(seen.hold_s)
        assert not (seen.final and seen.comes_back)
        assert seen.final == signal.final  # a refusal is per dimension, "do not retry" is not
        rate = seen.rate_per_s
        assert rate is None or (0 < rate < math.inf)
    for reading in signal.readings:
        assert 0.0 <= reading.hold_s <= MAX_HOLD_S
        assert reading.rate_per_s is None or 0 < reading.rate_per_s < math.inf
        assert reading.reset_s is None or reading.reset_s >= 0.0


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_each_dialect_is_total_over_any_values(dialect: str) -> None:
    names = DIALECTS[dialect]

    @settings(max_examples=300, deadline=None)
    @given(
        status=STATUS,
        headers=st.dictionaries(st.sampled_from(names), VALUES, max_size=len(names)),
        body=BODY,
    )
    def run(status: int, headers: dict[str, str], body: str | bytes | None) -> None:
        check_total(parse_upstream(status, headers, now=NOW, body=body))

    run()


@settings(max_examples=300, deadline=None)
@given(
    status=STATUS,
    headers=st.lists(
        st.tuples(st.sampled_from(EVERY_NAME).map(str.title), VALUES), max_size=20
    ),  # mixed dialects, repeated names, any case
    body=BODY,
)
def test_mixed_dialects_are_total(
    status: int, headers: list[tuple[str, str]], body: str | bytes | None
) -> None:
    check_total(parse_upstream(status, headers, now=NOW, body=body))


@given(st.text(max_size=60))
def test_value_readers_are_total(text: str) -> None:
    duration = go_duration(text)
    assert duration is None or duration >= 0
    stamp = rfc3339(text)
    assert stamp is None or math.isfinite(stamp)


LIMITS = [
    Limit.parse("120000/m", name="tokens"),
    Limit.parse("20/s burst 1", name="shaper", algorithm="gcra"),
    Limit.parse("5000/h", name="window", algorithm="fixed_window"),
]


@settings(max_examples=300, deadline=None)
@given(
    status=STATUS,
    headers=st.lists(
        st.tuples(
            st.sampled_from([*EVERY_NAME, "x-ratelimit-limit", "ratelimit-policy"]),
            st.one_of(
                VALUES,
                st.floats(0, 1e16).map(lambda q: f"{q:f};w=60"),
                st.floats(0, 1e-3).map(lambda q: f"{q:.12f}"),  # a quota of almost nothing
                st.floats(0, 1e-3).map(lambda q: f"{q:.12f};w=1"),
            ),
        ),
        max_size=12,
    ),
    dimension=st.sampled_from([None, "tokens", "requests", "core", "route", "global-rate"]),
    cost=st.floats(0, 1e6),
)
def test_what_any_response_asks_of_a_limit_is_a_rate_it_can_store(
    status: int, headers: list[tuple[str, str]], dimension: str | None, cost: float
) -> None:
    """The policy's part of totality: whatever the headers state, the rates it would
    store parse (a store that raised would fail the task that reported the answer)."""
    signal = parse_upstream(status, headers, now=NOW)
    if signal is None:
        return
    book = RateBookBase(KeySpace())
    targets = [
        Target(limit, limit, None, per_call, dimension=dimension, cost=cost)
        for limit in LIMITS
        for per_call in (True, False)
    ]
    for step in plan(signal, targets, book):
        for spec in (step.lowered, step.followed):
            if spec is not None:
                stored = Limit.parse(spec, algorithm=step.target.configured.algorithm)
                assert stored.rate_per_s < step.target.configured.rate_per_s
