"""The index directory's manifest: everything `serve` needs to load an index without guessing.

Layout of an index directory (written by `build.py`):
    manifest.json      this model
    corpus.jsonl       the corpus (or an absolute path to the user's file, never copied)
    corpus.spans.npy   byte spans of every corpus row (see corpus.py)
    dense.faiss        the faiss index (dense/hybrid; or an absolute path to an existing one)
    bm25/              the bm25s index (bm25/hybrid)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from retriever.config import Bm25Manifest

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DenseManifest(_Model):
    encoder_path: str
    query_prefix: str
    passage_prefix: str
    pooling: Literal["mean", "cls"]
    normalize: bool
    max_length: int
    dim: int
    index_type: Literal["Flat", "HNSW", "IVF"]
    index_file: str
    metric: Literal["ip", "l2"] = "ip"
    build_params: dict[str, Any] = Field(default_factory=dict)


class Manifest(_Model):
    format_version: int = FORMAT_VERSION
    backend: Literal["dense", "bm25", "hybrid"]
    rows: int
    corpus_path: str = "corpus.jsonl"
    spans_path: str = "corpus.spans.npy"
    dense: DenseManifest | None = None
    bm25: Bm25Manifest | None = None
    created_unix: float | None = None

    def resolve(self, index_dir: Path, rel: str) -> Path:
        """Paths in the manifest are relative to the index directory unless absolute."""
        p = Path(rel)
        return p if p.is_absolute() else index_dir / p


def write_manifest(index_dir: Path, manifest: Manifest) -> None:
    tmp = index_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")
    tmp.replace(index_dir / MANIFEST)  # atomic: a half-written manifest is never read


def read_manifest(index_dir: Path) -> Manifest:
    path = Path(index_dir) / MANIFEST
    if not path.exists():
        raise ValueError(
            f"{index_dir} is not an index directory (no {MANIFEST}); build one with "
            "`searchr1 retriever build`, or import an existing Search-R1 faiss index with "
            "`searchr1 retriever build --faiss-index e5_Flat.index --corpus wiki-18.jsonl`"
        )
    try:
        m = Manifest.model_validate_json(path.read_text())
    except ValidationError as e:
        raise ValueError(f"{path}: invalid manifest: {e}") from None
    if m.format_version != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {m.format_version}, expected {FORMAT_VERSION}")
    return m
