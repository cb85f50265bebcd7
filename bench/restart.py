"""The limiter's Redis killed and restarted empty mid-run, many times: refusals at a strict API.

``python -m bench.restart [--runs 20] [--tasks 80] [--down 0]``

Each run (tests/support/restart.py) sends ``--tasks`` calls to 2 ``celery worker`` x 2
children of ``workers/demo_app.py``, throttled by a GCRA limit of 15/s burst 1 (the
default settings but ``park_after``) in front of the mock API at 20/s **burst 1** (strict
spacing, judged on arrival). 1, 2, 3 and 4 s after the first call reached the API, while
tasks sleep to their reserved slots, the limiter's Redis loses its data: SIGKILLed and
started again empty ``--down`` s later (at 1 and 3 s), flushed (at 2 and 4 s: a failover to
an empty replica). A run is good when the API refused nothing and every task completed and
reached the API exactly once. Prints one line per run and the count of good runs; exits 1
unless every run was good.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tests.support.restart import restart_fleet


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--tasks", type=int, default=80)
    parser.add_argument("--down", type=float, default=0.0, help="s between kill and restart")
    args = parser.parse_args(argv)
    good = 0
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="restart-", dir="/tmp") as tmp,
        restart_fleet(Path(tmp)) as fleet,
    ):
        for run in range(1, args.runs + 1):
            outcome = fleet.run(tasks=args.tasks, down_s=args.down)
            good += outcome.good
            print(f"run {run}: {'good' if outcome.good else 'BAD '} {outcome.line()}", flush=True)
    print(
        f"{good} of {args.runs} runs good (0 refused, every task once) "
        f"in {time.monotonic() - started:.0f} s"
    )
    return 0 if good == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
