"""The model of lua/adapt.lua: what the upstream's answers teach about a limit's rate."""

from __future__ import annotations

from collections.abc import Sequence

# A gap between successes longer than this counts as this (adapt.lua's GAP_US): an idle
# fleet learns nothing.
_GAP_US = 1_000_000.0


def adapt(state: dict[str, float], now: float, argv: Sequence[str]) -> str:
    """The model of lua/adapt.lua: ``state`` (its HASH's fields as numbers, changed in
    place), ``now`` in us, ``argv`` its ARGV from the event on (ARGV[2:]). Returns its
    reply. The same operations in the same order as the script."""
    event = argv[0]
    ceiling = float(argv[1])
    adaptive = argv[2] == "1"
    floor = min(float(argv[3]), ceiling)
    decrease, recover_us = float(argv[4]), float(argv[5])
    episode_us, persist_count, persist_us = float(argv[6]), float(argv[7]), float(argv[8])
    m, p, s, e = state.get("m"), state.get("p", 0.0), state.get("s"), state.get("e")
    w, c = state.get("w"), state.get("c", 0.0)

    def clamp(rate: float) -> float:
        return max(floor, min(ceiling, rate))

    def learned() -> float:
        if not adaptive or m is None:
            return ceiling
        x = 1 - p / recover_us
        return clamp(m * (1 - (1 - decrease) * x * x * x))

    decreased = persist = 0
    rate = learned()
    writes: dict[str, float] | None = None
    if event == "refuse":
        if w is None or now - w > persist_us:
            w, c = now, 0.0
        c = c + 1
        if c >= persist_count:
            persist = 1
        writes = {"w": w, "c": c}
        if adaptive and (e is None or now >= e):
            m, p, e = rate, 0.0, now + episode_us
            s = e
            rate = clamp(m * decrease)
            decreased = 1
            writes.update(m=m, p=p, e=e, s=s)
    elif event == "success" and adaptive and m is not None:
        if now >= (e or 0):
            gap = now - (now if s is None else s)
            if gap > 0:
                p = p + min(gap, _GAP_US)
                rate = learned()
            s = now
            writes = {"p": p, "s": s}
    elif event == "state" and adaptive:
        m = clamp(float(argv[9]))
        p, s, e = recover_us, now, now
        rate = m
        writes = {"m": m, "p": p, "s": s, "e": e}
    if writes is not None:
        if adaptive:
            writes["r"] = rate
        state.update(writes)
    return f"{rate:.6f} {decreased} {persist} {int(c)}"
