"""Rules: a limit as a task meets it, and the evaluation of its key and cost from the
task's arguments.

A :class:`Rule` pairs a :class:`~throttle.spec.Limit` with where its key and cost come from
and the policies of a waiting task (``max_wait``, ``on_timeout``, ``on_error``,
``on_redis_down``, ``cold_start``); the policy strings are parsed once, when the rule is
built, into typed values (:attr:`Rule.redis_down`, :attr:`Rule.fail_open_s`,
:attr:`Rule.dead_letter_queue`). :class:`Declared` is what ``@throttled`` or a task class
names (inline rules and names of rules in a limits file). :func:`targets` is the step
"rules -> (limit, key, cost)" of one execution: it knows nothing of Celery, only a
function and its arguments.

Keys built here are unambiguous: distinct arguments give distinct keys, or a
:class:`ConfigError` (see :func:`key_for`).
"""

from __future__ import annotations

import enum
import functools
import inspect
import math
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from throttle.adaptive import Adaptive
from throttle.errors import ConfigError
from throttle.redis.keys import PART_ALPHABET, encode_part, text_error
from throttle.spec import MAX_AMOUNT, Algorithm, Limit
from throttle.units import parse_duration, real, spelt_s
from throttle.upstream.dialects import dimension_name

__all__ = [
    "Declared",
    "KeyTemplate",
    "RedisDown",
    "Rule",
    "Target",
    "cost_for",
    "declare",
    "key_for",
    "key_problem",
    "named_arguments",
    "names_arguments",
    "parse_key_template",
    "targets",
]

OnTimeout = str  # "fail" or "dead_letter:QUEUE"
OnError = Literal["keep", "refund"]
OnRedisDown = str  # "defer", "allow", "allow:DURATION" or "local"
ColdStart = Literal["full", "empty"]
KeySource = str | Callable[..., object] | None
CostSource = float | str | Callable[..., float]
Target = tuple[Limit, str | None, float]
"""One limit of an acquisition: the limit, its key (None: one state for all), the cost."""


class RedisDown(enum.Enum):
    """The parsed ``on_redis_down`` of a rule."""

    DEFER = "defer"
    """Fail closed: the task comes back until Redis answers."""
    ALLOW = "allow"
    """Fail open, for :attr:`Rule.fail_open_s` (or ``settings.fail_open_for``)."""
    LOCAL = "local"
    """A per-process bucket at the limit's rate divided by the fleet's processes."""


# One replacement field of a key template: an argument, then attributes and indexes into it
# ("{tenant_id}", "{user.org}", "{ids[0]}"), and no conversion or format spec ("{x:.3}"
# would cut distinct values to one key).
_FIELD_RE = re.compile(r"(?P<head>[^\W\d]\w*)(?:\.[^\W\d]\w*|\[[^\[\]]+\])*")


@dataclass(frozen=True)
class KeyTemplate:
    """A key template split into its literal text and its fields: ``literals[0]``, the
    value of ``paths[0]``, ``literals[1]``, ... (``len(literals) == len(paths) + 1``)."""

    literals: tuple[str, ...]
    paths: tuple[str, ...]
    """The fields as written, e.g. ``"user.org"`` (``string.Formatter`` paths)."""
    whole: tuple[bool, ...] = field(init=False, repr=False, compare=False)
    """For each field, whether it is a whole argument (``"{tenant_id}"``, read by name),
    not a path into one."""
    heads: tuple[str, ...] = field(init=False, repr=False, compare=False)
    """The arguments the fields read (split once: every task's key reads them)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "whole", tuple(path.isidentifier() for path in self.paths))
        heads = tuple(re.split(r"[.\[]", path, maxsplit=1)[0] for path in self.paths)
        object.__setattr__(self, "heads", heads)


def parse_key_template(template: str, *, limit: str | None, source: str | None) -> KeyTemplate:
    """Split and check a key template. A template of several fields must separate each
    pair by a character outside :data:`throttle.redis.keys.PART_ALPHABET` (``:``, ``/``, a
    space...): the worker encodes each value of such a template (throttle.redis.keys.encode_part)
    so that the separator never occurs in it, which makes the key unambiguous
    ("{a}:{b}" with "x:y" and "z" is not "x" and "y:z")."""

    def bad(problem: str) -> ConfigError:
        return ConfigError(problem, field="key", value=template, limit=limit, source=source)

    problem = text_error(template)
    if problem is not None:
        raise bad(f"a key template must be Unicode text; it has {problem}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise bad(f"malformed key template ({exc})") from None
    literals, paths = [""], []
    for text, path, spec, conversion in parsed:
        literals[-1] += text
        if path is None:
            continue
        if not path or path.isdigit() or path[0].isdigit():
            raise bad("key template fields must name arguments, as in '{tenant_id}'")
        if not _FIELD_RE.fullmatch(path):
            raise bad(
                f"malformed key template field {{{path}}}: an argument name, then .attribute "
                "or [index] parts"
            )
        if spec or conversion:
            raise bad(
                f"a key template field takes no conversion or format spec ({{{path}}}): a "
                "spec such as ':.3' would give distinct values one key"
            )
        paths.append(path)
        literals.append("")
    for between in literals[1:-1]:
        if all(char in PART_ALPHABET for char in between):
            raise bad(
                "fields of a key template must be separated by a character such as ':', '/' "
                "or ' ', not only letters, digits or '_.@+=~-%#' (with '{a}-{b}', 'x-y' and "
                "'z' would share a key with 'x' and 'y-z')"
            )
    return KeyTemplate(tuple(literals), tuple(paths))


_REDIS_DOWN_HELP = (
    "must be 'defer' (fail closed), 'allow' (fail open for settings.fail_open_for), "
    "'allow:DURATION' such as 'allow:30s' (fail open that long, then closed) or 'local' "
    "(a per-process bucket at the limit's rate / the fleet's processes)"
)


def _redis_down(value: object, limit: str | None) -> tuple[RedisDown, float | None]:
    """The policy of ``on_redis_down`` and the bound of ``allow:DURATION`` in s (None for
    the other policies); a ConfigError names the field for anything else."""
    if value in ("defer", "allow", "local"):
        return RedisDown(value), None
    if isinstance(value, str) and value.startswith("allow:") and spelt_s(value[6:]) is not None:
        try:
            return RedisDown.ALLOW, parse_duration(value[6:], field="on_redis_down", limit=limit)
        except ConfigError as exc:  # a duration, out of bounds (ten years): say that
            raise ConfigError(
                exc.problem, field="on_redis_down", value=value, limit=limit
            ) from None
    raise ConfigError(_REDIS_DOWN_HELP, field="on_redis_down", value=value, limit=limit)


@dataclass(frozen=True)
class Rule:
    """A limit as a task meets it: where its key and cost come from, how long a task may wait.

    Parameters
    ----------
    limit:
        The :class:`Limit` (its name is the rule's name).
    key:
        ``None`` (one state for every task), a template over the task's arguments such as
        ``"{tenant_id}"`` or ``"{user.org}:{region}"``, or a callable of the task's
        arguments returning the key.
    cost:
        A number (default 1), the name of an argument holding the cost (an estimate that the
        task may correct with :func:`throttle.celery.report_cost`), or a callable of the
        task's arguments.
    max_wait_s:
        The throttle deadline in seconds, counted from the first denial (``None``: no
        deadline but the task's ``expires``). Past it, ``on_timeout`` applies.
    on_timeout:
        ``"fail"``: the task fails with ``ThrottleTimeout``; ``"dead_letter:QUEUE"``: the
        task is sent, unchanged and at once, to QUEUE.
    on_error:
        When the body raises and reported no actual cost: ``"keep"`` the reserved cost
        (safe: the call may have been made) or ``"refund"`` it in full.
    on_redis_down:
        When Redis cannot be reached: ``"defer"`` the task (fail closed, the default: it
        comes back every 5 s until Redis answers); ``"allow"`` it (fail open) for
        ``settings.fail_open_for`` from the start of the outage, then defer; ``"allow:30s"``
        with a bound of its own; or ``"local"``: a token bucket in each worker process at
        the limit's rate divided by the fleet's processes (:mod:`throttle.fallback`).
        Fail open trades the upstream's limit for availability; ``local`` keeps it roughly
        (exactly only while the count of processes is right), not for concurrency limits.
    cold_start:
        What a limit starts from when the limiter's Redis lost its data (a restart without
        persistence, a flush, a failover to an empty replica). Either way, the first
        script that misses the restart fence's marker starts a fence of ``sleep_max`` +
        ``late_tolerance`` (the latest a task may still call on a slot the lost state
        granted): token bucket and GCRA limits, of every key, read as empty at its end,
        so the first new slot comes a spacing after it and they refill from there.
        ``"full"`` (the default): nothing more; windows start from zero (a quota may be
        spent twice). ``"empty"``: the throttler also finds its marker key missing and
        drains the limit (takes its whole capacity once): a window counts as spent until
        it ends (a daily quota: the rest of the day). Unkeyed rate limits only: per-key
        states cannot be listed once Redis lost them.
    spacing_guard:
        The call-time spacing guard (:meth:`throttle.Limiter.space`): just before the call,
        after the task slept to its slot, one more round trip stamps the call on the Redis
        clock and waits, if the limit's (and key's) previous call was closer than the
        limit's spacing (period / count x cost), for the difference; so calls that
        started late cannot bunch. ``None`` (the default): on for GCRA and token bucket
        limits of burst 1 (with ``plans``: when every plan is one too), off otherwise;
        ``True``/``False``: on/off. On a limit of burst above 1 it spaces every call (no
        burst). Not for concurrency limits. A task whose
        reserving limits are all guarded keeps a slot it reaches up to one spacing late
        (``settings.late_tolerance`` otherwise): its lateness pushes the calls after it
        back, by at most that, instead of costing a slot.
    adaptive:
        Learn the upstream's rate from its answers (:class:`throttle.adaptive.Adaptive`):
        the rate in force goes down on refusals and probes back up on successes, between
        a floor and the limit's rate. Needs the upstream hook
        (:func:`throttle.upstream.upstream_hook`) on the task's calls; not for
        concurrency limits.
    upstream:
        The dimension of the upstream's limit this limit follows, as the provider's
        headers name it (:mod:`throttle.upstream.dialects`): ``requests``, ``tokens``,
        ``input-tokens``, ``output-tokens`` (OpenAI, Anthropic), a GitHub resource
        (``core``, ``search``, ``graphql``...), a Stripe reason (``global-rate``...),
        Discord's ``global``, ``route`` or ``shared``. A response then holds the limit
        only when that dimension is spent (or the refusal blames none), and its stated
        quota sets the limit's rate in the limit's own units, down and back up, never
        above the configured (or ``celery throttle set``) rate: an unkeyed tokens limit
        whose cost is an estimate follows the provider's tokens per minute. ``None``
        (the default): the response speaks for the limit as a whole, as without
        dimensions. Needs the upstream hook on the task's calls.
    plan:
        Where a task's *plan* comes from: a template over its arguments such as
        ``"{plan}"`` (the grammar of ``key``), or a callable of its arguments. Needs
        ``plans``.
    plans:
        The plan table: plan name -> the rate and burst of a key on that plan, such as
        ``{"free": "10/s burst 5", "pro": "100/s burst 50"}``. Every plan keeps the
        limit's algorithm, key and cost; each key's state runs at its plan's rate. A task
        whose plan is not in the table (or whose plan argument is missing, or not text or
        an integer) gets the limit's own ``rate``. On a ``fair`` limit a plan gives the
        key's weight in the shared rate (a number > 0: ``{"free": 1, "pro": 4}``) where
        ``weights`` does not list the key. Keyed limits only; not for concurrency
        limits, nor with ``adaptive``. A rate set at run time for the whole limit
        (``celery throttle set``) applies to every plan; one set for a key (``--key``) to
        that key, whatever its plan.
    mode:
        ``"enforce"``: the limit delays its tasks. ``"shadow"``: it decides and records
        everything (the decision, the wait it would impose, metrics, a Flower event, the
        would-be delays in ``celery throttle status``), on a twin state of its own, but
        its tasks run at once and nothing it takes delays any other task: a new limit
        tried on a live fleet. ``None`` (the default): ``settings.mode``. ``celery
        throttle enforce`` and ``shadow`` switch a limit at run time. Not for
        concurrency limits.
    """

    limit: Limit
    key: KeySource = None
    cost: CostSource = 1.0
    max_wait_s: float | None = None
    on_timeout: OnTimeout = "fail"
    on_error: OnError = "keep"
    on_redis_down: OnRedisDown = "defer"
    cold_start: ColdStart = "full"
    spacing_guard: bool | None = None
    adaptive: Adaptive | None = None
    upstream: str | None = None
    plan: KeySource = None
    plans: Any = None
    mode: str | None = None
    key_fields: tuple[str, ...] = field(init=False, repr=False, compare=False)
    """The argument names a key template reads (empty for a callable or no key)."""
    fail_open_s: float | None = field(init=False, repr=False, compare=False)
    """``allow:DURATION``: how long the rule fails open, in s; ``None``: ``allow`` (the
    setting ``fail_open_for`` applies), or not failing open (``defer``, ``local``)."""
    key_template: KeyTemplate | None = field(init=False, repr=False, compare=False)
    """The parsed key template (None for a callable or no key)."""
    redis_down: RedisDown = field(init=False, repr=False, compare=False)
    """The parsed ``on_redis_down``."""
    dead_letter_queue: str | None = field(init=False, repr=False, compare=False)
    """The queue of ``on_timeout: dead_letter:QUEUE``, else None."""
    plan_template: KeyTemplate | None = field(init=False, repr=False, compare=False)
    """The parsed plan template (None for a callable or no plan)."""
    plan_limits: Mapping[str, Limit] = field(init=False, repr=False, compare=False)
    """Each plan's limit: the limit's name, algorithm and fairness at the plan's numbers
    (empty without plans)."""

    def __post_init__(self) -> None:
        name = self.limit.name if isinstance(self.limit, Limit) else None
        if not isinstance(self.limit, Limit):
            raise ConfigError("a rule needs a Limit", field="limit", value=self.limit)
        template = None
        if isinstance(self.key, str):
            if not self.key:
                raise ConfigError("an empty key template", field="key", value="", limit=name)
            template = parse_key_template(self.key, limit=name, source=None)
            if not template.paths:
                hint = (
                    f": write '{{{self.key}}}' for the argument" if self.key.isidentifier() else ""
                )
                raise ConfigError(
                    "a key template names the task's arguments that make the key, such as "
                    f"'{{tenant_id}}': without a field, every task would share one key{hint}",
                    field="key", value=self.key, limit=name,
                )  # fmt: skip
        elif self.key is not None and not callable(self.key):
            raise ConfigError(
                "must be a template string such as '{tenant_id}' or a callable",
                field="key", value=self.key, limit=name,
            )  # fmt: skip
        if self.limit.fair and self.key is None:
            raise ConfigError(
                "a fair limit shares its rate among the values of its key: give it a key, "
                "such as '{tenant_id}'",
                field="fair", value=True, limit=name,
            )  # fmt: skip
        object.__setattr__(self, "key_template", template)
        object.__setattr__(self, "key_fields", () if template is None else template.heads)
        cost, number = self.cost, real(self.cost)
        if number is None and not (isinstance(cost, str) or callable(cost)):
            raise ConfigError(
                "must be a number, an argument name or a callable",
                field="cost", value=cost, limit=name,
            )  # fmt: skip
        if number is not None:
            if not (0 <= number <= self.limit.capacity):
                hint = ""
                if number > self.limit.capacity:  # the default cost 1 on '0.5/s', say
                    hint = f": no task could ever run; {_room_for(self.limit, number)}"
                raise ConfigError(
                    f"must be a number from 0 to the limit's capacity "
                    f"{self.limit.capacity:g}{hint}",
                    field="cost", value=cost, limit=name,
                )  # fmt: skip
            object.__setattr__(self, "cost", number)
        elif isinstance(cost, str) and not cost.isidentifier():
            raise ConfigError(
                "must be a number or the name of an argument", field="cost", value=cost,
                limit=name,
            )  # fmt: skip
        if self.max_wait_s is not None:
            object.__setattr__(
                self, "max_wait_s", parse_duration(self.max_wait_s, field="max_wait", limit=name)
            )
        timeout = self.on_timeout
        if not isinstance(timeout, str) or not (
            timeout == "fail"
            or (
                timeout.startswith("dead_letter:")
                and timeout[12:].strip()
                and text_error(timeout) is None
            )
        ):
            raise ConfigError(
                "must be 'fail' or 'dead_letter:QUEUE'", field="on_timeout", value=timeout,
                limit=name,
            )  # fmt: skip
        if self.on_error not in ("keep", "refund"):
            raise ConfigError(
                "must be 'keep' or 'refund'", field="on_error", value=self.on_error, limit=name
            )
        policy, fail_open_s = _redis_down(self.on_redis_down, name)
        object.__setattr__(self, "redis_down", policy)
        object.__setattr__(self, "fail_open_s", fail_open_s)
        dead_letter = timeout.partition(":")[2] if timeout.startswith("dead_letter:") else None
        object.__setattr__(self, "dead_letter_queue", dead_letter)
        if policy is RedisDown.LOCAL and self.limit.algorithm.holds_units:
            raise ConfigError(
                "'local' needs a rate; a concurrency limit has none: use 'defer' or 'allow'",
                field="on_redis_down", value=self.on_redis_down, limit=name,
            )  # fmt: skip
        if self.adaptive is not None:
            if not isinstance(self.adaptive, Adaptive):
                raise ConfigError(
                    "must be an Adaptive (or, in a limits file, true)", field="adaptive",
                    value=self.adaptive, limit=name,
                )  # fmt: skip
            self.adaptive.check(self.limit)
        if self.upstream is not None:
            dimension = dimension_name(self.upstream)
            if dimension is None:
                raise ConfigError(
                    "must be the name of a dimension of the upstream's limit, as its headers "
                    "name it: requests, tokens, input-tokens, output-tokens, a GitHub "
                    "resource (core, search...), a Stripe reason (global-rate...) or "
                    "Discord's global, route or shared",
                    field="upstream", value=self.upstream, limit=name,
                )  # fmt: skip
            object.__setattr__(self, "upstream", dimension)
        if self.cold_start not in ("full", "empty"):
            raise ConfigError(
                "must be 'full' (a fresh burst) or 'empty' (start at the rate)",
                field="cold_start", value=self.cold_start, limit=name,
            )  # fmt: skip
        if self.cold_start == "empty" and (
            self.key is not None or self.limit.algorithm.holds_units
        ):
            raise ConfigError(
                "'empty' is for unkeyed rate limits: per-key states cannot be listed once "
                "Redis lost them, and a concurrency limit's state is its running holders",
                field="cold_start", value=self.cold_start, limit=name,
            )  # fmt: skip

        if self.spacing_guard is not None and not isinstance(self.spacing_guard, bool):
            raise ConfigError(
                "must be true or false (or left out: on for burst-1 GCRA and token bucket "
                "limits)",
                field="spacing_guard", value=self.spacing_guard, limit=name,
            )  # fmt: skip
        if self.spacing_guard and self.limit.algorithm.holds_units:
            raise ConfigError(
                "a concurrency limit has no spacing to guard",
                field="spacing_guard", value=self.spacing_guard, limit=name,
            )  # fmt: skip
        self._check_plans(name)
        if self.mode not in (None, "enforce", "shadow"):
            raise ConfigError(
                "must be 'enforce' (the limit delays its tasks) or 'shadow' (it records what "
                "it would do, and its tasks run at once)",
                field="mode", value=self.mode, limit=name,
            )  # fmt: skip
        if self.mode == "shadow" and self.limit.algorithm.holds_units:
            raise ConfigError(
                "a concurrency limit cannot run in shadow: its units are held while tasks "
                "run, which a shadow may not do",
                field="mode", value=self.mode, limit=name,
            )  # fmt: skip

    def _check_plans(self, name: str) -> None:
        """Parse ``plan`` and ``plans``: each plan's limit, checked against the rule."""
        object.__setattr__(self, "plan_template", None)
        object.__setattr__(self, "plan_limits", {})
        if self.plan is None and self.plans is None:
            return
        if self.plans is None:
            raise ConfigError(
                "a plan template needs a plan table: add plans, such as "
                "{free: 10/s burst 5, pro: 100/s}",
                field="plan", value=self.plan, limit=name,
            )  # fmt: skip
        if self.plan is None:
            raise ConfigError(
                "a plan table needs a plan template naming the task's argument that holds "
                "the plan: add plan, such as '{plan}'",
                field="plans", value=_plain_plans(self.plans), limit=name,
            )  # fmt: skip
        if isinstance(self.plan, str):
            if not self.plan:
                raise ConfigError("an empty plan template", field="plan", value="", limit=name)
            try:
                template = parse_key_template(self.plan, limit=name, source=None)
            except ConfigError as exc:
                raise ConfigError(exc.problem, field="plan", value=self.plan, limit=name) from None
            if not template.paths:
                raise ConfigError(
                    "a plan template names the task's argument that holds the plan, such as "
                    "'{plan}': without a field, every task would be on the same plan",
                    field="plan", value=self.plan, limit=name,
                )  # fmt: skip
            object.__setattr__(self, "plan_template", template)
        elif not callable(self.plan):
            raise ConfigError(
                "must be a template string such as '{plan}' or a callable",
                field="plan", value=self.plan, limit=name,
            )  # fmt: skip
        limit = self.limit
        if limit.algorithm.holds_units:
            raise ConfigError(
                "plans set a rate per key; a concurrency limit has none (give each plan "
                "its own concurrency limit instead)",
                field="plans", value=_plain_plans(self.plans), limit=name,
            )  # fmt: skip
        if self.key is None:
            raise ConfigError(
                "plans set each key's rate: give the limit a key, such as '{tenant_id}' "
                "(with one state for every task, tasks of different plans would share it)",
                field="plans", value=_plain_plans(self.plans), limit=name,
            )  # fmt: skip
        if self.adaptive is not None:
            raise ConfigError(
                "an adaptive limit learns one rate under its own; with plans, each key's rate "
                "comes from its plan: not both on one limit (yet)",
                field="plans", value=_plain_plans(self.plans), limit=name,
            )  # fmt: skip
        if isinstance(self.plans, tuple):
            pairs = self.plans
        elif isinstance(self.plans, Mapping):
            pairs = tuple(self.plans.items())
        else:
            pairs = None
        if not pairs or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise ConfigError(
                "must be a non-empty mapping of plan names to rates, such as "
                "{free: 10/s burst 5, pro: 100/s}" + (" (to weights on a fair limit)"
                                                        if limit.fair else ""),
                field="plans", value=self.plans, limit=name,
            )  # fmt: skip
        limits: dict[str, Limit] = {}
        for written, spec in pairs:
            plan = written
            if isinstance(written, int) and not isinstance(written, bool):
                plan = str(written)  # a plan named 1 in YAML, read from an argument as 1 or "1"
            if not isinstance(plan, str) or not plan:
                raise ConfigError(
                    "a plan's name must be a non-empty string"
                    + (", not null (YAML reads a bare `null`, `~` or empty name so)"
                       if plan is None else ""),
                    field="plans", value=plan, limit=name,
                )  # fmt: skip
            if plan in limits:  # 2 and "2": one plan, since an argument of 2 or "2" is it
                raise ConfigError(
                    f"plan {plan!r} is named twice (as {plan} and as {plan!r}): a task's plan "
                    f"argument of either matches both, so keep one",
                    field=f"plans.{plan}", value=spec, limit=name,
                )  # fmt: skip
            limits[plan] = _plan_limit(limit, plan, spec)
            cost = real(self.cost)
            if cost is not None and cost > limits[plan].capacity:
                raise ConfigError(
                    f"the burst {limits[plan].capacity:g} of plan {plan!r} is below the "
                    f"limit's cost {cost:g}: no task on this plan could run",
                    field=f"plans.{plan}", value=spec, limit=name,
                )  # fmt: skip
        object.__setattr__(self, "plans", tuple(sorted((str(p), s) for p, s in pairs)))
        object.__setattr__(self, "plan_limits", limits)

    @property
    def name(self) -> str:
        return self.limit.name

    def limit_for(
        self, named: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Limit:
        """The limit of a task with these arguments: its plan's, or the rule's own limit
        (no plans; a plan not in the table; no plan argument, or one that is not text or
        an integer)."""
        if not self.plan_limits:
            return self.limit
        plan = self.plan
        if callable(plan):
            value = _call(self, "plan", plan, args, kwargs)
        else:
            template = self.plan_template
            assert template is not None  # a str plan is parsed by Rule
            try:
                value = _render(self, template, named, "plan")
            except ConfigError:  # no such argument, or a value that names no plan
                return self.limit
        if isinstance(value, int) and not isinstance(value, bool):
            value = int.__repr__(value)
        if not isinstance(value, str):
            return self.limit
        return self.plan_limits.get(str.__str__(value), self.limit)

    @property
    def guarded(self) -> bool:
        """Whether the call-time spacing guard applies (``spacing_guard``, or its
        default: GCRA and token bucket limits of burst 1). With a plan table, the default
        asks it of every limit a task may get: the rule's own and each plan's. A burst-1
        ``rate`` beside plans of larger bursts must not space every call of those plans
        (no burst, one more round trip each); the guard is decided per rule, not per
        task, so a table that mixes burst 1 with larger bursts is unguarded unless
        ``spacing_guard: true`` says so."""
        if self.spacing_guard is not None:
            return self.spacing_guard
        return all(
            limit.capacity == 1 and limit.algorithm.reserves
            for limit in (self.limit, *self.plan_limits.values())
        )

    @property
    def estimated(self) -> bool:
        """True when the cost comes from the task (an argument or a callable): an estimate
        that a reported actual cost replaces."""
        return not isinstance(self.cost, float)


def _plain_plans(plans: object) -> object:
    """A plan table as written, for an error message."""
    return dict(plans) if isinstance(plans, tuple) else plans


def _plan_limit(limit: Limit, plan: str, spec: object) -> Limit:
    """The limit of one plan of ``limit``: its rate and burst (a fair limit: its weight)."""
    where = f"plans.{plan}"
    if limit.fair:
        weight = real(spec)
        if weight is None or not 0 < weight < math.inf:
            raise ConfigError(
                "a plan of a fair limit gives its keys' weight in the shared rate: a "
                "number > 0, such as 4",
                field=where, value=spec, limit=limit.name,
            )  # fmt: skip
        try:
            return replace(limit, default_weight=weight)
        except ConfigError as exc:
            raise ConfigError(exc.problem, field=where, value=spec, limit=limit.name) from None
    # Limit.parse refuses a spec that is not a string, naming the field.
    return Limit.parse(cast("str", spec), name=limit.name, algorithm=limit.algorithm, field=where)


# -- what a task declares ------------------------------------------------------------------

UNSET: Any = object()
"""An option of ``@throttled`` that was not given (``None`` is a value of some)."""


@dataclass(frozen=True)
class Declared:
    """What ``@throttled`` or ``ThrottledTask.throttle`` names: inline rules, and names of
    rules in the limits file (resolved when the worker starts), with overrides of their
    fields."""

    rules: tuple[Rule, ...] = ()
    names: tuple[str, ...] = ()
    overrides: Mapping[str, Any] = field(default_factory=dict)


def declare(
    items: Sequence[Limit | Rule | str], owner: str, options: Mapping[str, Any]
) -> Declared:
    """The rules named by ``items`` (names in the limits file, inline rates such as
    ``"20/s burst 1"``, Limits or Rules), with ``options`` (Rule fields, and ``algorithm``
    for inline rates; :data:`UNSET` ones left out). ``owner`` names inline limits and
    errors (the task's function)."""
    rules: list[Rule] = []
    names: list[str] = []
    rule_options = {k: v for k, v in options.items() if v is not UNSET and k != "algorithm"}
    algorithm = options.get("algorithm", UNSET)
    for i, item in enumerate(items):
        if isinstance(item, Rule):
            rules.append(item)
        elif isinstance(item, Limit):
            rules.append(Rule(item, **rule_options))
        elif isinstance(item, str) and _inline_rate(item):
            name = owner if len(items) == 1 else f"{owner}#{i + 1}"
            algo = None if algorithm is UNSET else algorithm
            limit = Limit.parse(item, name=name, algorithm=algo, source=owner)
            rules.append(Rule(limit, **rule_options))
        elif isinstance(item, str) and item:
            names.append(item)
        else:
            raise ConfigError(
                "a throttled limit is a rate such as '20/s', the name of a limit in the "
                "config file, a Limit or a Rule",
                value=item, source=owner,
            )  # fmt: skip
    if names and rule_options and not rules:
        # Checked now, as they would be on an inline limit, not when a task first runs:
        # on a stand-in of the named limit (its own numbers come from the file later).
        stand_in = Limit.parse(_STAND_IN, name=names[0], source=owner)
        try:
            Rule(stand_in, **rule_options)
        except ConfigError as exc:
            raise ConfigError(
                exc.problem, field=exc.field, value=exc.value, limit=exc.limit, source=owner
            ) from None
    return Declared(tuple(rules), tuple(names), rule_options)


def _room_for(limit: Limit, cost: float) -> str:
    """How to give ``limit`` room for a fixed ``cost`` above its capacity, in the words of
    its algorithm (only token bucket and GCRA limits take a burst)."""
    if limit.algorithm is Algorithm.CONCURRENCY:
        return f"allow at least {math.ceil(cost)} concurrent"
    if limit.algorithm in (Algorithm.TOKEN_BUCKET, Algorithm.GCRA):
        advice = f"give the limit a burst of at least {cost:g}"
        if limit.capacity < 1:  # a count below 1 is the capacity: '0.5/s'
            advice += " (a rate of 0.5/s holds 0.5 at once, 1/2s holds 1)"
        return advice
    return f"a window holds its count: give the rate a count of at least {cost:g}"


def _inline_rate(item: str) -> bool:
    """Whether ``item`` of ``@throttled`` is an inline rate (``"20/s burst 1"``, ``"8
    concurrent"``) rather than the name of a limit in the file: a rate starts with its
    count, while a file's limit name may hold a ``/`` (``github/core``) or ``concurrent``
    (``max-concurrent``). A malformed rate that starts with a number (``"20/x"``) is still
    refused as a rate, naming the mistake."""
    text = item.lstrip()
    return text[:1] in _RATE_START and ("/" in text or "concurrent" in text.lower())


_RATE_START = frozenset("0123456789.+-")
"""How an inline rate (or a negative or fractional count, refused as a rate) starts."""

_STAND_IN = f"{MAX_AMOUNT:.0f}/s"
"""A rate no option's check can find too small (a fixed cost, a plan's burst)."""


# -- keys and costs from a task's arguments ------------------------------------------------

# inspect.signature costs tens of us; a task's function never changes.
_signature = functools.lru_cache(maxsize=1024)(inspect.signature)


def _plain_parameters(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """The names of ``fn``'s parameters when each is positional-or-keyword (no ``*args``,
    ``**kwargs``, keyword- or positional-only ones: then binding a call is a zip), else
    None."""
    try:
        parameters = _signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters):
        return tuple(p.name for p in parameters)
    return None


_plain = functools.lru_cache(maxsize=1024)(_plain_parameters)


def _parameter_defaults(fn: Callable[..., Any]) -> tuple[tuple[str, Any], ...]:
    """The parameters of ``fn`` that have a default value, with it (none when its
    signature cannot be read)."""
    try:
        parameters = _signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(
        (p.name, p.default) for p in parameters if p.default is not inspect.Parameter.empty
    )


_defaults = functools.lru_cache(maxsize=1024)(_parameter_defaults)


class _Unbound(dict[str, Any]):
    """The keyword arguments of a call that the task's function refuses, and why: an
    argument a template or a cost names is then missing for that reason."""

    def __init__(self, kwargs: Mapping[str, Any], problem: str) -> None:
        super().__init__(kwargs)
        self.problem = problem


def _no_argument(named: Mapping[str, Any], what: str) -> str:
    """Why the argument(s) ``what`` names are missing from ``named``."""
    if isinstance(named, _Unbound):
        return f"the call does not fit the task's parameters ({named.problem}): no {what}"
    return f"the task has no {what}"


def _call(
    rule: Rule, field: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A key, cost or plan function of ``rule`` on the task's arguments; what it raises
    as a ConfigError naming the limit and field (chained to the original)."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        raise ConfigError(
            f"the {field} function raised {type(exc).__name__}: {exc}", field=field,
            limit=rule.name,
        ) from exc  # fmt: skip


def named_arguments(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The arguments of a call of ``fn`` by name: positional ones bound to its parameters,
    and the parameters the call leaves out at their default values (what the body sees)."""
    try:
        names = _plain(fn)
    except TypeError:  # not hashable
        names = None
    if names is not None:
        # Signature.bind_partial's answer, in a fraction of its time (a task's function
        # usually has plain parameters). A call it refuses (too many arguments, one given
        # twice or unknown) gives the keyword arguments alone, as below.
        if len(args) > len(names):
            return _Unbound(kwargs, f"{len(args)} positional arguments for {len(names)}")
        named = dict(zip(names, args, strict=False))
        for name in kwargs:
            if name in named:
                return _Unbound(kwargs, f"argument {name!r} given twice")
            if name not in names:
                return _Unbound(kwargs, f"an unexpected keyword argument {name!r}")
        named.update(kwargs)
        if len(named) < len(names):
            for name, default in _defaults(fn):
                named.setdefault(name, default)
        return named
    try:
        signature = _signature(fn)
        bound = signature.bind_partial(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        return _Unbound(kwargs, str(exc))
    bound.apply_defaults()
    named = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and parameter.name in named:
            named.update(named.pop(parameter.name))
    return named


_FORMATTER = string.Formatter()


def _key_text(rule: Rule, value: object, what: str, field: str = "key") -> str:
    """One value of a key as text. Only ``str`` and ``int`` qualify: an int is the same
    key as its decimal string (``42`` and ``"42"`` are one tenant, as JSON producers may
    send either). Anything else (None, bool, float, bytes, lists, objects) is refused
    rather than passed through ``str()``: ``None`` would share the bucket of a tenant named
    "None", and an object's ``__str__`` or ``__format__`` may return the same text for
    distinct values. A ``str`` subclass is read as the plain string it holds."""
    if isinstance(value, str):
        text = str.__str__(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            text = int.__repr__(value)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise ConfigError(
                f"{what} is an integer too long for a key", field=field, value=value,
                limit=rule.name,
            ) from None  # fmt: skip
    else:
        raise ConfigError(
            f"{what} is {type(value).__name__}, not text or an integer: it cannot name a "
            "bucket",
            field=field, value=value, limit=rule.name,
        )  # fmt: skip
    problem = text_error(text)
    if problem is not None:
        raise ConfigError(
            f"{what} is not Unicode text (it has {problem})", field=field, value=text,
            limit=rule.name,
        )  # fmt: skip
    return text


def _render(rule: Rule, template: KeyTemplate, named: Mapping[str, Any], what: str) -> str:
    """A template of ``rule`` (its key's, or its plan's: ``what`` names the field) over
    the task's arguments: distinct arguments give distinct texts, or a ConfigError."""
    missing = [name for name in template.heads if name not in named]
    if missing:
        raise ConfigError(
            f"{_no_argument(named, 'argument ' + ', '.join(map(repr, missing)))} for the {what} "
            "template",
            field=what, value=_written(rule, what), limit=rule.name,
        )  # fmt: skip
    texts = []
    for path, whole in zip(template.paths, template.whole, strict=True):
        if whole:  # what get_field reads for a bare name, without parsing the path
            texts.append(_key_text(rule, named[path], f"{{{path}}}", what))
            continue
        try:
            found = _FORMATTER.get_field(path, (), named)[0]
        except Exception as exc:  # a missing attribute or index, or a hostile __getattr__
            raise ConfigError(
                f"cannot read {{{path}}} of the task's arguments for the {what} template "
                f"({type(exc).__name__}: {str(exc)[:100]})",
                field=what, value=_written(rule, what), limit=rule.name,
            ) from None  # fmt: skip
        texts.append(_key_text(rule, found, f"{{{path}}}", what))
    if len(texts) > 1:
        # Each value without the template's separators, so the key reads back one way.
        texts = [encode_part(text) for text in texts]
    literals = template.literals
    return literals[0] + "".join(t + lit for t, lit in zip(texts, literals[1:], strict=True))


def argument_errors(
    rule: Rule, fn: Callable[..., Any], task: str, source: str | None = None
) -> list[ConfigError]:
    """What of ``rule`` names an argument that ``fn`` (task ``task``'s function) does not
    have: a head of its key or plan template, its cost's argument. Checked when a worker
    starts: every call of the task would fail on the key or cost (a ConfigError per
    task), or fall back to the limit's own rate for the plan, which a misspelt name
    must not do silently. Nothing is found for a function that takes ``**kwargs`` or
    whose signature cannot be read (any name may come), nor for callables."""
    try:
        parameters = _signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return []
    names = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    found: list[tuple[str, str, object]] = []  # (field, problem, value)
    for what, template in (("key", rule.key_template), ("plan", rule.plan_template)):
        missing = [head for head in template.heads if head not in names] if template else []
        if missing:
            named = ", ".join(map(repr, missing))
            found.append(
                (what, f"no argument {named} for the {what} template", _written(rule, what))
            )
    if isinstance(rule.cost, str) and rule.cost not in names:
        found.append(("cost", "no argument of this name for the cost", rule.cost))
    # A bound task's ``self`` is the task, not an argument its callers give.
    listed = ", ".join(sorted(names - {"self"})) or "none"
    return [
        ConfigError(
            f"task {task!r} has {problem} (its arguments: {listed})",
            field=what,
            value=value,
            limit=rule.name,
            source=source,
        )
        for what, problem, value in found
    ]


def _written(rule: Rule, what: str) -> object:
    return rule.key if what == "key" else rule.plan


def key_for(
    rule: Rule, named: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """The key of ``rule`` for these arguments (``named``: :func:`named_arguments`):
    distinct arguments give distinct keys, or a ConfigError (see :func:`_key_text` and
    :func:`parse_key_template`)."""
    key = rule.key
    if key is None:
        return None
    if callable(key):
        value = _key_text(rule, _call(rule, "key", key, args, kwargs), "the key function's result")
    else:
        template = rule.key_template
        assert template is not None  # a str key is parsed by Rule
        value = _render(rule, template, named, "key")
    if not value:
        raise ConfigError(
            "the key is empty for this task's arguments", field="key", value=key, limit=rule.name
        )
    return value


def key_problem(rule: Rule, key: str) -> str | None:
    """Why ``key`` (as an operator types it: ``celery throttle pause api KEY``) is no key
    that ``rule``'s tasks can have, or None. A limit without a key has one state for
    every task. A key template of several fields percent-encodes each value in the key
    (:func:`_render`), so ``"{tenant}:{region}"`` with ``acme corp`` and ``eu`` is
    ``acme%20corp:eu``: a key that does not read back that way names nothing."""
    if rule.key is None:
        return f"limit {rule.name!r} has no key: it has one state for every task"
    template = rule.key_template
    if template is None or len(template.paths) < 2:
        return None  # a key function's, or one field's (not encoded): any text
    part = "[" + re.escape("".join(sorted(PART_ALPHABET))) + "]*"
    literals = template.literals
    pattern = re.escape(literals[0]) + "".join(part + re.escape(lit) for lit in literals[1:])
    if re.fullmatch(pattern, key):
        return None
    problem = (
        f"{key!r} is no key of limit {rule.name!r}: its key template {rule.key!r} "
        "percent-encodes each value in the key"
    )
    rest, values = key, []
    if rest.startswith(literals[0]):
        rest = rest[len(literals[0]) :]
        for literal in literals[1:-1]:
            value, found, rest = rest.partition(literal)
            if not found:
                return problem
            values.append(value)
        if rest.endswith(literals[-1]):
            values.append(rest[: len(rest) - len(literals[-1])] if literals[-1] else rest)
            encoded = literals[0] + "".join(
                encode_part(value) + lit for value, lit in zip(values, literals[1:], strict=True)
            )
            if re.fullmatch(pattern, encoded):
                return f"{problem} (did you mean {encoded!r}?)"
    return problem


def cost_for(
    rule: Rule, named: Mapping[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> float:
    """The cost of ``rule`` for these arguments: a finite number >= 0, or a ConfigError."""
    cost = rule.cost
    if isinstance(cost, float):
        return cost
    if isinstance(cost, str):
        if cost not in named:
            raise ConfigError(
                _no_argument(named, "argument of this name"), field="cost", value=cost,
                limit=rule.name,
            )  # fmt: skip
        value = named[cost]
    else:
        value = _call(rule, "cost", cost, args, kwargs)
    number = real(value)
    if number is None or not 0 <= number < math.inf:
        raise ConfigError(
            "the cost of this task is not a finite number >= 0", field="cost", value=value,
            limit=rule.name,
        )  # fmt: skip
    return number


def _configured(limit: Limit, key: str | None = None) -> Limit:
    return limit


def targets(
    rules: Sequence[Rule],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    current: Callable[[Limit, str | None], Limit] = _configured,
    *,
    by_name: bool | None = None,
) -> list[Target]:
    """Each rule's (limit, key, cost) for a call of ``fn`` with these arguments.

    The limit is the rule's, or its plan's for these arguments (:meth:`Rule.limit_for`);
    ``current(limit, key)`` gives the limit in force for the key (a rate changed at run
    time, for the limit or for the key: :meth:`throttle.rates.RateBook.current`), default
    the configured one. ``by_name``: whether some key template, plan template or cost
    names an argument (None: found from the rules; a caller that evaluates the same rules
    on every call knows it already)."""
    # Binding the arguments to names is only needed by templates and argument costs.
    if by_name is None:
        by_name = any(names_arguments(rule) for rule in rules)
    named = named_arguments(fn, args, kwargs) if by_name else {}
    found: list[Target] = []
    for rule in rules:
        key = key_for(rule, named, args, kwargs)
        limit = rule.limit_for(named, args, kwargs) if rule.plan_limits else rule.limit
        found.append((current(limit, key), key, cost_for(rule, named, args, kwargs)))
    return found


def kept_in_hand(found: Sequence[Target], margin_s: float) -> list[Target]:
    """``found`` with ``margin_s`` s of each bursty limit's refill kept in hand
    (:meth:`Limit.with_margin`), the burst never below the target's cost."""
    kept: list[Target] = []
    for limit, key, cost in found:
        margined = limit.with_margin(margin_s)
        if margined.capacity < cost:
            margined = limit if cost >= limit.capacity else replace(limit, burst=cost)
        kept.append((margined, key, cost))
    return kept


def names_arguments(rule: Rule) -> bool:
    """Whether ``rule`` reads the task's arguments by name: a key or plan template, or a
    cost named by an argument."""
    return isinstance(rule.key, str) or isinstance(rule.cost, str) or isinstance(rule.plan, str)
