"""The backend registries: every name the config accepts has a loader, and no other name loads."""

from __future__ import annotations

from typing import get_args

import pytest

from retriever.backends.registry import BACKENDS, INDEX_BACKENDS
from retriever.config import BackendName, RetrieverSettings
from retriever.manifest import Manifest
from searchr1.settings import ConfigError, load_settings


def test_the_config_accepts_exactly_the_registered_backends() -> None:
    assert set(get_args(BackendName)) == set(BACKENDS)
    for name in BACKENDS:
        assert (
            load_settings(RetrieverSettings, retriever={"backend": name}).retriever.backend == name
        )


def test_an_unknown_backend_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"retriever\.backend: Input should be 'index' or 'web'"):
        load_settings(RetrieverSettings, retriever={"backend": "elastic"})


def test_every_index_kind_a_manifest_names_has_a_loader() -> None:
    assert set(get_args(Manifest.model_fields["backend"].annotation)) == set(INDEX_BACKENDS)
