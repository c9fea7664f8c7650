"""`searchr1 orchestrator ...`, `searchr1 data ...` and `searchr1 eval`: the commands.

Each checks what it can without the other services, then hands over to `orchestrator.wiring`
(`serve` for the service, `evaluate_served` for eval). transformers and pyarrow load inside
the functions that use them, so `--help` stays fast.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

from orchestrator.config import OrchestratorSettings
from orchestrator.data import (
    DataError,
    PromptSampler,
    load_prompts,
    prepare_rows,
    validation_subset,
    write_parquet,
)
from orchestrator.evaluate import format_table
from orchestrator.hooks import HookError, load_hook
from orchestrator.sample import Prompt
from orchestrator.scoring import Scorer
from orchestrator.tasks.base import steps_episodes
from orchestrator.wiring import (
    configured_task,
    evaluate_served,
    serve,
    training_prompts,
    validation_prompts,
)
from searchr1.cli_common import ConfigOption, add_show_config, start_service
from searchr1.service import exit_cleanly_after_shutdown

app = typer.Typer(
    help="Multi-turn search rollouts, rewards, and the trajectory stream into Redis.",
    no_args_is_help=True,
)
data_app = typer.Typer(help="Datasets in the Search-R1 row format.", no_args_is_help=True)


def _fail(msg: str) -> typer.Exit:
    typer.secho(f"error: {msg}", err=True, fg=typer.colors.RED)
    return typer.Exit(2)


def check_enough_data(cfg: OrchestratorSettings, prompts: list[Prompt]) -> None:
    """DataError unless the rollouts feed every step the trainer is configured to take.

    Otherwise the orchestrator finishes its data and the trainer waits for groups forever.
    """
    orch, run = cfg.orchestrator, cfg.run
    if run.max_steps is None:
        return
    # The service's own sampler decides how many steps the data gives.
    per_step = run.groups_per_step + orch.rollout.over_sampling
    steps = PromptSampler(prompts, per_step, epochs=orch.epochs).num_steps
    if steps < run.max_steps:
        raise DataError(
            f"the data gives {steps} steps ({len(prompts)} prompts x orchestrator.epochs "
            f"{orch.epochs} // (run.groups_per_step {run.groups_per_step} + "
            f"orchestrator.rollout.over_sampling {orch.rollout.over_sampling})) but "
            f"run.max_steps is {run.max_steps}: raise orchestrator.epochs or lower run.max_steps"
        )


add_show_config(app, OrchestratorSettings, "orchestrator")


@app.command("run")
def run(
    config: ConfigOption = None,
    port: Annotated[int | None, typer.Option(help="Listen port (overrides http.port).")] = None,
    data: Annotated[
        Path | None, typer.Option(help="Training rows (overrides data.train_path).")
    ] = None,
    fresh: Annotated[
        bool,
        typer.Option(
            "--fresh",
            help="Forget an earlier run with the same run.id (its Redis markers) and start over.",
        ),
    ] = False,
) -> None:
    """Roll out groups step by step and publish them to the bus; exits 0 when done.

    A restart continues the run named by `run.id`; a run id that belongs to a finished run or
    to other data/batch sizes is refused (exit 1) unless `--fresh`."""
    cfg = start_service("orchestrator", OrchestratorSettings, config)
    orch = cfg.orchestrator
    if port is not None:
        orch.http.port = port
    if data is not None:
        orch.data.train_path = str(data)
    if not cfg.redis.url:
        raise _fail("redis.url is not set (SEARCHR1_REDIS__URL)")
    if not orch.data.train_path and orch.task is None:
        raise _fail("orchestrator.data.train_path is not set (or pass --data, or set a task)")
    try:  # everything that can be checked without the other services fails here, not later
        task = configured_task(orch)
        Scorer(orch.reward, scored_by_task=steps_episodes(task))
        prompts = training_prompts(orch, task)
        check_enough_data(cfg, prompts)
        validation_prompts(orch, task)
        if orch.rollout.custom_generate:
            load_hook(
                orch.rollout.custom_generate,
                field="rollout.custom_generate",
                n_args=2,
                is_async=True,
            )
    except (HookError, DataError) as e:
        raise _fail(str(e)) from None
    exit_cleanly_after_shutdown()  # SIGTERM: stop rolling out, shut down, exit 0
    served = serve(orch, cfg.engines, cfg.run, cfg.redis.url, cfg.bus, fresh=fresh)
    raise typer.Exit(asyncio.run(served))


@data_app.command("prepare")
def prepare(
    input_dir: Annotated[
        Path, typer.Option("--input", help="FlashRAG layout: <input>/<dataset>/<split>.jsonl")
    ],
    out: Annotated[Path, typer.Option(help="Output .parquet (or .jsonl) file.")],
    datasets: Annotated[str, typer.Option(help="Comma-separated dataset names.")] = "nq,hotpotqa",
    split: Annotated[
        str | None, typer.Option(help="Split to read (default: test, else dev, else train).")
    ] = None,
) -> None:
    """Convert local FlashRAG-style QA files into Search-R1 rows with the exact prompt."""
    names = [d.strip() for d in datasets.split(",") if d.strip()]
    if not names:
        raise _fail("--datasets is empty")
    try:
        rows, used = prepare_rows(input_dir, names, split)
    except DataError as e:
        raise _fail(str(e)) from None
    if out.suffix == ".jsonl":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        write_parquet(rows, out)
    splits = ", ".join(f"{k}:{v}" for k, v in used.items())
    typer.echo(f"wrote {len(rows)} rows to {out} ({splits})")


def eval_command(
    data: Annotated[
        Path | None,
        typer.Option(help="Rows to evaluate (parquet or JSONL); default: the task's eval rows."),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Write the results as JSON here.")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N rows.")] = None,
    concurrency: Annotated[int, typer.Option(min=1)] = 64,
    subset: Annotated[
        bool,
        typer.Option(help="Only the fixed validation subset (data.val_size rows, data.seed)."),
    ] = False,
    config: ConfigOption = None,
) -> None:
    """Greedy rollouts; prints EM / sub-EM / F1 per data source (and writes JSON)."""
    cfg = start_service("orchestrator", OrchestratorSettings, config)
    orch = cfg.orchestrator
    try:
        if data is not None:
            prompts = load_prompts(data, limit)
        elif (task := configured_task(orch)) is not None:
            prompts = task.rows("eval")[:limit] if limit else task.rows("eval")
        else:
            raise DataError("--data is required (or set orchestrator.task)")
    except (DataError, HookError) as e:
        raise _fail(str(e)) from None
    if subset:  # the same prompts every time, so evaluation curves are comparable
        prompts = validation_subset(prompts, orch.data.val_size, orch.data.seed)

    try:
        run = evaluate_served(
            orch,
            cfg.engines,
            cfg.bus,
            prompts,
            run_id=cfg.run.id,
            redis_url=cfg.redis.url,
            concurrency=concurrency,
        )
        result = asyncio.run(run)
    except HookError as e:
        raise _fail(str(e)) from None
    typer.echo(format_table(result))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        typer.echo(f"wrote {out}")
