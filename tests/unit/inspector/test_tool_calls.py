"""A function-calling turn's calls, arguments and results: from the turn record through the
trajectory message and the rollout log to the inspector's page; logs written before the fields
existed still show."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from fastapi.testclient import TestClient

from harness.inspector_run import WordTokenizer
from inspector.server import create_app
from orchestrator.config import RolloutLogConfig
from orchestrator.rollout_log import RolloutLog, trajectory_row
from orchestrator.sample import Prompt, Sample, Status, ToolCallRecord, TurnRecord
from orchestrator.trajectory import to_trajectory
from protos.trajectory import decode, encode
from searchr1.rundir import RunLayout, rollout_schema

MALFORMED = "malformed tool call: not JSON (Expecting value at 0)"
CALLS = [
    ToolCallRecord(
        "search", '{"query": "Mabales"}', 'Doc 1(Title: "Mabales") born in 1908.\n', "", 0.012, 1
    ),
    ToolCallRecord(
        "calculate",
        '{"expression": "1997 -"}',
        "Tool calculate failed: bad syntax",
        "bad syntax",
        0.003,
        1,
    ),
    ToolCallRecord("", "null", f"Error: {MALFORMED}", MALFORMED),
]


def _sample(tok: WordTokenizer) -> Sample:
    messages = [{"role": "user", "content": "Question: How many years apart?\n"}]
    prompt = Prompt("years/test/0", "synthetic_years", messages, ["89"])
    s = Sample(prompt, "run-eval/-1/years/test/0", 0, 1, tok.encode("Question: How many?"))
    call = '<tool_call>{"name": "search", "arguments": {"query": "Mabales"}}</tool_call>'
    s.append_model(tok.encode(call), None, call)
    turn = TurnRecord(0, "tool", query=json.dumps([{"name": c.name} for c in CALLS]))
    turn.tool_calls = list(CALLS)
    turn.error = "bad syntax; malformed tool call"
    obs = "\n<tool> results </tool>\n"
    s.append_observation(tok.encode(obs), obs)
    turn.observation_tokens = len(tok.encode(obs))
    s.turns.append(turn)
    s.append_model(tok.encode("<answer> 89 </answer>"), None, "<answer> 89 </answer>")
    s.turns.append(TurnRecord(1, "answer"))
    s.status = Status.ANSWERED
    return s


def test_tool_calls_survive_the_wire_and_the_log(tmp_path: Path) -> None:
    tok = WordTokenizer()
    traj = decode(encode(to_trajectory(_sample(tok))))
    calls = traj.turns[0].tool_calls
    assert [(c.name, c.arguments_json, c.error, c.attempts) for c in calls] == [
        (c.name, c.arguments_json, c.error, c.attempts) for c in CALLS
    ]
    assert calls[0].result == CALLS[0].result and not traj.turns[1].tool_calls
    row = trajectory_row(traj, tok, kind="eval", reason="eval")
    assert row["turns"][0]["tool_calls"][1]["error"] == "bad syntax"
    # the row fits the run directory's schema
    pa.Table.from_pylist([row], schema=rollout_schema())


def _page(run_dir: Path) -> str:
    client = TestClient(create_app(run_dir))
    html = client.get("/trajectories?kind=eval").text
    href = html.split('href="/t/', 1)[1].split('"', 1)[0]
    page = client.get(f"/t/{href}")
    assert page.status_code == 200
    return page.text


def test_the_trajectory_page_shows_each_call(tmp_path: Path) -> None:
    tok = WordTokenizer()
    RolloutLog(RolloutLogConfig(run_dir=str(tmp_path)), tok).write_eval(
        [_sample(tok)], {"overall": {}}, "multi-tool"
    )
    html = _page(tmp_path)
    assert 'table class="calls"' in html
    for name in ("search", "calculate", "(unreadable)"):
        assert f'<td class="mono name">{name}</td>' in html
    assert "{&#34;query&#34;: &#34;Mabales&#34;}" in html  # the arguments, escaped
    assert "Doc 1(Title: &#34;Mabales&#34;) born in 1908." in html  # the result as read
    assert '<div class="bad error">bad syntax</div>' in html
    assert "malformed tool call: not JSON" in html
    assert html.count('<tr class="call err">') == 2


def test_a_log_written_before_the_fields_still_shows(tmp_path: Path) -> None:
    """Rows of an older writer: turns without `tool_calls` (the calls only in `query`)."""
    tok = WordTokenizer()
    row = trajectory_row(to_trajectory(_sample(tok)), tok, kind="eval", reason="eval")
    for turn in row["turns"]:
        del turn["tool_calls"]
    schema = rollout_schema()
    turns = schema.field("turns")
    old_turn = pa.struct([f for f in turns.type.value_type if f.name != "tool_calls"])
    old = schema.set(schema.get_field_index("turns"), pa.field("turns", pa.list_(old_turn)))
    row["eval_id"] = "20260101-000000-old"
    path = RunLayout(tmp_path).eval_file("20260101-000000-old")
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([row], schema=old), path)
    html = _page(tmp_path)
    assert 'table class="calls"' not in html
    assert "&#34;name&#34;: &#34;calculate&#34;" in html  # the turn's query, as before
