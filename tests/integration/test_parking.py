"""The parking lot on a real Redis: due times, claims that expire, publish ids, exactly-once."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
import redis

from tests.support.clock import FakeClock
from throttle.parking import Claimed, ParkingLot
from throttle.redis.keys import KeySpace

LEAD_S = 2.0


@pytest.fixture
def lot(client: redis.Redis, prefix: str, clock: FakeClock) -> ParkingLot:
    """A lot on the test clock: the scripts use ``clock`` instead of Redis TIME."""
    return ParkingLot(client, KeySpace(prefix, "ns"), clock_us=clock)


def tokens(claimed: list[Claimed]) -> list[str]:
    return [c.token for c in claimed]


def test_park_then_claim_only_when_due_within_lead(lot: ParkingLot, clock: FakeClock) -> None:
    payload = b'{"task": "proj.call", "args": [1]}'
    token = lot.park(payload, 10.0)
    assert lot.counts() == (1, 0)
    assert lot.claim(lead_s=LEAD_S) == []
    # One microsecond before due - lead: still parked.
    clock.now_us += 8_000_000 - 1
    assert lot.claim(lead_s=LEAD_S) == []
    assert lot.counts() == (1, 0)
    clock.now_us += 1
    [claimed] = lot.claim(lead_s=LEAD_S)
    assert claimed.token == token
    assert claimed.payload == payload
    # Claimed exactly `lead` before its due time, on the lot's clock.
    assert claimed.due_in_s == pytest.approx(LEAD_S, abs=1e-6)
    assert lot.counts() == (0, 1)


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(bytes(range(256)), id="every-byte"),
        pytest.param(b"line one\nline two\r\n\n\x00\x00trailing\n", id="newlines-and-nul"),
        pytest.param("ünïcødé ✓".encode(), id="utf8"),
        pytest.param(b"", id="empty"),
        pytest.param(random.Random(7).randbytes(100_000), id="100kB-random"),
    ],
)
def test_payload_bytes_round_trip_exactly(
    lot: ParkingLot, clock: FakeClock, payload: bytes
) -> None:
    token = lot.park(payload, 0.5)
    clock.advance(1.0)
    [claimed] = lot.claim(lead_s=0.0)
    assert claimed.token == token
    assert claimed.payload == payload
    assert type(claimed.payload) is bytes
    # Overdue by half a second: a negative due_in_s.
    assert claimed.due_in_s == pytest.approx(-0.5, abs=1e-6)


def test_overdue_task_reports_how_late(lot: ParkingLot, clock: FakeClock) -> None:
    lot.park(b"x", 3.0)
    clock.advance(10.0)
    [claimed] = lot.claim(lead_s=LEAD_S)
    assert claimed.due_in_s == pytest.approx(-7.0, abs=1e-6)


def test_negative_delay_is_due_at_once(lot: ParkingLot) -> None:
    lot.park(b"x", -5.0)
    [claimed] = lot.claim(lead_s=0.0)
    assert claimed.due_in_s == 0.0


def test_claimed_task_is_not_handed_out_twice_while_claim_lives(
    lot: ParkingLot, clock: FakeClock
) -> None:
    lot.park(b"x", 1.0)
    clock.advance(1.0)
    first = lot.claim(lead_s=LEAD_S, claim_s=30.0)
    assert len(first) == 1
    # Another releaser, at any time until the claim expires, gets nothing.
    assert lot.claim(lead_s=LEAD_S, claim_s=30.0) == []
    clock.now_us += 30_000_000 - 1
    assert lot.claim(lead_s=LEAD_S, claim_s=30.0) == []
    assert lot.counts() == (0, 1)


def test_commit_forgets_the_task(
    client: redis.Redis, prefix: str, lot: ParkingLot, clock: FakeClock
) -> None:
    lot.park(b"one", 1.0)
    lot.park(b"two", 1.5)
    clock.advance(2.0)
    claimed = lot.claim(lead_s=0.0)
    assert lot.counts() == (0, 2)
    assert lot.commit(claimed) == 2
    assert lot.counts() == (0, 0)
    # Nothing is left behind: not the messages, not the publish ids.
    due, messages, claims, pub = lot.keyspace.parking_keys()
    assert client.exists(due, messages, claims, pub) == 0
    # A committed task never comes back, even after its claim would have expired.
    clock.advance(3600.0)
    assert lot.claim(lead_s=LEAD_S) == []
    # Committing again is harmless and counts nothing.
    assert lot.commit(claimed) == 0
    assert lot.commit([]) == 0


def test_dead_releaser_claim_expires_and_the_task_is_claimed_again(
    lot: ParkingLot, clock: FakeClock
) -> None:
    payload = b"\x00binary\npayload"
    token = lot.park(payload, 5.0)
    clock.advance(5.0)
    [dead] = lot.claim(lead_s=0.0, claim_s=30.0)
    # The releaser dies here: no commit. Its claim lasts 30 s.
    clock.advance(30.0)
    [again] = lot.claim(lead_s=0.0, claim_s=30.0)
    assert again.token == token
    assert again.payload == payload
    assert again.publish_id != dead.publish_id
    # The due time survives the re-claim: still the original one (now 30 s overdue).
    assert again.due_in_s == pytest.approx(-30.0, abs=1e-6)
    # The dead releaser wakes up and commits: its claim is no longer the task's.
    assert lot.commit([dead]) == 0
    assert lot.counts() == (0, 1)
    assert lot.commit([again]) == 1
    assert lot.counts() == (0, 0)


def test_publish_ids_are_unique_across_claims(lot: ParkingLot, clock: FakeClock) -> None:
    for _ in range(5):
        lot.park(b"x", 0.0)
    first = lot.claim(lead_s=0.0, batch=3, claim_s=1.0)
    second = lot.claim(lead_s=0.0, batch=3, claim_s=1.0)
    clock.advance(1.0)
    third = lot.claim(lead_s=0.0, batch=10, claim_s=1.0)
    ids = [c.publish_id for c in first + second + third]
    assert len(ids) == 10
    assert len(set(ids)) == 10


def test_accept_first_copy_and_its_redelivery_only(lot: ParkingLot, clock: FakeClock) -> None:
    token = lot.park(b"x", 0.0)
    [dead] = lot.claim(lead_s=0.0, claim_s=1.0)
    clock.advance(1.0)
    [again] = lot.claim(lead_s=0.0, claim_s=1.0)
    # Two copies were published (the first releaser died after publishing). The copy that
    # starts first wins, and the broker may deliver that same copy again.
    assert lot.accept(token, again.publish_id) is True
    assert lot.accept(token, again.publish_id) is True
    assert lot.accept(token, dead.publish_id) is False
    assert lot.accept(token, again.publish_id) is True
    # Tokens are independent of each other.
    other = lot.park(b"y", 0.0)
    assert lot.accept(other, dead.publish_id) is True


def test_accept_remembers_for_its_ttl(client: redis.Redis, lot: ParkingLot) -> None:
    assert lot.accept("tok", "pub-1", ttl_s=60.0) is True
    ttl_ms = client.pttl(lot.keyspace.parked_run_key("tok"))
    assert 59_000 < ttl_ms <= 60_000


def test_batch_limit_is_respected(lot: ParkingLot, clock: FakeClock) -> None:
    parked = [lot.park(f"task {i}".encode(), 1.0 + i) for i in range(7)]
    clock.advance(100.0)
    first = lot.claim(lead_s=0.0, batch=3)
    assert tokens(first) == parked[:3]
    assert lot.counts() == (4, 3)
    second = lot.claim(lead_s=0.0, batch=3)
    assert tokens(second) == parked[3:6]
    third = lot.claim(lead_s=0.0, batch=3)
    assert tokens(third) == parked[6:]
    assert lot.claim(lead_s=0.0, batch=3) == []


def test_expired_claims_come_first_and_count_toward_the_batch(
    lot: ParkingLot, clock: FakeClock
) -> None:
    stale = [lot.park(b"stale", 1.0 + i) for i in range(2)]
    clock.advance(10.0)
    lot.claim(lead_s=0.0, batch=2, claim_s=5.0)
    fresh = [lot.park(b"fresh", 0.0 + i) for i in range(3)]
    clock.advance(5.0)
    # Two expired claims plus room for one due task in a batch of three.
    claimed = lot.claim(lead_s=0.0, batch=3, claim_s=5.0)
    # The two stale claims share one expiry, so Redis orders them by token: compare as a set.
    assert sorted(tokens(claimed)[:2]) == sorted(stale)
    assert tokens(claimed)[2] == fresh[0]
    assert lot.counts() == (2, 3)
    # A batch smaller than the expired claims takes only that many.
    clock.advance(5.0)
    assert len(lot.claim(lead_s=0.0, batch=1, claim_s=5.0)) == 1


def test_claims_come_in_due_order(lot: ParkingLot, clock: FakeClock) -> None:
    late = lot.park(b"late", 5.0)
    early = lot.park(b"early", 1.0)
    middle = lot.park(b"middle", 3.0)
    clock.advance(10.0)
    claimed = lot.claim(lead_s=0.0)
    assert tokens(claimed) == [early, middle, late]
    assert [c.payload for c in claimed] == [b"early", b"middle", b"late"]
    assert [c.due_in_s for c in claimed] == pytest.approx([-9.0, -7.0, -5.0], abs=1e-6)


def test_lots_in_other_namespaces_are_separate(
    client: redis.Redis, prefix: str, lot: ParkingLot, clock: FakeClock
) -> None:
    other = ParkingLot(client, KeySpace(prefix, "other"), clock_us=clock)
    lot.park(b"mine", 0.0)
    assert other.claim(lead_s=LEAD_S) == []
    assert other.counts() == (0, 0)
    assert [c.payload for c in lot.claim(lead_s=LEAD_S)] == [b"mine"]


def test_concurrent_releasers_release_every_task_exactly_once(
    client: redis.Redis, prefix: str
) -> None:
    """1000 tasks, three releasers on the Redis clock: none lost, none released twice."""
    keyspace = KeySpace(prefix, "ns")
    parker = ParkingLot(client, keyspace)
    rng = random.Random(1)
    payloads: dict[str, bytes] = {}
    for i in range(1000):
        payload = f"task {i}\n".encode() + rng.randbytes(16)
        payloads[parker.park(payload, rng.uniform(0.0, 0.5))] = payload

    released: list[tuple[str, bytes]] = []
    accepted: list[bool] = []
    record = threading.Lock()
    errors: list[BaseException] = []
    deadline = time.monotonic() + 30.0

    def releaser() -> None:
        lot = ParkingLot(client, keyspace)
        try:
            while time.monotonic() < deadline:
                claimed = lot.claim(lead_s=0.05, batch=25, claim_s=10.0)
                if not claimed:
                    if lot.counts() == (0, 0):
                        return
                    time.sleep(0.005)
                    continue
                # "Publish": record the copy, as the broker would receive it; then the
                # worker that starts it asks whether it may run.
                ok = [lot.accept(c.token, c.publish_id) for c in claimed]
                with record:
                    released.extend((c.token, c.payload) for c in claimed)
                    accepted.extend(ok)
                assert lot.commit(claimed) == len(claimed)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=releaser) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60.0)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)

    counts = Counter(token for token, _ in released)
    assert set(counts) == set(payloads), "a parked task was lost"
    assert max(counts.values()) == 1, "a parked task was released twice"
    assert all(payloads[token] == payload for token, payload in released)
    assert all(accepted)
    assert parker.counts() == (0, 0)


def test_the_index_finds_a_parked_task_by_id_until_it_is_released(
    client: redis.Redis, lot: ParkingLot, clock: FakeClock
) -> None:
    token = lot.park(b"payload", 10.0, task_id="task-1")
    lot.park(b"anonymous", 10.0)  # not indexed: no task id
    found = lot.find("task-1")
    assert found is not None
    assert (found.token, found.payload, found.task_id) == (token, b"payload", "task-1")
    assert found.due_us == clock() + 10_000_000 and found.claimed_until_us is None
    assert lot.find("task-2") is None
    # While a releaser holds its claim, it is found as claimed
    clock.advance(10.0)
    claimed = lot.claim(lead_s=0.0, claim_s=30.0)
    found = lot.find("task-1")
    assert found is not None and found.due_us is None
    assert found.claimed_until_us == clock() + 30_000_000
    # Committed: gone, and so is its index entry (the index never outgrows the lot)
    assert lot.commit(claimed) == 2
    assert lot.find("task-1") is None
    assert client.exists(*lot.keyspace.parking_index_keys()) == 0


def test_a_task_parked_again_before_its_release_commits_keeps_its_new_entry(
    lot: ParkingLot, clock: FakeClock
) -> None:
    # The releaser published it, the task ran, was denied and parked again, and only then
    # did the first release commit: the index keeps the new parking.
    lot.park(b"first", 1.0, task_id="t")
    clock.advance(1.0)
    claimed = lot.claim(lead_s=0.0)
    second = lot.park(b"second", 60.0, task_id="t")
    assert lot.commit(claimed) == 1
    found = lot.find("t")
    assert found is not None and (found.token, found.payload) == (second, b"second")


def test_purge_deletes_waiting_tasks_but_never_one_being_released(
    client: redis.Redis, lot: ParkingLot, clock: FakeClock
) -> None:
    soon = lot.park(b"soon", 1.0, task_id="soon")
    later = lot.park(b"later", 100.0, task_id="later")
    clock.advance(1.0)
    claimed = lot.claim(lead_s=0.0)  # a releaser is publishing "soon"
    assert tokens(claimed) == [soon]
    assert sorted(p.token for p in lot.scan()) == sorted([soon, later])
    # Purging both deletes only the one still waiting
    assert lot.purge([soon, later, "no-such-token"]) == 1
    assert lot.find("later") is None
    assert [p.token for p in lot.scan()] == [soon]
    # The release of the other goes on: committed, nothing of either is left
    assert lot.commit(claimed) == 1
    assert client.exists(*lot.keyspace.parking_keys(), *lot.keyspace.parking_index_keys()) == 0
    assert lot.purge([]) == 0


def test_scan_reads_a_lot_larger_than_its_batch(lot: ParkingLot) -> None:
    parked = {lot.park(f"p{i}".encode(), 5.0, task_id=f"id-{i}") for i in range(23)}
    seen = list(lot.scan(count=5))
    assert {p.token for p in seen} == parked
    assert {p.task_id for p in seen} == {f"id-{i}" for i in range(23)}


def test_a_copy_delivered_again_after_a_newer_one_was_sent_is_stale(
    client: redis.Redis, lot: ParkingLot
) -> None:
    # Nothing sent back yet: the first delivery and its redeliveries run.
    assert lot.stale_copy("task-1", 0) is False
    lot.sent_copy("task-1", 1, ttl_s=60.0)
    # The original (copy 0), delivered again, is stale; copy 1 is not, nor another task.
    assert lot.stale_copy("task-1", 0) is True
    assert lot.stale_copy("task-1", 1) is False
    assert lot.stale_copy("task-2", 0) is False
    lot.sent_copy("task-1", 2, ttl_s=60.0)
    assert lot.stale_copy("task-1", 1) is True
    assert lot.stale_copy("task-1", 2) is False
    assert 59_000 < client.pttl(lot.keyspace.copy_key("task-1")) <= 60_000


def test_parking_a_copy_records_its_number_in_the_same_call(
    client: redis.Redis, lot: ParkingLot
) -> None:
    # Parked as copy 1 of task-1: the original (copy 0) delivered again is stale at once,
    # with no second call in which a worker could die first.
    lot.park(b"copy", 10.0, task_id="task-1", copy=1, copy_ttl_s=60.0)
    assert lot.stale_copy("task-1", 0) is True
    assert lot.stale_copy("task-1", 1) is False
    assert 59_000 < client.pttl(lot.keyspace.copy_key("task-1")) <= 60_000
    # Without a number (or a task id), nothing is recorded.
    lot.park(b"other", 10.0, task_id="task-2")
    assert lot.stale_copy("task-2", 0) is False
    assert client.exists(lot.keyspace.copy_key("task-2")) == 0
