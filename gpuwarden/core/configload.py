"""Generic, strict loading of TOML tables into frozen dataclasses.

Pure: turns a parsed mapping into typed records, or a ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class FieldError(ValueError):
    """Raised by a dataclass's __post_init__ to reject one field's value."""

    def __init__(self, key: str, expected: str) -> None:
        self.key = key
        self.expected = expected
        super().__init__(f"{key}: {expected}")


def require(ok: bool, key: str, expected: str) -> None:
    if not ok:
        raise FieldError(key, expected)


class LoadError(ValueError):
    def __init__(self, key: str, expected: str) -> None:
        self.key = key
        self.expected = expected
        super().__init__(f"{key}: {expected}")


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        (inner, _ellipsis) = typing.get_args(tp)
        return f"a list of {_describe(inner)}"
    if dataclasses.is_dataclass(tp):
        return "a table"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is tuple:
        (inner, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list):
            raise LoadError(key, f"expected {_describe(tp)}, got {type(value).__name__}")
        return tuple(_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_tp, inner = typing.get_args(tp)
        if key_tp is not str or not isinstance(value, Mapping):
            raise LoadError(key, f"expected a table of {_describe(inner)}")
        return {k: _convert(v, inner, f"{key}.{k}") for k, v in value.items()}
    if origin in (types.UnionType, typing.Union):
        raise TypeError(f"unions are not supported in config fields ({key})")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise LoadError(key, f"expected a table, got {type(value).__name__}")
        return build(tp, value, prefix=f"{key}.")  # type: ignore[arg-type]
    # bool is a subclass of int: refuse `retries = true`.
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    else:
        raise TypeError(f"unsupported config field type {tp!r} ({key})")
    if not ok:
        raise LoadError(key, f"expected {_describe(tp)}, got {value!r}")
    return value


def build(cls: type[T], table: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``table``; unknown keys and wrong types are errors."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(table) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        raise LoadError(prefix + unknown[0], f"unknown key (known keys here: {known})")
    kwargs = {name: _convert(table[name], hints[name], prefix + name) for name in table}
    try:
        return cls(**kwargs)
    except FieldError as exc:
        raise LoadError(prefix + exc.key, exc.expected) from None


def to_dict(obj: Any) -> dict[str, Any]:
    """The inverse of build, for `config show`: tuples become lists."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = [to_dict(v) if dataclasses.is_dataclass(v) else v for v in value]
        elif isinstance(value, dict):
            out[f.name] = {k: to_dict(v) if dataclasses.is_dataclass(v) else v
                           for k, v in value.items()}
        else:
            out[f.name] = value
    return out
