"""How `searchr1 inference serve` puts the service together and runs it.

Per `inference.engine`: our reference engine (`TorchEngine`, whose scheduler thread,
`inference.scheduler`, is its main loop, behind the thin HTTP layer of `inference.server`), or
SGLang run and supervised by `inference.sglang_launcher`. Either way the call returns when the
service stops (SIGTERM).
"""

from __future__ import annotations

from inference.config import InferenceSettings
from inference.engine import TorchEngine
from inference.server import create_app
from inference.sglang_launcher import run_sglang
from searchr1.service import run_http


def serve(cfg: InferenceSettings, *, replicas: int = 1) -> int:
    """Serve the configured engine until SIGTERM; the exit status. `replicas`: SGLang only.
    The caller has checked `inference.model_path`."""
    section = cfg.inference
    if section.engine == "sglang":
        token = cfg.admin_token.get_secret_value() if cfg.admin_token else None
        return run_sglang(section, replicas=replicas, admin_token=token)
    assert section.model_path, "model_path is validated by the CLI"
    engine = TorchEngine(section.model_path, section.torch_engine)  # starts its scheduler
    run_http(create_app(engine, admin_token=cfg.admin_token), section.http)
    return 0
