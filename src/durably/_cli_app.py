"""Loading the application's ``Engine`` for ``durably worker --app module[:attr]``."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from .engine import Engine

__all__ = ["DEFAULT_ATTRIBUTE", "AppLoadError", "load_engine"]

DEFAULT_ATTRIBUTE = "engine"
"""The attribute ``--app module`` names when it names none (``module:engine``)."""


class AppLoadError(Exception):
    """``--app`` does not name an importable ``Engine``; the message says why."""


def load_engine(spec: str) -> Engine:
    """Import ``module:attr`` (``module`` alone means ``module:engine``) and
    return the :class:`Engine` it names.

    ``attr`` may be a dotted path (``module:app.engine``) and may name a
    callable taking no arguments that returns the engine (a factory). The
    current directory is put on ``sys.path`` first, like ``python -m`` does.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep:
        attr_path = DEFAULT_ATTRIBUTE
    if not module_name or not attr_path:
        raise AppLoadError(
            "--app must look like 'module' or 'module:attribute' "
            f"(e.g. myapp.main or myapp.main:engine), got {spec!r}"
        )
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (
            module_name == exc.name or module_name.startswith(exc.name + ".")
        ):
            raise AppLoadError(
                f"cannot import {module_name!r}: no module named {exc.name!r} "
                f"(looked in {cwd} and the installed packages)"
            ) from exc
        raise AppLoadError(f"importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise AppLoadError(
            f"importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise AppLoadError(f"module {module_name!r} has no attribute {attr_path!r}") from None
    if isinstance(target, Engine):
        return target
    if callable(target):
        try:
            made = target()
        except Exception as exc:
            raise AppLoadError(
                f"calling {spec!r} to make the engine failed: {type(exc).__name__}: {exc}"
            ) from exc
        if isinstance(made, Engine):
            return made
        raise AppLoadError(f"{spec!r} returned {type(made).__name__}, not a durably.Engine")
    raise AppLoadError(f"{spec!r} is a {type(target).__name__}, not a durably.Engine")
