"""Datasets: Search-R1 rows from parquet or JSONL, deterministic sampling, data preparation.

Row format (spec section 1): `data_source`, `prompt` (chat messages), `ability`,
`reward_model.ground_truth.target` (gold answers), `extra_info` (`split`, `index`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from orchestrator.prompt import make_row
from orchestrator.sample import Prompt

# FlashRAG's evaluation preference: the test split, else dev, else train.
EVAL_SPLIT_ORDER = ("test", "dev", "train")


class DataError(ValueError):
    """A dataset file that is missing or has rows in the wrong shape."""


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a parquet (`.parquet`) or JSON-lines file as plain dicts."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"dataset file not found: {p}")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    rows = []
    with p.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{line_no}: not valid JSON: {e}") from e
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def row_to_prompt(row: dict[str, Any], position: int, source: str = "") -> Prompt:
    """Convert one row; errors name the row and the missing field."""
    where = f"{source} row {position}"
    try:
        messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
        golds = row["reward_model"]["ground_truth"]["target"]
    except (KeyError, TypeError) as e:
        raise DataError(
            f"{where}: missing field {e} (need prompt, reward_model.ground_truth)"
        ) from e
    if isinstance(golds, str):
        golds = [golds]
    golds = [str(g) for g in golds]
    if not messages or not golds:
        raise DataError(f"{where}: empty prompt or gold answers")
    extra = row.get("extra_info") or {}
    data_source = str(row.get("data_source") or "unknown")
    split = str(extra.get("split", "unknown"))
    index = extra.get("index", position)
    return Prompt(
        prompt_id=f"{data_source}/{split}/{index}",
        data_source=data_source,
        messages=messages,
        golds=golds,
        metadata={"split": split, "index": str(index)},
    )


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    rows = read_rows(path)
    if limit is not None:
        rows = rows[:limit]
    prompts = [row_to_prompt(r, i, str(path)) for i, r in enumerate(rows)]
    if not prompts:
        raise DataError(f"{path}: no rows")
    return prompts


class PromptSampler:
    """Deterministic batches: epoch e is a permutation seeded by (seed, e).

    `batch(step)` is a pure function of the step, so a restarted orchestrator regenerates the
    very same prompts for a step it had not finished.
    """

    def __init__(
        self,
        prompts: list[Prompt],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        epochs: int = 1,
    ) -> None:
        if batch_size > len(prompts):
            raise DataError(f"prompts_per_step={batch_size} exceeds the {len(prompts)} prompts")
        self.prompts = prompts
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self._orders: dict[int, list[int]] = {}

    @property
    def num_steps(self) -> int:
        # The last partial batch of the whole run is dropped (groups stay full-sized).
        return len(self.prompts) * self.epochs // self.batch_size

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(f"{self.seed}/{epoch}").shuffle(order)
            self._orders = {epoch: order}  # keep one epoch: memory stays O(dataset)
        return self._orders[epoch]

    def batch(self, step: int) -> list[Prompt]:
        if not 0 <= step < self.num_steps:
            raise IndexError(f"step {step} outside [0, {self.num_steps})")
        n = len(self.prompts)
        out = []
        for pos in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, i = divmod(pos, n)
            out.append(self.prompts[self._order(epoch)[i]])
        return out

    def __iter__(self) -> Iterator[list[Prompt]]:
        for step in range(self.num_steps):
            yield self.batch(step)


def validation_subset(prompts: list[Prompt], size: int, seed: int = 0) -> list[Prompt]:
    """The same `size` prompts every time (seeded), so evaluation curves are comparable."""
    if size >= len(prompts):
        return list(prompts)
    idx = sorted(random.Random(f"val/{seed}").sample(range(len(prompts)), size))
    return [prompts[i] for i in idx]


# -- `searchr1 data prepare` -----------------------------------------------------------------


def find_split_file(root: Path, dataset: str, split: str | None) -> tuple[str, Path]:
    """FlashRAG layout `<root>/<dataset>/<split>.jsonl`; no split: test, else dev, else train."""
    candidates = (split,) if split else EVAL_SPLIT_ORDER
    for s in candidates:
        for ext in (".jsonl", ".parquet"):
            p = root / dataset / f"{s}{ext}"
            if p.exists():
                return s, p
    want = split or "/".join(EVAL_SPLIT_ORDER)
    raise DataError(f"no {want} file for dataset {dataset!r} under {root / dataset}")


def prepare_rows(
    root: Path, datasets: Iterable[str], split: str | None
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """FlashRAG QA files -> Search-R1 rows with the exact prompt. Returns rows, split per set."""
    rows: list[dict[str, Any]] = []
    used: dict[str, str] = {}
    for ds in datasets:
        found_split, path = find_split_file(root, ds, split)
        used[ds] = found_split
        for i, raw in enumerate(read_rows(path)):
            try:
                question, golds = raw["question"], raw["golden_answers"]
            except KeyError as e:
                raise DataError(f"{path} row {i}: missing field {e}") from e
            if isinstance(golds, str):
                golds = [golds]
            try:
                rows.append(make_row(question, golds, data_source=ds, split=found_split, index=i))
            except ValueError as e:
                raise DataError(f"{path} row {i}: {e}") from e
    return rows, used
