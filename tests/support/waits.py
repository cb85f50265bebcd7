"""Waiting in tests for a condition the system under test reaches on its own time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(what: Callable[[], Any], timeout_s: float, step_s: float = 0.05) -> Any:
    """Poll ``what`` every ``step_s`` until it returns something true, and return that;
    raise TimeoutError after ``timeout_s`` (s, monotonic)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(step_s)
    raise TimeoutError(f"not true after {timeout_s} s: {what}")
