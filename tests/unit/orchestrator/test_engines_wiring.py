"""The orchestrator generates on the `engines` section: through the router when there is one,
on the one engine directly, over its own pool when there are several."""

from __future__ import annotations

import pytest

from engine_client.client import InferenceClient
from engine_client.pool import EnginePool
from orchestrator.config import OrchestratorConfig
from orchestrator.wiring import make_clients
from searchr1.sections import BusConfig, EnginesConfig


@pytest.mark.parametrize(
    ("engines", "kind", "url"),
    [
        (EnginesConfig(urls=["http://e0:1", "http://e1:1"], router_url="http://r:1"), "one", "r"),
        (EnginesConfig(urls=["http://e0:1"]), "one", "e0"),
        (EnginesConfig(urls=["http://e0:1", "http://e1:1"], probe_s=None), "pool", None),
    ],
)
async def test_the_orchestrator_calls_the_router_one_engine_or_its_pool(
    engines: EnginesConfig, kind: str, url: str | None
) -> None:
    clients = make_clients(OrchestratorConfig(), engines, "redis://127.0.0.1:1/0", BusConfig())
    try:
        if kind == "one":
            assert isinstance(clients.engine, InferenceClient)
            assert f"//{url}:1" in clients.engine.base_url
        else:
            assert isinstance(clients.engine, EnginePool)
            assert len(clients.engine.engines) == 2
    finally:
        await clients.aclose()


async def test_the_engine_registry_is_closed_with_the_clients() -> None:
    # engines.discover opens a Redis connection of its own (joined engines announce there);
    # it used to stay open after the orchestrator's clients were closed.
    engines = EnginesConfig(urls=["http://e0:1"], discover=True, probe_s=None)
    clients = make_clients(OrchestratorConfig(), engines, "redis://127.0.0.1:1/0", BusConfig())
    assert clients.registry is not None
    closed: list[bool] = []

    async def aclose() -> None:
        closed.append(True)

    clients.registry.aclose = aclose  # type: ignore[method-assign]
    await clients.aclose()
    assert closed == [True]
