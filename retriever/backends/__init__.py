"""Search backends: the interface (`base.py`), one module per backend, and `registry.py`, which
loads the one `retriever.backend` (and the index manifest) names.

This package's own import stays light (the interface only): `retriever.encoder` imports
`base.py`, and the dense backend imports the encoder.
"""

from __future__ import annotations

from retriever.backends.base import AsyncBackend, BackendUnavailable, BatchBackend, Hit

__all__ = ["AsyncBackend", "BackendUnavailable", "BatchBackend", "Hit"]
