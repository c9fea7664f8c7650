"""Sessions, groups and rewards: a group is published whole when its sessions have ended with
rewards; a session without a reward (ended, or at its deadline) is dead-lettered and counted;
an edited history is a new segment (or a 409); registered sessions by their base URL."""

from __future__ import annotations

from typing import Any

import pytest

from gateway import metrics
from searchr1.chat_template import prompt_token_ids
from tests.unit.gateway.conftest import EOT


def value(counter: Any, *labels: str) -> float:
    return float((counter.labels(*labels) if labels else counter)._value.get())


async def ask(client: Any, text: str, history: list[dict[str, Any]] | None = None) -> Any:
    messages = [*(history or []), {"role": "user", "content": text}]
    r = await client.chat.completions.create(model="m", messages=messages)
    return [*messages, r.choices[0].message.model_dump(exclude_none=True)]


async def test_a_group_is_published_when_all_its_sessions_ended_with_rewards(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["a" + EOT])
    group = {"X-Group-Id": "run/row-7", "X-Group-Size": "2", "X-Row-Id": "row-7"}
    await ask(rig.openai("g-0", **group), "q")
    await ask(rig.openai("g-1", **group), "q")
    async with rig.http() as http:
        r = await http.post("/v1/sessions/g-0/end", json={"reward": 1.0})
        assert r.json() == {"id": "g-0", "status": "ended"}
        assert await rig.published(2) == []  # g-1 still running
        await http.post("/v1/sessions/g-1/reward", json={"reward": 0.0})
        await http.post("/v1/sessions/g-1/end")
    trajs = await rig.published(2)
    assert sorted((t.trajectory_id, t.reward.total) for t in trajs) == [
        ("g-0/0", 1.0),
        ("g-1/0", 0.0),
    ]
    assert {(t.group_id, t.group_size, t.prompt_id) for t in trajs} == {("run/row-7", 2, "row-7")}
    assert sorted(t.sample_index for t in trajs) == [0, 1]


async def test_a_session_ended_without_reward_is_dead_lettered(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["a" + EOT])
    group = {"X-Group-Id": "grp", "X-Group-Size": "2"}
    await ask(rig.openai("d-0", **group), "q")
    await ask(rig.openai("d-1", **group), "q")
    before = value(metrics.DEAD_SESSIONS, "no_reward")
    assert await rig.gateway.end("d-0") == "dead_lettered"
    assert value(metrics.DEAD_SESSIONS, "no_reward") == before + 1
    [dead] = await rig.dead()
    assert dead["reason"] == b"no_reward" and dead["tid"] == b"d-0/0"
    # Its partner still trains, as a group of one.
    assert await rig.gateway.end("d-1", reward=0.5) == "ended"
    [traj] = await rig.published(1)
    assert (traj.trajectory_id, traj.group_size, traj.reward.total) == ("d-1/0", 1, 0.5)


async def test_a_group_whose_sessions_all_died_is_counted_dead_lettered(make_rig) -> None:  # type: ignore[no-untyped-def]
    """searchr1_gateway_groups_total{outcome="dead_lettered"}: a group with nothing to train
    on (every session dead-lettered) is finished and counted; it was never counted, so
    published + dead-lettered did not add up to the groups finished."""
    rig = make_rig(["a" + EOT])
    group = {"X-Group-Id": "all-dead", "X-Group-Size": "2"}
    await ask(rig.openai("x-0", **group), "q")
    await ask(rig.openai("x-1", **group), "q")
    dead, published = value(metrics.GROUPS, "dead_lettered"), value(metrics.GROUPS, "published")
    await rig.gateway.end("x-0")
    assert value(metrics.GROUPS, "dead_lettered") == dead  # x-1 still running
    await rig.gateway.end("x-1")
    assert await rig.published(1) == []
    assert value(metrics.GROUPS, "dead_lettered") == dead + 1
    assert value(metrics.GROUPS, "published") == published


async def test_deadlines_dead_letter_open_sessions(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["a" + EOT], session_timeout_s=10, group_timeout_s=100)
    now = [0.0]
    rig.gateway.table.clock = lambda: now[0]
    group = {"X-Group-Id": "late", "X-Group-Size": "3"}
    await ask(rig.openai("t-0", **group), "q")  # will have a reward, never ended
    await ask(rig.openai("t-1", **group), "q")  # neither
    rig.gateway.reward("t-0", 1.0)
    before = value(metrics.DEAD_SESSIONS, "deadline")
    now[0] = 11.0
    rig.gateway.reap()
    assert value(metrics.DEAD_SESSIONS, "deadline") == before + 1
    assert [d["tid"] for d in await rig.dead()] == [b"t-1/0"]
    assert await rig.published(1) == []  # the group waits for its third session
    now[0] = 101.0
    rig.gateway.reap()  # the group's deadline: the third never came
    [traj] = await rig.published(1)
    assert (traj.trajectory_id, traj.group_size) == ("t-0/0", 1)
    async with rig.http() as http:  # ended: a late reward is refused
        r = await http.post("/v1/sessions/t-0/reward", json={"reward": 0.0})
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_ended"


async def test_an_open_session_at_its_groups_deadline_is_incomplete(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["a" + EOT], session_timeout_s=1000, group_timeout_s=100)
    now = [0.0]
    rig.gateway.table.clock = lambda: now[0]
    group = {"X-Group-Id": "slow", "X-Group-Size": "2"}
    await ask(rig.openai("i-0", **group), "q")
    await ask(rig.openai("i-1", **group), "q")
    await rig.gateway.end("i-0", reward=1.0)
    now[0] = 101.0
    rig.gateway.reap()
    assert [(d["tid"], d["reason"]) for d in await rig.dead()] == [(b"i-1/0", b"incomplete_group")]
    [traj] = await rig.published(1)
    assert traj.trajectory_id == "i-0/0"


async def test_an_edited_history_starts_a_new_segment(make_rig, qwen_tok) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["one" + EOT, "two" + EOT, "three" + EOT])
    client = rig.openai("e")
    history = await ask(client, "first")
    history = await ask(client, "second", history)  # extends: same segment
    before = value(metrics.FORKS, "edited")
    history[1]["content"] = "something else"  # the agent rewrote the model's answer
    await ask(client, "third", history)
    assert value(metrics.FORKS, "edited") == before + 1
    await rig.gateway.end("e", reward=1.0)
    a, b = sorted(await rig.published(2), key=lambda t: t.trajectory_id)
    assert (a.trajectory_id, b.trajectory_id) == ("e/0", "e/1")
    assert {a.group_size, b.group_size} == {2} and {a.reward.total, b.reward.total} == {1.0}
    assert (b.metadata["segment_reason"], b.metadata["segments"]) == ("edited", "2")
    assert len(a.turns) == 2 and len(b.turns) == 1
    # The new segment's prompt is the template's rendering of the edited history: the old
    # answers are context there (not trained on), the old segment is left as it was.
    edited = [*history, {"role": "user", "content": "third"}]
    assert list(b.prompt_token_ids) == prompt_token_ids(qwen_tok, edited)
    assert sum(b.loss_mask) == len(qwen_tok.encode("one" + EOT))


async def test_history_edits_reject_answers_409(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["one" + EOT], history_edits="reject")
    client = rig.openai("r")
    history = await ask(client, "first")
    history[-1]["content"] = "edited"
    before = value(metrics.REJECTED, "history_edit")
    async with rig.http() as http:
        messages = [*history, {"role": "user", "content": "next"}]
        r = await http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": messages},
            headers={"X-Session-Id": "r"},
        )
    assert r.status_code == 409 and "do not extend" in r.json()["error"]["message"]
    assert value(metrics.REJECTED, "history_edit") == before + 1


async def test_an_agent_keeping_two_conversations_extends_each(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["x" + EOT])
    client = rig.openai("two")
    main = await ask(client, "main task")
    side = await ask(client, "summarize this")  # another conversation: a second segment
    await ask(client, "continue", main)  # extends the first one again
    await ask(client, "shorter", side)  # and the second
    s = rig.gateway.table.get("two")
    assert [len(seg.turns) for seg in s.segments] == [2, 2]


async def test_per_turn_rewards_and_conflicts(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["x" + EOT])
    client = rig.openai("pt")
    history = await ask(client, "a")
    await ask(client, "b", history)
    async with rig.http() as http:
        assert (
            await http.post("/v1/sessions/pt/reward", json={"reward": 0.25, "turn": 1})
        ).is_success
        bad = await http.post("/v1/sessions/pt/reward", json={"reward": 1, "turn": 7})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_turn"
        assert (await http.post("/v1/sessions/pt/reward", json={"reward": 1.0})).is_success
        assert (await http.post("/v1/sessions/pt/reward", json={"reward": 1.0})).is_success
        again = await http.post("/v1/sessions/pt/reward", json={"reward": 0.0})
        assert again.status_code == 409 and again.json()["error"]["code"] == "reward_conflict"
        nan = await http.post("/v1/sessions/pt/reward", content=b'{"reward": NaN}')
        assert nan.status_code == 422
        assert (await http.post("/v1/sessions/pt/end")).json()["status"] == "ended"
    [traj] = await rig.published(1)
    assert [t.reward for t in traj.turns] == [0.0, 0.25] and traj.reward.total == 1.0


async def test_registered_sessions_by_their_base_url(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["hello" + EOT])
    async with rig.http() as http:
        r = await http.post("/v1/sessions", json={"id": "reg-1", "group_id": "g", "group_size": 1})
        assert r.json()["base_path"] == "/sessions/reg-1/v1"
        dup = await http.post("/v1/sessions", json={"id": "reg-1"})
        assert dup.status_code == 409 and dup.json()["error"]["code"] == "session_exists"
        unknown = await http.post(
            "/sessions/nobody/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_session"
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url="http://gateway/sessions/reg-1/v1", api_key="x", http_client=rig.http()
    )
    r2 = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}]
    )
    assert r2.choices[0].message.content == "hello"
    assert [m.id for m in (await client.models.list()).data] == ["tiny"]
    await rig.gateway.end("reg-1", reward=1.0)
    [traj] = await rig.published(1)
    assert (traj.trajectory_id, traj.group_id) == ("reg-1/0", "g")


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/sessions/ghost/reward", {"reward": 1.0}), ("/v1/sessions/ghost/end", {})],
)
async def test_unknown_sessions_are_404(make_rig, path: str, body: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["x"])
    before = value(metrics.REJECTED, "unknown_session")
    async with rig.http() as http:
        r = await http.post(path, json=body)
    assert r.status_code == 404 and "ghost" in r.json()["error"]["message"]
    assert value(metrics.REJECTED, "unknown_session") == before + 1


async def test_shutdown_dead_letters_live_sessions_and_publishes_done_ones(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["a" + EOT])
    group = {"X-Group-Id": "stop", "X-Group-Size": "2"}
    await ask(rig.openai("sd-0", **group), "q")
    await ask(rig.openai("sd-1", **group), "q")
    await rig.gateway.end("sd-0", reward=1.0)
    before = value(metrics.DEAD_SESSIONS, "shutdown")
    await rig.gateway.shutdown()
    assert value(metrics.DEAD_SESSIONS, "shutdown") == before + 1
    assert [(d["tid"], d["reason"]) for d in await rig.dead()] == [(b"sd-1/0", b"shutdown")]
    [traj] = await rig.published(1)
    assert (traj.trajectory_id, traj.group_size) == ("sd-0/0", 1)


async def test_a_group_the_bus_refuses_is_counted_not_waited_for(make_rig) -> None:  # type: ignore[no-untyped-def]
    rig = make_rig(["a" + EOT])
    rig.bus.config.max_backlog = 1  # a batch of 2 can never fit
    group = {"X-Group-Id": "big", "X-Group-Size": "2"}
    await ask(rig.openai("b-0", **group), "q")
    await ask(rig.openai("b-1", **group), "q")
    before = value(metrics.BUS_FAILURES, "publish")
    await rig.gateway.end("b-0", reward=1.0)
    await rig.gateway.end("b-1", reward=1.0)
    await rig.gateway.publisher.drain(5.0)
    assert value(metrics.BUS_FAILURES, "publish") == before + 1
