"""Guardrail: every public algo function has a docstring that names each of its parameters."""

import inspect
import re

import pytest

import turborlhf.algo as algo

PUBLIC = [getattr(algo, n) for n in algo.__all__ if callable(getattr(algo, n)) and not isinstance(getattr(algo, n), dict)]


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda o: o.__name__)
def test_docstring_mentions_every_parameter(obj):
    doc = inspect.getdoc(obj)
    assert doc and len(doc) > 80, f"{obj.__name__} lacks a real docstring"
    assert "Raises" in doc or "ValueError" in doc or inspect.isclass(obj), f"{obj.__name__}: document errors raised"
    target = obj.__init__ if inspect.isclass(obj) else obj
    for name in inspect.signature(target).parameters:
        if name in ("self",):
            continue
        assert re.search(rf"\b{name}\b", doc), f"{obj.__name__}: parameter {name!r} not documented"
