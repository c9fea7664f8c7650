"""Loop parts: the group buffer (a step takes only complete prompt groups, in completion
order) and the optional metric sinks."""

from __future__ import annotations

from protos.trajectory import SCHEMA_VERSION, Trajectory
from searchr1.bus import Delivery
from trainer.loop import GroupBuffer


def d(group: str, k: int, size: int) -> Delivery:
    t = Trajectory(
        schema_version=SCHEMA_VERSION, trajectory_id=f"{group}-{k}", group_id=group, group_size=size
    )
    return Delivery(entry_id=f"1-{k}", trajectory=t)


def test_takes_complete_groups_in_completion_order() -> None:
    buf = GroupBuffer()
    buf.add([d("a", 0, 2), d("b", 0, 2), d("b", 1, 2)])
    assert buf.complete_groups == 1
    buf.add([d("c", 0, 1), d("a", 1, 2)])
    assert buf.complete_groups == 3
    taken = buf.take(2)
    assert [x.trajectory_id for x in taken] == ["b-0", "b-1", "c-0"]
    assert buf.held() == 2 and buf.complete_groups == 1
    assert [x.trajectory_id for x in buf.take(5)] == ["a-0", "a-1"]
    assert buf.held() == 0


def test_unset_group_size_is_a_group_of_one() -> None:
    buf = GroupBuffer()
    buf.add([d("x", 0, 0)])
    assert buf.complete_groups == 1


def test_incomplete_groups_expire_after_the_timeout() -> None:
    now = [0.0]
    buf = GroupBuffer(clock=lambda: now[0])
    buf.add([d("a", 0, 2)])
    now[0] = 5.0
    buf.add([d("b", 0, 2), d("c", 0, 1)])
    assert buf.expire(10) == []
    now[0] = 10.5
    [(gid, members)] = buf.expire(10)
    assert gid == "a" and [m.trajectory_id for m in members] == ["a-0"]
    assert buf.held() == 2  # b is 5.5 s old; c is complete and never expires
    now[0] = 100.0
    assert [g for g, _ in buf.expire(10)] == ["b"]
    assert [x.trajectory_id for x in buf.take(1)] == ["c-0"]
    assert buf.held() == 0 and buf.expire(10) == []


def test_optional_sinks_without_their_packages_are_skipped(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    from trainer.metrics import OptionalSinks

    sinks = OptionalSinks(str(tmp_path / "tb"), "proj")
    installed = []
    for name in ("tensorboard", "wandb"):
        try:
            __import__(name)
            installed.append(name)
        except ImportError:
            assert f"{name} sink disabled" in caplog.text
    assert sinks.active == installed
    sinks.write(1, {"loss": 0.5})  # never raises
