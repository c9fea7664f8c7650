"""Configuration of the retriever service (its section of the stack config file).

`RetrieverConfig` holds what the serving process decides: listeners, request limits, batching,
cache, and the run-time knobs of each backend. The serper API key is a secret: env
`SERPER_API_KEY` only. `BuildConfig` holds what `searchr1 retriever build` decides; those
choices are recorded in the index directory's manifest (`manifest.py`), which `serve` reads.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from searchr1.sections import HttpConfig, Section
from searchr1.settings import ServiceSettings


class LimitsConfig(Section):
    """Request validation: anything outside these gets 422 with a message naming the field."""

    default_topk: int = Field(default=3, ge=1, description="Used when topk is null or 0.")
    max_topk: int = Field(default=100, ge=1)
    max_queries: int = Field(default=512, ge=1, description="Queries per request.")
    max_query_chars: int = Field(default=4096, ge=1)


class BatchingConfig(Section):
    """Cross-request micro-batching on one worker thread."""

    max_batch: int = Field(default=64, ge=1, description="Queries encoded/searched together.")
    # 0 = greedy: whatever queued while the previous batch computed forms the next batch, so
    # batches grow with load and an idle server adds no latency.
    max_wait_ms: float = Field(
        default=0.0, ge=0, description="How long a non-full batch waits for more queries."
    )
    max_pending: int = Field(
        default=8192,
        ge=1,
        description="Queued queries beyond this get 429 / RESOURCE_EXHAUSTED.",
    )


class CacheConfig(Section):
    size: int = Field(default=100_000, ge=0, description="LRU entries; 0 disables the cache.")
    # An entry holds topk passages: at topk 100 over long passages, 100,000 entries is GBs.
    max_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1,
        description="Estimated memory of the cached results; least recently used go beyond it.",
    )


class DenseConfig(Section):
    """Run-time settings of the dense backend (the index type comes from the manifest)."""

    device: str = Field(default="auto", description="auto | cpu | cuda | cuda:N")
    encoder_path: str | None = Field(
        default=None,
        description="Use this encoder directory instead of the manifest's (index built elsewhere).",
    )
    encode_batch_size: int = Field(default=64, ge=1)
    # auto = a child process on CPU: next to the HTTP event loop an in-process CPU encoder loses
    # ~20% of its throughput to GIL hand-offs (docs/benchmarks.md); a GPU encoder stays in-process.
    encoder_process: Literal["auto"] | bool = Field(
        default="auto",
        description="Encode queries in a child process (no GIL shared with the HTTP server); "
        "auto: on CPU yes, on GPU no.",
    )
    # The child's round trip and the hand-off to the search thread cost a lone request ~1-4 ms
    # on a busy 2-core machine, time nothing overlaps at low concurrency (docs/benchmarks.md).
    inline_max_queries: int = Field(
        default=1,
        ge=0,
        description="A batch of at most this many queries that finds nothing else queued or in "
        "flight is encoded and searched on the batching thread, in this process (with "
        "encoder_process on, a second copy of the encoder is loaded for it); 0: never.",
    )
    # On one CPU core faiss Flat over a batch is slower than a torch matmul + top-k
    # (memory-bound; see docs/benchmarks.md); "auto" uses torch for Flat, faiss otherwise.
    flat_search: Literal["auto", "torch", "faiss"] = "auto"
    hnsw_ef_search: int = Field(default=256, ge=1)
    ivf_nprobe: int = Field(default=32, ge=1)
    torch_threads: int = Field(default=1, ge=1, description="Intra-op threads for encode/search.")
    # The child encodes what queued up while it was busy: batches big enough for intra-op
    # threads to pay, where the serving process's own paths (a lone query, the search) may not.
    encoder_threads: int | None = Field(
        default=None,
        ge=1,
        description="Intra-op threads of the encoder child process (encoder_process on); "
        "None: torch_threads.",
    )


class SerperConfig(Section):
    """Web search through serper.dev (key from env SERPER_API_KEY, never from the file)."""

    url: str = "https://google.serper.dev/search"
    gl: str = "us"
    hl: str = "en"
    timeout_s: float = Field(default=10.0, gt=0)
    max_retries: int = Field(default=3, ge=0, description="Retries on 429/5xx/connection errors.")
    backoff_s: float = Field(default=0.5, ge=0, description="First retry delay, doubled each time.")
    rate_limit_qps: float = Field(default=10.0, gt=0, description="Client-side request rate cap.")
    max_concurrency: int = Field(default=16, ge=1)
    max_queued: int = Field(
        default=256,
        ge=1,
        description="Queries waiting for (or in) a serper call at once; more get 429.",
    )


class HybridConfig(Section):
    """Fusion of dense and BM25 results, used when the index was built with `--backend hybrid`."""

    rrf_k: int = Field(default=60, ge=1, description="Reciprocal-rank-fusion constant.")
    candidates: int = Field(default=20, ge=1, description="Top-n taken from each backend.")


class RetrieverHttpConfig(HttpConfig):
    # Its own class (not HttpConfig(port=...)): a partial override such as
    # SEARCHR1_RETRIEVER__HTTP__HOST must keep this default port.
    port: int = Field(default=8000, ge=0, le=65535)


class RerankConfig(Section):
    """Optional cross-encoder rerank of the index backend's top candidates (off: no model)."""

    model_path: str | None = Field(
        default=None, description="HF sequence-classification model dir; null disables rerank."
    )
    candidates: int = Field(default=10, ge=1, description="Top-n rescored per query.")
    batch_size: int = Field(default=32, ge=1)
    max_length: int = Field(default=512, ge=8)


# The backends `retriever.backend` may name: the keys of `retriever.backends.BACKENDS` (a test
# checks both agree); pydantic rejects any other name as a ConfigError naming the field.
BackendName = Literal["index", "web"]


class RetrieverConfig(Section):
    http: RetrieverHttpConfig = Field(default_factory=RetrieverHttpConfig)
    grpc_port: int | None = Field(
        default=8001, ge=0, le=65535, description="gRPC Retriever.Search port; null disables."
    )
    index_dir: str | None = Field(
        default=None, description="Index directory from `searchr1 retriever build` (or --index)."
    )
    backend: BackendName = Field(
        default="index", description="index: the built index (dense/bm25); web: serper.dev."
    )
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    dense: DenseConfig = Field(default_factory=DenseConfig)
    serper: SerperConfig = Field(default_factory=SerperConfig)
    hybrid: HybridConfig = Field(default_factory=HybridConfig)
    rerank: RerankConfig = Field(default_factory=RerankConfig)

    @model_validator(mode="after")
    def _check(self) -> RetrieverConfig:
        if self.limits.default_topk > self.limits.max_topk:
            raise ValueError("limits.default_topk must be <= limits.max_topk")
        return self


class RetrieverSettings(ServiceSettings):
    """What `searchr1 retriever ...` loads: the shared sections plus `retriever`."""

    retriever: RetrieverConfig = RetrieverConfig()


class Bm25Manifest(Section):
    """BM25 parameters: chosen at build time (`BuildConfig.bm25`), recorded in the manifest."""

    dir: str = "bm25"
    method: str = "lucene"
    k1: float = 0.9
    b: float = 0.4
    stemmer: str | None = "english"
    stopwords: str | None = "en"


class BuildConfig(Section):
    """`searchr1 retriever build`: what goes into an index directory (`build.build_index`)."""

    backend: Literal["dense", "bm25", "hybrid"] = "dense"
    # Dense: encoder and e5 conventions (recorded in the manifest for query encoding).
    encoder: str | None = Field(default=None, description="HF encoder dir; default: PyPI MiniLM")
    query_prefix: str = "query: "
    passage_prefix: str = "passage: "
    pooling: Literal["mean", "cls"] = "mean"
    normalize: bool = True
    max_length: int = Field(default=256, ge=1)
    batch_size: int = Field(default=64, ge=1)
    device: str = "auto"
    index_type: Literal["Flat", "HNSW", "IVF"] = "Flat"
    hnsw_m: int = Field(default=32, ge=2)
    hnsw_ef_construction: int = Field(default=200, ge=1)
    ivf_nlist: int | None = Field(default=None, ge=1, description="default ~4*sqrt(rows)")
    ivf_train_size: int = Field(default=100_000, ge=1)
    faiss_index: str | None = Field(
        default=None, description="Import this existing faiss index instead of encoding."
    )
    # Corpus: copied into the directory (self-contained) or referenced by absolute path.
    copy_corpus: bool = True
    # BM25.
    bm25: Bm25Manifest = Field(default_factory=Bm25Manifest)
    progress: bool = True
