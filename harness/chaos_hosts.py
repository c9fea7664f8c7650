"""The chaos bench's stack on hosts of its own (`bench/chaos.py --hosts netns`, issue 32).

Every service, Redis included, runs in a network namespace of its own (`harness/netns.py`) and
listens on that host's address, not on loopback: the admin token and Redis's password are on,
as in a cluster, and the weight group's rendezvous and gloo cross the switch. A second trainer,
`trainer-b`, waits on a host of its own as a hot standby (`trainer.lease_wait_s`): when the
trainer is cut off from Redis or frozen past its lease, the standby takes the lease over,
resumes from the shared checkpoint directory (one volume, as a cluster's shared storage) and
trains on; the first one, once it can reach Redis again, finds itself fenced and becomes the
standby in turn.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from harness.netns import IFNAME, HostNetwork
from searchr1.service import ADMIN_TOKEN_ENV
from searchr1.supervisor import ServiceSpec

HOSTS = ["redis", "retriever", "inference", "orchestrator", "trainer", "trainer-b"]
STANDBY = "trainer-b"
STANDBY_WAIT_S = 86_400.0  # "as long as it takes": the run's own deadline ends it first


class HostedStack:
    """The hosts, the secrets and how the run's config and process specs are placed on them."""

    def __init__(self) -> None:
        self.net = HostNetwork(HOSTS)
        self.token = secrets.token_hex(16)
        self.redis_password = secrets.token_hex(16)

    def up(self) -> HostedStack:
        self.net.up()
        return self

    def down(self) -> None:
        self.net.down()

    def place_config(self, data: dict[str, Any], redis_port: int) -> None:
        """Point every listener and URL of the run's config at its service's host. Redis's
        password stays out of the file: the services get the URL from env only
        (`SEARCHR1_REDIS__URL`, set by the launcher's specs)."""
        addr = self.net.address
        data["redis"] = {"url": f"redis://{addr('redis')}:{redis_port}/0"}
        for name in ("retriever", "inference", "orchestrator", "trainer"):
            data[name].setdefault("http", {})["host"] = addr(name)
        engine = f"http://{addr('inference')}:{data['inference']['http']['port']}"
        data["engines"] = {**data.get("engines", {}), "urls": [engine]}  # orchestrator's, pushes'
        port = data["retriever"]["http"]["port"]
        data["orchestrator"]["search"]["retriever_url"] = f"http://{addr('retriever')}:{port}"
        data["trainer"]["weight_push"].pop("engine_urls", None)  # engines.urls
        data["trainer"]["weight_push"]["master_addr"] = addr("trainer")

    def redis_server_args(self) -> dict[str, Any]:
        """RedisServer's arguments for Redis on its host (`--bind` its address, a password)."""
        return {
            "host": self.net.address("redis"),
            "password": self.redis_password,
            "prefix": self.net.exec_prefix("redis"),
        }

    def place_specs(self, specs: list[ServiceSpec]) -> list[ServiceSpec]:
        """Each service's spec run on its host with the cluster's secrets; a standby trainer
        beside the trainer. Both trainers wait for the lease as long as it takes (the one that
        lost it must not crash-loop against the other's lease) and serve /ready only once they
        hold it: for the supervisor, started is ready."""
        env = {ADMIN_TOKEN_ENV: self.token, "GLOO_SOCKET_IFNAME": IFNAME}
        placed = []
        for spec in specs:
            command = [*self.net.exec_prefix(spec.name), *spec.command]
            placed.append(replace(spec, command=command, env={**spec.env, **env}))
            if spec.name == "trainer":
                trainer = placed[-1]
                trainer.ready_url = None
                trainer.env["SEARCHR1_TRAINER__LEASE_WAIT_S"] = str(STANDBY_WAIT_S)
                addr = self.net.address(STANDBY)
                placed.append(
                    replace(
                        trainer,
                        name=STANDBY,
                        command=[*self.net.exec_prefix(STANDBY), *spec.command],
                        env={
                            **trainer.env,
                            "SEARCHR1_TRAINER__HTTP__HOST": addr,
                            "SEARCHR1_TRAINER__WEIGHT_PUSH__MASTER_ADDR": addr,
                        },
                    )
                )
        return placed
