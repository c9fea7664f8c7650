"""The package layering, checked on every import statement of the product code.

- The floor (`searchr1/` and `protos/`) imports no service and nothing from the roof
  (`stack/`): every service can use it.
- A service imports another service only through its client or the weight-sync channel.
- No import cycle between modules, function-local imports included (they hid one before).
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("retriever", "inference", "orchestrator", "trainer")
# Packages that are neither services nor the floor: what services may use of each other.
TOOLS = ("inspector",)
PACKAGES = ("searchr1", "protos", *SERVICES, *TOOLS, "stack")
# (importer, imported module): the only doors from one service (or tool) into another.
ALLOWED_CROSSINGS = {
    ("orchestrator", "inference.client"),
    ("orchestrator", "retriever.client"),
    ("orchestrator", "inspector"),  # the run inspector mounted at /ui (optional)
    ("trainer", "inference.client"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
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


def imports_of(path: Path, modules: dict[str, Path], me: str | None = None) -> set[str]:
    me = me or module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
            if target is not None and target != me:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = product_modules()
    return {m: imports_of(p, modules) for m, p in modules.items()}


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


def test_services_meet_only_through_clients_and_weight_sync(graph) -> None:  # type: ignore[no-untyped-def]
    bad = []
    for m, targets in graph.items():
        if top(m) not in (*SERVICES, *TOOLS):
            continue
        for t in targets:
            if top(t) == "stack":
                bad.append(f"{m} -> {t} (the roof)")
            elif top(t) in (*SERVICES, *TOOLS) and top(t) != top(m):
                door = next(
                    (
                        d
                        for s, d in ALLOWED_CROSSINGS
                        if s == top(m) and (t + ".").startswith(d + ".")
                    ),
                    None,
                )
                if door is None:
                    bad.append(f"{m} -> {t}")
    assert not bad, "imports across services:\n" + "\n".join(sorted(bad))


def test_no_import_cycles(graph) -> None:  # type: ignore[no-untyped-def]
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_the_checker_sees_function_local_and_relative_imports(tmp_path: Path) -> None:
    """The rules are only as good as the import scan: it must not miss the hidden kinds."""
    modules = product_modules()
    src = ROOT / "orchestrator" / "wiring.py"
    assert "inference.client" in imports_of(src, modules)
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    from trainer.loop import TrainingLoop\n    from .bus import X\n"
    )
    found = imports_of(probe, modules, me="searchr1.probe")
    assert found == {"trainer.loop", "searchr1.bus"}
