"""The payload a parked task waits in Redis as (throttle.celery.message): written once by
``defer``, read by the releaser and by ``celery throttle parked``/``task``. No broker, no
Redis: the codec is pure."""

from __future__ import annotations

import pytest
from celery import Celery
from kombu.exceptions import ContentDisallowed, DecodeError

from throttle.celery.message import parked_payload, parked_signature

APP = Celery("payload", set_as_current=False)


def test_a_signature_comes_back_as_it_was_parked() -> None:
    # Given the signature of a task deferred to its queue's lane, with throttle headers
    sig = APP.signature(
        "proj.call",
        args=(1, "é\nline"),
        kwargs={"tenant": "acme"},
        options={
            "queue": "api.throttled",
            "task_id": "id-1",
            "headers": {"throttle_deferrals": 2, "throttle_deadline": 1.7e9},
        },
    )
    # When it is parked and read back
    payload = parked_payload(sig, "json")
    back = parked_signature(payload)
    # Then the releaser rebuilds the same task, queue, id and headers from it
    assert payload.startswith(b"application/json\nutf-8\n")
    again = APP.signature(back)
    assert (again.task, list(again.args), again.kwargs) == ("proj.call", [1, "é\nline"], sig.kwargs)
    assert again.options == sig.options


@pytest.mark.parametrize(
    ("payload", "error", "says"),
    [
        pytest.param(b"", ValueError, "content type, encoding, body", id="empty"),
        pytest.param(b"application/json\nutf-8", ValueError, "content type", id="no-body"),
        pytest.param(b"\xff\nutf-8\n{}", ValueError, "utf-8", id="head-not-utf8"),
        pytest.param(b"application/json\nutf-8\n[1]", ValueError, "not list", id="a-list"),
        pytest.param(b"text/x-unknown\nutf-8\n{}", ValueError, "not str", id="unknown-type"),
        pytest.param(b"application/json\nutf-8\n{nope", DecodeError, None, id="bad-json"),
        pytest.param(
            b"application/x-python-serialize\nbinary\nx", ContentDisallowed, "pickle", id="pickle"
        ),
    ],
)
def test_an_unreadable_payload_raises_rather_than_guess(
    payload: bytes, error: type[Exception], says: str | None
) -> None:
    with pytest.raises(error, match=says):
        parked_signature(payload)
