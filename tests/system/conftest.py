"""What every system test shares."""

from __future__ import annotations

import gc

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a module's last test, collect its garbage while the module's servers still
    run (they stop in the teardown that follows): Celery's ``AsyncResult`` leaves its
    result backend when collected, and one collected later (in a reference cycle) tries
    the stopped redis-server for 20 s, then fails whichever test runs then."""
    if nextitem is None or nextitem.module is not item.module:
        gc.collect()
