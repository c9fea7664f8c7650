"""Optional rerank stage: a cross-encoder rescores the first backend's top candidates.

The reference chain is e5 top-10 -> cross-encoder -> top-3. Any Hugging Face sequence
classification model from a local directory works (`retriever.rerank.model_path`); its
first logit is the relevance score, as for the ms-marco cross-encoders. The returned score is
the cross-encoder's, so results are ordered by it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from retriever.backends.base import BatchBackend, Hit
from retriever.config import RerankConfig
from retriever.encoder import resolve_device


class CrossEncoder:
    def __init__(self, cfg: RerankConfig, *, device: str = "auto") -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        assert cfg.model_path is not None
        self.cfg = cfg
        self.device = resolve_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        dtype = torch.float16 if self.device.startswith("cuda") else torch.float32
        model = AutoModelForSequenceClassification.from_pretrained(cfg.model_path, dtype=dtype)
        self.model = model.to(self.device).eval()

    def score(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """Relevance of each (query, passage) pair: the model's first logit."""
        import torch

        out = np.empty(len(pairs), dtype=np.float32)
        bs = self.cfg.batch_size
        for s in range(0, len(pairs), bs):
            chunk = pairs[s : s + bs]
            batch = self.tokenizer(
                [q for q, _ in chunk],
                [p for _, p in chunk],
                padding=True,
                truncation=True,
                max_length=self.cfg.max_length,
                return_tensors="pt",
            ).to(self.device)
            with torch.inference_mode():
                out[s : s + len(chunk)] = self.model(**batch).logits[:, 0].float().cpu().numpy()
        return out


class RerankBackend:
    name = "rerank"

    def __init__(self, inner: BatchBackend, reranker: CrossEncoder, cfg: RerankConfig) -> None:
        self.inner = inner
        self.reranker = reranker
        self.cfg = cfg
        self.name = f"{inner.name}+rerank"

    def search_batch(self, queries: list[str], topk: int) -> list[list[Hit]]:
        candidates = self.inner.search_batch(queries, max(topk, self.cfg.candidates))
        pairs = [
            (q, doc["contents"])
            for q, hits in zip(queries, candidates, strict=True)
            for doc, _ in hits
        ]
        scores = self.reranker.score(pairs)
        out: list[list[Hit]] = []
        offset = 0
        for hits in candidates:
            mine = scores[offset : offset + len(hits)]
            offset += len(hits)
            order = np.argsort(-mine, kind="stable")[:topk]
            out.append([(hits[i][0], float(mine[i])) for i in order])
        return out

    def healthy(self) -> bool:
        return getattr(self.inner, "healthy", lambda: True)()

    def close(self) -> None:
        self.inner.close()
