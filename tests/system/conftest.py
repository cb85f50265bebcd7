"""What every system test shares."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _collect_results() -> Iterator[None]:
    """Collect the test's garbage while its module's servers still run: Celery's
    ``AsyncResult`` leaves its result backend when collected, and one collected later (in
    a reference cycle) tries the stopped redis-server for 20 s, then fails whichever test
    is running then with its ignored exception."""
    yield
    gc.collect()
