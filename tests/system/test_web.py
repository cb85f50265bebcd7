"""The limits page (``celery throttle web``) in a real browser: headless Debian chromium
driven by Selenium through chromium-driver (``make test`` installs both). A real
``celery worker`` (1 x 2 prefork children) runs tasks of a live fleet against a private
redis-server; the page is served by the command, as an operator starts it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.apps.celery_limits import LIMITS
from tests.support.http import post_json
from tests.support.servers import RedisServer, free_port
from throttle import KeySpace, Limit, Limiter
from throttle.rates import RateBook
from workers.harness import ROOT, Worker, wait_ready
from workers.screenshot import CHROMIUM_FLAGS

pytestmark = pytest.mark.slow

CONFIG = (
    """
settings:
  sleep_max: 0.3s
  metrics: true
  metrics_dir: {metrics_dir}
  pause_recheck: 0.5s
limits:
"""
    + LIMITS
    + """\
  tiers: {{algorithm: gcra, rate: 1/s, key: "{{tenant}}", plan: "{{plan}}",
          plans: {{free: 10/s burst 5, pro: 100/s}}}}
  trial: {{algorithm: gcra, rate: 2/s, burst: 1, mode: shadow}}
  slots: {{rate: 1 concurrent}}
tasks:
  tests.apps.celery_app.live: [trial]
"""
)
TOKEN = "a-test-token-of-32-characters-xx"
APP = "tests.apps.celery_app"


def browser_paths() -> tuple[str, str]:
    """Debian's chromium and chromedriver (``make test`` installs them when missing)."""
    chromium = shutil.which("chromium")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail("chromium and chromedriver are missing: `make test` installs them (apt-get)")
    return chromium, driver


def state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/api/state", timeout=10) as response:
        data: dict[str, Any] = json.load(response)
        return data


def until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            found = check()
        except Exception:  # a row redrawn under the driver's hand: look again
            found = None
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"not seen within {timeout_s} s: {what}")


class Fleet:
    """A worker, two pages (read-only and with control), a producer, on a private Redis."""

    def __init__(self, tmp: Path, server: RedisServer) -> None:
        self.tmp = tmp
        config = tmp / "limits.yaml"
        config.write_text(CONFIG.format(metrics_dir=tmp / "metrics"))
        self.env = {"DEMO_BROKER_URL": server.url, "THROTTLE_CONFIG": str(config)}
        self.worker = Worker(
            "web", {**self.env, "THROTTLE_METRICS_PORT": str(free_port())}, concurrency=2,
            queues="celery", app=APP, log=tmp / "worker.log",
        )  # fmt: skip
        self.pages: list[subprocess.Popen[bytes]] = []
        self.producer = Celery("web", broker=server.url, backend=server.url, set_as_current=False)
        self.producer.conf.task_default_queue = "celery"
        self.client = redis.Redis.from_url(server.url)

    def page(self, *extra: str, host: str = "127.0.0.1") -> str:
        """Start ``celery throttle web`` on ``host`` and return its URL once it answers."""
        port = free_port()
        log = self.tmp / f"web-{port}.log"
        env = {**os.environ, **self.env, "THROTTLE_WEB_TOKEN": TOKEN}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", APP, "throttle", "web",
                 "--host", host, "--port", str(port), "--interval", "0.5", *extra],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.pages.append(proc)
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        # Up to 90 s: a shared 2-core host under load took 25 s to start the command.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the page exited: {log.read_text()[-2000:]}")
            try:
                state(url)
                return url
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"the page did not answer in 90 s: {log.read_text()[-2000:]}")

    def send(self, task: str, *args: Any) -> Any:
        return self.producer.send_task(f"{APP}.{task}", args)

    def cli(self, *args: str) -> str:
        """``celery -A APP throttle ARGS`` as an operator runs it; its output."""
        env = {**os.environ, **self.env}
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", APP, "throttle", *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return done.stdout

    def stop(self) -> None:
        for proc in self.pages:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.worker.stop()
        self.client.close()
        self.producer.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with RedisServer() as server:
        fleet = Fleet(tmp_path_factory.mktemp("web"), server)
        try:
            fleet.worker.start()
            wait_ready(fleet.producer, [fleet.worker])
            yield fleet
        finally:
            fleet.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, driver = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        if not flag.startswith("--virtual-time-budget"):
            options.add_argument(flag)
    options.add_argument("--window-size=1400,900")
    with tempfile.TemporaryDirectory(prefix="throttle-chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        # SE_OFFLINE: Selenium Manager must not look for a driver or browser to download.
        os.environ.setdefault("SE_OFFLINE", "true")
        chrome = webdriver.Chrome(options=options, service=Service(executable_path=driver))
        try:
            yield chrome
        finally:
            chrome.quit()


def cell(browser: WebDriver, limit: str, name: str) -> str:
    return str(browser.find_element(By.CSS_SELECTOR, f'tr[data-limit="{limit}"] .{name}').text)


def test_the_page_shows_a_live_fleet_and_pauses_a_limit(fleet: Fleet, browser: WebDriver) -> None:
    # Given a fleet running tasks under "live" (10/s burst 1) and keyed "fair" tasks
    url = fleet.page("--allow-control")
    handles = [fleet.send("live", x) for x in range(100)]
    handles += [fleet.send("fair_call", tenant, x) for x in range(6) for tenant in ("acme", "zeta")]
    # and under the keyed "tokens" (10000/d), 6000 each: one call per tenant runs, the
    # others wait hours (parked)
    tenants = ("acme", "zeta", "acme", "zeta", "acme")
    spent = [fleet.send("spend", tenant, 6000, 6000) for tenant in tenants]

    # When the page is loaded in the browser
    browser.get(url + "/")
    assert browser.title.startswith("Limits")

    # Then it shows the limit, its configured rate, and tasks being admitted
    until(lambda: browser.find_elements(By.CSS_SELECTOR, 'tr[data-limit="live"]'), 15, "a row")
    # (through until: the page redraws its rows every 0.5 s, a row found may go stale)
    until(lambda: cell(browser, "live", "configured").startswith("10/s burst 1"), 5, "burst")
    until(lambda: cell(browser, "live", "rate") == "10/s", 5, "the rate in force")
    admitted = until(
        lambda: float(cell(browser, "live", "now").split("/")[0] or 0) > 2
        and cell(browser, "live", "now"),
        20, "tasks admitted per second",
    )  # fmt: skip
    assert "est." not in admitted  # from the workers' counters (metrics on, same host)
    points = browser.find_element(By.CSS_SELECTOR, 'tr[data-limit="live"] svg.chart')
    assert int(points.get_attribute("data-points") or 0) >= 1
    assert browser.find_elements(By.CSS_SELECTOR, 'tr[data-limit="live"] svg polyline.limit')

    # And it updates by itself
    stamp = browser.find_element(By.ID, "updated").get_attribute("data-taken")
    until(
        lambda: browser.find_element(By.ID, "updated").get_attribute("data-taken") != stamp,
        5, "a newer snapshot",
    )  # fmt: skip

    # When pause is clicked without the token, the server refuses and the page says why
    until(lambda: browser.find_element(By.CSS_SELECTOR, "button.pause").click() or True, 5, "")
    until(lambda: "token is required" in browser.find_element(By.ID, "message").text, 5,
          "the refusal")  # fmt: skip
    assert {row["name"]: row for row in state(url)["limits"]}["live"]["hold"] is None

    # When the token is given and pause clicked
    browser.find_element(By.ID, "token").send_keys(TOKEN)
    until(
        lambda: browser.find_element(By.CSS_SELECTOR, 'button.pause[data-limit="live"]').click()
        or True,
        5, "a click",
    )  # fmt: skip

    # Then the limit is paused in Redis, the page shows it, and the fleet admits nothing
    until(lambda: cell(browser, "live", "hold") == "paused", 5, "the pause on the page")
    until(
        lambda: {row["name"]: row for row in state(url)["limits"]}["live"]["hold"]
        == {"paused": True, "held_s": None},
        5, "the pause in the state",
    )  # fmt: skip
    until(lambda: cell(browser, "live", "now") == "0/s", 5, "nothing admitted while paused")
    # and counts the tasks waiting in the workers' lines (none held for a near slot)
    until(
        lambda: not any((fleet.producer.control.inspect(timeout=1).scheduled() or {}).values())
        and int(cell(browser, "live", "waiting") or 0) > 0,
        15, "tasks in the lines",
    )  # fmt: skip

    # When resumed from the page, tasks flow again
    until(
        lambda: browser.find_element(By.CSS_SELECTOR, 'button.resume[data-limit="live"]').click()
        or True,
        5, "a click",
    )  # fmt: skip
    until(lambda: cell(browser, "live", "hold") == "\u2013", 5, "the pause lifted")  # a dash
    until(lambda: float(cell(browser, "live", "now").split("/")[0] or 0) > 2, 10, "admitted again")

    # A keyed limit: its parked tasks per key, the busiest first
    shown = ["3", "acme: 2", "zeta: 1"]
    until(lambda: cell(browser, "tokens", "parked").split("\n") == shown, 10, "parked per key")
    parked = {row["name"]: row for row in state(url)["limits"]}["tokens"]["parked"]
    assert parked == {
        "total": 3, "keys": [{"key": "acme", "count": 2}, {"key": "zeta", "count": 1}],
        "more_keys": 0,
    }  # fmt: skip
    assert cell(browser, "tokens", "tokens") == "per key"
    assert [spent[0].get(timeout=10), spent[1].get(timeout=10)] == [6000, 6000]
    for handle in handles[-12:]:
        handle.get(timeout=30)


def test_control_is_refused_without_the_flag_or_the_token(fleet: Fleet) -> None:
    read_only = fleet.page()
    status, answer = post_json(f"{read_only}/api/pause", {"limit": "live"}, TOKEN)
    assert status == 403 and "--allow-control" in answer["error"]
    assert state(read_only)["control"] is False

    controlled = fleet.page("--allow-control")
    for token in (None, "", TOKEN[:-1] + "y"):
        status, answer = post_json(f"{controlled}/api/pause", {"limit": "live"}, token)
        assert status == 401 and "token" in answer["error"], (token, answer)
    status, answer = post_json(f"{controlled}/api/pause", {"limit": "nope"}, TOKEN)
    assert status == 400 and "unknown limit 'nope'" in answer["error"]
    # a key of a limit without a key: it would pause nothing
    status, answer = post_json(f"{controlled}/api/pause", {"limit": "live", "key": "x"}, TOKEN)
    assert status == 400 and "limit 'live' has no key" in answer["error"]
    assert not {row["name"]: row for row in state(controlled)["limits"]}["live"]["hold"]

    # A page of another site cannot read it through DNS rebinding: the Host is checked
    request = urllib.request.Request(f"{controlled}/api/state", headers={"Host": "evil.example"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    refused.value.close()  # an HTTPError holds its response's socket
    assert refused.value.code == 421
    # and a health check's HEAD gets GET's status and headers, without a body
    head = urllib.request.Request(f"{controlled}/", method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as response:
        assert response.status == 200
        assert int(response.headers["Content-Length"]) > 0
        assert response.read() == b""


def test_the_page_shows_plans_key_rates_and_shadow_results(
    fleet: Fleet, browser: WebDriver
) -> None:
    # Given a limit with a plan table, a key given its own rate at run time, and a limit
    # in shadow mode ("trial", 2/s burst 1) on 20 tasks sent at once
    url = fleet.page()
    fleet.cli("set", "tiers", "250/s", "--key", "acme")
    # (the module's other test ran "live" tasks, under "trial" too: counted from here)
    before = ({row["name"]: row for row in state(url)["limits"]}["trial"]["shadow"] or {}).get(
        "tasks", 0
    )
    handles = [fleet.send("live", x) for x in range(20)]

    # When the page is loaded
    browser.get(url + "/")
    until(lambda: browser.find_elements(By.CSS_SELECTOR, 'tr[data-limit="tiers"]'), 15, "a row")

    # Then the plans and the key's own rate show under the configured rate
    shown = ["plan free: 10/s burst 5", "plan pro: 100/s burst 100"]
    until(
        lambda: [
            plan.text
            for plan in browser.find_elements(
                By.CSS_SELECTOR, 'tr[data-limit="tiers"] .configured .plan'
            )
        ]
        == shown,
        5, "the plans",
    )  # fmt: skip
    until(
        lambda: cell(browser, "tiers", "key-rate") == "key acme: 250/s", 10, "the key's rate"
    )  # fmt: skip
    # and the shadow limit says so, and what it would have done, once the tasks ran
    until(lambda: cell(browser, "trial", "mode") == "shadow mode: delays nothing", 5, "mode")
    for handle in handles:
        handle.get(timeout=60)

    def shown_as_counted() -> Any:
        seen = {row["name"]: row for row in state(url)["limits"]}["trial"]["shadow"]
        text = cell(browser, "trial", "shadow")
        counted = f"would have delayed {seen['delayed']} of {seen['tasks']}, p50 "
        return seen if seen["tasks"] >= before + 20 and text.startswith(counted) else None

    seen = until(shown_as_counted, 15, "the shadow's results, as the JSON counts them")
    # 20 more tasks at once against 2/s burst 1: at least 19 more would have waited
    assert seen["delayed"] >= 19 and seen["p95_s"] > 2.0
    trial = {row["name"]: row for row in state(url)["limits"]}["trial"]
    # And the JSON API carries the same
    tiers = {row["name"]: row for row in state(url)["limits"]}["tiers"]
    assert tiers["plans"] == {
        "free": {"rate": "10/s", "burst": 5.0}, "pro": {"rate": "100/s", "burst": 100.0},
    }  # fmt: skip
    assert (tiers["key_rates"], trial["mode"]) == ({"acme": "250/s"}, "shadow")
    # and, the limit enforced at run time, its shadow figures say they are the shadow's
    fleet.cli("enforce", "trial")
    try:
        until(
            lambda: cell(browser, "trial", "shadow").startswith(
                "enforced now; in shadow mode it would have delayed"
            ),
            15, "enforced now",
        )  # fmt: skip
    finally:
        fleet.cli("enforce", "trial", "--default")
    fleet.cli("clear", "tiers", "--key", "acme")
    until(lambda: not browser.find_elements(By.CSS_SELECTOR, ".key-rate"), 10, "the rate cleared")


def test_a_limit_with_many_keys_set_or_held_stays_one_short_row(
    fleet: Fleet, browser: WebDriver
) -> None:
    # Given a keyed limit with 300 tenants given a rate of their own and 300 held (a
    # fleet of many tenants; `status` lists two of each and counts the rest)
    url = fleet.page()
    book = RateBook(fleet.client, KeySpace())
    limiter = Limiter(fleet.client)
    tiers = Limit.parse("1/s", name="tiers", algorithm="gcra")
    keys = [f"tenant-{i:03d}" for i in range(300)]
    try:
        for key in keys:
            book.set_key(tiers, key, "5/s")
            limiter.hold("tiers", key, 120)
        # When the page is loaded
        browser.get(url + "/")
        until(
            lambda: "+295 more keys set" in cell(browser, "tiers", "key-rates-more"),
            15, "the keys set, counted",
        )  # fmt: skip
        # Then it lists 5 of each and counts the others, and the row stays short: the
        # limits below it are still on the page, not 300 lines further down
        row = browser.find_element(By.CSS_SELECTOR, 'tr[data-limit="tiers"]')
        assert len(row.find_elements(By.CSS_SELECTOR, ".key-rate")) == 5
        assert "+295 more keys held" in cell(browser, "tiers", "key-holds-more")
        assert row.size["height"] < 400
        # and the JSON API still carries every one
        (data,) = [r for r in state(url)["limits"] if r["name"] == "tiers"]
        assert len(data["key_rates"]) == len(data["key_holds"]) == 300
    finally:
        for key in keys:
            book.clear_key("tiers", key)
            limiter.unhold("tiers", key)


def test_the_page_warns_of_a_limiter_redis_that_evicts_keys(
    fleet: Fleet, browser: WebDriver
) -> None:
    # Given the fleet's Redis set to evict keys when full (this test's own server)
    url = fleet.page()
    browser.get(url + "/")
    until(lambda: browser.find_elements(By.CSS_SELECTOR, "tr[data-limit]"), 15, "a row")
    assert not browser.find_element(By.ID, "warning").is_displayed()
    fleet.client.config_set("maxmemory", "1gb")
    fleet.client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        # Then the page names the policy at its next snapshot
        shown = until(
            lambda: (
                browser.find_element(By.ID, "warning").is_displayed()
                and browser.find_element(By.ID, "warning").text
            ),
            15,
            "the eviction warning",
        )
        assert "maxmemory-policy allkeys-lru" in shown
        assert state(url)["evicts"] == "allkeys-lru"
    finally:
        fleet.client.config_set("maxmemory-policy", "noeviction")
        fleet.client.config_set("maxmemory", "0")
    # And it goes away when the Redis no longer evicts
    until(lambda: not browser.find_element(By.ID, "warning").is_displayed(), 15, "no warning")


def test_a_full_concurrency_limit_frees_its_next_unit_on_release(
    fleet: Fleet, browser: WebDriver
) -> None:
    # Given a concurrency limit whose one unit a running task holds: its lease (5 minutes)
    # ends long after the task will, so the next unit comes back when the task ends
    url = fleet.page()
    limiter = Limiter(fleet.client)  # the workers' prefix and namespace: the defaults
    held = limiter.acquire(Limit.parse("1 concurrent", name="slots"), acquisition_id="held")
    assert held.allowed and held.acquisition is not None
    try:
        # When the page shows it
        browser.get(url + "/")
        until(lambda: browser.find_elements(By.CSS_SELECTOR, 'tr[data-limit="slots"]'), 15, "a row")
        row = until(
            lambda: (
                r := {row["name"]: row for row in state(url)["limits"]}["slots"]
            )["tokens"] == 0 and r,
            10, "the unit taken",
        )  # fmt: skip
        assert row["next_slot_s"] > 60  # the lease's end, not when a unit comes back

        # Then its next slot reads "on release", as `celery throttle status` says, not the
        # minutes until the lease would expire
        until(lambda: cell(browser, "slots", "slot") == "on release", 10, "on release")
        assert "on release" in fleet.cli("status", "--timeout", "0").split("slots", 1)[1]
    finally:
        limiter.release(held.acquisition)
    until(lambda: cell(browser, "slots", "slot") == "now", 10, "free again")


def test_the_page_listens_on_an_ipv6_address(fleet: Fleet, browser: WebDriver) -> None:
    # Given the page started on IPv6 loopback, as --host documents (`::` for every interface)
    url = fleet.page("--allow-control", host="::1")
    # Then it serves its state there, checks the Host header, and takes a pause
    assert [row["name"] for row in state(url)["limits"]][:2] == ["upstream", "slow"]
    request = urllib.request.Request(f"{url}/api/state", headers={"Host": "evil.example"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    refused.value.close()
    assert refused.value.code == 421
    assert post_json(f"{url}/api/pause", {"limit": "held"}, TOKEN)[0] == 200
    try:
        # and a browser draws it from there
        browser.get(url + "/")
        until(lambda: cell(browser, "held", "hold") == "paused", 15, "the pause on the page")
    finally:
        assert post_json(f"{url}/api/resume", {"limit": "held"}, TOKEN)[0] == 200
