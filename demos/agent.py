"""`searchr1 demo --agent openai`: the demo's agent as a plain `openai`-client program
(docs/examples/openai_agent.py, `search_agent`: function calling, it runs its search tool
itself) learns through the gateway (docs/gateway.md).

The stages of the Search-R1 demo (demos/run.py) over the same world, in the function-calling
format of the multi-tool demo:
1. the synthetic world, its MiniLM index; the questions name the person in quotes, so the name
   is the same token in the question and in the call's JSON (`"query": "Name"`);
2. the tiny model, warm-started on demonstrations (`SearchCallSampler`): token-exact copies of
   what the agent's sessions record through the gateway (its prompt, its tool schema, the
   template's `tool` turns), with random facts, 30% searching in the last phase;
3. held-out EM before and after, greedy, through the built-in loop (`demos.run.evaluate`, the
   other demos' evaluation: the same turns give the same ids, tests/unit/gateway/
   test_same_as_loop.py);
4. GRPO where the rollouts come from `searchr1 agent run --program ...:search_agent`: Redis,
   retriever, engine, trainer and `searchr1 gateway serve` under one supervisor, no
   orchestrator. The runner has no step window of its own (docs/gateway.md), so the demo runs
   it once per training step on that step's rows and starts the next step's run when the
   engine serves the weights of the groups published so far (`StepPacer`): sync, as the other
   demos' `orchestrator.mode: sync`.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from demos.multitool import call_text, tool_calls_per_question
from demos.run import (
    CONFIG_TEMPLATE,
    DemoConfig,
    _newest,
    build_policy,
    evaluate,
    plot,
    summarize,
    summary_row,
    write_stack_config,
)
from demos.warmstart import Demo, MaskedResponse, Phase, WarmStartConfig
from demos.world import (
    PROFESSIONS,
    Person,
    Question,
    Town,
    World,
    generate_world,
    person_of,
    person_passage,
    town_passage,
    write_jsonl,
    write_world,
)
from retriever.build import build_index
from retriever.config import BuildConfig
from searchr1.chat_template import ToolTurns, prompt_token_ids
from searchr1.redis_server import RedisServer, free_port
from searchr1.supervisor import ChildFailed, ServiceSpec, Supervisor, tail_lines
from stack.config import StackConfig, load_config
from stack.launcher import build_specs, searchr1_command

log = logging.getLogger(__name__)

AGENTS = ("openai",)  # `--agent` values: the program each one runs
EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "openai_agent.py"
PROGRAM = f"{EXAMPLE}:search_agent"
RL_STEPS = 30  # as the Search-R1 demo (its warm start is worded the same)
EXTRA_VOCAB_PER_NAME = 4  # each name also without a leading space (`"query": "Name"`)
# One session's deadline: a tiny model's three calls take seconds; a stuck one is dropped.
SESSION_TIMEOUT_S = 300.0
PUBLISH_WAIT_S = 30.0  # a finished batch's groups reach the bus in the background


def example() -> ModuleType:
    """docs/examples/openai_agent.py as a module (its instruction and tool schema)."""
    spec = importlib.util.spec_from_file_location("openai_agent", EXAMPLE)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"the agent program {EXAMPLE} is missing")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quoted(q: Question) -> str:
    """The question with the person's name in quotes (one token, as in the call's JSON)."""
    name = person_of(q)
    return q.question.replace(f"was {name} born", f'was "{name}" born')


def prompt_text(question: str, instruction: str) -> str:
    """The agent's first (user) message, as `make_agent` writes it."""
    return f"{instruction}\nQuestion: {question}\n"


def write_agent_rows(world: World, out: Path, instruction: str) -> dict[str, Path]:
    """`agent_train.jsonl`: the runner's rows (`id`, `question`, `answer`, `data_source`);
    `train.jsonl` / `test.jsonl`: the same questions as the built-in loop's rows (the agent's
    first message as `prompt`), which the evaluation reads."""
    runner_rows = (
        {"id": f"train_{i}", "question": quoted(q), "answer": q.answers[0],
         "data_source": q.data_source}
        for i, q in enumerate(world.split("train"))
    )  # fmt: skip
    paths = {"agent_train": write_jsonl(out / "agent_train.jsonl", runner_rows)}
    for split in ("train", "test"):
        rows = (
            {
                "data_source": q.data_source,
                "prompt": [{"role": "user", "content": prompt_text(quoted(q), instruction)}],
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": q.answers}},
                "extra_info": {"split": split, "index": i},
            }
            for i, q in enumerate(world.split(split))
        )
        paths[split] = write_jsonl(out / f"{split}.jsonl", rows)
    return paths


def model_turns(person: Person, town: Town, hops: int, guess: str | None) -> list[str]:
    """The model's messages of an episode (each ends at the end-of-turn token, not included):
    a first thought that decides (`I remember this` / `I need to search`), and before each next
    step a thought that restates the sentence just read, word for word (`X is a sailor who was
    born in Y.`): every token of it is a copy from the tool result, so the 2-layer model learns
    the induction that copies the fact. (With `X was born in Y`, as the Search-R1 demo words
    it, the town was the one copied token after the tool message and was not learned.)"""
    if guess is not None:
        return [f"<think> I remember this. </think>\n<answer> {guess} </answer>"]
    # Not "I need to find where X was born": the name would stand there in its spaced form,
    # nearer than the question's quoted (bare) one, which is the token the call's JSON needs.
    turns = ["<think> I need to search for it. </think>\n"
             + call_text("search", {"query": person.name})]  # fmt: skip
    found = f"<think> {sentence(person_passage(person))} </think>\n"
    if hops == 2:
        turns.append(found + call_text("search", {"query": town.name}))
        found = f"<think> {sentence(town_passage(town))} </think>\n"
        return [*turns, f"{found}<answer> {town.country} </answer>"]
    return [*turns, f"{found}<answer> {town.name} </answer>"]


def sentence(passage: str) -> str:
    """A passage's text without its title line."""
    return passage.partition("\n")[2]


class SearchCallSampler:
    """Demonstrations with random facts (as `demos.warmstart.DemoSampler`) in the
    agent's format: `search` calls in `<tool_call>` blocks ending at the end-of-turn token,
    the results as the chat template's `tool` turns (mask 0), then `<answer> X </answer>`; or a
    guess at once."""

    def __init__(
        self,
        world: World,
        tokenizer: Any,
        cfg: WarmStartConfig,
        instruction: str,
        schemas: list[dict[str, Any]],
    ) -> None:
        self.world = world
        self.tok = tokenizer
        self.cfg = cfg
        self.instruction = instruction
        self.schemas = schemas
        self.turns = ToolTurns(tokenizer, schemas)
        self.eot = tokenizer.eos_token
        self.names = [p.name for p in world.people]
        self.towns = [t.name for t in world.towns]

    def sample(self, rng: random.Random, *, searched: bool, short_prompt: bool = False) -> Demo:
        """`short_prompt`: the question alone, without the instruction (the copy phase: as in
        the Search-R1 demo, a 2-layer model learns to copy far sooner without it)."""
        person = Person(rng.choice(self.names), rng.choice(self.towns), rng.choice(PROFESSIONS))
        town = Town(person.town, rng.choice(self.world.countries))
        hops = 2 if rng.random() < self.cfg.two_hop_fraction else 1
        pool = self.world.countries if hops == 2 else self.towns
        guess = None if searched else rng.choice(pool)
        return self.demonstration(
            person, town, hops, guess, lambda p: self._docs(rng, p), short_prompt=short_prompt
        )

    def demonstration(
        self,
        person: Person,
        town: Town,
        hops: int,
        guess: str | None,
        docs: Callable[[str], str],
        *,
        short_prompt: bool = False,
    ) -> Demo:
        """The episode on these facts: a guess at once (`guess`), or the searches (`docs`:
        what a search for a passage returns) and the answer."""
        kind = "country" if hops == 2 else "town"
        answer = town.country if hops == 2 else town.name
        question = f'In which {kind} was "{person.name}" born?'
        content = (
            f"Question: {question}\n" if short_prompt else prompt_text(question, self.instruction)
        )
        messages = [{"role": "user", "content": content}]
        prompt = prompt_token_ids(self.tok, messages, tools=self.schemas)
        response = MaskedResponse(self.tok)

        turns = model_turns(person, town, hops, guess)
        passages = [person_passage(person), town_passage(town)]
        for turn, passage in zip(turns[:-1], passages, strict=False):  # the search calls
            response.add(turn + self.eot, 1)
            response.add(self.turns.text(turn + self.eot, [("search", docs(passage))]), 0)
        response.add(turns[-1] + self.eot, 1)
        return Demo(prompt, response.ids, response.mask, guess is None, answer)

    def _docs(self, rng: random.Random, passage: str) -> str:
        """What the agent's search returns: the passage + topk-1 distractors."""
        docs = [passage]
        for _ in range(self.cfg.topk - 1):
            other = Person(rng.choice(self.names), rng.choice(self.towns), rng.choice(PROFESSIONS))
            docs.append(person_passage(other))
        # format_docs's rendering, as the example's `search` writes it
        parts = [d.partition("\n") for d in docs]
        return "".join(f"Doc {i}(Title: {t}) {text}\n" for i, (t, _, text) in enumerate(parts, 1))

    def batches(self, phase: Phase, rng: random.Random) -> Iterator[list[Demo]]:
        for _ in range(phase.steps):
            used = [rng.random() < phase.search_rate for _ in range(phase.batch_size)]
            yield [self.sample(rng, searched=u, short_prompt=phase.short_prompt) for u in used]


def warm_start_config(seed: int, topk: int, *, quick: bool = False) -> WarmStartConfig:
    """Search-R1's phases: copy (the question alone, every demonstration searches), format
    (the agent's prompt, every one searches), mix (30% search, the rest guess)."""
    if quick:
        return WarmStartConfig(copy_steps=10, copy_batch_size=8, format_steps=0, mix_steps=5,
                               batch_size=8, seed=seed, topk=topk)  # fmt: skip
    return WarmStartConfig(copy_steps=600, copy_batch_size=32, format_steps=100, mix_steps=100,
                           batch_size=16, search_rate=0.3, seed=seed, topk=topk)  # fmt: skip


def vocabulary_texts(world: World, instruction: str) -> list[str]:
    """Text for the tokenizer: the prompt, the calls' JSON, and every person and town bare
    (as the JSON and the quotes split them), so each is one token there too."""
    bare = "\n".join(p.name for p in world.people) + "\n" + "\n".join(t.name for t in world.towns)
    calls = "\n".join(call_text("search", {"query": p.name}) for p in world.people[:2])
    prompts = [prompt_text(quoted(q), instruction) for q in world.questions[:50]]
    return prompts + [calls, bare] * 30


def stack_settings(data: dict[str, Any]) -> None:
    """The built-in loop's settings for the evaluation: function calling, search only."""
    rollout = data["orchestrator"]["rollout"]
    rollout["action_format"] = "function_calling"
    rollout["tools"] = ["search"]
    rollout["max_turns"] = 3  # two searches and the answer
    rollout.pop("stop", None)  # function calling stops on the end-of-turn token
    data["orchestrator"]["reward"] = {"function": "em"}


def add_gateway(stack: Path, out: Path) -> dict[str, str]:
    """The gateway and agent sections over the written stack config; returns the URLs."""
    data = yaml.safe_load(stack.read_text())
    port = free_port()
    gateway_url = f"http://127.0.0.1:{port}"
    engine_url = data["engines"]["urls"][0]
    data["gateway"] = {  # its engine: the stack's engines section
        "http": {"port": port},
        "max_tokens": data["orchestrator"]["rollout"]["max_tokens_per_turn"],
    }
    data["agent"] = {
        "gateway_url": gateway_url,
        "program": PROGRAM,
        "concurrency": data["run"]["groups_per_step"] * data["run"]["group_size"],
        "timeout_s": SESSION_TIMEOUT_S,
    }
    data["local"]["services"] = ["retriever", "inference", "trainer"]
    stack.write_text(yaml.safe_dump(data, sort_keys=False))
    return {
        "gateway": gateway_url,
        "engine": engine_url,
        "retriever": data["orchestrator"]["search"]["retriever_url"],
        "topk": str(data["orchestrator"]["search"]["topk"]),
        "agent_log": str(out / "agent"),
    }


def gateway_spec(cfg: StackConfig, stack: Path, redis_url: str) -> ServiceSpec:
    return ServiceSpec(
        name="gateway",
        command=[*searchr1_command(), "gateway", "serve", "--config", str(stack)],
        ready_url=f"http://127.0.0.1:{cfg.gateway.http.port}/ready",
        env={"SEARCHR1_REDIS__URL": redis_url, "SEARCHR1_CONFIG": str(stack)},
        ready_timeout_s=cfg.local.ready_timeout_s,
    )


def gateway_groups(text: str) -> dict[str, float]:
    """Finished groups from the gateway's /metrics: published, dead-lettered, lost."""
    out = {"published": 0.0, "dead_lettered": 0.0, "lost": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "searchr1_gateway_groups_total" and s.labels.get("outcome") in out:
                out[s.labels["outcome"]] = s.value
            elif (
                s.name == "searchr1_gateway_bus_failures_total" and s.labels.get("op") == "publish"
            ):
                out["lost"] = s.value
    return out


@dataclass
class StepPacer:
    """Runs `searchr1 agent run` once per training step, on that step's rows, from the
    supervisor's tick: the next run starts once the previous one's groups are on the bus and
    the engine serves the weights trained on them (sync). Rows: the training rows shuffled
    per epoch (seeded)."""

    stack: Path
    rows: list[dict[str, Any]]
    groups_per_step: int
    group_size: int
    max_steps: int
    urls: dict[str, str]
    seed: int
    run_id: str = "demo-agent"
    batches: int = 0
    results: list[str] = field(default_factory=list)  # each run's summary line
    _proc: subprocess.Popen[bytes] | None = None
    _order: list[int] = field(default_factory=list)
    _next_poll: float = 0.0
    _finished_at: float = 0.0

    def tick(self, client: httpx.Client) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                return
            self._collect()
        if time.monotonic() < self._next_poll:
            return
        self._next_poll = time.monotonic() + 0.5
        groups = gateway_groups(client.get(f"{self.urls['gateway']}/metrics").text)
        done = sum(groups.values())
        expected = self.batches * self.groups_per_step
        if done < expected and time.monotonic() - self._finished_at < PUBLISH_WAIT_S:
            return  # the last run's groups are still on their way to the bus
        trained = int(groups["published"]) // self.groups_per_step
        if trained >= self.max_steps:
            return  # the trainer has its data: it stops the stack when done
        info = client.get(f"{self.urls['engine']}/get_model_info").json()
        if int(info["weight_version"]) < trained:
            return  # the trainer is still on the last step
        self._start()

    def _batch_rows(self) -> list[dict[str, Any]]:
        out = []
        for _ in range(self.groups_per_step):
            if not self._order:
                self._order = list(range(len(self.rows)))
                random.Random(self.seed + len(self.results)).shuffle(self._order)
            out.append(self.rows[self._order.pop()])
        return out

    def _start(self) -> None:
        folder = Path(self.urls["agent_log"])
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / f"batch-{self.batches:03d}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in self._batch_rows()))
        command = self.command(data)
        env = {
            "RETRIEVER_URL": self.urls["retriever"],
            "SEARCH_TOPK": self.urls["topk"],
            "OMP_NUM_THREADS": "1",
        }
        logf = (folder / f"batch-{self.batches:03d}.log").open("wb")
        self._proc = subprocess.Popen(command, stdout=logf, stderr=subprocess.STDOUT,
                                      env={**os.environ, **env})  # fmt: skip
        logf.close()
        self.batches += 1

    def command(self, data: Path) -> list[str]:
        """`searchr1 agent run` on one batch of rows, its sessions named by the batch."""
        return [
            *searchr1_command(), "agent", "run", "--config", str(self.stack), "--data",
            str(data), "-n", str(self.group_size), "--run-id", f"{self.run_id}-{self.batches}",
        ]  # fmt: skip

    def _collect(self) -> None:
        assert self._proc is not None
        code, self._proc = self._proc.returncode, None
        self._finished_at = time.monotonic()
        logfile = Path(self.urls["agent_log"]) / f"batch-{self.batches - 1:03d}.log"
        lines = tail_lines(logfile, 20)
        if code != 0:
            raise ChildFailed("agent run", f"exited with status {code}", lines)
        summary = next((ln for ln in reversed(lines) if ln.startswith("sessions=")), "")
        self.results.append(summary)
        log.info("agent run done", extra={"batch": self.batches - 1, "summary": summary})

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def train_through_gateway(
    stack: Path, rows_path: Path, urls: dict[str, str], seed: int
) -> StepPacer:
    """GRPO on the agent's sessions: Redis, retriever, engine, trainer and gateway supervised
    until the trainer's last step; `searchr1 agent run` once per step (`StepPacer`)."""
    cfg = load_config(stack)
    redis = RedisServer(data_dir=cfg.local.redis_dir).start()
    specs = [*build_specs(cfg, stack, redis.url), gateway_spec(cfg, stack, redis.url)]
    sup = Supervisor(specs, cfg.local.log_dir, grace_s=cfg.local.grace_s)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    pacer = StepPacer(stack, rows, cfg.run.groups_per_step, cfg.run.group_size,
                      cfg.run.max_steps or RL_STEPS, urls, seed)  # fmt: skip
    try:
        sup.start()
        with httpx.Client(timeout=5.0) as client:
            sup.run(on_tick=lambda: pacer.tick(client))
    finally:
        pacer.stop()
        sup.stop()
        redis.stop()
    return pacer


def run_agent_demo(cfg: DemoConfig) -> dict[str, float]:
    """The demo's stages (module doc); the result as the other demos' (`summarize`)."""
    start = time.monotonic()
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    ex = example()
    schemas, instruction = ex.TOOLS[:1], ex.SEARCH_INSTRUCTION
    topk = yaml.safe_load(CONFIG_TEMPLATE.read_text())["orchestrator"]["search"]["topk"]
    cfg = replace(cfg, warm_start=warm_start_config(cfg.seed, topk, quick=cfg.quick))
    world = generate_world(cfg.seed, n_people=cfg.n_people)
    files = write_world(world, cfg.out_dir / "world")
    rows = write_agent_rows(world, cfg.out_dir / "data", instruction)
    index_dir = cfg.out_dir / "index"
    build_index(files["corpus"], index_dir, BuildConfig(query_prefix="", passage_prefix=""))
    if cfg.warm_start_from is None:
        extra = EXTRA_VOCAB_PER_NAME * (len(world.people) + len(world.towns))
        warm = build_policy(
            cfg,
            world,
            lambda tok: SearchCallSampler(world, tok, cfg.warm_start, instruction, schemas),
            vocabulary_texts(world, instruction),
            extra,
        )
    else:
        warm = cfg.warm_start_from / "model-warm"
        log.info("warm start reused", extra={"model": str(warm)})
    stack = write_stack_config(cfg, index_dir, warm, rows, stack_settings)
    urls = add_gateway(stack, cfg.out_dir)

    evals = cfg.out_dir / "rollouts" / "eval"
    before = evaluate(stack, warm, rows["test"], cfg.out_dir / "eval_before.json", cfg.eval_limit)
    calls_before = tool_calls_per_question(_newest(evals))
    seed = cfg.seed if cfg.train_seed is None else cfg.train_seed
    pacer = train_through_gateway(stack, rows["agent_train"], urls, seed)
    (cfg.out_dir / "agent_runs.txt").write_text("\n".join(pacer.results) + "\n")
    trained = cfg.out_dir / "model-trained"
    after = evaluate(stack, trained, rows["test"], cfg.out_dir / "eval_after.json", cfg.eval_limit)
    calls_after = tool_calls_per_question(_newest(evals))

    b, a = summary_row(before), summary_row(after)
    # searches read from the rollout log's calls, as the multi-tool demo reads them (the
    # evaluation's searches_mean counts function calls too now: TurnRecord.searches)
    b["searches"], a["searches"] = calls_before.get("search", 0.0), calls_after.get("search", 0.0)
    plot(cfg.out_dir / "train_metrics.jsonl", b["em"], a["em"], cfg.out_dir / "demo.png")
    return summarize(b, a, time.monotonic() - start)
