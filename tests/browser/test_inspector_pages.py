"""Every inspector page in a real browser, over a run written by the real writers.

Asserts on the DOM: charts drawn (canvases), observation spans = runs of zeros in the loss mask,
filters that change the list, the step's groups, the before/after comparison. Screenshots go to
the test's tmp dir (and docs/img/ with SEARCHR1_UPDATE_SCREENSHOTS=1, for the README).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from fastapi import FastAPI

from harness.inspector_run import ServerThread, build_run
from inspector.server import create_app
from orchestrator.rollout_log import mask_runs

DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("run")
    build_run(path, steps=8, groups=3, group_size=4)
    return path


@pytest.fixture(scope="module")
def server(run_dir: Path) -> Iterator[str]:
    with ServerThread(create_app(run_dir)) as s:
        yield s.url


def shot(page: Any, tmp_path: Path, name: str, readme: bool = False) -> None:
    page.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
    if readme and os.environ.get("SEARCHR1_UPDATE_SCREENSHOTS") == "1":
        page.screenshot(path=str(DOCS_IMG / f"{name}.png"))


def test_overview_draws_every_panel(page: Any, server: str, tmp_path: Path) -> None:
    panels = page.request.get(f"{server}/api/curves").json()["panels"]
    titles = [p["title"] for p in panels]
    for expected in ("Reward / EM", "KL", "Entropy", "Clip fractions", "Grad norm",
                     "Response length", "Searches per sample", "Observation fraction",
                     "TIS effective sample size", "Staleness (versions)", "Throughput",
                     "Held-out evaluations"):  # fmt: skip
        assert expected in titles
    page.goto(server + "/")
    page.wait_for_function(f"document.querySelectorAll('.chart canvas').length >= {len(panels)}")
    assert page.locator(".chart").count() == len(panels)
    assert page.locator(".chart .u-title").all_inner_texts() == titles
    assert page.locator("table.evals tr").count() == 1 + 2
    assert page.locator("table.steps tr").count() == 1 + 8
    assert page.locator("#last-step").inner_text() == "8"
    shot(page, tmp_path, "inspector", readme=True)


def test_overview_updates_live(page: Any, run_dir: Path, tmp_path: Path) -> None:
    """A new training step appears without reloading the page."""
    import json

    from inspector.config import InspectorConfig

    live = tmp_path / "live"
    build_run(live, steps=3, groups=1, evaluations=False)
    with ServerThread(create_app(live, InspectorConfig(refresh_s=0.2))) as s:
        page.goto(s.url + "/")
        page.wait_for_function("document.querySelectorAll('.chart canvas').length > 0")
        assert page.locator("#last-step").inner_text() == "3"
        with (live / "train_metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": 4, "kl": 0.5, "reward/mean": 0.9}) + "\n")
        page.wait_for_function("document.getElementById('last-step').textContent === '4'")
        page.goto("about:blank")  # stop the polling before the server goes


def _first_ref(page: Any, server: str, query: str) -> str:
    page.goto(f"{server}/trajectories?{query}")
    href = page.locator("table.trajectories a").first.get_attribute("href")
    return href.removeprefix("/t/")


def test_trajectory_spans_follow_the_loss_mask(
    page: Any, server: str, run_dir: Path, tmp_path: Path
) -> None:
    ref = _first_ref(page, server, "kind=train&searches=2")
    kind, stem, tid = ref.split("/", 2)
    table = pq.read_table(run_dir / "rollouts" / kind / f"{stem}.parquet")
    [row] = [r for r in table.to_pylist() if r["trajectory_id"] == tid]
    zero_runs = [r for r in mask_runs(row["loss_mask"]) if r[0] == 0]
    assert len(zero_runs) >= 2

    page.goto(f"{server}/t/{ref}")
    assert page.locator("#response .span.obs").count() == len(zero_runs)
    assert page.locator("#response .span.model .t").count() == sum(row["loss_mask"])
    spans = page.eval_on_selector_all(
        "#response .span.obs", "els => els.map(e => [+e.dataset.a, +e.dataset.b])"
    )
    assert spans == [[a, b] for _, a, b in zero_runs]
    assert page.locator("#response").inner_text() == row["response_text"]
    assert page.locator("details.turn").count() == len(row["turns"])
    assert page.locator("details.turn.search").count() == 2
    assert page.locator("details.turn.search ol.passages li").count() == 2 * 3
    assert page.locator("#gold").inner_text() == " | ".join(row["gold_answers"])
    assert page.locator("#finish").inner_text() == row["finish_reason"]
    assert "em" in page.locator("#reward").inner_text()

    token = page.locator("#response .span.model .t").nth(3)
    token.hover()
    tip = page.locator("#tip")
    tip.wait_for(state="visible")
    lp = row["rollout_logprobs"][int(token.get_attribute("data-i"))]
    assert f"logprob {lp:.4f}" in tip.inner_text()
    shot(page, tmp_path, "inspector-trajectory", readme=True)


def _rows(page: Any) -> int:
    return page.locator("tr.traj-row").count()


def test_filters_change_the_list(page: Any, server: str, tmp_path: Path) -> None:
    page.goto(f"{server}/trajectories")
    total = _rows(page)
    assert total > 10

    with page.expect_navigation():
        page.select_option("select[name=finish]", "truncated")
    truncated = _rows(page)
    assert 0 < truncated < total
    assert set(page.locator("tr.traj-row td:nth-child(7)").all_inner_texts()) == {"truncated"}

    with page.expect_navigation():
        page.select_option("select[name=finish]", "")
    with page.expect_navigation():
        page.select_option("select[name=errors]", "yes")
    errors = _rows(page)
    assert 0 < errors < total

    with page.expect_navigation():
        page.select_option("select[name=errors]", "")
    with page.expect_navigation():
        page.select_option("select[name=searches]", "0")
    assert set(page.locator("tr.traj-row td:nth-child(8)").all_inner_texts()) == {"0"}

    page.goto(f"{server}/trajectories")
    page.fill("input[name=q]", "Marrowby")
    with page.expect_navigation():
        page.press("input[name=q]", "Enter")
    found = _rows(page)
    assert 0 < found < total
    assert re.match(rf"{found} of \d+ logged trajectories match", page.inner_text("#count"))
    shot(page, tmp_path, "trajectories")


def test_step_view_groups_and_advantages(page: Any, server: str, tmp_path: Path) -> None:
    page.goto(f"{server}/steps/2")
    assert page.locator("tr.group").count() == 3
    assert page.locator("tr.group .sample").count() == 3 * 4
    advs = [float(x) for x in page.locator("tr.group").first.locator(".adv").all_inner_texts()]
    assert sum(advs) == pytest.approx(0.0, abs=0.02)
    links = page.locator("tr.group .sample a")
    assert links.count() >= 4  # the logged group, plus failures of the others
    with page.expect_navigation():
        links.first.click()
    assert page.locator("#response").count() == 1
    shot(page, tmp_path, "step")


def test_compare_before_and_after(page: Any, server: str, tmp_path: Path) -> None:
    page.goto(f"{server}/compare")
    assert page.locator("tr.pair").count() == 6
    summary = page.inner_text("#compare-summary")
    assert summary.startswith("6 questions in both")
    first = page.locator("tr.pair a").first
    with page.expect_navigation():
        first.click()
    assert "evaluation" in page.inner_text("main p")
    shot(page, tmp_path, "compare")


def test_pages_under_a_mount_point(page: Any, run_dir: Path) -> None:
    """The orchestrator mounts the app at /ui: links and static files follow the prefix."""
    host = FastAPI()
    host.mount("/ui", create_app(run_dir))
    with ServerThread(host) as s:
        page.goto(s.url + "/ui/")
        page.wait_for_function("document.querySelectorAll('.chart canvas').length > 3")
        with page.expect_navigation():
            page.click("nav >> text=Trajectories")
        assert page.url.startswith(s.url + "/ui/trajectories")
        with page.expect_navigation():
            page.locator("table.trajectories a").first.click()
        assert "/ui/t/" in page.url
        page.goto("about:blank")
