"""Hostile and broken input: untrusted key values, fuzzed limit specs and limits files, and
forged or corrupt throttle_* headers on real messages through a real worker.

What is proved here:

* keys: every key value is encoded injectively (it decodes back, or is the SHA-256 of a
  value too long to spell out), never contains ``:{}``, and never moves a key out of its
  namespace's Redis Cluster slot; values that cannot be a key are a RequestError.
* key templates over task arguments: distinct argument values give distinct keys (a
  composite template cannot be split two ways), or a ConfigError; never ``str()`` of an
  arbitrary object.
* Limit.parse / Limit / ThrottleConfig: any input (arbitrary objects, text, YAML bytes,
  alias and merge bombs, deep nesting, huge numbers) gives a valid object or a ConfigError
  naming its place, never another exception, and never hangs.
* headers: a forged dead-letter mark or deadline cannot make a task skip the limiter or run
  before its slot; corrupt values of every header are read as absent.
"""

from __future__ import annotations

import binascii
import hashlib
import itertools
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pytest
import redis
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from tests.support.servers import RedisServer
from throttle import ConfigError, KeySpace, Limit, RequestError
from throttle.celery.message import count_header, deadline_header, id_header
from throttle.config import ThrottleConfig
from throttle.parking import ParkingLot
from throttle.redis.keys import PART_ALPHABET, _state_keys, encode, encode_part
from throttle.redis.wire import limit_args
from throttle.rules import KeyTemplate, Rule, key_for, parse_key_template
from throttle.spec import MAX_AMOUNT, MAX_PERIOD_S, MIN_PERIOD_S
from workers.harness import Worker, wait_ready

# Text that makes collisions likely: separators, braces, the encoder's own markers.
TRICKY = ":{}%#@+=~-_. a/\x00é"
tricky_text = st.text(alphabet=TRICKY, max_size=6)
# Valid text: no lone surrogates (hypothesis' default for st.text()).
any_text = st.one_of(tricky_text, st.text(), st.text(min_size=95, max_size=110))
surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
slow = settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)


def fewer(n: int) -> settings:
    """``n`` examples under the CI profile (each example parses YAML twice: the suite stays
    quick); the profile's own count under ``HYPOTHESIS_PROFILE=explore``."""
    if os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci":
        return settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
    return settings(max_examples=n, suppress_health_check=[HealthCheck.too_slow], deadline=None)


# --- keys --------------------------------------------------------------------------------


@given(value=any_text.filter(bool))
def test_an_encoded_key_value_decodes_back_or_is_its_hash(value: str) -> None:
    encoded = encode(value)
    # Then it contains only the encoder's alphabet (no ':', no braces, no separator)
    assert set(encoded) <= PART_ALPHABET
    if encoded.startswith("#"):
        # hashed: only values too long to spell out, and exactly their SHA-256
        assert len(value) > 100 or len(quote(value.encode(), safe="")) > 100
        assert encoded == "#" + hashlib.sha256(value.encode()).hexdigest()
    else:
        # spelled out: at most 100 characters, and it reads back as the value. A '#' is
        # never first (it is percent-encoded), so the two forms cannot meet: injective.
        assert len(encoded) <= 100
        assert unquote(encoded, errors="strict") == value


@given(
    first=st.tuples(tricky_text.filter(bool), st.none() | tricky_text.filter(bool)),
    second=st.tuples(tricky_text.filter(bool), st.none() | tricky_text.filter(bool)),
)
def test_distinct_limit_and_key_pairs_never_share_a_redis_key(
    first: tuple[str, str | None], second: tuple[str, str | None]
) -> None:
    assume(first != second)
    space = KeySpace(prefix="p", namespace="ns")
    for algorithm in ("token_bucket", "concurrency"):
        spec = "3 concurrent" if algorithm == "concurrency" else "1/s"
        a = space.state_keys(Limit.parse(spec, name=first[0]), first[1])
        b = space.state_keys(Limit.parse(spec, name=second[0]), second[1])
        assert not set(a) & set(b)
    assert space.hold_fields(*first) != space.hold_fields(*second)


@given(
    prefix=st.text(min_size=1).filter(lambda s: "{" not in s and "}" not in s),
    namespace=st.text(min_size=1).filter(lambda s: "{" not in s and "}" not in s),
    name=any_text.filter(bool),
    key=st.none() | any_text.filter(bool),
)
def test_no_value_moves_a_key_out_of_its_namespace_slot(
    prefix: str, namespace: str, name: str, key: str | None
) -> None:
    # Redis Cluster hashes the first {...} of a key: it must always be the namespace, so
    # that every key of one acquisition lands in one slot, whatever braces a value holds.
    space = KeySpace(prefix=prefix, namespace=namespace)
    # Redis Cluster's slot of the tag's content: CRC16 (XMODEM) mod 16384
    slot = binascii.crc_hqx(namespace.encode(), 0) % 16384
    keys = [
        *space.state_keys(Limit.parse("1/s", name=name), key),
        *space.state_keys(Limit.parse("2 concurrent", name=name), key),
        space.one_limit(Limit.parse("1/s", name=name, algorithm="gcra"), key)[0][1],
        space.holds_key(),
        space.lease_key(name),
        space.parked_run_key(name),
        *space.parking_keys(),
        space.rates_key(),
    ]
    assert {key_slot(k.encode()) for k in keys} == {slot}


@given(
    text=st.tuples(any_text, surrogates, any_text).map("".join),
)
def test_lone_surrogates_are_a_request_error_or_a_config_error(text: str) -> None:
    space = KeySpace()
    with pytest.raises(RequestError, match=r"lone surrogate U\+D[89A-F]"):
        space.state_keys(Limit.parse("1/s", name="api"), text)
    with pytest.raises(RequestError, match="lone surrogate"):
        space.lease_key(text)
    with pytest.raises(ConfigError, match="lone surrogate"):
        Limit.parse("1/s", name=text)
    with pytest.raises(ConfigError, match="lone surrogate"):
        KeySpace(namespace=text.replace("{", "").replace("}", ""))


def test_a_huge_key_value_is_hashed_quickly_and_not_cached() -> None:
    space = KeySpace()
    limit = Limit.parse("1/s", name="api")
    huge = "\N{PILE OF POO}{}:%" * 2_500_000  # 10 M characters, 40 MB of UTF-8
    before = _state_keys.cache_info().currsize
    started = time.perf_counter()
    (name,) = space.state_keys(limit, huge)
    fields = space.hold_fields("api", huge)
    elapsed = time.perf_counter() - started
    assert name.endswith(":#" + hashlib.sha256(huge.encode()).hexdigest())
    assert fields[1] == "api:" + name.rsplit(":", 1)[1]
    assert _state_keys.cache_info().currsize == before  # 4096 of these would hold 160 GB
    assert elapsed < 2.0, elapsed
    with pytest.raises(RequestError, match="non-empty"):
        space.state_keys(limit, "")  # "" would be the keyless state's key


# --- keys from task arguments (throttle.rules.key_for) ---------------------------------------


class Shouty(str):
    """A str subclass whose __str__ and __format__ lie: its content is the key."""

    def __str__(self) -> str:
        return "same"

    def __format__(self, spec: str) -> str:
        return "same"


class Constant:
    """An object whose text is the same for every instance."""

    def __str__(self) -> str:
        return "tenant"

    __format__ = object.__format__


class Exploding:
    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("boom")

    def __format__(self, spec: str) -> str:
        raise RuntimeError("boom")


def key_of(template: str, **named: Any) -> str | None:
    rule = Rule(Limit.parse("10/s", name="api"), key=template)
    return key_for(rule, named, (), named)


def normal(value: str | int) -> str:
    """What a key value means: an int is its decimal string."""
    return value if isinstance(value, str) else str(value)


field_values = st.one_of(tricky_text, st.integers(), st.text(max_size=3))


@st.composite
def templates(draw: st.DrawFn) -> str:
    """Key templates over arguments a, b, c with literal text full of separators."""
    fields = draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=3))
    literal = st.one_of(
        st.text(alphabet=":-/_a%{}x #", max_size=3),
        st.sampled_from([":", "/", " ", "-:", ":-", "a:b", "%:#", "}{"]),
    )
    literals = draw(st.lists(literal, min_size=4, max_size=4))
    escaped = [text.replace("{", "{{").replace("}", "}}") for text in literals]
    parts = [escaped[0]]
    for i, name in enumerate(fields):
        parts += ["{" + name + "}", escaped[i + 1]]
    return "".join(parts)


def read_back(template: KeyTemplate, key: str) -> list[str]:
    """The value parts of ``key`` (encoded, for a template of several fields), found with
    nothing but the template: if this always works, distinct values give distinct keys."""
    literals, parts = template.literals, []
    assert key.startswith(literals[0])
    rest = key[len(literals[0]) :]
    for i in range(len(template.paths) - 1):
        separator = literals[i + 1]
        # The first character outside the encoder's alphabet belongs to the separator
        in_separator = next(j for j, ch in enumerate(separator) if ch not in PART_ALPHABET)
        first = next(j for j, ch in enumerate(rest) if ch not in PART_ALPHABET)
        end = first - in_separator
        assert rest[end:].startswith(separator)
        parts.append(rest[:end])
        rest = rest[end + len(separator) :]
    assert rest.endswith(literals[-1])
    parts.append(rest[: len(rest) - len(literals[-1])])
    return parts


@slow
@given(
    template=templates(),
    named=st.fixed_dictionaries({"a": field_values, "b": field_values, "c": field_values}),
)
def test_a_key_reads_back_as_its_argument_values(template: str, named: dict[str, Any]) -> None:
    try:
        parsed = parse_key_template(template, limit="api", source=None)
    except ConfigError as exc:
        # Refused only for fields run together without a separator
        assert "separated by a character" in exc.problem
        return
    try:
        key = key_of(template, **named)
    except ConfigError as exc:
        assert "empty" in exc.problem  # "{a}" with a == ""
        return
    assert key is not None
    values = [normal(named[head]) for head in parsed.heads]
    if len(values) > 1:
        values = [encode_part(value) for value in values]  # injective (tested above)
    assert read_back(parsed, key) == values, (template, named, key)


def test_composite_keys_cannot_be_split_two_ways() -> None:
    assert key_of("{a}:{b}", a="a:b", b="c") != key_of("{a}:{b}", a="a", b="b:c")
    assert key_of("{a}/{b}", a="x/y", b="z") != key_of("{a}/{b}", a="x", b="y/z")
    # Safe values keep the readable key they always had
    assert key_of("{tenant}:{region}", tenant="acme", region="eu-1") == "acme:eu-1"
    # A separator made only of characters a value may keep is refused at config time
    with pytest.raises(ConfigError, match="separated by a character"):
        Rule(Limit.parse("1/s", name="api"), key="{a}-{b}")
    with pytest.raises(ConfigError, match="separated by a character"):
        Rule(Limit.parse("1/s", name="api"), key="{a}{b}")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        pytest.param(None, "is NoneType", id="none"),
        pytest.param(True, "is bool", id="bool"),
        pytest.param(1.5, "is float", id="float"),
        pytest.param(b"acme", "is bytes", id="bytes"),
        pytest.param(["acme"], "is list", id="list"),
        pytest.param(Constant(), "is Constant", id="constant-str"),
        pytest.param(Exploding(), "is Exploding", id="raising-format"),
        pytest.param(10**5000, "integer too long", id="5000-digit-int"),
        pytest.param("a\udc80", "lone surrogate", id="surrogate"),
    ],
)
def test_values_that_cannot_name_a_bucket_are_a_config_error(value: Any, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as caught:
        key_of("{tenant}", tenant=value)
    assert (caught.value.limit, caught.value.field) == ("api", "key")
    rule = Rule(Limit.parse("10/s", name="api"), key=lambda tenant: tenant)
    with pytest.raises(ConfigError, match=problem):
        key_for(rule, {}, (value,), {})


def test_hostile_arguments_give_their_content_or_a_config_error() -> None:
    # A str subclass is its content, whatever its __str__ / __format__ say
    assert key_of("{t}", t=Shouty("a")) != key_of("{t}", t=Shouty("b"))
    assert key_of("{t}", t=Shouty("a")) == "a"
    # 42 and "42" are one tenant (JSON producers send either); "None" is not None
    assert key_of("{t}", t=42) == key_of("{t}", t="42") == "42"
    assert key_of("{t}", t="None") == "None"
    # A raising attribute is named, not leaked raw
    with pytest.raises(ConfigError, match=r"cannot read \{t.org\}.*RuntimeError"):
        key_of("{t.org}", t=Exploding())
    with pytest.raises(ConfigError, match=r"cannot read \{t\[9\]\}.*IndexError"):
        key_of("{t[9]}", t=[1])
    # A huge value is a key, hashed by the key space
    assert key_of("{t}", t="x" * 10_000_000) == "x" * 10_000_000


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("{t:.3}", "no conversion or format spec"),
        ("{t!r}", "no conversion or format spec"),
        ("{t:{u}}", "no conversion or format spec"),
        ("{t.}", "malformed key template field"),
        ("{t[0]x}", "malformed key template field"),
        ("{ }", "malformed key template field"),
        ("{1x}", "must name arguments"),
        ("a\ud800{t}", "lone surrogate"),
    ],
)
def test_key_templates_that_could_merge_values_are_refused(template: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as caught:
        Rule(Limit.parse("1/s", name="api"), key=template)
    assert (caught.value.field, caught.value.limit) == ("key", "api")


# --- limit specs -------------------------------------------------------------------------


def check_limit(limit: Limit) -> None:
    """What every Limit that exists promises the scripts: finite amounts and times."""
    assert isinstance(limit.name, str) and limit.name
    assert 0 < limit.count <= MAX_AMOUNT
    assert 0 < limit.capacity <= MAX_AMOUNT
    if limit.algorithm.value != "concurrency":
        assert MIN_PERIOD_S <= limit.period_s <= MAX_PERIOD_S
        assert 0 < limit.rate_per_s < math.inf
        assert limit.period_s / limit.count <= MAX_PERIOD_S
    for arg in limit_args(limit)[1:]:
        assert math.isfinite(float(arg))


numbers = st.one_of(
    st.integers(0, 20).map(str),
    st.integers(0, 10**400).map(str),
    st.floats(0, 1e6, allow_nan=False).map(lambda x: f"{x:f}"),
    st.text(alphabet="0123456789.", min_size=1, max_size=400),
    st.just("0." + "0" * 330 + "1"),
)
units = st.sampled_from(
    ["ms", "s", "m", "h", "d", "sec", "days", "fortnight", "S", "\u017f", "\u212a"]
)


@st.composite
def rate_specs(draw: st.DrawFn) -> str:
    """Rate strings close to the grammar, so the fuzz reaches the number checks."""
    count, unit = draw(numbers), draw(units)
    mult = draw(st.none() | numbers)
    text = f"{count}/{mult or ''}{unit}"
    if draw(st.booleans()):
        text += f" burst {draw(numbers)}"
    if draw(st.booleans()):
        text = f"{draw(numbers)} concurrent"
    return text


junk = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(10**300, 10**400),
        st.floats(),
        any_text,
        st.binary(max_size=8),
        st.dates(),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)


@slow
@given(
    spec=st.one_of(rate_specs(), any_text, junk),
    name=st.one_of(st.just(""), any_text, junk),
    algorithm=st.one_of(st.none(), st.sampled_from(["gcra", "concurrency", "fixed_window"]), junk),
)
def test_limit_parse_gives_a_limit_or_a_config_error(spec: Any, name: Any, algorithm: Any) -> None:
    try:
        limit = Limit.parse(spec, name=name, algorithm=algorithm, source="f.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("f.yaml: ") or exc.field == "name"
        return
    check_limit(limit)


@slow
@given(
    count=st.one_of(st.floats(), st.integers(), st.integers(10**300, 10**400), junk),
    period=st.one_of(st.floats(), st.integers(), junk),
    burst=st.one_of(st.none(), st.floats(), st.integers(), junk),
    algorithm=st.sampled_from(["token_bucket", "gcra", "sliding_window", "concurrency"]),
)
def test_a_limit_built_from_any_numbers_is_valid_or_a_config_error(
    count: Any, period: Any, burst: Any, algorithm: str
) -> None:
    try:
        limit = Limit("x", algorithm, count, period, burst)  # type: ignore[arg-type]
    except ConfigError as exc:
        assert exc.limit == "x" and exc.field in ("count", "period_s", "burst")
        return
    check_limit(limit)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("1/0.0000001ms", "at least 1e-06 s"),
        ("1/400000d", "at most 1e+10"),
        ("0.0000001/d", "too slow"),
        ("2000000000000000/s", "at most 1e+15"),
        ("9" * 400 + "/s", "finite number > 0"),
        ("1/s burst " + "9" * 20, "at most 1e+15"),
    ],
)
def test_absurd_rates_are_refused_with_their_place(spec: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(problem)) as caught:
        Limit.parse(spec, name="api", source="f.yaml")
    assert str(caught.value).startswith("f.yaml: limit 'api': field 'rate': ")


# --- limits files ------------------------------------------------------------------------

field_values_yaml = st.one_of(
    junk,
    rate_specs(),
    st.sampled_from(
        [
            "10/s",
            "3 concurrent",
            "{tenant}",
            "{a}-{b}",
            "{a}:{b}",
            "dead_letter:",
            "dead_letter:q",
            "refund",
            "allow",
            "10m",
            "gcra",
            "fixed_window",
            "a{b",
        ]
    ),
    st.floats(),
    st.integers(-(10**400), 10**400),
)
limit_entries = st.dictionaries(
    st.sampled_from(
        [
            "rate",
            "algorithm",
            "burst",
            "key",
            "cost",
            "max_wait",
            "on_timeout",
            "on_error",
            "on_redis_down",
            "typo",
        ]
    ),
    field_values_yaml,
)
settings_entries = st.dictionaries(
    st.sampled_from(
        [
            "redis_url",
            "prefix",
            "namespace",
            "refresh",
            "sleep_max",
            "park_after",
            "park_lead",
            "jitter",
            "lanes",
            "metrics",
            "metrics_port",
            "metrics_dir",
            7,
        ]
    ),
    field_values_yaml,
)
documents = st.one_of(
    junk,
    st.fixed_dictionaries(
        {},
        optional={
            "settings": st.one_of(settings_entries, junk),
            "limits": st.one_of(
                st.dictionaries(st.one_of(any_text, st.integers(), st.none()), limit_entries),
                junk,
            ),
            "queues": st.one_of(st.dictionaries(any_text, st.lists(any_text) | junk), junk),
            "tasks": st.one_of(st.dictionaries(any_text | st.integers(), junk), junk),
            "bogus": junk,
        },
    ),
)


@fewer(100)
@given(document=documents)
def test_any_document_gives_a_config_or_a_config_error_naming_the_source(document: Any) -> None:
    try:
        config = ThrottleConfig.from_mapping(document, source="f.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("f.yaml: ")
        return
    for rule in config.rules.values():
        check_limit(rule.limit)
        KeySpace(config.settings.prefix, config.settings.namespace)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory)


def load_both(path: Path) -> None:
    """load() and check() agree: the first error of check() is the one load() raises."""
    errors = ThrottleConfig.check(path)
    assert all(str(error).startswith(f"{path}: ") for error in errors), errors
    try:
        ThrottleConfig.load(path)
    except ConfigError as exc:
        assert errors, exc
        assert str(exc) == str(errors[0])
        return
    assert not errors


# Pieces of YAML: tags, anchors, aliases, merges, flow and block collections, odd scalars.
yaml_tokens = st.sampled_from(
    ["limits:", "settings:", "queues:", "tasks:", "\n", "\n  ", "\n    ", "- ", "? ", ": ",
     "[", "]", "{", "}", ", ", "&a ", "*a", "&b ", "*b", "<<: ", "!!set ", "!!omap ",
     "!!pairs ", "!!binary ", "!!timestamp ", "!!float ", "!!int ", "!!str ", "!!map ",
     "!!seq ", "!!bool ", "!!null ", "!!python/tuple ", "!local ", "rate", "10/s", "api",
     "2024-02-30", "0x1F", "0o17", "1_000", "1:30", ".nan", "-.inf", "~", "yes", "'q'",
     '"\\ud800"', '"\\x00"', "|\n  x", ">\n  x", "%YAML 1.1\n---\n", "---\n", "..."]
)  # fmt: skip
yaml_text = st.one_of(
    st.lists(yaml_tokens, max_size=30).map("".join),
    st.binary(max_size=200),
    st.text(alphabet="{}[]:,-&*!|>'\"#%@`?<\n \t\\0123456789.eE+x", max_size=80),
    documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
)


@fewer(100)
@given(data=st.data())
def test_any_yaml_bytes_give_a_config_or_a_config_error(scratch: Path, data: st.DataObject) -> None:
    raw = data.draw(yaml_text)
    path = scratch / "limits.yaml"
    path.write_bytes(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass"))
    load_both(path)


def alias_bomb(where: str) -> str:
    """Nine levels of nine aliases: 387 million strings if anything expands it."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 9):
        refs = ", ".join([f"*a{i - 1}"] * 9)
        lines.append(f"a{i}: &a{i} [{refs}]")
    body = "\n".join("      " + line for line in lines)
    return f"limits:\n  api:\n    rate: 10/s\n    bomb:\n{body}\n    {where}: *a8\n"


def merge_bomb(levels: int) -> str:
    lines = ["limits:", "  m0: &m0 {rate: 10/s, burst: 1, algorithm: gcra}"]
    for i in range(1, levels):
        refs = ", ".join([f"*m{i - 1}"] * 3)
        lines.append(f"  m{i}: &m{i} {{<<: [{refs}]}}")
    return "\n".join(lines) + "\n"


HOSTILE_FILES = [
    pytest.param(b"\xff\xfe\x00garbage", "not UTF-8 text", id="not-utf8"),
    pytest.param(b"limits:\n  a\x00: {rate: 1/s}\n", "not valid YAML", id="nul-byte"),
    pytest.param(("[" * 100_000).encode(), "nested more than 50 levels", id="deep-list"),
    pytest.param(
        ("a:\n" + "".join(" " * i + "b:\n" for i in range(1, 300))).encode(),
        "nested more than 50 levels",
        id="deep-mapping",
    ),
    pytest.param(b"limits: {" * 60 + b"}" * 60, "nested more than 50 levels", id="deep-flow"),
    pytest.param(b"# " + b"x" * (1 << 20), "larger than 1 MiB", id="huge-file"),
    pytest.param(alias_bomb("key").encode(), "unknown field", id="alias-bomb"),
    pytest.param(merge_bomb(30).encode(), "merge keys", id="merge-bomb"),
    pytest.param(
        b"limits:\n  api: {rate: 10/s, burst: " + b"9" * 5000 + b"}\n",
        "not a valid YAML value",
        id="5000-digit-int",
    ),
    pytest.param(
        b"limits:\n  api: {rate: 10/s, max_wait: " + b"9" * 400 + b"}\n",
        "must be a duration",
        id="400-digit-max-wait",
    ),
    pytest.param(b"limits:\n  api: {rate: 10/s, burst: .nan}\n", "finite", id="nan-burst"),
    pytest.param(b"limits:\n  api: {rate: 10/s, burst: -.inf}\n", "finite", id="inf-burst"),
    pytest.param(b"limits:\n  api: {rate: 10/s, max_wait: -1}\n", "duration >= 0", id="neg"),
    pytest.param(b"limits:\n  api: {rate: 2024-13-45}\n", "not a valid YAML value", id="date"),
    pytest.param(b"limits: !!timestamp ''\n", "not a valid YAML value", id="empty-timestamp"),
    pytest.param(b"limits:\n  api: {rate: !!binary '@@'}\n", "must be a string", id="binary"),
    pytest.param(b"limits: !!python/object:os.system {}\n", "not valid YAML", id="python-tag"),
    pytest.param(b"limits:\n  ? [a, b]\n  : {rate: 1/s}\n", "not valid YAML", id="list-key"),
    pytest.param(b"limits:\n  1: {rate: 1/s}\n", "name is text: quote it", id="int-name"),
    pytest.param(b"limits:\n  null: {rate: 1/s}\n", "non-empty name", id="null-name"),
    pytest.param(b'limits:\n  "a\\ud800": {rate: 1/s}\n', "lone surrogate", id="surrogate-name"),
    pytest.param(
        b'limits:\n  a: {rate: 1/s, key: "{t}\\ud800"}\n', "lone surrogate", id="surrogate-key"
    ),
    pytest.param(b"limits:\n  a: {rate: 1/s, key: '{t:.3}'}\n", "format spec", id="key-spec"),
    pytest.param(b"settings: {namespace: 'a{b}'}\n", "without braces", id="brace-namespace"),
    pytest.param(b'settings: {metrics_dir: "/tmp/a\\0b"}\n', "NUL", id="nul-dir"),
    pytest.param(b"queues: {1: [a]}\nlimits: {a: {rate: 1/s}}\n", "queue name", id="int-queue"),
    pytest.param(
        b"limits: {a: {rate: 1/s, on_timeout: 'dead_letter: '}}\n",
        "dead_letter",
        id="blank-dead-letter",
    ),
]


@pytest.mark.parametrize(("raw", "problem"), HOSTILE_FILES)
def test_hostile_files_are_a_config_error_naming_the_file(
    tmp_path: Path, raw: bytes, problem: str
) -> None:
    path = tmp_path / "limits.yaml"
    path.write_bytes(raw)
    started = time.perf_counter()
    with pytest.raises(ConfigError) as caught:
        ThrottleConfig.load(path)
    load_both(path)
    elapsed = time.perf_counter() - started
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and problem in message, message
    assert len(message) < 2000  # a bomb or a huge value is shown cut, not expanded
    assert elapsed < 5.0, elapsed


def test_a_small_merge_is_still_a_merge(tmp_path: Path) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(
        "limits:\n"
        "  github: &shaper {algorithm: gcra, rate: 5000/h, burst: 10, max_wait: 10m}\n"
        "  stripe: {<<: *shaper, rate: 100/s}\n"
    )
    stripe = ThrottleConfig.load(path).rule("stripe")
    assert (stripe.limit.algorithm.value, stripe.limit.rate_per_s) == ("gcra", 100.0)
    assert (stripe.limit.burst, stripe.max_wait_s) == (10.0, 600.0)


# --- headers: the readers (unit) ---------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [None, "soon", "1e9", True, math.nan, math.inf, -math.inf, -1, 0, 10**400, 1e300, [1e9],
     {"at": 1e9}, 253402300800, [1e9, True], [1e9, "0"], ["1e9", 0], [math.nan, 0]],
)  # fmt: skip
def test_corrupt_deadlines_read_as_absent(value: Any) -> None:
    assert deadline_header({"throttle_deadline": value}) is None


def test_valid_headers_read_as_themselves() -> None:
    assert deadline_header({"throttle_deadline": 1_763_776_800.5}) == 1_763_776_800.5
    assert deadline_header({"throttle_deadline": 1_763_776_800}) == 1_763_776_800.0
    # stamped with the retries it was set at: a Celery retry since has a max_wait of its own
    stamped = {"throttle_deadline": [1_763_776_800.5, 2]}
    assert deadline_header(stamped, retries=2) == 1_763_776_800.5
    assert deadline_header(stamped, retries=3) is None
    assert count_header({"throttle_deferrals": 3}) == 3
    assert [count_header({"throttle_deferrals": v}) for v in ("3", -1, True, 10**30, 2.0)] == [
        0
    ] * 5
    assert id_header({"t": "0f" * 16}, "t") == "0f" * 16
    for bad in (5, "", "x" * 101, "a\ud800", "a\nb", "é", None, ["a"]):
        assert id_header({"t": bad}, "t") is None


# --- headers: real messages through a real worker -----------------------------------------

CONFIG = """
settings:
  sleep_max: 0.5s
  park_after: 3s
  park_lead: 1s
limits:
  spaced: {algorithm: gcra, rate: 5/s, burst: 1}
  gate: {algorithm: gcra, rate: 1/h, burst: 1, max_wait: 1s, on_timeout: "dead_letter:dead"}
  hourly: {algorithm: gcra, rate: 1/h, burst: 1, max_wait: 1s}
"""


class Fleet:
    def __init__(self, server: RedisServer, app: Any) -> None:
        self.client = redis.Redis.from_url(server.url)
        self.app = app

    def runs(self, task_id: str) -> int:
        return int(self.client.get(f"test:runs:{task_id}") or 0)

    def parked(self, task_id: str) -> bool:
        """Whether the task waits in the parking lot."""
        return ParkingLot(self.client, KeySpace()).find(task_id) is not None

    def timeouts(self, limit: str) -> int:
        """Timeouts of ``limit`` in the fleet-wide stats (every minute bucket)."""
        total = 0
        for key in self.client.scan_iter(match="throttle:{default}:stats:*"):
            total += int(self.client.hget(key, f"timeout:{limit}") or 0)
        return total


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("hostile")
    config = tmp / "limits.yaml"
    config.write_text(CONFIG)
    with RedisServer() as server:
        env = {"DEMO_BROKER_URL": server.url, "THROTTLE_CONFIG": str(config)}
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        from tests.apps.hostile_app import app  # noqa: PLC0415

        app.conf.broker_url = app.conf.result_backend = server.url
        # One worker of 2 children, consuming its dead-letter queue too.
        worker = Worker("hostile", env, app="tests.apps.hostile_app", queues="celery,dead",
                        concurrency=2, log=tmp / "worker.log")  # fmt: skip
        fleet = Fleet(server, app)
        try:
            worker.start()
            wait_ready(app, [worker])
            yield fleet
        finally:
            worker.stop()
            fleet.client.close()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def outcome(handle: Any, timeout: float = 30) -> str:
    try:
        handle.get(timeout=timeout)
    except Exception as exc:
        return type(exc).__name__
    return "ran"


def test_a_forged_dead_letter_mark_does_not_skip_the_limiter(fleet: Fleet) -> None:
    from tests.apps.hostile_app import gated  # noqa: PLC0415

    # Given the only slot of the hour taken
    assert outcome(gated.delay(0)) == "ran"
    # When a producer forges the mark of a dead-lettered task for the queue it publishes to
    forged = gated.apply_async((1,), headers={"throttle_dead_letter": "celery"})
    # Then the task still meets the limit: no slot within max_wait, so it times out; the
    # mark only keeps it from being dead-lettered (it claims to come from there).
    # (Before: the mark made the gate return at once and the task ran unthrottled.)
    assert outcome(forged) == "ThrottleTimeout"
    assert fleet.runs(forged.id) == 0
    # And a task that really times out goes to queue "dead" once, is throttled when the
    # worker consumes it from there (before: it ran unthrottled), and then fails rather
    # than being dead-lettered again.
    real = gated.delay(2)
    assert outcome(real) == "ThrottleTimeout"
    assert fleet.runs(real.id) == 0
    assert fleet.client.llen("dead") == 0
    assert fleet.timeouts("gate") == 3  # forged: 1; real: to "dead", then failed there


def test_a_forged_deadline_never_makes_a_task_run_before_its_slot(fleet: Fleet) -> None:
    from tests.apps.hostile_app import hourly  # noqa: PLC0415

    assert outcome(hourly.delay(0)) == "ran"  # the only slot of the hour
    now = time.time()
    past = hourly.apply_async((1,), headers={"throttle_deadline": now - 60})
    huge = hourly.apply_async((2,), headers={"throttle_deadline": 10**400})
    late = hourly.apply_async((3,), headers={"throttle_deadline": now + 7200})
    # A deadline in the past: no slot before it, the task fails; a corrupt one is absent:
    # max_wait (1 s) applies. Neither runs.
    assert outcome(past) == "ThrottleTimeout"
    assert outcome(huge) == "ThrottleTimeout"
    # A later deadline than max_wait lets the task wait longer, never run sooner: it has
    # reserved the next slot, an hour away, and is parked until then.
    time.sleep(1.5)
    assert fleet.parked(late.id)
    assert late.state == "PENDING"  # a deferral writes no state over the task's
    assert fleet.runs(late.id) == 0 and fleet.runs(past.id) == 0 and fleet.runs(huge.id) == 0


CORRUPT_HEADERS: list[dict[str, Any]] = [
    {"throttle_deadline": "soon"},
    {"throttle_deadline": math.nan},
    {"throttle_deadline": 10**400},
    {"throttle_deadline": 1e308},
    {"throttle_deadline": [1]},
    {"throttle_deferrals": "many"},
    {"throttle_deferrals": 10**400},
    {"throttle_deferrals": -7},
    {"throttle_parked": "forged-token", "throttle_publish": "forged-id"},
    {"throttle_parked": "a\ud800", "throttle_publish": "x" * 10_000},
    {"throttle_parked": 5, "throttle_publish": None},
    {"throttle_dead_letter": "celery"},
    {"throttle_dead_letter": ["celery"]},
    {"headers": [1, 2]},
]


def test_corrupt_headers_are_absent_and_every_task_pays_its_slot(fleet: Fleet) -> None:
    from tests.apps.hostile_app import spaced  # noqa: PLC0415

    # Given tasks of a 5/s burst-1 limit, each carrying forged or corrupt throttle headers
    handles = [spaced.apply_async((i,), headers=h) for i, h in enumerate(CORRUPT_HEADERS)]
    done = [handle.get(timeout=60) for handle in handles]
    # Then none crashed, each ran once, and each took its own slot: the slots the limiter
    # granted (their lease records, Redis time) are 200 ms apart, and no body started
    # before its slot (none skipped the limiter, none paid less). Judged on the slots, not
    # on the starts' gaps: on a loaded host one body starting late and the next on time
    # are closer than 200 ms without anything wrong.
    assert [r["x"] for r in done] == list(range(len(CORRUPT_HEADERS)))
    assert all(r["runs"] == 1 for r in done)
    keys = KeySpace()
    slots = []
    for handle, result in zip(handles, done, strict=True):
        slot_us = fleet.client.hget(keys.lease_key(handle.id), "at")
        assert slot_us is not None, f"task {handle.id} ran without a lease"
        slots.append(float(slot_us) / 1e6)
        assert result["at"] >= slots[-1] - 0.005  # same host: one clock
    gaps = [round(b - a, 4) for a, b in itertools.pairwise(sorted(slots))]
    assert min(gaps) >= 0.2 - 0.001, gaps
