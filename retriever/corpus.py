"""Offset-indexed, memory-mapped access to a Search-R1 corpus JSONL.

Row i of the index is the i-th non-empty line of the JSONL (the reference server's convention).
The serving process never reads the whole corpus into memory: the file is memory-mapped and a
`corpus.spans.npy` array ((start, end) byte offsets per row) locates each line, so start-up takes
seconds even for the 13 GB wiki-18 dump and the OS page cache holds only the rows served.

Search-R1 ships the corpus gzipped (`wiki-18.jsonl.gz`). A gzip stream has no random access,
so the build decompresses it into the index directory (`decompress_to`) and serves that copy;
`iter_jsonl` streams either form.
"""

from __future__ import annotations

import gzip
import json
import mmap
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

_CHUNK = 64 << 20
_GZIP_MAGIC = b"\x1f\x8b"


def is_gzip(path: Path) -> bool:
    """By content, not by name: a `.jsonl` that is really gzip is read right too."""
    with open(path, "rb") as f:
        return f.read(2) == _GZIP_MAGIC


def decompress_to(path: Path, dest: Path) -> Path:
    """Stream the gzip corpus `path` into `dest` (plain JSONL); returns `dest`."""
    tmp = dest.with_name(dest.name + ".part")
    try:
        with gzip.open(path, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK)
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; EOF: truncated
        tmp.unlink(missing_ok=True)
        raise ValueError(f"{path}: cannot decompress the gzip corpus: {e}") from None
    tmp.replace(dest)
    return dest


def _refuse_gzip(path: Path) -> None:
    if is_gzip(path):
        raise ValueError(
            f"{path} is gzip-compressed: rows are read by byte offset, which a gzip stream "
            "does not allow. `searchr1 retriever build` decompresses it into the index "
            "directory; or gunzip it first"
        )


def scan_spans(path: Path) -> np.ndarray:
    """(start, end) byte offsets of every non-blank line, as an (n, 2) uint64 array."""
    _refuse_gzip(path)
    ends: list[np.ndarray] = []
    pos = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10).astype(np.uint64)
            ends.append(nl + np.uint64(pos))
            pos += len(chunk)
    line_ends = np.concatenate([*ends, np.array([pos], dtype=np.uint64)])
    line_starts = np.concatenate([np.zeros(1, dtype=np.uint64), line_ends[:-1] + np.uint64(1)])
    keep = line_ends > line_starts
    # Lines of a few bytes may be only white space ("\r", " "): blank, not rows. Rare; check each.
    with open(path, "rb") as f:
        for i in np.flatnonzero(keep & (line_ends - line_starts <= 2)):
            f.seek(int(line_starts[i]))
            keep[i] = bool(f.read(int(line_ends[i] - line_starts[i])).strip())
    return np.stack([line_starts[keep], line_ends[keep]], axis=1)


class CorpusStore:
    """Read-only random access to corpus rows by index position."""

    def __init__(self, path: Path, spans: np.ndarray) -> None:
        self.path = path
        self._spans = spans
        self._file = open(path, "rb")  # noqa: SIM115 - lives as long as the store
        size = path.stat().st_size
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    @classmethod
    def open(cls, path: Path, spans_path: Path | None = None) -> CorpusStore:
        """Open a corpus, using (or writing) its spans file; without one, scan the file."""
        path = Path(path)
        _refuse_gzip(path)
        if spans_path is not None and spans_path.exists():
            spans = np.load(spans_path, mmap_mode="r")
        else:
            spans = scan_spans(path)
            if spans_path is not None:
                np.save(spans_path, spans)
        return cls(path, spans)

    def __len__(self) -> int:
        return int(self._spans.shape[0])

    def raw(self, i: int) -> bytes:
        if not 0 <= i < len(self):
            raise IndexError(f"corpus row {i} out of range (0..{len(self) - 1})")
        assert self._mm is not None
        start, end = self._spans[i]
        return self._mm[int(start) : int(end)]

    def row(self, i: int) -> dict[str, Any]:
        """The corpus row as the reference returns it: every field of the JSON line."""
        row = json.loads(self.raw(i))
        if "id" not in row:
            row = {"id": str(i), **row}
        return row

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self.row(i)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._file.close()


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Stream a corpus JSONL, plain or gzip (non-empty lines), validating the row shape."""
    opener = gzip.open if is_gzip(path) else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(row, dict) or not isinstance(row.get("contents"), str):
                raise ValueError(f"{path}:{lineno}: a row needs a string 'contents' field")
            yield row
