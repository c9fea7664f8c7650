"""harness/chaos_hosts.py: the run's config and process specs placed on hosts of their own
(nothing is made here: HostNetwork only names its hosts until `up()`)."""

from __future__ import annotations

from harness.chaos_hosts import STANDBY, HostedStack
from searchr1.redis_server import RedisServer
from searchr1.service import ADMIN_TOKEN_ENV
from searchr1.supervisor import ServiceSpec


def demo_config() -> dict:
    return {
        "redis": {"url": "redis://127.0.0.1:1/0"},
        "retriever": {"http": {"port": 8001}},
        "inference": {"http": {"port": 8002}},
        "engines": {"urls": ["http://127.0.0.1:8002"]},
        "orchestrator": {
            "http": {"port": 8003},
            "search": {"retriever_url": "http://127.0.0.1:8001"},
        },
        "trainer": {"http": {"port": 8004}, "weight_push": {"engine_urls": []}},
    }


def test_every_listener_and_url_points_at_its_host_and_no_secret_is_in_the_file() -> None:
    hosted = HostedStack()
    data = demo_config()
    hosted.place_config(data, redis_port=6390)
    addr = hosted.net.address
    assert data["inference"]["http"]["host"] == addr("inference")
    assert data["engines"] == {"urls": [f"http://{addr('inference')}:8002"]}
    assert data["orchestrator"]["search"]["retriever_url"] == f"http://{addr('retriever')}:8001"
    assert data["trainer"]["weight_push"] == {"master_addr": addr("trainer")}  # engines.urls
    assert data["redis"]["url"] == f"redis://{addr('redis')}:6390/0"
    assert hosted.redis_password not in str(data) and hosted.token not in str(data)
    url = RedisServer(port=6390, **hosted.redis_server_args()).url  # what the services get
    assert url == f"redis://:{hosted.redis_password}@{addr('redis')}:6390/0"


def test_each_service_runs_on_its_host_and_a_standby_trainer_waits_on_another() -> None:
    hosted = HostedStack()
    specs = [
        ServiceSpec("retriever", ["searchr1", "retriever", "serve"], ready_url="http://x/ready"),
        ServiceSpec(
            "trainer",
            ["searchr1", "trainer", "run"],
            ready_url="http://y/ready",
            exit_ends_stack=True,  # as `searchr1 local`'s spec: its exit ends the run
            may_finish=True,
        ),
    ]
    placed = {s.name: s for s in hosted.place_specs(specs)}
    assert list(placed) == ["retriever", "trainer", STANDBY]
    retriever, trainer, standby = placed["retriever"], placed["trainer"], placed[STANDBY]
    assert retriever.command[:4] == ["ip", "netns", "exec", hosted.net.hosts["retriever"].netns]
    assert retriever.ready_url == "http://x/ready" and specs[0].command[0] == "searchr1"
    assert standby.command == [*hosted.net.exec_prefix(STANDBY), "searchr1", "trainer", "run"]
    for spec in (retriever, trainer, standby):
        assert spec.env[ADMIN_TOKEN_ENV] == hosted.token and spec.env["GLOO_SOCKET_IFNAME"]
    # Both trainers wait for the lease as long as it takes and are ready once started.
    for t in (trainer, standby):
        assert t.ready_url is None and float(t.env["SEARCHR1_TRAINER__LEASE_WAIT_S"]) > 3600
        assert t.exit_ends_stack  # either one finishing the run ends it
    assert standby.env["SEARCHR1_TRAINER__WEIGHT_PUSH__MASTER_ADDR"] == hosted.net.address(STANDBY)
    assert standby.env["SEARCHR1_TRAINER__HTTP__HOST"] == hosted.net.address(STANDBY)
