"""The limiter's Redis killed and restarted empty mid-run, many times: refusals at a strict API.

``python -m bench.restart [--runs 20] [--tasks 120] [--down 0] [--control]``

Each run (tests/support/restart.py) sends ``--tasks`` calls to 2 ``celery worker`` x 2
children of ``workers/demo_app.py``, throttled by a GCRA limit of 15/s burst 1 (the
default settings but ``park_after``) in front of the mock API at 20/s **burst 1** (strict
spacing, judged on arrival). 1, 3, 5 and 7 s after the first call reached the API, while
tasks sleep to their reserved slots, the limiter's Redis loses its data: flushed (at 1, 5
and 7 s: a failover to an empty replica), SIGKILLed and started again empty ``--down`` s
later (at 3 s). A run is good when every task completed and reached the API exactly once,
and the API refused no call whose slot was too close to the last allowed call's (refusals
of calls that a loaded host made late are counted apart; ``tests/support/restart.py``,
``unexplained_refusals``). ``--control``: the same runs
without any loss. Prints one line per run and the count of good runs; exits 1
unless every run was good.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tests.support.restart import LOSSES, restart_fleet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--tasks", type=int, default=120)
    parser.add_argument("--down", type=float, default=0.0, help="s between kill and restart")
    parser.add_argument(
        "--control", action="store_true", help="no loss: the refusals a loaded host gives alone"
    )
    args = parser.parse_args(argv)
    good = 0
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="restart-", dir="/tmp") as tmp,
        restart_fleet(Path(tmp)) as fleet,
    ):
        for run in range(1, args.runs + 1):
            outcome = fleet.run(
                tasks=args.tasks, down_s=args.down, losses=() if args.control else LOSSES
            )
            good += outcome.good
            print(f"run {run}: {'good' if outcome.good else 'BAD '} {outcome.line()}", flush=True)
    print(
        f"{good} of {args.runs} runs good (no refusal of slots too close, every task once) "
        f"in {time.monotonic() - started:.0f} s"
    )
    return 0 if good == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
