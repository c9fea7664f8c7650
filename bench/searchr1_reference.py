"""A stand-in for the reference Search-R1 retrieval server (`search_r1/search/retrieval_server.py`),
to measure ours side by side with it (`bench/retriever.py --reference-url`).

Written here, step for step as the reference does its work, so that what it costs per request is
the reference's cost:
- a FastAPI app whose `/retrieve` is a plain `def` (run in Starlette's thread pool, no batching
  across requests), returning a dict that FastAPI serializes;
- `batch_search` cuts the request's queries into batches of 512 with a tqdm bar on stderr (one per
  request), encodes each batch (fast tokenizer, `query: ` prefix for e5-style encoders, max length
  256, padding, mean pooling with `masked_fill`, L2 normalisation, under `torch.no_grad`), searches
  the faiss index, `.tolist()`s the results, flattens the ids with `sum(ids, [])` and looks every
  row up one by one;
- the endpoint always unpacks `results, scores = batch_search(...)`, which with
  `return_scores=false` unpacks the list of per-query results (the reference's defect: a
  one-query request fails, a two-query one is garbled). Measure it with `return_scores=true`,
  the path the original Search-R1 client uses.

CPU adaptations (the reference moves the model and inputs to CUDA, in fp16, and clones the index
to GPUs): the model runs in fp32 on the CPU and the faiss index stays on the CPU. The corpus is a
list of dicts read from the JSONL, not a `datasets` table (not installed here): row look-ups are
cheaper than the reference's Arrow rows, so this stand-in is, if anything, faster than the real one.

    OMP_NUM_THREADS=1 .venv/bin/python bench/searchr1_reference.py --index_path IDX/dense.faiss \
        --corpus_path IDX/corpus.jsonl --retriever_model MODEL_DIR --port 8090
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import faiss
import numpy as np
import torch
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from tqdm import tqdm
from transformers import AutoModel, AutoTokenizer


class QueryRequest(BaseModel):
    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


class ReferenceEncoder:
    def __init__(self, method: str, model_path: str, max_length: int) -> None:
        self.method = method
        self.max_length = max_length
        self.model = AutoModel.from_pretrained(model_path).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, use_fast=True)

    @torch.no_grad()
    def encode(self, queries: list[str]) -> np.ndarray:
        if "e5" in self.method.lower():
            queries = [f"query: {q}" for q in queries]
        inputs = self.tokenizer(
            queries, max_length=self.max_length, padding=True, truncation=True, return_tensors="pt"
        )
        out = self.model(**inputs, return_dict=True)
        mask = inputs["attention_mask"]
        hidden = out.last_hidden_state.masked_fill(~mask[..., None].bool(), 0.0)
        emb = hidden.sum(dim=1) / mask.sum(dim=1)[..., None]
        emb = torch.nn.functional.normalize(emb, dim=-1)
        return emb.detach().cpu().numpy().astype(np.float32, order="C")


class ReferenceRetriever:
    def __init__(self, args: argparse.Namespace) -> None:
        self.index = faiss.read_index(args.index_path)
        with open(args.corpus_path) as f:
            self.corpus = [json.loads(line) for line in f if line.strip()]
        self.encoder = ReferenceEncoder(args.retrieval_method, args.retriever_model, 256)
        self.topk = args.topk
        self.batch_size = 512

    def batch_search(self, queries: list[str], num: int, return_score: bool):  # type: ignore[no-untyped-def]
        results: list[list[dict]] = []
        scores: list[list[float]] = []
        for start in tqdm(range(0, len(queries), self.batch_size), desc="Retrieval process: "):
            emb = self.encoder.encode(queries[start : start + self.batch_size])
            batch_scores, batch_ids = self.index.search(emb, k=num)
            batch_scores, batch_ids = batch_scores.tolist(), batch_ids.tolist()
            docs = [self.corpus[int(i)] for i in sum(batch_ids, [])]  # noqa: RUF017 (as the reference)
            results.extend(docs[i * num : (i + 1) * num] for i in range(len(batch_ids)))
            scores.extend(batch_scores)
        if return_score:
            return results, scores
        return results


def create_app(retriever: ReferenceRetriever) -> FastAPI:
    app = FastAPI()

    @app.post("/retrieve")
    def retrieve(request: QueryRequest) -> dict:
        if not request.topk:
            request.topk = retriever.topk
        results, scores = retriever.batch_search(
            request.queries, num=request.topk, return_score=request.return_scores
        )
        resp = []
        for i, hits in enumerate(results):
            if request.return_scores:
                resp.append(
                    [{"document": doc, "score": s} for doc, s in zip(hits, scores[i], strict=False)]
                )
            else:
                resp.append(hits)
        return {"result": resp}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--index_path", required=True)
    ap.add_argument("--corpus_path", required=True)
    ap.add_argument("--retriever_model", required=True)
    ap.add_argument("--retrieval_method", default="e5", help="e5: queries get 'query: '")
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    uvicorn.run(create_app(ReferenceRetriever(args)), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
