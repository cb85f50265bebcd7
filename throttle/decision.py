"""The results of the limiter: what was decided, what to settle later, how it settled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from throttle.errors import Throttled
from throttle.spec import Limit

__all__ = ["Acquisition", "Decision", "LimitState", "SettleStatus", "Settlement"]

SettleStatus = Literal["settled", "already_settled", "unknown", "mismatch"]


# LimitState and Decision are NamedTuples: immutable like a frozen dataclass, but built in a
# fraction of the time, and one of each is built on every acquire.
class LimitState(NamedTuple):
    """One limit's view of a decision (all times in seconds, from the Redis clock)."""

    limit: str
    allowed: bool
    remaining: float
    """Tokens (or units) left after this call; 0 when in debt."""
    retry_after_s: float
    """How long until this limit could admit the cost; 0 when it admitted it now."""
    reset_after_s: float
    """How long until this limit is back to full capacity if nothing else is taken."""

    def __bool__(self) -> bool:
        return self.allowed


@dataclass(frozen=True, slots=True)
class Acquisition:
    """What an admitted acquisition took: the handle for :meth:`Limiter.settle`.

    Only acquisitions with an id (given, or generated for concurrency limits) are recorded
    in Redis and can be settled; the record lives for the lease after the slot.
    """

    id: str
    costs: tuple[float, ...]
    """The cost taken from each target, in order."""
    targets: tuple[tuple[Limit, str | None], ...]
    keys: tuple[str, ...]
    """The state keys of the targets, in order, then the lease record key."""

    @property
    def cost(self) -> float:
        """The largest cost taken from one target (the cost, when all are the same)."""
        return max(self.costs)


class Decision(NamedTuple):
    """The answer to an acquisition over one or more limits.

    ``allowed`` is all or nothing: when any limit denies, nothing was taken from any.
    With a reservation (``max_wait_s`` > 0) an allowed decision may carry ``wait_s`` > 0:
    the cost is taken, and the caller's slot comes that many seconds from now.
    """

    allowed: bool
    remaining: float
    """The smallest ``remaining`` among the limits."""
    retry_after_s: float
    """When denied: the largest wait among the limits that could not admit the cost now."""
    reset_after_s: float
    """The largest ``reset_after_s`` among the limits."""
    wait_s: float
    """When allowed: seconds until the reserved slot (0 = now)."""
    limits: tuple[LimitState, ...]
    acquisition: Acquisition | None = None
    """Set when allowed and recorded (an acquisition id was given or needed)."""
    held: bool = False
    """True when the acquisition id already held a live lease (a redelivered task): allowed,
    nothing was taken again, ``wait_s`` is the time left until its slot."""
    late_s: float = 0.0
    """When ``held``: how long ago the reserved slot passed (0 if it has not yet)."""

    def __bool__(self) -> bool:
        return self.allowed

    @classmethod
    def denial(cls, limits: Sequence[str], retry_after_s: float) -> Decision:
        """A denial by ``limits`` for ``retry_after_s`` seconds that no limiter gave: what
        a caller decided for them (an upstream's word, a wait that may not be waited)."""
        states = tuple(LimitState(name, False, 0.0, retry_after_s, 0.0) for name in limits)
        return cls(False, 0.0, retry_after_s, 0.0, 0.0, states)

    @property
    def denied_by(self) -> tuple[str, ...]:
        """The names of the limits that could not admit the cost now."""
        return tuple(state.limit for state in self.limits if not state.allowed)

    def raise_if_denied(self) -> Decision:
        """Return self when allowed; raise :class:`Throttled` (with the delay) when denied.

        For callers that prefer an exception, as in ``limiter.acquire(...).raise_if_denied()``.
        """
        if not self.allowed:
            raise Throttled(self.retry_after_s, self.denied_by)
        return self


@dataclass(frozen=True, slots=True)
class Settlement:
    """The outcome of :meth:`Limiter.settle`.

    ``deltas`` are actual minus reserved cost, one per limit of the acquisition: > 0 was
    charged, < 0 refunded, as asked: a refund is capped by the limit's state (a bucket
    never above its burst, a GCRA slot never before now, a window only while the window
    that paid still counts), which the delta does not show. Any status other than
    ``"settled"`` means nothing changed (and ``deltas`` is empty).
    """

    status: SettleStatus
    deltas: tuple[float, ...] = ()

    @property
    def delta(self) -> float:
        """The change of the first limit (of the only one, usually); 0 when nothing changed."""
        return self.deltas[0] if self.deltas else 0.0

    @property
    def refunded(self) -> float:
        """Tokens given back to the first limit (0 when charged or nothing changed)."""
        return max(-self.delta, 0.0)

    @property
    def charged(self) -> float:
        """Extra tokens taken from the first limit (0 when refunded or nothing changed)."""
        return max(self.delta, 0.0)
