"""The package layering, checked on every import statement of the product code and bench/.

- The floor (`searchr1/` and `protos/`) imports no service and nothing from the roof
  (`stack/`): every service can use it.
- A service imports another service only through its client (weight sync is in the floor);
  the engines' clients are a package of their own (`engine_client/`) on the floor, which the
  engine does not import.
- No import cycle between modules, function-local imports included (they hid one before), and
  none between folders.
- Every `config.py` is a leaf: it imports config modules and import-free modules only.
- Function-local imports of project modules are few (MAX_LOCAL_IMPORTS), each with its reason.
- Product code imports neither `harness/`, `tests/` nor `bench/`; `harness/` and `bench/` import
  no `tests`.
- Every service reads `cli -> wiring -> loop`: its CLI imports its wiring, which imports the
  module of its main loop.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("retriever", "inference", "orchestrator", "trainer", "gateway")
# Packages that are neither services nor the floor: what services may use of each other.
TOOLS = ("inspector",)
# The engines' clients: any service may use them; they stand on the floor only, and the engine
# (`inference/`) does not import them.
CLIENTS = ("engine_client",)
# The roof (`stack/`: the CLI, its config, the launcher) and, above it, the demos.
PACKAGES = ("searchr1", "protos", *SERVICES, *TOOLS, *CLIENTS, "stack", "demos")
# What the roof holds: the `searchr1` command and its sub-commands' homes, the stack config,
# the local launcher and its control endpoint. Demo worlds, warm starts and runners live in
# `demos/` (issue 42), which the CLI reaches by dotted path only.
ROOF = {
    "stack",
    "stack.cli",  # the `searchr1` command
    "stack.config",  # the stack config (StackConfig)
    "stack.launcher",  # `searchr1 local`: the services as supervised processes
    "stack.scale",  # `searchr1 local scale`: the launcher's control endpoint
    "stack.task_cli",  # `searchr1 task list|check`
}
# Not shipped: what tests and benchmarks share (service processes, synthetic data, fakes).
SUPPORT = ("harness", "bench")
# Function-local imports of project modules in PACKAGES: kept for optional dependencies only.
MAX_LOCAL_IMPORTS = 20
# service -> the module of its main loop (reached from its CLI through its wiring)
MAIN_LOOPS = {
    "retriever": "retriever.engine",
    "inference": "inference.engine",
    "orchestrator": "orchestrator.loop",
    "trainer": "trainer.loop",
    "gateway": "gateway.core",
}
# (importer, imported module): the only doors from one service (or tool) into another.
ALLOWED_CROSSINGS = {
    ("orchestrator", "retriever.client"),
    ("orchestrator", "inspector"),  # the run inspector mounted at /ui (optional)
}
# Single modules that cross, each with its reason.
ALLOWED_MODULE_CROSSINGS = {
    # `searchr1 agent run --task`: the runner scores a session by a Task's rubric or by the
    # orchestrator's reward function; the Task interface, its registry and the Scorer are the
    # orchestrator's, one implementation of each (the gateway's HTTP service does not score).
    ("gateway.rubric", "orchestrator"),
}
# Modules of the engine that may use its clients: `push-weights` is a client-side command.
ENGINE_CLIENT_USERS = {"inference.cli"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in (ROOT / pkg).rglob("*.py"):
            if not path.name.endswith("_pb2.py") and not path.name.endswith("_pb2_grpc.py"):
                out[module_name(path)] = path
    return out


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an import names (`a.b.c` may be a module or an attribute of `a.b`)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_in(source: str, modules: dict[str, Path], me: str, is_init: bool) -> set[str]:
    package = me if is_init else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            target = resolve(name, modules)
            if target is not None:
                found.add(target)
    return found


def imports_of(path: Path, modules: dict[str, Path], me: str | None = None) -> set[str]:
    me = me or module_name(path)
    return imports_in(path.read_text(), modules, me, path.name == "__init__.py") - {me}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports: product code, harness/ and bench/ (tests/ is
    a target only, to catch harness/ and bench/ reaching into it)."""
    modules = product_modules((*PACKAGES, *SUPPORT, "tests"))
    return {
        m: imports_of(p, modules) for m, p in modules.items() if top(m) in (*PACKAGES, *SUPPORT)
    }


def local_imports(
    path: Path, modules: dict[str, Path], me: str | None = None
) -> list[tuple[int, str, bool]]:
    """(line, imported module, has a reason comment) of each project import inside a function.

    The reason is a comment on the import's line or on the line above it."""
    me = me or module_name(path)
    text = path.read_text()
    lines = text.splitlines()
    found = set()
    for fn in ast.walk(ast.parse(text, str(path))):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            source = "\n".join(lines[node.lineno - 1 : node.end_lineno]).strip()
            targets = imports_in(source, modules, me, path.name == "__init__.py") - {me}
            if targets:
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                reason = "#" in lines[node.lineno - 1] or above.startswith("#")
                found.add((node.lineno, max(targets, key=len), reason))
    return sorted(found)


def top(module: str) -> str:
    return module.split(".")[0]


def is_floor(module: str) -> bool:
    return top(module) in ("protos", "searchr1")


def test_the_floor_imports_no_service_and_nothing_from_the_roof(graph) -> None:  # type: ignore[no-untyped-def]
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if is_floor(m)
        for t in targets
        if not is_floor(t)
    )
    assert not bad, "floor modules importing upward:\n" + "\n".join(bad)


def test_the_roof_holds_its_cli_config_and_launcher_and_nothing_imports_the_demos(graph) -> None:  # type: ignore[no-untyped-def]
    roof = {m for m in product_modules(("stack",))}
    assert roof == ROOF, f"stack/ holds {sorted(roof - ROOF)} (demos go to demos/)"
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if top(m) in PACKAGES and top(m) != "demos"
        for t in targets
        if top(t) == "demos"
    )
    assert not bad, "the demos are the top: nothing product-side imports them\n" + "\n".join(bad)


def test_services_meet_only_through_clients_and_weight_sync(graph) -> None:  # type: ignore[no-untyped-def]
    bad = []
    for m, targets in graph.items():
        if top(m) not in (*SERVICES, *TOOLS):
            continue
        for t in targets:
            if top(t) in ("stack", "demos"):
                bad.append(f"{m} -> {t} (the roof)")
            elif top(t) in (*SERVICES, *TOOLS) and top(t) != top(m):
                door = next(
                    (
                        d
                        for s, d in ALLOWED_CROSSINGS
                        if s == top(m) and (t + ".").startswith(d + ".")
                    ),
                    None,
                ) or next((d for s, d in ALLOWED_MODULE_CROSSINGS if s == m and top(t) == d), None)
                if door is None:
                    bad.append(f"{m} -> {t}")
    assert not bad, "imports across services:\n" + "\n".join(sorted(bad))


def client_violations(graph: dict[str, set[str]]) -> list[str]:
    """Clients importing above the floor, and engine modules importing the clients."""
    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        for t in targets
        if (top(m) in CLIENTS and not is_floor(t) and top(t) != top(m))
        or (top(m) == "inference" and top(t) in CLIENTS and m not in ENGINE_CLIENT_USERS)
    )


def test_the_clients_stand_on_the_floor_and_the_engine_does_not_import_them(graph) -> None:  # type: ignore[no-untyped-def]
    bad = client_violations(graph)
    assert not bad, "clients importing above the floor, or the engine importing its clients:\n" + (
        "\n".join(bad)
    )
    probe = {
        "inference.scheduler": {"engine_client.client"},  # the engine using its clients
        "inference.cli": {"engine_client.client"},  # push-weights: allowed
        "engine_client.pool": {"engine_client.client", "inference.engine", "searchr1.logs"},
    }
    assert client_violations(probe) == [
        "engine_client.pool -> inference.engine",
        "inference.scheduler -> engine_client.client",
    ]


def private_imports(path: Path, package: str) -> list[str]:
    """`module.name` of each private name (`_x`) imported from a module of `package`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (f"{node.module}.").startswith(f"{package}.")
        ):
            found += [
                f"{node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return found


def test_no_module_imports_the_privates_of_weight_sync(tmp_path: Path) -> None:
    """What both senders (or both receivers) share is public, in its own module (`session.py`):
    a module of weight sync, or one using it, imports no `_name` from it."""
    modules = product_modules((*PACKAGES, *SUPPORT))
    bad = sorted(
        f"{m}: {name}"
        for m, path in modules.items()
        for name in private_imports(path, "searchr1.weightsync")
    )
    assert not bad, "private weight-sync names imported:\n" + "\n".join(bad)
    probe = tmp_path / "probe.py"
    probe.write_text("from searchr1.weightsync.sender import _open_session, WeightSender\n")
    assert private_imports(probe, "searchr1.weightsync") == [
        "searchr1.weightsync.sender._open_session"
    ]


def test_no_import_cycles(graph) -> None:  # type: ignore[no-untyped-def]
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_the_checker_sees_function_local_and_relative_imports(tmp_path: Path) -> None:
    """The rules are only as good as the import scan: it must not miss the hidden kinds."""
    modules = product_modules()
    src = ROOT / "orchestrator" / "wiring.py"
    assert "engine_client.client" in imports_of(src, modules)
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    from trainer.loop import TrainingLoop\n    from .bus import X\n"
    )
    found = imports_of(probe, modules, me="searchr1.probe")
    assert found == {"trainer.loop", "searchr1.bus"}


def folder(module: str, modules: dict[str, Path]) -> str:
    """The folder a module's file is in (a package is in its own folder)."""
    return str(modules[module].parent.relative_to(ROOT))


def test_no_folder_cycles(graph) -> None:  # type: ignore[no-untyped-def]
    """Folders stack up too. A subfolder is part of its parent (the retriever's backends build on
    `retriever/corpus.py`, the retriever wires its backends): arrows between a folder and its
    own ancestor are left out; the packages and sibling folders must not loop. (The old roof's
    cycle ran through such pairs; the roof is one flat folder now.)"""
    modules = product_modules((*PACKAGES, *SUPPORT, "tests"))
    folders: dict[str, set[str]] = {}
    for m, targets in graph.items():
        mine = folder(m, modules)
        for t in targets:
            theirs = folder(t, modules)
            if not (f"{mine}/".startswith(f"{theirs}/") or f"{theirs}/".startswith(f"{mine}/")):
                folders.setdefault(mine, set()).add(theirs)
    try:
        tuple(graphlib.TopologicalSorter(folders).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"folder cycle: {' -> '.join(e.args[1])}")


def is_config(module: str) -> bool:
    return module.rpartition(".")[2] == "config" or module in (
        "searchr1.sections",
        "searchr1.settings",
    )


def test_configs_are_leaves(graph) -> None:  # type: ignore[no-untyped-def]
    """Loading a service's config loads no behaviour: config modules import config modules and
    modules that import nothing of the project (a registry of dotted paths, say)."""
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if m.endswith(".config") and top(m) in PACKAGES
        for t in targets
        if not is_config(t) and graph.get(t)
    )
    assert not bad, "config modules importing behaviour:\n" + "\n".join(bad)


def test_function_local_imports_are_few_and_say_why() -> None:
    modules = product_modules((*PACKAGES, *SUPPORT, "tests"))
    found = [
        (str(path.relative_to(ROOT)), line, target, reason)
        for m, path in modules.items()
        if top(m) in PACKAGES
        for line, target, reason in local_imports(path, modules)
    ]
    unexplained = [f"{f}:{line} imports {t}" for f, line, t, reason in found if not reason]
    assert not unexplained, "function-local imports without a reason comment:\n" + "\n".join(
        unexplained
    )
    assert len(found) <= MAX_LOCAL_IMPORTS, "\n".join(f"{f}:{line} {t}" for f, line, t, _ in found)


def test_support_code_stays_out_of_the_product(graph) -> None:  # type: ignore[no-untyped-def]
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        for t in targets
        if (top(m) in PACKAGES and top(t) in (*SUPPORT, "tests"))
        or (top(m) in SUPPORT and top(t) == "tests")
    )
    assert not bad, "product -> harness/bench/tests, or harness/bench -> tests:\n" + "\n".join(bad)


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_reads_cli_wiring_loop(graph, service: str) -> None:  # type: ignore[no-untyped-def]
    """The service's main loop is two hops from its command: cli -> wiring -> loop."""
    assert f"{service}.wiring" in graph[f"{service}.cli"], f"{service}/cli.py: no wiring import"
    assert MAIN_LOOPS[service] in graph[f"{service}.wiring"], (
        f"{service}/wiring.py does not import {MAIN_LOOPS[service]}"
    )


def test_the_checker_sees_local_imports_and_their_reasons(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    import json\n    from trainer.loop import TrainingLoop\n"
        "    # optional: megatron-core\n    from trainer import config\n"
    )
    found = local_imports(probe, product_modules(), me="searchr1.probe")
    assert found == [(3, "trainer.loop", False), (5, "trainer.config", True)]


# A service's subfolders and their parent import each other: the parent wires its parts, the
# parts use the parent's leaf modules (config, records, metrics). Each pair, with its reason;
# a new subfolder is added here on purpose or the test fails (issue 45: "the folder-arrow
# exceptions inside a service removed or written down with their reason").
SUBFOLDERS: dict[str, str] = {
    "orchestrator/formats": "the rollout (orchestrator.rollout) picks its action format; the "
    "formats use the loop's records (sample, observation) and its config",
    "orchestrator/tasks": "the wiring loads the task (registry) and asks it for its rows; tasks "
    "build on the loop's records (sample, config, data)",
    "orchestrator/tools": "the wiring builds the toolbox and the rollout runs it; tools read "
    "their limits from the orchestrator's config and count into its metrics",
    "retriever/backends": "the engine wires the backend the config names; backends build on "
    "the corpus, the config and the encoder; retriever.encoder raises the backends' "
    "BackendUnavailable (the one error every backend's caller handles)",
    "trainer/backends": "trainer.config validates `trainer.backend` against the registry (a "
    "leaf of dotted paths) and the wiring builds the backend; backends build on the trainer's "
    "step, batching and config",
    "trainer/backends/megatron": "trainer.config holds the `megatron` section (its config "
    "module, a leaf); the backend builds on the trainer's step, batching and export",
}


def test_subfolders_that_import_their_parent_are_written_down() -> None:
    modules = product_modules(PACKAGES)
    both: dict[str, set[str]] = {}
    for m, path in modules.items():
        mine = folder(m, modules)
        for t in imports_of(path, modules, me=m):
            theirs = folder(t, modules)
            if mine != theirs and f"{mine}/".startswith(f"{theirs}/"):
                both.setdefault(mine, set()).add("up")
            elif mine != theirs and f"{theirs}/".startswith(f"{mine}/"):
                both.setdefault(theirs, set()).add("down")
    mutual = {f for f, ways in both.items() if ways == {"up", "down"}}
    assert mutual == set(SUBFOLDERS), (
        "subfolders importing their parent and imported by it, without a reason in SUBFOLDERS: "
        f"{sorted(mutual - set(SUBFOLDERS))}; listed but no longer so: "
        f"{sorted(set(SUBFOLDERS) - mutual)}"
    )


def test_one_name_for_one_thing() -> None:
    """No two public classes of the product or its support code share a name (issue 45: two
    `Sample`s, two `Supervisor`s, two `PrefixCache`s each read as one thing and were not)."""
    homes: dict[str, list[str]] = {}
    for module, path in product_modules((*PACKAGES, *SUPPORT)).items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                homes.setdefault(node.name, []).append(module)
    assert {name: ms for name, ms in homes.items() if len(ms) > 1} == {}
