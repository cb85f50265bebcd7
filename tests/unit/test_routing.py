"""The queue a task came from (throttle.celery.routing), its lane's declaration, and the
start-up checks of routing and of RabbitMQ's consumer_timeout: no broker needed."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue, binding

from throttle.celery.message import queue_of
from throttle.celery.routing import (
    check_routing,
    lane_queue,
    resolve,
    topic_matches,
    topics_overlap,
)
from throttle.celery.runtime import Throttler
from throttle.errors import ConfigError

TOPIC = Exchange("tasks", type="topic")
FANOUT = Exchange("news", type="fanout")
QUEUES = [
    Queue("celery", Exchange("celery"), routing_key="celery"),
    Queue("github", TOPIC, routing_key="github.#"),
    Queue("gitlab", TOPIC, routing_key="gitlab.*"),
    Queue("news", FANOUT),
    Queue("multi", bindings=[binding(Exchange("a"), "x"), binding(Exchange("b"), "y")]),
]


@pytest.mark.parametrize(
    ("pattern", "key", "expected"),
    [
        ("github.#", "github.fetch", True),
        ("github.#", "github", True),
        ("github.#", "gitlab.fetch", False),
        ("github.*", "github", False),
        ("*.fetch", "github.fetch", True),
        ("*.fetch", "a.b.fetch", False),
        ("a.#.z", "a.z", True),
        ("a.#.z", "a.b.c.z", True),
        ("#", "", True),
        ("a.*", "a.#", True),  # in a routing key, "#" is a word
    ],
)
def test_topic_patterns_match_as_amqp_does(pattern: str, key: str, expected: bool) -> None:
    assert topic_matches(pattern, key) is expected


def test_topic_patterns_overlap_when_one_key_matches_both() -> None:
    assert topics_overlap("github.#", "*.fetch")
    assert topics_overlap("#", "a.b")
    assert not topics_overlap("github.*", "gitlab.#")
    assert not topics_overlap("a.*", "a")


@pytest.mark.parametrize(
    ("exchange", "routing_key", "queue"),
    [
        ("tasks", "github.fetch", "github"),  # topic: the routing key names no queue
        ("tasks", "gitlab.push", "gitlab"),
        ("news", "anything", "news"),  # fanout: any key
        ("", "celery", "celery"),  # the default exchange: the queue's name
        ("celery", "celery", "celery"),  # direct: equality
        ("b", "y", "multi"),  # explicit bindings
        ("tasks", "other.thing", None),  # nothing consumed matches
    ],
)
def test_a_delivery_is_resolved_by_the_bindings_of_the_consumed_queues(
    exchange: str, routing_key: str, queue: str | None
) -> None:
    info = {"exchange": exchange, "routing_key": routing_key}
    assert resolve(QUEUES, {}, info) == queue


def test_the_consumer_tag_names_the_queue_whatever_the_routing() -> None:
    # Given two queues that both match the message (only the tag can tell them apart)
    queues = [Queue("all", TOPIC, routing_key="#"), Queue("github", TOPIC, routing_key="github.#")]
    tags = {"all": "ctag-1", "github": "ctag-2", "github.throttled": "ctag-3"}
    info = {"consumer_tag": "ctag-2", "exchange": "tasks", "routing_key": "github.fetch"}
    assert resolve(queues, tags, info) == "github"
    assert resolve(queues, tags, {**info, "consumer_tag": "ctag-3"}) == "github.throttled"
    # Without a tag both match: the routing key names no queue either, so none
    assert resolve(queues, {}, {"exchange": "tasks", "routing_key": "github.fetch"}) is None


def test_queue_of_reads_what_the_worker_resolved_then_the_routing_key() -> None:
    assert queue_of({"queue": "github", "routing_key": "github.fetch"}) == "github"
    assert queue_of({"queue": "github.throttled", "routing_key": "x"}) == "github"
    assert queue_of({"queue": "", "routing_key": "github.fetch"}) is None  # unresolved
    assert queue_of({"routing_key": "celery"}) == "celery"  # no worker resolved it


def test_a_lane_is_declared_with_its_queue_s_arguments() -> None:
    app = Celery("lanes", broker="amqp://guest@localhost//")
    quorum = Queue("q", Exchange("q"), routing_key="q", queue_arguments={"x-queue-type": "quorum"})
    app.conf.task_queues = [quorum, Queue("p", Exchange("p"), "p", max_priority=5)]
    lane = lane_queue(app, "q")
    assert (lane.name, lane.routing_key, lane.exchange.name) == ("q.throttled",) * 3
    assert lane.queue_arguments == {"x-queue-type": "quorum"}
    assert app.amqp.queues["q.throttled"] is lane  # what Celery declares when publishing
    assert lane_queue(app, "p").max_priority == 5
    # An operator's own definition of a lane wins
    mine = Queue("r.throttled", Exchange("r.throttled"), "r.throttled", max_priority=9)
    app.amqp.queues.add(mine)
    assert lane_queue(app, "r") is mine


def _app(broker: str, **conf: Any) -> Celery:
    app = Celery("checks", broker=broker)
    app.conf.update(throttle_redis_url="redis://127.0.0.1:1/0", **conf)
    return app


def _throttler(app: Celery, park_after: str) -> Throttler:
    app.conf.throttle_config = {"settings": {"park_after": park_after}, "limits": {}}
    return Throttler.from_app(app)


def test_rabbitmq_s_consumer_timeout_bounds_how_long_a_worker_holds_a_task() -> None:
    # RabbitMQ's default consumer_timeout (30 min) is assumed on an AMQP broker
    with pytest.raises(ConfigError, match="consumer_timeout"):
        _throttler(_app("amqp://guest@localhost//"), "20m").check_visibility()
    _throttler(_app("amqp://guest@localhost//"), "10m").check_visibility()
    # the server's own, said in broker_transport_options
    options = {"broker_transport_options": {"consumer_timeout": 60}}
    with pytest.raises(ConfigError, match="consumer_timeout"):
        _throttler(_app("pyamqp://guest@localhost//", **options), "1m").check_visibility()
    # not on Redis, which has a visibility timeout instead
    _throttler(_app("redis://127.0.0.1:1/0"), "20m").check_visibility()


def test_a_worker_without_consumer_tags_refuses_queues_one_message_reaches_twice() -> None:
    app = _app("redis://127.0.0.1:1/0")
    app.conf.task_queues = [
        Queue("all", TOPIC, routing_key="#"),
        Queue("github", TOPIC, routing_key="github.#"),
    ]
    with pytest.raises(ConfigError, match="'all' and 'github'"):
        check_routing(app)
    app.amqp.queues.select(["github"])  # a worker of -Q github alone
    check_routing(app)
    # RabbitMQ names the consumer of each delivery: nothing to refuse
    app = _app("amqp://guest@localhost//", task_queues=list(app.conf.task_queues))
    check_routing(app)
