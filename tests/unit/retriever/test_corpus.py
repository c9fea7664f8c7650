from __future__ import annotations

import json

import pytest

from retriever.corpus import CorpusStore, iter_jsonl, scan_spans


def test_spans_skip_blank_lines_and_handle_crlf_and_missing_final_newline(tmp_path):
    p = tmp_path / "c.jsonl"
    rows = [{"id": "a", "contents": '"T1"\nbody one'}, {"id": "b", "contents": '"T2"\nzwei ü'}]
    text = json.dumps(rows[0]) + "\r\n\n  \n" + json.dumps(rows[1], ensure_ascii=False)
    p.write_bytes(text.encode())
    spans = scan_spans(p)
    assert spans.shape == (2, 2)
    store = CorpusStore.open(p, tmp_path / "c.spans.npy")
    assert len(store) == 2
    assert store.row(0) == rows[0]
    assert store.row(1) == rows[1]
    assert (tmp_path / "c.spans.npy").exists()
    # Reopening uses the saved spans (memory-mapped), same rows.
    again = CorpusStore.open(p, tmp_path / "c.spans.npy")
    assert again.row(1) == rows[1]
    with pytest.raises(IndexError):
        store.row(2)
    store.close()
    again.close()


def test_row_without_id_gets_its_position(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"contents": "x"}) + "\n" + json.dumps({"contents": "y"}) + "\n")
    store = CorpusStore.open(p)
    assert [r["id"] for r in store] == ["0", "1"]
    store.close()


def test_empty_corpus_has_no_rows(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text("\n\n")
    store = CorpusStore.open(p)
    assert len(store) == 0
    store.close()


def test_iter_jsonl_names_the_bad_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"id": "0", "contents": "x"}\n{"id": "1"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2: .*contents"):
        list(iter_jsonl(p))
