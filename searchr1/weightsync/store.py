"""A weight store: every version the trainer pushes, on disk, for engines that join by pulling.

An engine that starts, restarts or is added mid-run reads the current version here (a full
snapshot, then the deltas after it) instead of waiting for the next push; the engines already
serving are not involved (`inference.join`). The trainer's `WeightPusher` publishes each
version before pushing it (`trainer.weight_push.store_dir`).

Layout of the directory (safetensors and JSON only, never a pickle):

    index.json                      the manifest (`StoreIndex`): one entry per version kept
    v00000012.full.safetensors      every tensor, in the engines' dtype
    v00000013.delta.safetensors     one uint8 tensor "payload" and a `protocol.Bucket` with its
                                    `DeltaHeader` as metadata (`protocol.DELTA_METADATA`): each
                                    tensor full, same, XOR+zstd or sparse against version 12

Tensors holding the same bits as an earlier one (a tied embedding, norms still equal) are
stored once: the file's metadata (`searchr1.aliases`, JSON) names them with their source.
Each entry names its file's SHA-256 and size, and `checksum`: `delta.state_checksum` of the
whole state at that version (the trainer's tensors as the engines hold them). A reader checks
both: a corrupt or truncated file, or a chain that does not rebuild the trainer's weights bit
for bit, is a `StoreCorrupt` error (counted in `searchr1_weight_store_errors_total`), never
weights served. Files are written under a temporary name and renamed; `index.json` is renamed
over last, so a reader sees either the old or the new manifest, whole. One writer per store
(the trainer holding the run's lease).

Retention: a full snapshot every `full_every` versions (or sooner, once the deltas since the
last one add up to `max_chain_ratio` of a full one: a joiner never reads much more than one
full version), the newest `keep_full` snapshots and the deltas after the oldest of them; the
rest is deleted after the new manifest is in place (a reader that loses a file to a prune
mid-read reads the new manifest again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from searchr1.weightsync.delta import (
    EncodedTensor,
    Encoding,
    apply_in_place,
    bits,
    encode,
    state_checksum,
)
from searchr1.weightsync.group import dtype_from_name, dtype_name
from searchr1.weightsync.protocol import DELTA_METADATA, Bucket, DeltaHeader

log = logging.getLogger(__name__)

INDEX = "index.json"
ALIASES = "searchr1.aliases"  # safetensors metadata: {name: an earlier name, same bits}
FORMAT = 1
STORE_ERRORS = Counter(
    "searchr1_weight_store_errors_total",
    "Weight store reads refused: a file whose SHA-256 or size is not the manifest's, a "
    "manifest or header that does not parse, a chain that does not rebuild the trainer's "
    "checksum, a missing file",
    ["reason"],
)
for _reason in ("sha256", "manifest", "header", "checksum", "missing", "dtype"):
    STORE_ERRORS.labels(_reason)


class StoreCorrupt(ValueError):
    """The store holds something that is not what its manifest says (counted by reason)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        STORE_ERRORS.labels(reason).inc()
        log.error("weight store entry refused", extra={"reason": reason, "error": message})


class StoreEmpty(LookupError):
    """No version published yet."""


class StoreEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)
    kind: Literal["full", "delta"]
    base: int | None = None  # a delta's: the version it applies to
    file: str = Field(pattern=r"^v\d{8}\.(full|delta)\.safetensors$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)
    checksum: str  # delta.state_checksum of the whole state at this version
    state: str | None = None  # the pusher's delta state name of this version (baseline.py)
    tensors: int = Field(ge=0)
    created: float


class StoreIndex(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = FORMAT
    run: str | None = None  # the run (`run.id`) whose weights these are
    dtype: str | None = None  # the engines' floating dtype the tensors are in
    entries: list[StoreEntry] = Field(default_factory=list)

    @property
    def latest(self) -> StoreEntry | None:
        return self.entries[-1] if self.entries else None

    def chain(self, version: int, have: int | None = None) -> list[StoreEntry]:
        """The entries that rebuild `version`: from `have` (a version the reader holds) by
        deltas where they reach it, else from the newest full snapshot at or below it."""
        by_version = {e.version: e for e in self.entries}
        if version not in by_version:
            raise LookupError(f"version {version} is not in the store")
        out: list[StoreEntry] = []
        e = by_version[version]
        while True:
            if have is not None and e.version == have:
                return out[::-1]
            out.append(e)
            if e.kind == "full":
                return out[::-1] if have is None else self.chain(version)
            assert e.base is not None
            if e.base not in by_version:
                raise LookupError(f"version {e.version}'s base {e.base} is not in the store")
            e = by_version[e.base]


@dataclass(frozen=True)
class Snapshot:
    """A version read from the store: its tensors (CPU, the engines' dtype), as published."""

    version: int
    tensors: dict[str, torch.Tensor]
    checksum: str
    state: str | None
    bytes_read: int
    files: int


@dataclass(frozen=True)
class Published:
    version: int
    kind: str
    bytes: int
    seconds: float


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.part")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_index(root: Path) -> StoreIndex:
    """The manifest; an empty one where none was written yet. StoreCorrupt if unreadable."""
    path = Path(root) / INDEX
    try:
        text = path.read_text()
    except FileNotFoundError:
        return StoreIndex()
    try:
        return StoreIndex.model_validate_json(text)
    except ValidationError as e:
        raise StoreCorrupt("manifest", f"{path}: not a weight store manifest ({e})") from None


class WeightStoreWriter:
    """The trainer's side: `publish(version, named)` after each training step."""

    def __init__(
        self,
        root: str | Path,
        *,
        run: str | None = None,
        full_every: int = 10,
        keep_full: int = 2,
        max_chain_ratio: float = 0.5,
    ) -> None:
        """`run`: the run's id, recorded in the manifest; a store holding another run's
        weights is started afresh (its files deleted) at the first publication."""
        if full_every < 1 or keep_full < 1 or max_chain_ratio <= 0:
            raise ValueError("full_every and keep_full must be >= 1, max_chain_ratio > 0")
        self.root = Path(root)
        self.full_every = full_every
        self.keep_full = keep_full
        self.max_chain_ratio = max_chain_ratio
        self.run = run
        self.root.mkdir(parents=True, exist_ok=True)
        # What the newest entry holds (a delta is encoded against it); None: unknown, the next
        # publication is a full snapshot (a new writer never trusts files it did not write).
        self._held: dict[str, torch.Tensor] | None = None
        self._held_version: int | None = None

    def publish(
        self,
        version: int,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        dtype: torch.dtype | None = None,
        state: str | None = None,
    ) -> Published:
        """Write `version` (floating tensors cast to `dtype`, the engines'). A version at or
        below the newest (a trainer resumed from an older checkpoint) drops the entries from
        it on and is written in full."""
        start = time.perf_counter()
        index = read_index(self.root)
        if index.run != self.run:
            if index.entries:
                log.warning(
                    "weight store of another run: started afresh",
                    extra={"store": str(self.root), "run": index.run, "this_run": self.run},
                )
            index, self._held = StoreIndex(run=self.run), None
        tensors = {n: _engine_copy(t, dtype) for n, t in named}
        if not tensors:
            raise ValueError("nothing to publish: no tensors")
        floating = {t.dtype for t in tensors.values() if t.is_floating_point()}
        index.dtype = dtype_name(next(iter(floating))) if len(floating) == 1 else index.dtype
        latest = index.latest
        checksum = state_checksum(tensors.items())
        if latest is not None and latest.version == version and latest.checksum == checksum:
            # A push retried, or a trainer resumed at the version it last published.
            self._held, self._held_version = tensors, version
            return Published(version, "kept", 0, time.perf_counter() - start)
        if latest is not None and version <= latest.version:
            log.warning(
                "weight store goes back a version",
                extra={"version": version, "newest": latest.version},
            )
            index.entries = [e for e in index.entries if e.version < version]
            self._held = None
        full_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        delta_ok = (
            self._held is not None
            and index.latest is not None
            and index.latest.version == self._held_version
            and self._held.keys() == tensors.keys()
            and not self._full_due(index, full_bytes)
        )
        if delta_ok:
            assert self._held is not None and index.latest is not None
            entry = self._write_delta(version, tensors, index.latest.version, checksum, state)
        else:
            entry = self._write_full(version, tensors, checksum, state)
        index.entries.append(entry)
        _write_atomic(self.root / INDEX, index.model_dump_json(indent=1).encode())
        self._held, self._held_version = tensors, version
        self._prune(index)
        seconds = time.perf_counter() - start
        log.info(
            "weights published to the store",
            extra={"version": version, "kind": entry.kind, "bytes": entry.bytes,
                   "seconds": round(seconds, 3)},
        )  # fmt: skip
        return Published(version, entry.kind, entry.bytes, seconds)

    def set_state(self, version: int, state: str | None) -> None:
        """Record the pusher's delta state of `version` once its push is committed: an engine
        that joins at that version takes it, and the next delta push applies there too."""
        index = read_index(self.root)
        latest = index.latest
        if latest is None or latest.version != version or latest.state == state:
            return
        latest.state = state
        _write_atomic(self.root / INDEX, index.model_dump_json(indent=1).encode())

    def _full_due(self, index: StoreIndex, full_bytes: int) -> bool:
        since = []
        for e in reversed(index.entries):
            if e.kind == "full":
                break
            since.append(e)
        return (
            len(since) + 1 >= self.full_every
            or sum(e.bytes for e in since) > self.max_chain_ratio * full_bytes
        )

    def _entry(
        self, version: int, kind: str, base: int | None, path: Path, **kw: object
    ) -> StoreEntry:
        return StoreEntry(
            version=version, kind=kind, base=base, file=path.name, sha256=_sha256(path),
            bytes=path.stat().st_size, created=time.time(), **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    def _write_full(
        self, version: int, tensors: dict[str, torch.Tensor], checksum: str, state: str | None
    ) -> StoreEntry:
        from safetensors.torch import save_file

        path = self.root / f"v{version:08d}.full.safetensors"
        tmp = path.with_name(f".{path.name}.part")
        aliases = _aliases(tensors)
        unique = {n: t for n, t in tensors.items() if n not in aliases}
        meta = {"searchr1.version": str(version), ALIASES: json.dumps(aliases)}
        save_file(unique, str(tmp), metadata=meta)
        tmp.replace(path)
        return self._entry(
            version, "full", None, path, checksum=checksum, state=state, tensors=len(tensors)
        )

    def _write_delta(
        self,
        version: int,
        tensors: dict[str, torch.Tensor],
        base: int,
        checksum: str,
        state: str | None,
    ) -> StoreEntry:
        from safetensors.torch import save_file

        assert self._held is not None
        bucket = Bucket(names=[], dtypes=[], shapes=[])
        encodings: list[str] = []
        payloads: list[torch.Tensor] = []
        aliases = _aliases(tensors)
        for name, t in tensors.items():
            if name in aliases:
                continue
            enc = encode(self._held[name], t)
            bucket.names.append(name)
            bucket.dtypes.append(dtype_name(t.dtype))
            bucket.shapes.append(list(t.shape))
            encodings.append(enc.encoding.value)
            payloads.append(enc.payload)
        bucket.delta = DeltaHeader(
            encodings=encodings,  # type: ignore[arg-type]
            nbytes=[int(p.numel()) for p in payloads],
            base=str(base),
            state=str(version),
            checksum=checksum,
        )
        blob = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8)
        path = self.root / f"v{version:08d}.delta.safetensors"
        tmp = path.with_name(f".{path.name}.part")
        meta = {DELTA_METADATA: bucket.model_dump_json(), ALIASES: json.dumps(aliases)}
        save_file({"payload": blob}, str(tmp), metadata=meta)
        tmp.replace(path)
        return self._entry(
            version, "delta", base, path, checksum=checksum, state=state, tensors=len(tensors)
        )

    def _prune(self, index: StoreIndex) -> None:
        """Keep the newest `keep_full` full snapshots and what follows the oldest of them."""
        fulls = [e for e in index.entries if e.kind == "full"]
        if len(fulls) > self.keep_full:
            oldest_kept = fulls[-self.keep_full].version
            index.entries = [e for e in index.entries if e.version >= oldest_kept]
            _write_atomic(self.root / INDEX, index.model_dump_json(indent=1).encode())
        keep = {e.file for e in index.entries}
        for path in self.root.glob("v*.safetensors"):
            if path.name not in keep:
                path.unlink(missing_ok=True)


class WeightStoreReader:
    """An engine's side: the newest version (or a given one), checked end to end."""

    def __init__(self, root: str | Path, *, run: str | None = None) -> None:
        """`run`: only this run's weights (a store of another run reads as empty)."""
        self.root = Path(root)
        self.run = run

    def index(self) -> StoreIndex:
        index = read_index(self.root)
        if self.run is not None and index.entries and index.run != self.run:
            log.warning(
                "weight store of another run: not pulled",
                extra={"store": str(self.root), "run": index.run, "this_run": self.run},
            )
            return StoreIndex(run=self.run)
        return index

    def latest_version(self) -> int | None:
        latest = self.index().latest
        return None if latest is None else latest.version

    def read(
        self,
        version: int | None = None,
        *,
        have: Snapshot | None = None,
        dtype: torch.dtype | None = None,
    ) -> Snapshot:
        """`version` (default: the newest) rebuilt and checked against its checksum. `have`: a
        snapshot read earlier, brought forward by the deltas since where they reach it (its
        tensors are left as they are). `dtype`: the reader's floating dtype, refused if the
        store's differs (a cast would not be the trainer's weights). A file pruned while
        reading: read again once."""
        for attempt in (0, 1):
            try:
                return self._read(version, have, dtype)
            except FileNotFoundError as e:
                if attempt:
                    raise StoreCorrupt("missing", f"{self.root}: {e}") from None
        raise AssertionError("unreachable")

    def _read(
        self, version: int | None, have: Snapshot | None, dtype: torch.dtype | None
    ) -> Snapshot:
        index = self.index()
        if index.latest is None:
            raise StoreEmpty(f"{self.root}: no weights published yet")
        if dtype is not None and index.dtype and dtype_from_name(index.dtype) != dtype:
            raise StoreCorrupt(
                "dtype",
                f"{self.root} holds {index.dtype} weights; this engine serves "
                f"{dtype_name(dtype)} (set the engines' dtype to the store's)",
            )
        target = index.latest.version if version is None else version
        chain = index.chain(target, have.version if have is not None else None)
        if have is not None and not chain:
            return have
        tensors: dict[str, torch.Tensor] = {}
        borrowed: set[str] = set()  # the caller's tensors: replaced, never written
        if have is not None and chain[0].kind == "delta":
            tensors, borrowed = dict(have.tensors), set(have.tensors)
        nbytes = 0
        for entry in chain:
            path = self.root / entry.file
            if not path.exists():
                raise FileNotFoundError(entry.file)
            size, digest = path.stat().st_size, _sha256(path)
            if size != entry.bytes or digest != entry.sha256:
                raise StoreCorrupt(
                    "sha256",
                    f"{path}: {size} bytes, sha256 {digest[:12]}.. (the manifest says "
                    f"{entry.bytes} bytes, {entry.sha256[:12]}..)",
                )
            nbytes += size
            if entry.kind == "full":
                tensors, borrowed = _load_full(path), set()
            else:
                _apply_delta(path, tensors, entry, borrowed)
        last = chain[-1]
        got = state_checksum(tensors.items())
        if got != last.checksum:
            raise StoreCorrupt(
                "checksum",
                f"{self.root}: version {last.version} rebuilt to checksum {got}, the trainer's "
                f"is {last.checksum}",
            )
        return Snapshot(last.version, tensors, got, last.state, nbytes, len(chain))


def _aliases(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> an earlier name holding the same dtype, shape and bits (tied embeddings, equal
    norms): stored once."""
    out: dict[str, str] = {}
    seen: dict[tuple[object, ...], list[str]] = {}
    for name, t in tensors.items():
        if not t.numel():
            continue
        flat = bits(t)
        step = max(1, flat.numel() // 64)
        key = (t.dtype, tuple(t.shape), flat[::step][:64].numpy().tobytes())
        earlier = seen.setdefault(key, [])
        match = next((n for n in earlier if torch.equal(bits(tensors[n]), flat)), None)
        if match is None:
            earlier.append(name)
        else:
            out[name] = match
    return out


def _read_aliases(meta: dict[str, str] | None, path: Path) -> dict[str, str]:
    try:
        aliases = json.loads((meta or {}).get(ALIASES, "{}"))
    except json.JSONDecodeError as e:
        raise StoreCorrupt("header", f"{path}: bad {ALIASES} metadata ({e})") from None
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
    ):
        raise StoreCorrupt("header", f"{path}: {ALIASES} must map names to names")
    return aliases


def _set_aliases(tensors: dict[str, torch.Tensor], aliases: dict[str, str], path: Path) -> None:
    for name, source in aliases.items():
        if source not in tensors or source in aliases:
            raise StoreCorrupt("header", f"{path}: {name} is an alias of unknown {source!r}")
        tensors[name] = tensors[source].clone()


def _load_full(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), framework="pt") as sf:
            meta = sf.metadata()
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise StoreCorrupt("header", f"{path}: not a readable safetensors file ({e})") from None
    _set_aliases(tensors, _read_aliases(meta, path), path)
    return tensors


def _apply_delta(
    path: Path, tensors: dict[str, torch.Tensor], entry: StoreEntry, borrowed: set[str]
) -> None:
    """Bring `tensors` (version entry.base) to entry.version in place; a `borrowed` tensor (the
    caller's snapshot) is copied first, never written."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as sf:
            metadata = sf.metadata()
            blob = sf.get_tensor("payload")
        bucket = Bucket.model_validate_json((metadata or {}).get(DELTA_METADATA) or "")
    except (ValidationError, Exception) as e:
        raise StoreCorrupt("header", f"{path}: not a readable delta ({e})") from None
    header = bucket.delta
    if header is None or blob.dtype != torch.uint8 or blob.numel() != sum(header.nbytes):
        raise StoreCorrupt("header", f"{path}: payload does not match its header")
    aliases = _read_aliases(metadata, path)
    if set(bucket.names) | set(aliases) != set(tensors) or set(bucket.names) & set(aliases):
        raise StoreCorrupt("header", f"{path}: names differ from version {entry.base}'s")
    offset = 0
    for name, dt, shape, encoding, n in zip(
        bucket.names, bucket.dtypes, bucket.shapes, header.encodings, header.nbytes, strict=True
    ):
        payload = blob[offset : offset + n]
        offset += n
        if encoding == "same":
            continue
        if encoding == "alias":
            raise StoreCorrupt("header", f"{path}: {name}: alias payloads are not stored")
        prev = tensors[name]
        if dtype_name(prev.dtype) != dt or list(prev.shape) != shape:
            raise StoreCorrupt("header", f"{path}: {name}: {dt} {shape} for {prev.dtype}")
        out = prev.clone() if name in borrowed else prev
        borrowed.discard(name)
        try:
            enc = EncodedTensor(Encoding(encoding), payload, prev.dtype, tuple(shape))
            apply_in_place(out, enc, name, undo=False)
        except ValueError as e:
            raise StoreCorrupt("header", f"{path}: {e}") from None
        tensors[name] = out
    _set_aliases(tensors, aliases, path)


def _engine_copy(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` as the engines hold it, on the CPU, in memory of its own."""
    src = t.detach()
    out = src.to(dtype) if dtype is not None and src.is_floating_point() else src
    out = out.to("cpu").contiguous()
    return out.clone() if out.data_ptr() == src.data_ptr() else out


def describe(root: str | Path) -> dict[str, object]:
    """The manifest as plain data (for logs and `searchr1 local` status)."""
    index = read_index(Path(root))
    return json.loads(index.model_dump_json())
