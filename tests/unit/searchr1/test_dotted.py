"""Objects by dotted path: both spellings, nested attributes, and what a bad path raises."""

from __future__ import annotations

import json
import os.path

import pytest

from searchr1.dotted import load_object, split_path


def test_both_spellings_and_nested_attributes() -> None:
    assert load_object("json:dumps") is json.dumps
    assert load_object("json.dumps") is json.dumps
    assert load_object("os:path.join") is os.path.join
    assert split_path("pkg.mod:a.b") == ("pkg.mod", "a.b")


@pytest.mark.parametrize("path", ["", "dumps", ":dumps", "json:"])
def test_a_path_without_module_or_attribute_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match="not a dotted path"):
        load_object(path)


def test_missing_module_and_attribute_raise_their_own_errors() -> None:
    with pytest.raises(ImportError):
        load_object("no_such_module_here:f")
    with pytest.raises(AttributeError):
        load_object("json:no_such_function")
