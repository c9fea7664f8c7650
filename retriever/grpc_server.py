"""gRPC `searchr1.v1.Retriever/Search`: the same engine call as HTTP `POST /retrieve`.

Proto messages are converted at this edge only; statuses mirror the HTTP codes:
INVALID_ARGUMENT (422), RESOURCE_EXHAUSTED (429), UNAVAILABLE (503 / index still loading).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from protos import retriever_pb2, retriever_pb2_grpc
from retriever.backends import BackendUnavailable, Hit
from retriever.engine import BadRequest, Overloaded, RetrieverEngine

log = logging.getLogger(__name__)


def _convert_results(results: list[list[Hit]]) -> retriever_pb2.SearchResponse:
    return retriever_pb2.SearchResponse(
        results=[
            retriever_pb2.QueryResult(
                documents=[
                    retriever_pb2.ScoredDocument(
                        document=retriever_pb2.Document(
                            id=str(doc.get("id", "")), contents=str(doc.get("contents", ""))
                        ),
                        score=score,
                    )
                    for doc, score in hits
                ]
            )
            for hits in results
        ]
    )


class RetrieverServicer(retriever_pb2_grpc.RetrieverServicer):
    def __init__(self, get_engine: Callable[[], RetrieverEngine | None]) -> None:
        self._get_engine = get_engine

    async def Search(
        self, request: retriever_pb2.SearchRequest, context: grpc.aio.ServicerContext
    ) -> retriever_pb2.SearchResponse:
        engine = self._get_engine()
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "index is still loading")
        assert engine is not None
        try:
            results = await engine.search(list(request.queries), request.topk, protocol="grpc")
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except BackendUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return _convert_results(results)


async def start_grpc_server(
    get_engine: Callable[[], RetrieverEngine | None], host: str, port: int
) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server; returns it and the bound port (port 0 picks a free one)."""
    server = grpc.aio.server()
    retriever_pb2_grpc.add_RetrieverServicer_to_server(RetrieverServicer(get_engine), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port}")
    await server.start()
    log.info("grpc listening", extra={"host": host, "port": bound})
    return server, bound
