"""A NumPy dtype as text for the manifest, and back, exactly. Pure.

A plain dtype is its ``dtype.str`` (``<f4``, ``>i8``, ``|S3``, ``<M8[s]``, ``|V3``). A structured
one is compact JSON: ``{"aligned": bool, "fields": [[name, title or null, offset, dtype], ...],
"itemsize": n}``, where each field's dtype is again a string, a structured object, or
``{"shape": [...], "subarray": dtype}``. Field names, titles, offsets, padding and alignment all
survive, which ``dtype.str`` (``|V12``) does not keep.

``parse`` accepts only what ``describe`` writes (the canonical text of the dtype it builds must be
the text it was given) and never a dtype holding Python objects: a manifest cannot make a
restore build anything else.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from gpuwarden.core import safejson

MAX_TEXT = 64 << 10
MAX_DEPTH = 16
MAX_NDIM = 64


class DtypeError(ValueError):
    """A dtype that a checkpoint cannot carry, or text that is not one."""


def describe(dt: np.dtype[Any]) -> str:
    if dt.fields is None and dt.subdtype is None:
        return dt.str
    return json.dumps(_desc(dt), sort_keys=True, separators=(",", ":"))


def _desc(dt: np.dtype[Any]) -> Any:
    if dt.subdtype is not None:
        base, shape = dt.subdtype
        return {"shape": list(shape), "subarray": _desc(base)}
    if dt.names is None or dt.fields is None:
        return dt.str
    fields = []
    for name in dt.names:
        spec = dt.fields[name]
        fields.append([name, spec[2] if len(spec) > 2 else None, int(spec[1]), _desc(spec[0])])
    return {"aligned": bool(dt.isalignedstruct), "fields": fields, "itemsize": dt.itemsize}


def parse(text: str) -> np.dtype[Any]:
    """The dtype ``describe`` wrote as ``text``; DtypeError says why not."""
    if not isinstance(text, str) or not text or len(text) > MAX_TEXT:
        raise DtypeError("expected a dtype's text")
    if text.startswith("{"):
        try:
            # Each level of a dtype is at most 3 of JSON's ([name, title, offset, dtype]).
            doc = safejson.loads(text, max_bytes=MAX_TEXT, max_depth=3 * MAX_DEPTH + 3)
            dt = _build(doc, 0)
        except (ValueError, RecursionError) as exc:
            raise DtypeError(f"not a structured dtype ({str(exc)[:120]})") from None
    else:
        dt = _simple(text)
    if dt.hasobject:
        raise DtypeError(f"{text[:40]!r} holds Python objects: never restored")
    if dt.subdtype is not None:
        raise DtypeError(f"{text[:40]!r}: a sub-array dtype belongs in the shape")
    if describe(dt) != text:
        raise DtypeError(f"{text[:40]!r} is not the canonical form of {dt} "
                         f"({describe(dt)[:40]!r})")
    return dt


def _simple(text: str) -> np.dtype[Any]:
    try:
        dt = np.dtype(text)
    except (TypeError, ValueError, SyntaxError) as exc:
        raise DtypeError(f"{text[:40]!r} is not a dtype ({str(exc)[:80]})") from None
    if dt.fields is not None or dt.subdtype is not None or dt.str != text:
        raise DtypeError(f"{text[:40]!r} is not the canonical form of a plain dtype")
    return dt


def _build(doc: Any, depth: int) -> np.dtype[Any]:
    if depth > MAX_DEPTH:
        raise DtypeError(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(doc, str):
        return _simple(doc)
    if isinstance(doc, dict) and set(doc) == {"shape", "subarray"}:
        shape = doc["shape"]
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
                and all(_count(x) for x in shape)):
            raise DtypeError("a sub-array's shape: expected a list of integers >= 0")
        return _numpy((_build(doc["subarray"], depth + 1), tuple(shape)))
    if isinstance(doc, dict) and set(doc) == {"aligned", "fields", "itemsize"}:
        fields, itemsize, aligned = doc["fields"], doc["itemsize"], doc["aligned"]
        if not (isinstance(fields, list) and _count(itemsize) and isinstance(aligned, bool)):
            raise DtypeError("a structured dtype: expected fields, itemsize and aligned")
        names, titles, offsets, formats = [], [], [], []
        for f in fields:
            if not (isinstance(f, list) and len(f) == 4 and isinstance(f[0], str)
                    and (f[1] is None or isinstance(f[1], str)) and _count(f[2])):
                raise DtypeError("a field: expected [name, title or null, offset, dtype]")
            names.append(f[0])
            titles.append(f[1])
            offsets.append(f[2])
            formats.append(_build(f[3], depth + 1))
        spec = {"names": names, "formats": formats, "offsets": offsets, "itemsize": itemsize}
        if any(t is not None for t in titles):
            spec["titles"] = titles
        return _numpy(spec, align=aligned)
    raise DtypeError("expected a dtype string, a structured dtype or a sub-array")


def _numpy(spec: Any, align: bool = False) -> np.dtype[Any]:
    try:
        dt: np.dtype[Any] = np.dtype(spec, align=align)
    except (TypeError, ValueError, KeyError) as exc:
        raise DtypeError(f"numpy refused it ({str(exc)[:120]})") from None
    return dt


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62
