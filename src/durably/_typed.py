"""Declared types for the values a workflow passes around: JSON data in, that type out.

Every value is stored as plain JSON data (:mod:`durably._codec`). Where a type
is declared — ``output=`` on a workflow or a step, or else the function's
return annotation — the data is validated into that type with a pydantic
``TypeAdapter`` each time a body (or a client) receives it: on the first run
and on every replay alike, so a body sees the same value either way.

Plain JSON types (``str``, ``int``, ``float``, ``bool``, ``None``, ``Any``,
``list`` / ``dict`` of them) pass through untouched and need no pydantic.
Anything else needs the ``durably[pydantic]`` extra: an explicit ``output=``
without it is refused at registration; a return annotation without it is not
enforced (the data passes through, as it did before types were decoded).

Adapters are built once per type and cached: building one costs about half a
millisecond, using one a few microseconds (``bench/RESULTS.md``).
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _codec as codec
from .errors import SchemaValidationError

__all__ = [
    "PLAIN",
    "Decoder",
    "Misfit",
    "MissingPydantic",
    "Typed",
    "check_declared",
    "clear_caches",
    "decoder_for",
    "identity",
    "is_plain",
    "output_type_of",
    "typed_for",
]

Decoder = Callable[[Any], Any]
"""JSON data in, the declared type out (:class:`SchemaValidationError` if it does not fit)."""

_PLAIN_TYPES: frozenset[Any] = frozenset(
    {Any, object, str, int, float, bool, type(None), None, dict, list}
)
_PLAIN_ORIGINS: frozenset[Any] = frozenset(
    {
        list,
        dict,
        typing.Union,
        types.UnionType,
        collections.abc.Sequence,
        collections.abc.Mapping,
        typing.Optional,
    }
)
_AWAITABLE_ORIGINS: frozenset[Any] = frozenset(
    {collections.abc.Awaitable, collections.abc.Coroutine}
)


class MissingPydantic(TypeError):
    """A type other than plain JSON was declared, and pydantic is not installed."""


class Misfit(SchemaValidationError):
    """A value does not fit its declared type. Like a value no store can keep,
    it is not retried: the same code returns the same shape."""


def identity(value: Any) -> Any:
    """The decoder of plain JSON types: the data itself."""
    return value


def is_plain(tp: Any) -> bool:
    """Whether ``tp`` is plain JSON (no decoding needed): ``Any``, ``str``,
    ``int``, ``float``, ``bool``, ``None``, and lists, dicts, unions of those."""
    try:
        if tp in _PLAIN_TYPES:
            return True
    except TypeError:  # an unhashable annotation
        return False
    if isinstance(tp, typing.TypeVar):
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return all(isinstance(arg, str | int | bool) or arg is None for arg in typing.get_args(tp))
    if origin not in _PLAIN_ORIGINS:
        return False
    args = typing.get_args(tp)
    if origin in (dict, collections.abc.Mapping) and args and args[0] is not str:
        return False
    return all(is_plain(arg) for arg in args)


def output_type_of(fn: Callable[..., Any] | None, declared: Any = None) -> Any:
    """The output type of ``fn``: ``declared`` when given, else its return
    annotation (unwrapping ``Awaitable[T]`` / ``Coroutine[..., T]``), else ``Any``.

    An annotation that cannot be used counts as ``Any``: one that does not
    resolve (a name the function cannot see), one pydantic has no schema for,
    and any non-plain one while pydantic is not installed. An explicit
    ``declared`` is returned as given: check it with :func:`check_declared`.
    """
    if declared is not None:
        return declared
    if fn is None:
        return Any
    annotations = getattr(fn, "__annotations__", None)
    if isinstance(annotations, dict) and "return" not in annotations:
        return Any  # lambdas and unannotated functions: no lookup, no cache entry
    # Keyed by the code and the annotation as written, not the function: a
    # step function defined inside a body is a new object every run, and
    # must neither miss the cache every time nor keep the closure (and its
    # turn) alive in it. (functools.wraps wrappers share their code, not
    # their annotation.)
    code = getattr(fn, "__code__", None)
    written = annotations.get("return") if isinstance(annotations, dict) else None
    key = (code, written) if code is not None else fn
    try:
        return _ANNOTATED[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable callable
        return _annotated_output(fn)
    tp = _annotated_output(fn)
    if len(_ANNOTATED) >= _MAX_CACHED:
        _ANNOTATED.clear()
    _ANNOTATED[key] = tp
    return tp


_MAX_CACHED = 4096
_ANNOTATED: dict[Any, Any] = {}


def _annotated_output(fn: Callable[..., Any]) -> Any:
    tp = _return_annotation(fn)
    if is_plain(tp):
        return tp
    try:
        _adapter(tp)
    except Exception:  # no pydantic, or no schema: the annotation is not enforced
        return Any
    return tp


def _return_annotation(fn: Callable[..., Any]) -> Any:
    target: Any = fn
    while isinstance(target, functools.partial):
        target = target.func
    if not (inspect.isfunction(target) or inspect.ismethod(target)):
        target = getattr(target, "__call__", target)  # noqa: B004 - a callable object's hints
    try:
        hints = typing.get_type_hints(target)
    except NameError:
        # A class defined in the enclosing function (a string annotation under
        # `from __future__ import annotations`) resolves from the closure.
        try:
            hints = typing.get_type_hints(target, localns=inspect.getclosurevars(target).nonlocals)
        except Exception:
            return Any
    except Exception:  # an annotation typing cannot evaluate
        return Any
    tp = hints.get("return", Any)
    while typing.get_origin(tp) in _AWAITABLE_ORIGINS:
        args = typing.get_args(tp)
        tp = args[-1] if args else Any
    return tp


def check_declared(tp: Any, where: str) -> None:
    """Refuse an explicit output type that cannot be decoded here: one needing
    pydantic when it is not installed, or one pydantic cannot build a schema
    for. ``where`` names the registration in the message."""
    if tp is None or is_plain(tp):
        return
    try:
        _adapter(tp)
    except MissingPydantic as exc:
        raise MissingPydantic(f"{where}: {exc}") from None
    except Exception as exc:
        raise TypeError(f"{where}: output type {tp!r} cannot be decoded: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Typed:
    """A declared type's two directions: a value in, JSON data stored, the
    declared type out. Build with :func:`typed_for`."""

    type: Any
    decode: Decoder
    """JSON data as :attr:`type` (:class:`Misfit` if it does not fit)."""
    check: Decoder
    """A value a function returned as :attr:`type` (:class:`Misfit` if it does not fit)."""

    @property
    def plain(self) -> bool:
        """Plain JSON: nothing to check, nothing to decode."""
        return self.decode is identity

    def store(self, value: Any, field: str) -> tuple[Any, Any]:
        """``(JSON data to store, the value a body receives)`` for ``value``.

        The value is first fitted to the type (a dict becomes the declared
        model; bytes inside a model follow the model's own config), then
        stored in that type's JSON form, and the body receives that data
        decoded: the first run and every replay see the same value.
        """
        data = codec.to_jsonable(self.check(value), field)
        return data, self.decode(data)


PLAIN = Typed(Any, identity, identity)
"""Plain JSON: stored as given, handed back as stored."""


def typed_for(tp: Any, what: str = "value") -> Typed:
    """The :class:`Typed` of ``tp``; ``what`` names the value in a misfit's
    message ("the result of step 'x'"). Plain JSON types get :data:`PLAIN`."""
    if tp is None or tp is Any:
        return PLAIN
    try:
        return _cached_typed(tp, what)
    except TypeError as exc:  # an unhashable annotation
        if isinstance(exc, MissingPydantic) or "unhashable" not in str(exc):
            raise
    return _cached_typed.__wrapped__(tp, what)


@functools.lru_cache(maxsize=4096)
def _cached_typed(tp: Any, what: str) -> Typed:
    if is_plain(tp):
        return PLAIN
    validate = _adapter(tp).validate_python

    def run(value: Any) -> Any:
        try:
            return validate((value,))[0]
        except Exception as exc:
            raise _misfit(what, tp, exc) from None

    # JSON data and a returned value go through the same lax validation:
    # ISO text becomes a datetime, base64 text bytes, a dict the model.
    return Typed(tp, run, run)


def decoder_for(tp: Any, what: str = "value") -> Decoder:
    """A function turning JSON data into ``tp`` (:func:`identity` for plain
    JSON types, and for ``None`` or ``Any``).

    The decoder raises :class:`Misfit`, a :class:`SchemaValidationError` with
    pydantic's errors as ``details``, for data that does not fit. A run's
    stored output decodes with ``decoder_for(definition.output_type)``.
    """
    return typed_for(tp, what).decode


def _misfit(what: str, tp: Any, exc: Exception) -> Misfit:
    name = getattr(tp, "__name__", None) or repr(tp)
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return Misfit(f"{what} does not fit the declared type {name}: {exc}")
    found: list[dict[str, Any]] = errors(include_url=False, include_context=False)
    for error in found:
        error["loc"] = list(error.get("loc", ()))[1:]  # our 1-tuple wrapper's index
        error.pop("input", None)  # may hold what no store keeps; the value is in the run
    problems = "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'value'}: {e.get('msg', '')}" for e in found
    )
    try:
        details: Any = codec.to_jsonable(found)
    except Exception:
        details = None
    return Misfit(f"{what} does not fit the declared type {name}: {problems}", details)


def _have_pydantic() -> bool:
    try:
        import pydantic  # noqa: F401
    except ImportError:
        return False
    return True


_BYTES_AS_BASE64: dict[str, Any] = {"val_json_bytes": "base64", "ser_json_bytes": "base64"}


@functools.lru_cache(maxsize=1024)
def _cached_adapter(tp: Any) -> Any:
    try:
        import pydantic
    except ImportError:
        name = getattr(tp, "__name__", None) or repr(tp)
        raise MissingPydantic(
            f"the declared type {name} needs pydantic to be decoded: "
            "pip install 'durably[pydantic]' (plain JSON types need nothing)"
        ) from None
    # Wrapped in a 1-tuple so the config applies to a bare dataclass or
    # TypedDict too (pydantic refuses config on those at the top level): our
    # codec writes bytes as base64, and they must read back as such.
    return pydantic.TypeAdapter(
        tuple[tp],
        config=pydantic.ConfigDict(**_BYTES_AS_BASE64),  # type: ignore[typeddict-item]
    )


def clear_caches() -> None:
    """Forget every cached adapter and annotation (tests that hide pydantic)."""
    _cached_adapter.cache_clear()
    _cached_typed.cache_clear()
    _ANNOTATED.clear()


def _adapter(tp: Any) -> Any:
    try:
        return _cached_adapter(tp)
    except TypeError as exc:
        if isinstance(exc, MissingPydantic) or "unhashable" not in str(exc):
            raise
    return _cached_adapter.__wrapped__(tp)
