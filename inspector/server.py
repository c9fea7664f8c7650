"""The inspector's HTTP layer: server-rendered pages over `RunDir` + `views`, a JSON route for
the overview's live curves, and the vendored static files (no CDN: machines may be offline).

Links are relative to the mount point (`root_path`), so the same app serves at `/` under
`searchr1 inspect` and at `/ui` inside the orchestrator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from inspector import views
from inspector.config import InspectorConfig
from inspector.rundir import Ref, RunDir
from searchr1.service import create_service_app

HERE = Path(__file__).resolve().parent
FINISH_REASONS = (
    "answered",
    "max_turns",
    "response_budget",
    "context_limit",
    "truncated",
    "aborted",
    "error",
)


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "") else None
    except ValueError:
        raise HTTPException(422, f"not a number: {text!r}") from None


def _num(value: Any, fmt: str = "%.3f") -> str:
    """A number formatted, anything else (missing, None, text) as an empty cell."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return ""
    return fmt % value


def create_app(run_dir: Path, cfg: InspectorConfig | None = None) -> FastAPI:
    cfg = cfg or InspectorConfig()
    run = RunDir(run_dir, cfg.metrics_file)

    async def run_dir_ready() -> str:
        if not run.path.is_dir():
            raise RuntimeError(f"{run.path} is not a directory")
        return str(run.path)

    app = create_service_app("inspector", ready_checks={"run_dir": run_dir_ready})
    app.state.run = run
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.filters["num"] = _num

    def page(request: Request, name: str, **context: Any) -> HTMLResponse:
        base = request.scope.get("root_path", "").rstrip("/")
        return templates.TemplateResponse(
            request, name, {"base": base, "run_path": str(run.path), **context}
        )

    @app.get("/", response_class=HTMLResponse)
    def overview(request: Request) -> HTMLResponse:
        curves = views.curves(run)
        return page(
            request,
            "overview.html",
            curves=curves,
            curves_json=views.script_json(curves),
            refresh_s=cfg.refresh_s,
            config_text=run.config_text(),
            evaluations=run.evaluations(),
            recent=run.rollout_steps()[-20:][::-1],
        )

    @app.get("/api/curves")
    def api_curves() -> dict[str, Any]:
        return views.curves(run)

    @app.get("/steps/{step}", response_class=HTMLResponse)
    def step_page(request: Request, step: int) -> HTMLResponse:
        view = views.step_view(run, step)
        if view is None:
            raise HTTPException(404, f"step {step} is not in the rollout log")
        return page(request, "step.html", step=step, **view)

    @app.get("/trajectories", response_class=HTMLResponse)
    def trajectories(
        request: Request,
        kind: str = "",
        step: str = "",
        eval_id: str = "",
        finish: str = "",
        searches: str = "",
        errors: str = "",
        reason: str = "",
        min_reward: str = "",
        max_reward: str = "",
        q: str = Query(default="", max_length=200),
    ) -> HTMLResponse:
        f = views.Filters(
            kind=kind,
            step=int(_float(step)) if step else None,
            eval_id=eval_id,
            finish=finish,
            searches=searches,
            errors=errors,
            reason=reason,
            min_reward=_float(min_reward),
            max_reward=_float(max_reward),
            q=q,
        )
        if f.kind not in ("", "train", "eval"):
            raise HTTPException(422, f"kind must be train or eval, not {f.kind!r}")
        try:
            rows = run.trajectories(
                kind=f.kind or None, step=f.step, eval_id=f.eval_id or None, text=f.q or None
            )
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        shown = views.filter_rows(rows, f)
        return page(
            request,
            "trajectories.html",
            filters=f,
            rows=shown[: cfg.page_size],
            matched=len(shown),
            total=len(rows),
            finish_reasons=FINISH_REASONS,
            evaluations=run.evaluations(),
        )

    @app.get("/t/{ref:path}", response_class=HTMLResponse)
    def trajectory(request: Request, ref: str) -> HTMLResponse:
        parsed = Ref.parse(ref)
        row = run.trajectory(parsed) if parsed else None
        if row is None:
            raise HTTPException(404, f"no logged trajectory {ref!r}")
        return page(
            request,
            "trajectory.html",
            t=row,
            tokens=views.token_html(row),
            token_data=views.script_json(
                {
                    "lp": row["rollout_logprobs"],
                    "ids": row["response_token_ids"],
                    "tis": row["tis_weights"],
                    "has_lp": row["has_rollout_logprobs"],
                }
            ),
            passages=views.passages,
            arguments_text=views.arguments_text,
        )

    @app.get("/compare", response_class=HTMLResponse)
    def compare(request: Request, a: str = "", b: str = "") -> HTMLResponse:
        evals = [e for e in run.evaluations() if e.get("eval_id")]
        ids = [e["eval_id"] for e in evals]
        a = a or (ids[0] if ids else "")
        b = b or (ids[-1] if ids else "")
        for x in (a, b):
            if x and x not in ids:
                raise HTTPException(404, f"no logged evaluation {x!r}")
        result = views.compare(run, a, b) if a and b else None
        return page(request, "compare.html", evaluations=evals, a=a, b=b, result=result)

    return app
