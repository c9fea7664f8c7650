"""Index building: corpus JSONL in, self-describing index directory out (see manifest.py).

`build_index(corpus_jsonl, out_dir, BuildConfig(...))` (`BuildConfig` in `retriever.config`) is
the Python API behind `searchr1 retriever build`. Dense builds stream the corpus in chunks
(encode, add to faiss), so memory holds one chunk of text plus the index; `faiss_index=` imports
an existing Search-R1 index (e.g. `e5_Flat.index` for `wiki-18.jsonl`) without re-encoding.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path

import numpy as np

from retriever.backends.bm25 import Bm25Index
from retriever.config import BuildConfig
from retriever.corpus import CorpusStore, decompress_to, is_gzip
from retriever.encoder import DEFAULT_ENCODER, Encoder, EncoderSpec, resolve_model_path
from retriever.manifest import DenseManifest, Manifest, write_manifest

log = logging.getLogger(__name__)

_CHUNK_ROWS = 8192
# An imported index is checked by re-encoding this many rows (spread over the corpus): each
# must come out at this cosine or above. The same settings give ~1 (float noise, fp16 on GPU);
# a wrong pooling or passage prefix gives clearly less.
_VERIFY_ROWS = 8
_VERIFY_MIN_COSINE = 0.99


def _new_faiss_index(cfg: BuildConfig, dim: int, rows: int):  # type: ignore[no-untyped-def]
    import faiss

    if cfg.index_type == "Flat":
        return faiss.IndexFlatIP(dim)
    if cfg.index_type == "HNSW":
        index = faiss.IndexHNSWFlat(dim, cfg.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = cfg.hnsw_ef_construction
        return index
    nlist = cfg.ivf_nlist or max(1, min(rows, int(4 * math.sqrt(max(rows, 1)))))
    quantizer = faiss.IndexFlatIP(dim)
    return faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)


def _encode_corpus(corpus: CorpusStore, encoder: Encoder, cfg: BuildConfig, out: Path) -> dict:
    import faiss
    from tqdm import tqdm

    rows = len(corpus)
    index = _new_faiss_index(cfg, encoder.dim, rows)
    pending: list[np.ndarray] = []  # IVF: vectors held back until the quantizer is trained
    bar = tqdm(total=rows, desc="encoding passages", unit="psg", disable=not cfg.progress)
    for start in range(0, rows, _CHUNK_ROWS):
        texts = []
        for i in range(start, min(rows, start + _CHUNK_ROWS)):
            contents = corpus.row(i).get("contents")
            if not isinstance(contents, str):
                raise ValueError(f"{corpus.path}: row {i} has no string 'contents' field")
            texts.append(contents)
        vecs = encoder.encode(texts, is_query=False, batch_size=cfg.batch_size, progress=bar.update)
        if index.is_trained:
            index.add(vecs)
            continue
        pending.append(vecs)
        held = sum(len(p) for p in pending)
        if held >= min(cfg.ivf_train_size, rows) or start + _CHUNK_ROWS >= rows:
            sample = np.concatenate(pending)
            if len(sample) < index.nlist:
                raise ValueError(f"IVF needs >= nlist={index.nlist} rows to train, got {rows}")
            index.train(sample[: cfg.ivf_train_size])
            index.add(sample)
            pending.clear()
    bar.close()
    faiss.write_index(index, str(out / "dense.faiss"))
    params: dict = {"index_type": cfg.index_type}
    if cfg.index_type == "HNSW":
        params |= {"m": cfg.hnsw_m, "ef_construction": cfg.hnsw_ef_construction}
    if cfg.index_type == "IVF":
        params |= {"nlist": int(index.nlist), "train_size": cfg.ivf_train_size}
    return params


def _import_faiss(path: Path, rows: int, dim: int) -> tuple[str, str]:
    """Check an existing faiss index against the corpus; return (index_type, metric)."""
    import faiss

    raw = faiss.read_index(str(path))
    index = faiss.downcast_index(raw)  # a view: `raw` owns the memory and must stay alive
    if index.ntotal != rows:
        raise ValueError(f"{path} holds {index.ntotal} vectors but the corpus has {rows} rows")
    if index.d != dim:
        raise ValueError(f"{path} has dim {index.d} but the encoder produces dim {dim}")
    metric = "ip" if index.metric_type == faiss.METRIC_INNER_PRODUCT else "l2"
    if isinstance(index, faiss.IndexFlat):
        return "Flat", metric
    if isinstance(index, faiss.IndexHNSW):
        return "HNSW", metric
    if isinstance(index, faiss.IndexIVF):
        return "IVF", metric
    raise ValueError(f"{path}: unsupported faiss index type {type(index).__name__}")


def build_index(
    corpus_jsonl: str | Path, out_dir: str | Path, cfg: BuildConfig | None = None
) -> Manifest:
    """Build (or import) an index directory for `serve`; returns its manifest."""
    cfg = cfg or BuildConfig()
    corpus_jsonl, out = Path(corpus_jsonl).resolve(), Path(out_dir)
    if not corpus_jsonl.is_file():
        raise ValueError(f"corpus file not found: {corpus_jsonl}")
    out.mkdir(parents=True, exist_ok=True)
    if is_gzip(corpus_jsonl):
        # Served by byte offset (memory-mapped): a gzip stream must be decompressed, here.
        log.info("decompressing the gzip corpus", extra={"corpus": str(corpus_jsonl)})
        decompress_to(corpus_jsonl, out / "corpus.jsonl")
        corpus_path = "corpus.jsonl"
    elif cfg.copy_corpus and cfg.faiss_index is None:
        shutil.copyfile(corpus_jsonl, out / "corpus.jsonl")
        corpus_path = "corpus.jsonl"
    else:
        corpus_path = str(corpus_jsonl)  # a 13 GB dump is referenced, never copied
    corpus = CorpusStore.open(
        corpus_jsonl if corpus_path != "corpus.jsonl" else out / "corpus.jsonl",
        out / "corpus.spans.npy",
    )
    rows = len(corpus)
    if rows == 0:
        raise ValueError(f"corpus {corpus_jsonl} has no rows")
    t0 = time.perf_counter()
    dense = bm25 = None
    try:
        if cfg.backend in ("dense", "hybrid"):
            dense = _build_dense(corpus, cfg, out)
        if cfg.backend in ("bm25", "hybrid"):
            texts = [corpus.row(i)["contents"] for i in range(rows)]
            Bm25Index.build(texts, out / cfg.bm25.dir, cfg.bm25)
            bm25 = cfg.bm25
    finally:
        corpus.close()
    manifest = Manifest(
        backend=cfg.backend,
        rows=rows,
        corpus_path=corpus_path,
        dense=dense,
        bm25=bm25,
        created_unix=time.time(),
    )
    write_manifest(out, manifest)
    log.info("index built", extra={"rows": rows, "seconds": round(time.perf_counter() - t0, 1)})
    return manifest


def _build_dense(corpus: CorpusStore, cfg: BuildConfig, out: Path) -> DenseManifest:
    spec = EncoderSpec(
        model_path=str(Path(cfg.encoder).resolve()) if cfg.encoder else DEFAULT_ENCODER,
        query_prefix=cfg.query_prefix,
        passage_prefix=cfg.passage_prefix,
        pooling=cfg.pooling,
        normalize=cfg.normalize,
        max_length=cfg.max_length,
    )
    if cfg.faiss_index is not None:
        from transformers import AutoConfig

        dim = int(AutoConfig.from_pretrained(resolve_model_path(spec.model_path)).hidden_size)
        index_file = str(Path(cfg.faiss_index).resolve())
        index_type, metric = _import_faiss(Path(index_file), len(corpus), dim)
        verify_encoder(Path(index_file), corpus, Encoder(spec, device=cfg.device))
        params: dict = {"imported": index_file}
    else:
        encoder = Encoder(spec, device=cfg.device)
        dim, index_file, metric = encoder.dim, "dense.faiss", "ip"
        params = _encode_corpus(corpus, encoder, cfg, out)
        index_type = cfg.index_type
    fields = spec.to_dict()
    fields["encoder_path"] = fields.pop("model_path")
    return DenseManifest(
        **fields,
        dim=dim,
        index_type=index_type,  # type: ignore[arg-type]
        index_file=index_file,
        metric=metric,  # type: ignore[arg-type]
        build_params=params,
    )


def verify_encoder(index_path: Path, corpus: CorpusStore, encoder: Encoder) -> None:
    """Re-encode a sample of rows and compare with the index's own vectors: an encoder set up
    differently from the one that built the index (pooling, passage prefix, normalisation)
    would serve plausible but wrong hits, so it is refused, naming the setting. The query
    prefix cannot be checked here (the index holds passages only)."""
    import faiss

    raw = faiss.read_index(str(index_path))
    index = faiss.downcast_index(raw)
    if isinstance(index, faiss.IndexIVF):
        index.make_direct_map()  # IVF lists are not addressable by row without it
    n = len(corpus)
    ids = sorted({int(i) for i in np.linspace(0, n - 1, min(_VERIFY_ROWS, n))})
    try:
        stored = np.stack([index.reconstruct(i) for i in ids]).astype(np.float32)
    except RuntimeError as e:  # an index type that keeps no vectors (e.g. PQ codes only)
        log.warning("cannot read vectors back to check the encoder", extra={"error": str(e)})
        return
    texts = [corpus.row(i)["contents"] for i in ids]
    spec = encoder.spec
    worst = _min_cosine(stored, encoder.encode(texts, is_query=False))
    if worst >= _VERIFY_MIN_COSINE:
        _check_norms(index_path, stored, spec.normalize)
        return
    for setting, variant in _variants(spec):
        if _min_cosine(stored, encoder.with_spec(variant).encode(texts, is_query=False)) >= (
            _VERIFY_MIN_COSINE
        ):
            given, fits = getattr(spec, setting), getattr(variant, setting)
            raise ValueError(
                f"{index_path}: the encoder's vectors do not match the index (cosine "
                f"{worst:.3f} on {len(ids)} sampled rows) with {setting}={given!r}; with "
                f"{setting}={fits!r} they do: build with --{setting.replace('_', '-')} {fits!r}"
            )
    raise ValueError(
        f"{index_path}: the encoder's vectors do not match the index (cosine {worst:.3f} on "
        f"{len(ids)} sampled rows, {_VERIFY_MIN_COSINE} needed): check the encoder "
        f"({spec.model_path}), pooling={spec.pooling!r}, passage_prefix={spec.passage_prefix!r} "
        f"and max_length={spec.max_length}"
    )


def _variants(spec: EncoderSpec) -> list[tuple[str, EncoderSpec]]:
    """Each a one-setting change of `spec`: the usual mistakes."""
    from dataclasses import replace

    other_pooling = "cls" if spec.pooling == "mean" else "mean"
    other_prefix = "" if spec.passage_prefix else "passage: "
    return [
        ("pooling", replace(spec, pooling=other_pooling)),
        ("passage_prefix", replace(spec, passage_prefix=other_prefix)),
    ]


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    na = np.linalg.norm(a, axis=1)
    nb = np.linalg.norm(b, axis=1)
    return float(np.min((a * b).sum(axis=1) / np.maximum(na * nb, 1e-12)))


def _check_norms(index_path: Path, stored: np.ndarray, normalize: bool) -> None:
    unit = bool(np.allclose(np.linalg.norm(stored, axis=1), 1.0, atol=1e-2))
    if unit != normalize:
        raise ValueError(
            f"{index_path}: the index's vectors are {'' if unit else 'not '}unit-length but "
            f"the encoder has normalize={normalize}: set normalize={not normalize}"
        )
