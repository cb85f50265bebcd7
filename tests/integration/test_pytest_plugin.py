"""The pytest plugin (``throttle.pytest_plugin``), as a user's test suite meets it: a
project's conftest and tests run by pytest's ``pytester`` in this process, with Celery's
own fixtures (``celery.contrib.pytest``: ``celery_app``, ``celery_worker``, the embedded
test worker on the ``memory://`` broker) and the in-memory limiter."""

from __future__ import annotations

import pytest

from tests.support.servers import RedisServer

pytest_plugins = ["pytester"]

CONFTEST = """
import pytest

pytest_plugins = ("celery.contrib.pytest",)


@pytest.fixture(scope="session")
def celery_config():
    return {
        "broker_url": "memory://",
        "result_backend": "cache+memory://",
        "throttle_config": {
            "limits": {
                "slow": {"rate": "4/s burst 1"},
                "fast": {"rate": "1000/s"},
                "slower": {"rate": "2/s burst 1"},
            },
        },
    }


@pytest.fixture(scope="session")
def celery_parameters():
    from throttle.celery import ThrottledTask
    return {"task_cls": ThrottledTask}


@pytest.fixture
def celery_app(celery_app):
    from throttle.celery import install
    install(celery_app)
    return celery_app
"""

TESTS = """
import time

import pytest
from throttle.celery import throttled


@pytest.fixture
def tasks(celery_app):
    @celery_app.task
    @throttled("slow")
    def slow(n):
        return n

    @celery_app.task
    @throttled("fast")
    def fast(n):
        return n

    return slow, fast


def test_the_test_worker_throttles_in_memory(
    celery_app, tasks, throttle_memory, throttle_recorder, celery_worker
):
    slow, fast = tasks
    started = time.monotonic()
    results = [slow.delay(n) for n in range(4)]
    assert [r.get(timeout=20) for r in results] == [0, 1, 2, 3]
    assert time.monotonic() - started >= 0.7  # 4/s burst 1: the 4th at least 0.75 s on
    assert not throttle_recorder.throttled(results[0].id)
    # the worker's consumer takes their slots as they arrive, 0.25 s apart, and holds each
    # until its slot: the later ones were told to wait longer (about 0.25, 0.5, 0.75 s;
    # less when one arrived late)
    waits = [throttle_recorder.wait_s(result.id) for result in results[1:]]
    assert all(throttle_recorder.throttled(result.id) for result in results[1:])
    assert 0.2 <= waits[0] <= 0.3 and max(waits) <= 0.8, waits
    # by name, as hold("slow") takes it; a 4/s bucket refilling from its last slot
    assert throttle_memory.peek("slow").remaining <= 1


def test_the_test_worker_sends_back_a_task_whose_slot_is_far(
    celery_app, throttle_memory, throttle_recorder, celery_worker
):
    @celery_app.task
    @throttled("slower")
    def slower(n):
        return n

    celery_worker.reload()
    # 2/s burst 1: the last of six 2.5 s on, beyond sleep_max: some are sent back (a new
    # copy, recorded in the in-memory server), none fails
    results = [slower.delay(n) for n in range(6)]
    assert [r.get(timeout=20) for r in results] == [0, 1, 2, 3, 4, 5]


def test_each_test_starts_with_full_buckets(celery_app, tasks, throttle_memory):
    assert throttle_memory.peek("slow").remaining == 1


def test_eager_calls_are_recorded_too(celery_app, tasks, throttle_recorder):
    slow, _ = tasks
    celery_app.conf.task_always_eager = True
    try:
        first, second = slow.apply((1,)), slow.apply((2,))
    finally:
        celery_app.conf.task_always_eager = False
    assert not throttle_recorder.throttled(first.id)
    assert throttle_recorder.throttled(second.id)
    # a slot reserved 0.25 s ahead (the call slept to it), not a denial
    assert throttle_recorder.denied_by(second.id) == set()
    assert throttle_recorder.wait_s(second.id) == pytest.approx(0.25, abs=0.05)
    slow_limit = throttle_recorder.limiter.limits["slow"]
    denied = throttle_recorder.limiter.acquire(slow_limit, acquisition_id="by-hand")
    assert throttle_recorder.denied_by("by-hand") == {"slow"} and not denied


def test_throttling_off(celery_app, tasks, throttle_off):
    slow, _ = tasks
    started = time.monotonic()
    assert [slow.apply((n,)).get() for n in range(5)] == [0, 1, 2, 3, 4]
    assert time.monotonic() - started < 0.5
    assert getattr(celery_app, "_throttler", None) is None  # no limiter was built


def test_holds_work_in_memory(celery_app, tasks, throttle_memory):
    slow, _ = tasks
    throttle_memory.hold("slow", None, 60)
    assert throttle_memory.peek("slow").retry_after_s > 59
"""


def test_the_plugin_serves_celerys_test_worker_and_eager_tests(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_user=TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=6)


REDIS_TESTS = """
import pytest
from celery import Celery
from throttle.celery import ThrottledTask, install, throttled

app = Celery("user", broker="memory://", backend="cache+memory://", task_cls=ThrottledTask)
app.conf.throttle_config = {"limits": {"slow": {"rate": "2/s burst 1"}}}
install(app)


@app.task
@throttled("slow")
def slow(n):
    return n


@pytest.fixture
def throttle_app():
    return app


def test_on_a_real_redis(throttle_redis, throttle_recorder):
    first, second = slow.apply((1,)), slow.apply((2,))
    assert throttle_recorder.throttled(second.id)
    assert throttle_redis.keyspace.prefix.startswith("throttle-test-")
    assert throttle_redis.peek("slow").remaining < 1
    keys = list(throttle_redis.client.scan_iter(match=throttle_redis.keyspace.prefix + ":*"))
    assert keys


def test_with_celerys_test_worker(throttle_redis):
    from celery.contrib.testing.worker import start_worker

    with start_worker(app, pool="threads", perform_ping_check=False, shutdown_timeout=10):
        assert slow.delay(3).get(timeout=20) == 3


def test_without_a_redis_url_it_says_what_to_set(throttle_redis):
    pass
"""


def test_throttle_redis_uses_a_prefix_of_its_own_and_cleans_up(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_redis=REDIS_TESTS)
    with RedisServer() as server:
        client = server.client()
        client.set("theirs", "kept")
        result = pytester.runpytest_subprocess(
            "-q", "-p", "no:cacheprovider", "--throttle-redis-url", server.url,
            "test_redis.py::test_on_a_real_redis", "test_redis.py::test_with_celerys_test_worker",
        )  # fmt: skip
        result.assert_outcomes(passed=2)
        # (the worker's restart fence and clock check under the test's prefix too)
        assert [key.decode() for key in client.scan_iter()] == ["theirs"]
        client.close()
    monkeypatch.delenv("THROTTLE_TEST_REDIS_URL", raising=False)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-k", "without")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*throttle_redis needs a Redis: set $THROTTLE_TEST_REDIS_URL*"])


CONTRADICTIONS = """
def test_off_then_memory(throttle_off, throttle_memory):
    pass


def test_memory_then_off(throttle_memory, throttle_off):
    pass


def test_recorder_and_off(throttle_recorder, throttle_off):
    pass


def test_memory_and_its_recorder(throttle_memory, throttle_recorder):
    pass
"""


def test_fixtures_that_contradict_each_other_fail_the_test(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_contradictions=CONTRADICTIONS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    # whichever came last would have won, silently; the recorder's own limiter is fine
    result.assert_outcomes(passed=1, errors=3)
    result.stdout.fnmatch_lines(
        ["*throttle_off and throttle_memory contradict each other*"], consecutive=False
    )
    result.stdout.fnmatch_lines(
        ["*throttle_memory and throttle_off contradict each other*"], consecutive=False
    )
    # (the recorder's own limiter is not named: the test did not ask for it)
    result.stdout.fnmatch_lines(
        ["*throttle_recorder and throttle_off contradict each other*"], consecutive=False
    )
