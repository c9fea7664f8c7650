"""A minimal service built on the shared plumbing, run as a process by test_service_process.py.

python -m tests.integration.slow_service PORT
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from searchr1.logs import setup_logging
from searchr1.sections import HttpConfig
from searchr1.service import create_service_app, run_http

log = logging.getLogger("slow_service")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    log.info("started")
    yield
    # Where a real service hands back in-flight work (e.g. un-acked bus entries).
    log.info("handed back in-flight work")


def main() -> None:
    setup_logging("slow_service", "INFO", json_format=True)
    app = create_service_app("slow_service", lifespan=lifespan)

    @app.get("/slow")
    async def slow(seconds: float = 1.0) -> dict[str, float]:
        await asyncio.sleep(seconds)
        return {"slept": seconds}

    @app.post("/echo")
    async def echo(body: dict) -> dict[str, int]:
        return {"keys": len(body)}

    run_http(app, HttpConfig(port=int(sys.argv[1]), graceful_shutdown_s=10))


if __name__ == "__main__":
    main()
