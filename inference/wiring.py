"""How `searchr1 inference serve` puts the service together and runs it.

Per `inference.engine`: our reference engine (`TorchEngine`, whose scheduler thread,
`inference.scheduler`, is its main loop, behind the thin HTTP layer of `inference.server`), or
SGLang run and supervised by `inference.sglang_launcher`. Either way the call returns when the
service stops (SIGTERM).
"""

from __future__ import annotations

from inference.config import InferenceSettings
from inference.engine import TorchEngine
from inference.join import Joiner
from inference.server import create_app
from inference.sglang_launcher import run_sglang
from searchr1.service import run_http
from searchr1.weightsync.registry import EngineRegistry, registry_key


def serve(cfg: InferenceSettings, *, replicas: int = 1) -> int:
    """Serve the configured engine until SIGTERM; the exit status. `replicas`: SGLang only.
    The caller has checked `inference.model_path`."""
    section = cfg.inference
    if section.engine == "sglang":
        token = cfg.admin_token.get_secret_value() if cfg.admin_token else None
        return run_sglang(section, replicas=replicas, admin_token=token)
    assert section.model_path, "model_path is validated by the CLI"
    engine = TorchEngine(section.model_path, section.torch_engine)  # starts its scheduler
    joiner = make_joiner(cfg, engine)
    run_http(create_app(engine, admin_token=cfg.admin_token, joiner=joiner), section.http)
    return 0


def make_joiner(cfg: InferenceSettings, engine: TorchEngine) -> Joiner | None:
    """`inference.join`: the pull from the weight store and the announcement, or None."""
    join, http = cfg.inference.join, cfg.inference.http
    if not join.store_dir and not join.announce:
        return None
    registry = None
    if join.announce:
        assert cfg.redis.url, "checked by the CLI"
        registry = EngineRegistry.from_url(cfg.redis.url, registry_key(cfg.bus.stream))
    host = "127.0.0.1" if http.host in ("0.0.0.0", "::", "") else http.host
    url = join.advertise_url or f"http://{host}:{http.port}"
    return Joiner(engine, join, advertise_url=url, registry=registry, run=cfg.run.id)
