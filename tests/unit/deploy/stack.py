"""What the deployment files say, and what the code reads and serves, side by side.

The deploy tests compare the two: every fact about the services (ports, env var names, probe
paths, commands) is derived here from the code (config models, the typer app, the service app
factory), never from a hand-kept list.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import typer
import yaml
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "k8s" / "searchr1"
VALUES_FILES = {
    "default": None,
    "cluster": CHART / "values-cluster.yaml",
    "cpu": CHART / "values-cpu.yaml",
    "gateway": CHART / "values-gateway.yaml",
}
COMPOSE = ROOT / "docker-compose.yml"
DOCKER = ROOT / "docker"
SERVICES = ("retriever", "inference", "orchestrator", "trainer")
# Deployed on request (compose profile `gateway`, chart `gateway.enabled`), with an image of its
# own like the others.
OPTIONAL_SERVICES = ("gateway",)
IMAGES = SERVICES + OPTIONAL_SERVICES

# Values the tests substitute for secrets and `${VAR}` interpolations.
FAKE_SECRET = "s3cret-Value_1"


# ---------------------------------------------------------------------------- the code's side


def stack_config_cls() -> type[BaseModel]:
    from stack.config import StackConfig

    return StackConfig


def env_prefix() -> str:
    from stack.config import ENV_PREFIX

    return ENV_PREFIX


def config_file_env() -> str:
    """The variable naming the config file, as the CLI's --config option declares it."""
    from searchr1.cli_common import ConfigOption

    return ConfigOption.__metadata__[0].envvar


def secret_env_names() -> set[str]:
    """Secrets read from the environment: top-level secret keys and the serper API key."""
    from retriever.backends.web import API_KEY_ENV
    from stack.config import SECRET_KEYS

    return {env_prefix() + k.upper() for k in SECRET_KEYS} | {API_KEY_ENV}


def config_field_path(env_name: str) -> list[str] | None:
    """`SEARCHR1_A__B_C` -> ["a", "b_c"] when it names a field of the stack config, else None."""
    prefix = env_prefix()
    if not env_name.startswith(prefix):
        return None
    parts = env_name[len(prefix) :].lower().split("__")
    model: Any = stack_config_cls()
    for i, part in enumerate(parts):
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        f = model.model_fields.get(part)
        if f is None:
            return None
        model = f.annotation
        if i < len(parts) - 1:  # descend through Optional[Model] too
            args = [a for a in getattr(model, "__args__", ()) if a is not type(None)]
            if args and not (isinstance(model, type) and issubclass(model, BaseModel)):
                model = args[0]
    return parts


def load_with_env(env: dict[str, str], config_file: Path | None = None):  # type: ignore[no-untyped-def]
    """The StackConfig a service would load with exactly this environment (and file)."""
    from stack.config import load_config

    keep = {k: v for k, v in os.environ.items() if not k.startswith(env_prefix())}
    with mock.patch.dict(os.environ, {**keep, **env}, clear=True):
        return load_config(config_file)


@cache
def served_paths() -> frozenset[str]:
    """GET routes every service app has (from the shared app factory)."""
    from searchr1.service import create_service_app

    app = create_service_app("probe")
    return frozenset(r.path for r in app.routes if "GET" in getattr(r, "methods", ()))


@cache
def inference_paths() -> frozenset[str]:
    """GET routes of the inference app (the SGLang HTTP API subset the reference engine serves)."""
    from inference.server import create_app

    app = create_app(object())  # type: ignore[arg-type]  # routes only; the engine is not used
    return frozenset(r.path for r in app.routes if "GET" in getattr(r, "methods", ()))


def default_ports() -> dict[str, int]:
    cfg = load_with_env({})  # the models' defaults, whatever this shell exports
    return {s: getattr(cfg, s).http.port for s in IMAGES}


def _module_file(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_names(module: str, path: Path) -> set[str]:
    """Every name an `import` of the module's source names, lazy ones (in functions) too."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


@cache
def import_closure(*start: str) -> tuple[frozenset[str], frozenset[str]]:
    """What running the `start` modules can import: (first-party modules, top-level names of
    third-party ones). Follows this repository's modules transitively, by their source (nothing
    is imported); the standard library is left out."""
    first_party = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    seen: set[str] = set()
    third: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        path = _module_file(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        for name in _imported_names(module, path):
            top = name.split(".")[0]
            if top in first_party:
                parts = name.split(".")
                todo += [".".join(parts[: i + 1]) for i in range(len(parts))]
            elif top not in sys.stdlib_module_names and top != "__future__":
                third.add(top)
    return frozenset(seen), frozenset(third)


def service_imports(service: str) -> tuple[frozenset[str], frozenset[str]]:
    """`import_closure` of what `searchr1 <service> ...` runs: the console script's module and
    the service's CLI (stack.cli imports a sub-command's app only when it runs)."""
    from stack.cli import COMMANDS

    return import_closure("stack.cli", COMMANDS[service].split(":")[0])


class CliError(ValueError):
    pass


def check_cli(argv: list[str]) -> Any:
    """Parse `searchr1 <argv>` with the real typer app without running it; returns the leaf
    command's context (its `.params`). Raises on an unknown command or option, a bad value.

    Typer vendors its own click, so groups are recognised by behaviour, not by class.
    """
    from stack.cli import app

    cmd: Any = typer.main.get_command(app)
    ctx = cmd.context_class(cmd, info_name="searchr1")
    rest = list(argv)
    while hasattr(cmd, "list_commands"):
        if not rest:
            raise CliError(f"missing sub-command in `searchr1 {' '.join(argv)}`")
        name = rest.pop(0)
        sub = cmd.get_command(ctx, name)
        if sub is None:
            raise CliError(f"no command {name!r} in `searchr1 {' '.join(argv)}`")
        cmd = sub
    try:
        return cmd.make_context(cmd.name, rest)
    except Exception as e:  # typer's click exceptions: UsageError, NoSuchOption, BadParameter
        raise CliError(f"`searchr1 {' '.join(argv)}`: {e}") from e


# ----------------------------------------------------------------------------- the files' side


@dataclass
class Container:
    """One searchr1 container of a deployment file, normalised."""

    where: str  # "compose:<service>" or "k8s/<values>:<kind>/<name>/<container>"
    argv: list[str]  # after `searchr1` (e.g. ["retriever", "serve", ...]); [] if not searchr1
    env: dict[str, str]  # literal values, with secrets/interpolations substituted
    env_names: set[str]  # every variable name set, literal or from a secret
    ports: set[int]
    probes: dict[str, tuple[int, str]] = field(default_factory=dict)  # kind -> (port, path)
    raw_env: dict[str, str] = field(default_factory=dict)  # as written (before expansion)

    @property
    def service(self) -> str | None:
        return self.argv[0] if self.argv else None


@dataclass(frozen=True)
class Dockerfile:
    path: Path
    instructions: list[tuple[str, str]]  # (INSTRUCTION, rest) of the final stage

    def all(self, name: str) -> list[str]:
        return [rest for ins, rest in self.instructions if ins == name]

    def exec_form(self, name: str) -> list[str]:
        rests = self.all(name)
        return yaml.safe_load(rests[-1]) if rests else []


def parse_dockerfile(path: Path, final_stage_only: bool = True) -> Dockerfile:
    text = re.sub(r"\\\n", " ", path.read_text())
    out: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        ins, _, rest = line.partition(" ")
        if ins.upper() == "FROM" and final_stage_only:
            out = []
        out.append((ins.upper(), rest.strip()))
    return Dockerfile(path, out)


def dockerfile_of_image(repository: str) -> Path:
    """`searchr1/retriever` or `registry/x/searchr1/retriever` -> docker/retriever.Dockerfile."""
    return DOCKER / f"{repository.rsplit('/', 1)[-1]}.Dockerfile"


def healthcheck_probe(cmd: list[str]) -> tuple[str, str] | None:
    """(service, path) of a `python .../healthcheck.py <service> [path]` command, else None."""
    for i, tok in enumerate(cmd):
        if tok.endswith("healthcheck.py"):
            args = cmd[i + 1 :]
            return args[0], args[1] if len(args) > 1 else "/ready"
    return None


@cache
def healthcheck_module() -> ModuleType:
    """docker/healthcheck.py (a stdlib-only script copied into every image)."""
    spec = importlib.util.spec_from_file_location("searchr1_healthcheck", DOCKER / "healthcheck.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def port_for(service: str, env: dict[str, str]) -> int:
    """The port healthcheck.py probes inside a container with this environment."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(env_prefix())}
    with mock.patch.dict(os.environ, {**keep, **env}, clear=True):
        return int(healthcheck_module().port_of(service))


def _interpolate(value: str, variables: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} (and $$ escapes)."""

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in variables:
            return variables[name]
        if op == ":-":
            return arg
        return FAKE_SECRET

    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", sub, value).replace("$$", "$")


@cache
def compose_raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def compose_containers(variables: dict[str, str] | None = None) -> dict[str, Container]:
    variables = variables or {}
    out = {}
    for name, svc in compose_raw()["services"].items():
        raw = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        env = {k: _interpolate(v, variables) for k, v in raw.items()}
        argv: list[str] = []
        if "build" in svc and "entrypoint" not in svc:
            df = parse_dockerfile(ROOT / svc["build"]["dockerfile"])
            entry = df.exec_form("ENTRYPOINT")
            command = svc.get("command", df.exec_form("CMD"))
            if entry[:1] == ["searchr1"]:
                argv = entry[1:] + [_interpolate(str(c), variables) for c in command]
        ports = {int(str(p).split(":")[-1].split("/")[0]) for p in svc.get("ports", [])}
        probes = {}
        test = (svc.get("healthcheck") or {}).get("test") or []
        hc = healthcheck_probe(test)
        if hc and argv:
            probes["healthcheck"] = (port_for(hc[0], env), hc[1])
        out[name] = Container(f"compose:{name}", argv, env, set(env), ports, probes, raw)
    return out


@cache
def render_chart(values_name: str) -> tuple[dict[str, Any], ...]:
    """Rendered manifests (parsed) of the chart with the named values file."""
    import helm_python as helm

    path = VALUES_FILES[values_name]
    values = yaml.safe_load(path.read_text()) if path else None
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="rl", namespace="ml")
    docs = []
    for name, text in sorted(rendered.items()):
        if name.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return tuple(docs)


def chart_values(values_name: str) -> dict[str, Any]:
    import helm_python as helm

    path = VALUES_FILES[values_name]
    values = yaml.safe_load(path.read_text()) if path else None
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(values)


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        return doc["spec"]["template"]["spec"]
    return None


def _k8s_env(c: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    env: dict[str, str] = {}
    raw: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = raw[e["name"]] = e["value"]
        elif "secretKeyRef" in e.get("valueFrom", {}):
            env[e["name"]] = FAKE_SECRET
        else:
            env[e["name"]] = "0"  # downward API (e.g. the job completion index)
    # Kubernetes expands $(VAR) from variables defined earlier in the list.
    for k, v in env.items():
        env[k] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), v)
    return env, raw


def _k8s_argv(c: dict[str, Any]) -> list[str]:
    command, args = c.get("command"), c.get("args", [])
    if command:
        full = list(command) + list(args)
        if "stack.cli" in full:  # python -m torch.distributed.run ... -m stack.cli ...
            return full[full.index("stack.cli") + 1 :]
        if full[0] == "searchr1":
            return full[1:]
        return []
    entry = parse_dockerfile(dockerfile_of_image(c["image"].split(":")[0])).exec_form("ENTRYPOINT")
    return entry[1:] + list(args) if entry[:1] == ["searchr1"] else []


def _k8s_probe(probe: dict[str, Any], c: dict[str, Any], env: dict[str, str]):  # type: ignore[no-untyped-def]
    named = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
    if "httpGet" in probe:
        port = probe["httpGet"]["port"]
        return (named.get(port, port), probe["httpGet"]["path"])
    if "exec" in probe:
        cmd = shlex.split(" ".join(probe["exec"]["command"][-1:]))
        hc = healthcheck_probe(cmd)
        if hc:
            return (port_for(hc[0], env), hc[1])
    return None


def chart_containers(values_name: str) -> list[Container]:
    out = []
    for doc in render_chart(values_name):
        spec = pod_spec(doc)
        if spec is None:
            continue
        for c in spec["containers"]:
            env, raw = _k8s_env(c)
            probes = {}
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                if kind in c:
                    p = _k8s_probe(c[kind], c, env)
                    if p:
                        probes[kind] = p
            where = f"k8s/{values_name}:{doc['kind']}/{doc['metadata']['name']}/{c['name']}"
            ports = {p["containerPort"] for p in c.get("ports", [])}
            out.append(Container(where, _k8s_argv(c), env, set(env), ports, probes, raw))
    return out
