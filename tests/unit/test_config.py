"""Limits files: the examples load, every bad document names its place, rules resolve in order."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from throttle import Algorithm, ConfigError
from throttle.adaptive import Adaptive
from throttle.config import CONFIG_ENV, Settings, ThrottleConfig
from throttle.rules import Rule
from throttle.units import parse_duration

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# A valid limit to hang the faulty fields on, so that each document below has one fault.
BASE = """\
limits:
  api:
    rate: 10/s
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "limits.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


# --- the example files ----------------------------------------------------------------------


def test_example_limits_file_loads() -> None:
    config = ThrottleConfig.load(CONFIGS / "limits.yaml")
    assert config.source == str(CONFIGS / "limits.yaml")
    assert set(config.rules) == {
        "github",
        "openai-requests",
        "openai-tokens",
        "stripe",
        "mail-daily",
        "llm-shared",
        "saas-api",
        "llm-streams",
        "partner",
    }
    saas = config.rule("saas-api")
    assert (saas.mode, saas.plan_limits["pro"].rate_per_s, saas.plan_limits["free"].burst) == (
        "shadow", 100.0, 5.0,
    )  # fmt: skip
    shared = config.rule("llm-shared").limit
    assert shared.fair and shared.weight("enterprise") == 4.0 and shared.weight("acme") == 1.0
    assert config.rules["partner"].adaptive == Adaptive(floor_per_s=2.0)
    github = config.rule("github").limit
    assert github.algorithm is Algorithm.GCRA
    assert github.rate_per_s == pytest.approx(5000 / 3600)
    assert github.burst == 10
    requests = config.rule("openai-requests").limit
    assert (requests.algorithm, requests.count, requests.period_s, requests.burst) == (
        Algorithm.TOKEN_BUCKET,
        3500,
        60,
        100,
    )
    # No burst given: the capacity is the count of the rate.
    assert config.rule("openai-tokens").limit.capacity == 90000
    assert config.rule("stripe").limit.burst == 1
    mail = config.rule("mail-daily").limit
    assert (mail.algorithm, mail.period_s) == (Algorithm.FIXED_WINDOW, 86400)
    streams = config.rule("llm-streams").limit
    assert (streams.algorithm, streams.capacity) == (Algorithm.CONCURRENCY, 8)
    # The rule fields, where the file sets them, and their defaults where it does not.
    assert config.rule("github").key == "{token_id}"
    assert config.rule("github").max_wait_s == 7200
    tokens = config.rule("openai-tokens")
    assert (tokens.cost, tokens.on_error, tokens.estimated) == ("max_tokens", "refund", True)
    assert config.rule("stripe").dead_letter_queue == "payments-late"
    assert config.rule("mail-daily").key_fields == ("domain",)
    streams_rule = config.rule("llm-streams")
    assert (streams_rule.key, streams_rule.cost, streams_rule.max_wait_s) == (None, 1.0, None)
    assert (streams_rule.on_timeout, streams_rule.on_error, streams_rule.on_redis_down) == (
        "fail",
        "keep",
        "defer",
    )
    assert config.queues == {"github": ("github",), "payments": ("stripe",)}
    assert config.rules_for("proj.tasks.stream", "github") == (
        config.rule("openai-requests"),
        config.rule("llm-streams"),
        config.rule("github"),
    )
    assert config.settings == Settings(refresh_s=2.0)


def test_demo_file_loads() -> None:
    config = ThrottleConfig.load(CONFIGS / "demo.yaml")
    upstream = config.rule("upstream")
    assert upstream.limit.algorithm is Algorithm.GCRA
    assert upstream.limit.count == pytest.approx(19.6)
    assert upstream.limit.period_s == 1
    assert upstream.limit.burst == 1
    assert upstream.max_wait_s == 3600.0
    assert upstream.key is None
    assert not upstream.estimated
    tokens = config.rule("tokens")
    assert tokens.limit.algorithm is Algorithm.TOKEN_BUCKET
    assert tokens.limit.rate_per_s == pytest.approx(20000 / 60)
    assert tokens.key == "{tenant}"
    assert tokens.key_fields == ("tenant",)
    # The cost is read from the task's argument: an estimate, settled afterwards.
    assert tokens.cost == "max_tokens"
    assert tokens.estimated
    assert tokens.on_error == "refund"
    assert tokens.max_wait_s is None
    assert config.queues == {"upstream": ("upstream",)}
    assert config.tasks == {}
    assert config.rules_for("any.task", "upstream") == (upstream,)


def test_full_document_maps_every_field(tmp_path: Path) -> None:
    """Every field of a limit and of settings reaches the objects, converted to seconds."""
    path = write(
        tmp_path,
        """\
        settings:
          redis_url: redis://example:6379/3
          redis_own_connections: false
          namespace: llm
          refresh: 500ms
          park_after: 1m
          park_lead: 5s
        limits:
          tokens:
            rate: 90000/m burst 1000
            key: "{tenant.id}:{region}"
            cost: tokens
            max_wait: 10m
            on_timeout: dead_letter:slow
            on_error: refund
            on_redis_down: allow
        tasks:
          proj.tasks.chat: tokens
        """,
    )
    config = ThrottleConfig.load(path)
    rule = config.rule("tokens")
    assert rule.limit.burst == 1000
    assert rule.key_fields == ("tenant", "region")
    assert rule.cost == "tokens"
    assert rule.max_wait_s == 600.0
    assert rule.dead_letter_queue == "slow"
    assert (rule.on_error, rule.on_redis_down) == ("refund", "allow")
    # A single name is accepted where a list is expected.
    assert config.tasks == {"proj.tasks.chat": ("tokens",)}
    settings = config.settings
    assert settings.redis_url == "redis://example:6379/3"
    assert settings.redis_own_connections is False
    assert settings.namespace == "llm"
    assert (settings.refresh_s, settings.park_after_s, settings.park_lead_s) == (0.5, 60.0, 5.0)


def test_empty_file_is_an_empty_config(tmp_path: Path) -> None:
    config = ThrottleConfig.load(write(tmp_path, "# nothing yet\n"))
    assert (config.rules, config.queues, config.tasks) == ({}, {}, {})


# --- bad documents --------------------------------------------------------------------------


# (document, limit, field, bad value, a phrase of the problem). limit is None where the fault
# is outside any one limit (sections, settings, queue and task maps).
BAD_DOCUMENTS = [
    pytest.param(
        BASE + "limitz:\n  x: {rate: 1/s}\n",
        None,
        "limitz",
        {"x": {"rate": "1/s"}},
        "unknown section",
        id="unknown-top-level-section",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    max_wiat: 10m\n",
        "api",
        "max_wiat",
        "10m",
        "unknown field",
        id="unknown-field-in-limit",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: ten per second\n",
        "api",
        "rate",
        "ten per second",
        "malformed rate",
        id="malformed-rate",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/fortnight\n",
        "api",
        "rate",
        "10/fortnight",
        "unknown time unit",
        id="unknown-time-unit",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    algorithm: leaky_faucet\n",
        "api",
        "algorithm",
        "leaky_faucet",
        "unknown algorithm",
        id="unknown-algorithm",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    burst: 1e12\n",
        "api",
        "burst",
        "1e12",
        "must be a number (YAML reads 1e12 as text; write 1.0e+12 or 1000000000000)",
        id="burst-in-exponent-form-read-as-text",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 100/m\n    algorithm: fixed_window\n    burst: 5\n",
        "api",
        "burst",
        5,
        "burst applies to token_bucket and gcra only",
        id="burst-on-fixed-window",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 100/m burst 5\n    algorithm: sliding_window\n",
        "api",
        "rate",
        "100/m burst 5",
        "burst applies to token_bucket and gcra only",
        id="burst-in-rate-on-sliding-window",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    max_wait: ten minutes\n",
        "api",
        "max_wait",
        "ten minutes",
        "must be a duration",
        id="max-wait-words",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    max_wait: -1\n",
        "api",
        "max_wait",
        -1,
        "must be a duration >= 0",
        id="max-wait-negative",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    on_timeout: 'dead_letter:'\n",
        "api",
        "on_timeout",
        "dead_letter:",
        "dead_letter:QUEUE",
        id="on-timeout-dead-letter-without-queue",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    on_timeout: explode\n",
        "api",
        "on_timeout",
        "explode",
        "must be 'fail' or 'dead_letter:QUEUE'",
        id="on-timeout-unknown",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    on_error: retry\n",
        "api",
        "on_error",
        "retry",
        "must be 'keep' or 'refund'",
        id="on-error-unknown",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    on_redis_down: panic\n",
        "api",
        "on_redis_down",
        "panic",
        "must be 'defer' (fail closed), 'allow' (fail open for settings.fail_open_for)",
        id="on-redis-down-unknown",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    cost: -1\n",
        "api",
        "cost",
        -1,
        "capacity 10",
        id="cost-negative",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    cost: 11\n",
        "api",
        "cost",
        11,
        "capacity 10",
        id="cost-above-capacity",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    cost: max tokens\n",
        "api",
        "cost",
        "max tokens",
        "name of an argument",
        id="cost-not-an-identifier",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    key: 'tenant-{0}'\n",
        "api",
        "key",
        "tenant-{0}",
        "must name arguments",
        id="key-positional-field",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    key: 'tenant-{}'\n",
        "api",
        "key",
        "tenant-{}",
        "must name arguments",
        id="key-auto-numbered-field",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    key: '{tenant}-{region}'\n",
        "api",
        "key",
        "{tenant}-{region}",
        "separated by a character such as ':'",
        id="key-fields-without-separator",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    key: '{tenant:.8}'\n",
        "api",
        "key",
        "{tenant:.8}",
        "no conversion or format spec",
        id="key-format-spec",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 1/500000d\n",
        "api",
        "rate",
        "1/500000d",
        "the period in s must be at most 1e+10",
        id="period-beyond-the-ttl-cap",
    ),
    pytest.param(
        BASE + "settings:\n  namespace: 'a{b}'\n",
        None,
        "settings.namespace",
        "a{b}",
        "without braces",
        id="settings-namespace-with-braces",
    ),
    pytest.param(
        "limits:\n  api:\n    rate: 10/s\n    key: '{tenant'\n",
        "api",
        "key",
        "{tenant",
        "malformed key template",
        id="key-malformed",
    ),
    pytest.param(
        BASE + "queues:\n  llm: [api, nope]\n",
        None,
        "queues.llm",
        "nope",
        "unknown limit; the file defines api",
        id="queue-maps-unknown-limit",
    ),
    pytest.param(
        BASE + "tasks:\n  proj.tasks.send: [nope]\n",
        None,
        "tasks.proj.tasks.send",
        "nope",
        "unknown limit",
        id="task-maps-unknown-limit",
    ),
    pytest.param(
        BASE + "queues:\n  llm: [api, api]\n",
        None,
        "queues.llm",
        "api",
        "a limit listed twice",
        id="limit-listed-twice",
    ),
    pytest.param(
        "limits:\n  slots: {rate: 2.5 concurrent}\n",
        "slots",
        "rate",
        "2.5 concurrent",
        "the count of a concurrency limit must be a whole number",
        id="concurrency-count-a-fraction",
    ),
    pytest.param(
        BASE + "settings:\n  redis: redis://localhost\n",
        None,
        "settings.redis",
        "redis://localhost",
        "unknown setting",
        id="settings-unknown-key",
    ),
    pytest.param(
        BASE + "settings:\n  park_after: 5s\n  park_lead: 5s\n",
        None,
        "settings.park_lead",
        "5s",
        "park_lead (5 s) must be shorter than park_after (5 s)",
        id="park-lead-equals-park-after",
    ),
    pytest.param(
        BASE + "settings:\n  park_after: 5s\n  park_lead: 1m\n",
        None,
        "settings.park_lead",
        "1m",
        "park_lead (60 s) must be shorter than park_after (5 s)",
        id="park-lead-above-park-after",
    ),
    pytest.param(
        BASE + "settings:\n  redis_own_connections: 'no'\n",
        None,
        "settings.redis_own_connections",
        "no",
        "must be true or false",
        id="settings-own-connections-not-a-bool",
    ),
    pytest.param(
        BASE + "settings:\n  sleep_max: 0\n",
        None,
        "settings.sleep_max",
        0,
        "sleep_max must be at least 0.05 s",
        id="sleep-max-zero",
    ),
    pytest.param(
        BASE + "settings:\n  sleep_max: 40ms\n",
        None,
        "settings.sleep_max",
        "40ms",
        "sleep_max must be at least 0.05 s",
        id="sleep-max-below-the-floor",
    ),
    pytest.param(
        BASE + "settings:\n  reserve_ahead: 10ms\n",
        None,
        "settings.reserve_ahead",
        "10ms",
        "reserve_ahead must be at least 0.05 s",
        id="reserve-ahead-below-the-floor",
    ),
    pytest.param(
        BASE + "settings:\n  refusals_for: 0s\n",
        None,
        "settings.refusals_for",
        "0s",
        "refusals_for must be longer than 0 s",
        id="refusals-for-zero",
    ),
    pytest.param(
        BASE + "settings:\n  refresh: 0\n",
        None,
        "settings.refresh",
        0,
        "refresh must be at least 0.1 s",
        id="refresh-zero",
    ),
    pytest.param(
        BASE + "settings:\n  refresh: 50ms\n",
        None,
        "settings.refresh",
        "50ms",
        "refresh must be at least 0.1 s",
        id="refresh-below-the-floor",
    ),
    pytest.param(
        BASE + "settings:\n  jitter: 3651d\n",
        None,
        "settings.jitter",
        "3651d",
        "must be a duration of at most 3650d (ten years",
        id="settings-duration-beyond-ten-years",
    ),
    pytest.param(
        "limits:\n  api: {rate: 10/s, max_wait: 1.0e+300}\n",
        "api",
        "max_wait",
        1e300,
        "must be a duration of at most 3650d (ten years",
        id="max-wait-beyond-ten-years",
    ),
    pytest.param(
        "limits:\n  api: {rate: 10/s, on_redis_down: allow:5000d}\n",
        "api",
        "on_redis_down",
        "allow:5000d",
        "must be a duration of at most 3650d (ten years",
        id="fail-open-beyond-ten-years",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, adaptive: true, recover: 3651d}\n",
        "api",
        "recover",
        "3651d",
        "must be a duration of at most 3650d (ten years",
        id="adaptive-recover-beyond-ten-years",
    ),
    pytest.param(
        BASE + "settings:\n  refresh: soon\n",
        None,
        "settings.refresh",
        "soon",
        "must be a duration",
        id="settings-bad-duration",
    ),
    pytest.param(
        "limits:\n  api: {rate: 10/s, burst: 1, spacing_guard: sometimes}\n",
        "api",
        "spacing_guard",
        "sometimes",
        "must be true or false",
        id="spacing-guard-not-a-bool",
    ),
    pytest.param(
        "limits:\n  slots: {rate: 3 concurrent, spacing_guard: true}\n",
        "slots",
        "spacing_guard",
        True,
        "no spacing to guard",
        id="spacing-guard-on-concurrency",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, adaptive: true, floor: 30/s}\n",
        "api", "floor", "30/s", "the floor (30/s) is above the limit's rate, its ceiling (20/s)",
        id="adaptive-floor-above-ceiling",
    ),
    pytest.param(
        "limits:\n  api: {rate: 8 concurrent, adaptive: true}\n",
        "api", "adaptive", True, "a concurrency limit has no rate to learn",
        id="adaptive-on-concurrency",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, adaptive: yes please}\n",
        "api", "adaptive", "yes please", "must be true or false",
        id="adaptive-not-a-bool",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, adaptive: true, decrease: 1.5}\n",
        "api", "decrease", 1.5, "must be a number between 0 and 1",
        id="adaptive-decrease-above-one",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, adaptive: true, decrease: half}\n",
        "api", "decrease", "half", "must be a number between 0 and 1",
        id="adaptive-decrease-not-a-number",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, adaptive: true, recover: 0s}\n",
        "api", "recover", "0s", "must be a duration > 0",
        id="adaptive-recover-zero",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, adaptive: true, recover: soon}\n",
        "api", "recover", "soon", "must be a duration",
        id="adaptive-recover-not-a-duration",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, adaptive: true, floor: 2}\n",
        "api", "floor", 2, "must be a rate such as '2/s'",
        id="adaptive-floor-a-number",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, adaptive: true, floor: fast}\n",
        "api", "floor", "fast", "malformed rate",
        id="adaptive-floor-malformed",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, upstream: 5}\n",
        "api", "upstream", 5, "must be the name of a dimension of the upstream's limit",
        id="upstream-not-a-name",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, upstream: input tokens}\n",
        "api", "upstream", "input tokens", "must be the name of a dimension",
        id="upstream-with-a-space",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, upstream: ''}\n",
        "api", "upstream", "", "must be the name of a dimension",
        id="upstream-empty",
    ),
    pytest.param(
        "limits:\n  api: {rate: 20/s, floor: 2/s}\n",
        "api", "floor", "2/s", "applies only with adaptive: true",
        id="floor-without-adaptive",
    ),
]  # fmt: skip


def test_an_adaptive_limit_maps_its_fields(tmp_path: Path) -> None:
    config = ThrottleConfig.load(
        write(
            tmp_path,
            "limits:\n  api: {rate: 20/s, burst: 1, algorithm: gcra, adaptive: true,\n"
            "        floor: 2/s, decrease: 0.8, recover: 5s}\n"
            "  plain: {rate: 20/s, adaptive: false}\n",
        )
    )
    assert config.rules["api"].adaptive == Adaptive(floor_per_s=2.0, decrease=0.8, recover_s=5.0)
    assert config.rules["plain"].adaptive is None
    default = ThrottleConfig.from_mapping({"limits": {"api": {"rate": "20/s", "adaptive": True}}})
    learning = default.rules["api"].adaptive
    assert learning == Adaptive()
    assert learning.floor_for(default.rules["api"].limit) == 2.0


def test_a_limit_names_the_upstream_dimension_it_follows() -> None:
    config = ThrottleConfig.load(CONFIGS / "limits.yaml")
    assert config.rules["openai-tokens"].upstream == "tokens"
    assert config.rules["openai-requests"].upstream == "requests"
    assert config.rules["github"].upstream == "core"
    assert config.rules["stripe"].upstream is None  # the response speaks for the whole
    spelt = ThrottleConfig.from_mapping({"limits": {"llm": {"rate": "1/s", "upstream": " Tokens"}}})
    assert spelt.rules["llm"].upstream == "tokens"  # as the headers spell it
    assert Rule(spelt.rules["llm"].limit, upstream="input-tokens").upstream == "input-tokens"


def test_an_upstream_dimension_close_to_a_provider_s_is_a_warning_not_an_error() -> None:
    config = ThrottleConfig.from_mapping(
        {
            "limits": {
                "typo": {"rate": "1/s", "upstream": "tokenz"},
                "snake": {"rate": "1/s", "upstream": "input_tokens"},
                "openai": {"rate": "1/s", "upstream": "tokens"},
                "github": {"rate": "1/s", "upstream": "search"},  # open-ended: a resource
                "stripe": {"rate": "1/s", "upstream": "global-rate"},  # ...or a reason
            }
        },
        source="limits.yaml",
    )
    warnings = config.warnings()
    assert [(w.limit, w.field, w.value) for w in warnings] == [
        ("typo", "upstream", "tokenz"),
        ("snake", "upstream", "input_tokens"),
    ]
    assert str(warnings[0]).startswith(
        "limits.yaml: limit 'typo': field 'upstream': a dimension OpenAI, Anthropic and "
        "Discord do not name (did you mean 'tokens'?): "
    )
    assert str(warnings[0]).endswith("(got 'tokenz')")


def test_the_spacing_guard_is_on_for_burst_1_rate_limits_by_default() -> None:
    config = ThrottleConfig.from_mapping(
        {
            "limits": {
                "strict": {"algorithm": "gcra", "rate": "20/s", "burst": 1},
                "bucket": {"rate": "20/s", "burst": 1},
                "bursty": {"algorithm": "gcra", "rate": "20/s", "burst": 2},
                "off": {"algorithm": "gcra", "rate": "20/s", "burst": 1, "spacing_guard": False},
                "on": {"rate": "20/s", "spacing_guard": True},
                "daily": {"algorithm": "fixed_window", "rate": "1/d"},
                "slots": {"rate": "1 concurrent"},
            }
        }
    )
    guarded = {name for name, rule in config.rules.items() if rule.guarded}
    assert guarded == {"strict", "bucket", "on"}


@pytest.mark.parametrize(("document", "limit", "field", "value", "problem"), BAD_DOCUMENTS)
def test_bad_document_names_file_limit_field_and_value(
    tmp_path: Path, document: str, limit: str | None, field: str, value: object, problem: str
) -> None:
    path = write(tmp_path, document)
    with pytest.raises(ConfigError) as caught:
        ThrottleConfig.load(path)
    error = caught.value
    message = str(error)
    # The message is what an operator reads: it must carry every part of the place.
    assert message.startswith(f"{path}: ")
    if limit is not None:
        assert f"limit {limit!r}" in message
    assert f"field {field!r}" in message
    assert f"(got {value!r})" in message
    assert problem in message
    # ...and the parts stay available to code.
    assert (error.source, error.limit, error.field, error.value) == (str(path), limit, field, value)


def test_invalid_yaml_names_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "limits:\n  api:\n    rate: [10/s\n  other: 1\n")
    with pytest.raises(ConfigError) as caught:
        ThrottleConfig.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: not valid YAML at line ")
    # The unclosed "[" runs on until the ':' of "other:" (line 4, column 8), where PyYAML
    # gives up; the message must point there, 1-based like an editor.
    assert "at line 4, column 8: expected ',' or ']'" in message
    # and where the construct it was reading began: the "[" (line 3, column 11)
    assert "while parsing a flow sequence at line 3, column 11" in message


def test_a_quote_left_open_is_found_where_it_opened(tmp_path: Path) -> None:
    path = write(tmp_path, 'limits:\n  api:\n    rate: 10/s\n    key: "{tenant_id}\n')
    with pytest.raises(ConfigError) as caught:
        ThrottleConfig.load(path)
    # PyYAML stops at the end of the file; the quote opened on line 4
    assert "(while scanning a quoted scalar at line 4, column 10)" in str(caught.value)


def test_tab_indented_yaml_names_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path, "limits:\n\tapi:\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line 2, column 1") as caught:
        ThrottleConfig.load(path)
    assert caught.value.source == str(path)


def test_top_level_list_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "- api\n- other\n")
    with pytest.raises(ConfigError, match="must be a mapping") as caught:
        ThrottleConfig.load(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "limits.yaml"
    with pytest.raises(ConfigError) as caught:
        ThrottleConfig.load(path)
    assert str(caught.value) == (
        f"{path}: cannot read the limits file '{path}': No such file or directory"
    )


def test_a_relative_path_is_shown_as_the_absolute_one_tried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        ThrottleConfig.load("limits.yaml")
    assert str(caught.value) == (
        f"limits.yaml: cannot read the limits file '{tmp_path / 'limits.yaml'}': "
        "No such file or directory"
    )


def test_a_misspelt_name_gets_a_did_you_mean(tmp_path: Path) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(
        "settings: {refrsh: 2}\n"
        "limits:\n  api: {rate: 10/minuts, on_eror: refund}\n  b: {rate: 1/s, algorithm: gcr}\n"
        "queus: {}\n"
    )
    messages = "\n".join(str(e) for e in ThrottleConfig.check(path))
    assert "field 'settings.refrsh': unknown setting (did you mean 'refresh'?)" in messages
    assert "field 'on_eror': unknown field (did you mean 'on_error'?)" in messages
    assert "unknown time unit 'minuts' (did you mean 'minutes'?); use ms, s (sec" in messages
    assert "m (min, minute), h (hr, hour)" in messages
    assert "unknown algorithm (did you mean 'gcra'?)" in messages
    assert "field 'queus': unknown section (did you mean 'queues'?)" in messages
    # no suggestion for a name that resembles nothing
    path.write_text("zzz: 1\n")
    assert "did you mean" not in str(ThrottleConfig.check(path)[0])


def test_unreadable_path_names_the_path(tmp_path: Path) -> None:
    # A directory cannot be read as a file, even by root (a chmod 000 file can be).
    with pytest.raises(ConfigError) as caught:
        ThrottleConfig.load(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path}: cannot read the limits file '{tmp_path}': ")
    assert caught.value.source == str(tmp_path)


# --- resolving rules ------------------------------------------------------------------------


def test_rules_for_gives_the_tasks_limits_then_the_queues_each_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        limits:
          a: {rate: 1/s}
          b: {rate: 2/s}
          c: {rate: 3/s}
          d: {rate: 4/s}
        queues:
          llm: [c, a, d]
        tasks:
          proj.chat: [b, a]
        """,
    )
    config = ThrottleConfig.load(path)

    def names(task: str, queue: str | None) -> list[str]:
        return [rule.name for rule in config.rules_for(task, queue)]

    # The task's own order first; "a" is in both lists and comes once, in the task's place.
    assert names("proj.chat", "llm") == ["b", "a", "c", "d"]
    assert names("proj.chat", None) == ["b", "a"]
    assert names("proj.chat", "other") == ["b", "a"]
    assert names("proj.other", "llm") == ["c", "a", "d"]
    assert names("proj.other", None) == []
    assert all(isinstance(rule, Rule) for rule in config.rules_for("proj.chat", "llm"))


def test_rule_lookup_of_unknown_name_lists_the_defined_ones(tmp_path: Path) -> None:
    path = write(tmp_path, "limits:\n  b: {rate: 1/s}\n  a: {rate: 1/s}\n")
    config = ThrottleConfig.load(path)
    with pytest.raises(ConfigError) as caught:
        config.rule("c")
    assert str(caught.value) == f"{path}: unknown limit; {path} defines a, b (got 'c')"


# --- where the config comes from ------------------------------------------------------------


def test_from_source_none_reads_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, BASE)
    monkeypatch.setenv(CONFIG_ENV, str(path))
    config = ThrottleConfig.from_source(None)
    assert config.source == str(path)
    assert config.rule("api").limit.rate_per_s == 10


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
def test_from_source_none_without_environment_is_empty(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(CONFIG_ENV, raising=False)
    else:
        monkeypatch.setenv(CONFIG_ENV, value)
    config = ThrottleConfig.from_source(None)
    assert config == ThrottleConfig()
    assert config.rules_for("any.task", "any-queue") == ()


def test_from_source_mapping_and_path(tmp_path: Path) -> None:
    config = ThrottleConfig.from_source({"limits": {"api": {"rate": "5/s", "cost": 2}}})
    assert config.source == "<mapping>"
    assert config.rule("api").cost == 2.0
    with pytest.raises(ConfigError, match=r"^<mapping>: limit 'api': field 'cost'"):
        ThrottleConfig.from_source({"limits": {"api": {"rate": "5/s", "cost": 6}}})
    path = write(tmp_path, BASE)
    assert ThrottleConfig.from_source(path).rule("api").limit.count == 10
    assert ThrottleConfig.from_source(str(path)).source == str(path)
    # anything else is named, never opened (an int would be a file descriptor)
    for wrong in (42, ["limits.yaml"], b"limits.yaml"):
        with pytest.raises(ConfigError, match="field 'throttle_config': must be the path"):
            ThrottleConfig.from_source(wrong)  # type: ignore[arg-type]


# --- durations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        pytest.param("250ms", 0.25, id="ms"),
        pytest.param("30s", 30.0, id="s"),
        pytest.param("10m", 600.0, id="m"),
        pytest.param("2h", 7200.0, id="h"),
        pytest.param("1d", 86400.0, id="d"),
        pytest.param("1.5s", 1.5, id="fraction"),
        pytest.param(" 2 H ", 7200.0, id="spaces-and-case"),
        pytest.param(0, 0.0, id="zero"),
        pytest.param(45, 45.0, id="int"),
        pytest.param(0.75, 0.75, id="float"),
        pytest.param("3650d", 315360000.0, id="ten-years"),
    ],
)
def test_parse_duration_accepts(value: object, seconds: float) -> None:
    result = parse_duration(value, field="max_wait")
    assert result == pytest.approx(seconds)
    assert isinstance(result, float)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("ten minutes", id="words"),
        pytest.param("10", id="string-without-unit"),
        pytest.param("10w", id="weeks"),
        pytest.param("-5s", id="negative-string"),
        pytest.param(-1, id="negative"),
        pytest.param(float("inf"), id="inf"),
        pytest.param(float("nan"), id="nan"),
        pytest.param("3651d", id="beyond-ten-years"),
        pytest.param(1e300, id="absurd"),
        pytest.param(True, id="bool"),
        pytest.param(None, id="none"),
    ],
)
def test_parse_duration_refuses(value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_duration(value, field="max_wait", limit="api", source="f.yaml")
    assert str(caught.value).startswith("f.yaml: limit 'api': field 'max_wait': must be a duration")


@pytest.mark.parametrize(
    ("document", "where"),
    [
        ("limits:\n  a: {rate: 10/s}\n  b: {rate: 5/s}\n  a: {rate: 20/s}\n", "line 4"),
        ("limits:\n  a: {rate: 10/s, rate: 20/s}\n", "line 2, column 19"),
    ],
)
def test_a_key_given_twice_is_an_error_not_the_last_one_silently(
    tmp_path: Path, document: str, where: str
) -> None:
    with pytest.raises(ConfigError, match="appears twice in one mapping") as caught:
        ThrottleConfig.load(write(tmp_path, document))
    assert where in str(caught.value) and caught.value.source == str(tmp_path / "limits.yaml")


def test_a_merge_key_may_be_overridden_and_a_burst_given_twice_may_not(tmp_path: Path) -> None:
    merged = "limits:\n  base: &b {rate: 10/s, algorithm: gcra}\n  a: {<<: *b, rate: 20/s}\n"
    assert ThrottleConfig.load(write(tmp_path, merged)).rules["a"].limit.rate_per_s == 20.0
    twice = 'limits:\n  a: {rate: "10/s burst 5", burst: 3}\n'
    with pytest.raises(ConfigError, match="given twice") as caught:
        ThrottleConfig.load(write(tmp_path, twice))
    assert (caught.value.limit, caught.value.field) == ("a", "burst")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("htp://x", "a Redis URL starts with redis://"),
        ("redis://127.0.0.1:notaport/0", "the port must be a number"),
        ("redis://127.0.0.1:6379/zz", "the database (the URL's path) must be a number"),
        ("redis://:pa/ss@127.0.0.1:6379/0", "a URL parser cannot read this URL's host"),
        ("redis://h:1/0?socket_timeout=x", "redis-py cannot read this URL: Invalid value"),
        ("redis://h:1/0?decode_responses=true", "the limiter reads its scripts' replies as bytes"),
    ],
)
def test_a_redis_url_of_the_wrong_form_is_an_error_of_the_file(url: str, problem: str) -> None:
    # what celery throttle check can tell on any host (not the workers' TLS files)
    with pytest.raises(ConfigError) as caught:
        ThrottleConfig.from_mapping({"settings": {"redis_url": url}}, source="limits.yaml")
    assert str(caught.value).startswith(f"limits.yaml: field 'settings.redis_url': {problem}"), (
        caught.value
    )
    for fine in ("redis+sentinel://a:26379,b:26379/main/0", "unix:///tmp/redis.sock",
                 "rediss://h:6380/0?ssl_ca_certs=/only/on/the/workers.pem"):  # fmt: skip
        ThrottleConfig.from_mapping({"settings": {"redis_url": fine}})


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"a": {"rate": "1/0.0000001ms"}}, "field 'rate': the period must be at least 1e-06 s"),
        ({5: {"rate": "1/s"}}, "field 'limits': a limit's name is text: quote it (YAML read"),
    ],
)
def test_a_limit_s_error_reads_as_one_sentence(limits: dict[object, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ThrottleConfig.from_mapping({"limits": limits}, source="limits.yaml")
    assert message in str(caught.value), caught.value


def test_check_reports_every_bad_setting_each_on_its_own(tmp_path: Path) -> None:
    # An unknown setting does not hide a valid one below its floor, nor one floor another.
    path = tmp_path / "limits.yaml"
    path.write_text(
        "settings: {colour: blue, refresh: 10ms, sleep_max: 1ms, reserve_ahead: 1ms}\n"
        "limits: {api: {rate: 1/s}}\n"
    )
    fields = [error.field for error in ThrottleConfig.check(path)]
    assert fields == [
        "settings.colour", "settings.refresh", "settings.sleep_max", "settings.reserve_ahead"
    ]  # fmt: skip
    # park_lead is judged against park_after only when both are valid: a bad park_after
    # (left at its default, 1 s) says nothing of a park_lead of 2 s.
    path.write_text("settings: {park_after: soon, park_lead: 2s}\nlimits: {api: {rate: 1/s}}\n")
    assert [error.field for error in ThrottleConfig.check(path)] == ["settings.park_after"]
