"""Every public name of durably carries a docstring: the promise of a library
whose users read its API in their editor. A public name is one a public module
exports (``__all__``, else defined there without a leading underscore); a
public method is one of a public class without a leading underscore."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import durably


def _public_modules() -> Iterator[ModuleType]:
    yield durably
    for info in pkgutil.iter_modules(durably.__path__):
        if not info.name.startswith("_"):
            yield importlib.import_module(f"durably.{info.name}")


def _public_names(module: ModuleType) -> list[str]:
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return list(exported)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]


def _undocumented_methods(cls: type) -> Iterator[str]:
    for name, attribute in vars(cls).items():
        if name.startswith("_"):
            continue
        function: Any = attribute.fget if isinstance(attribute, property) else attribute
        if isinstance(function, staticmethod | classmethod):
            function = function.__func__
        if not inspect.isfunction(function):
            continue
        # An override documented on a base class counts (inspect.getdoc walks the MRO).
        looked_up = function if isinstance(attribute, property) else getattr(cls, name)
        if not inspect.getdoc(looked_up):
            yield name


def test_every_public_class_function_and_method_has_a_docstring() -> None:
    missing: list[str] = []
    for module in _public_modules():
        for name in _public_names(module):
            value = getattr(module, name)
            if not (inspect.isclass(value) or inspect.isfunction(value)):
                continue
            if not (value.__doc__ or "").strip():
                missing.append(f"{module.__name__}.{name}")
            if inspect.isclass(value):
                missing += [f"{module.__name__}.{name}.{m}" for m in _undocumented_methods(value)]
    assert sorted(set(missing)) == []
