"""JSON that someone else wrote (a user's manifest, restore record, coordination file, peer
message or heartbeat), decoded into plain values or refused with one `JsonError` that names
what is wrong. Pure; the standard library only (the prolog and the launcher import it).

Python's `json.loads` alone takes, or raises past a reader's ``except JSONDecodeError``:

* an integer of more than 4,300 digits (a plain ValueError: Python's int-digit limit), and
  ones that parse but overflow wherever they are used later (a size, an offset, a step);
* nesting deep enough for a RecursionError;
* NaN and Infinity (not JSON), and numbers such as 1e999 that become infinity;
* a key given twice (the last one silently wins: two readers may see two documents);
* bytes that are not UTF-8 (it also guesses UTF-16 and UTF-32), and lone surrogates
  (``"\\ud800"``), which become text that cannot be encoded again;
* any size at all.

`loads` refuses every one of these, so a reader maps one exception to its own verdict
(corrupt, refused, skipped) and never sees another. Values are only as trustworthy as their
types: each reader still checks every field it uses.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
# Every integer fits a signed 64-bit: sizes, offsets and steps stay numbers that the OS,
# numpy and struct can take, and never so many digits that printing one fails.
MAX_INT = (1 << 63) - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # where json.loads may make one
_SHOWN = 40


class JsonError(ValueError):
    """Data that is not JSON we accept: the message ("not JSON: ..." for broken syntax, "not
    JSON we accept: <where>: ..." for the rest) says what is wrong and where, in one short
    line that never repeats the whole input."""


class _Bad:
    """What the parser's hooks leave in place of a value refused (a number out of range, an
    object with a key twice): `_search` then names where it sits."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def _refused(reason: str, where: tuple[Any, ...] | None = None) -> JsonError:
    at = _where(where) if where else ""
    return JsonError(f"not JSON we accept: {at + ': ' if at else ''}{reason}")


def _shown(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


def _where(link: tuple[Any, ...]) -> str:
    """``shards[0].size`` from a chain of (parent link, key or index) pairs."""
    parts: list[str] = []
    while link:
        link, key = link
        parts.append(f"[{key}]" if isinstance(key, int)
                     else f".{key}" if _KEY.fullmatch(key) else f"[{_shown(key)}]")
    text = "".join(reversed(parts)).removeprefix(".")
    return text if len(text) <= 120 else "..." + text[-117:]


def loads(data: bytes | bytearray | memoryview | str, *, max_bytes: int = MAX_BYTES,
          max_depth: int = MAX_DEPTH, max_int: int = MAX_INT,
          lone_surrogates: bool = False) -> Any:
    """The value ``data`` holds (UTF-8 JSON, at most ``max_bytes``: characters for a str),
    or JsonError: nested more than ``max_depth`` arrays and objects, an integer beyond
    ``±max_int``, a number that is not finite, a key given twice, or text that is not UTF-8
    or holds a lone surrogate. ``lone_surrogates``: the escapes (``"\\udc80"``) are taken,
    for a document of Python strings that may hold them (a file name decoded with
    surrogateescape) and that its reader never encodes again."""
    if isinstance(data, str):
        if len(data) > max_bytes:
            raise _refused(f"{len(data)} characters, more than {max_bytes}")
        text = data
    else:
        raw = bytes(data)
        if len(raw) > max_bytes:
            raise _refused(f"{len(raw)} bytes, more than {max_bytes}")
        try:
            text = raw.decode("utf-8")  # strict: refuses encoded surrogates too
        except UnicodeDecodeError as exc:
            raise _refused(f"not UTF-8 (byte {exc.start}: {exc.reason})") from None
    bad = None if lone_surrogates else _SURROGATE.search(text)
    if bad:
        raise _refused(f"a lone surrogate (U+{ord(bad.group()):04X}) at character "
                       f"{bad.start()}: not text")
    digits = len(str(max_int))
    # The hooks never raise (the parser cannot say where): they leave a _Bad, and `_bad`
    # then finds it and says where it is. ``found`` spares clean documents that search.
    found: list[_Bad] = []

    def refuse(why: str) -> _Bad:
        found.append(_Bad(why))
        return found[-1]

    def parse_int(literal: str) -> int | _Bad:
        # Checked before int(): a 5,000-digit literal never reaches Python's digit limit.
        n = len(literal.lstrip("-"))
        if n > digits or abs(value := int(literal)) > max_int:
            return refuse(f"the integer {_shown(literal)} ({n} digits) is out of range (at "
                          f"most {max_int} in magnitude)")
        return value

    def parse_float(literal: str) -> float | _Bad:
        value = float(literal)
        if not math.isfinite(value):
            return refuse(f"the number {_shown(literal)} is out of range (not finite)")
        return value

    def parse_constant(name: str) -> _Bad:
        return refuse(f"{name} is not a JSON number")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any] | _Bad:
        out = dict(items)
        if len(out) == len(items):
            return out
        seen: set[str] = set()
        for k, _ in items:
            if k in seen:
                return refuse(f"the key {_shown(k)} is given twice")
            seen.add(k)
        return out  # not reached: fewer keys than pairs means one came twice

    try:
        doc = json.loads(text, parse_int=parse_int, parse_float=parse_float,
                         parse_constant=parse_constant, object_pairs_hook=pairs)
    except json.JSONDecodeError as exc:
        raise JsonError(f"not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise _refused(f"nested more than {max_depth} deep") from None
    except ValueError as exc:  # none known: said as what it is, never raised past the caller
        raise JsonError(f"not JSON: {str(exc)[:80]}") from None
    if _too_deep(doc, max_depth):
        raise _refused(f"nested more than {max_depth} deep")
    # A string holds a lone surrogate only where the text has one's escape (raw ones were
    # refused above): most documents skip the search.
    strings = not lone_surrogates and _ESCAPE.search(text) is not None
    if found or strings:
        _search(doc, strings)
    return doc


def _too_deep(doc: Any, max_depth: int) -> bool:
    """Whether arrays and objects nest more than ``max_depth`` deep; level by level, over the
    containers only (a deep document must not make the check itself recurse)."""
    level = [doc] if isinstance(doc, (dict, list)) else []
    for _ in range(max_depth):
        below = []
        for node in level:
            for v in node.values() if isinstance(node, dict) else node:
                if isinstance(v, (dict, list)):
                    below.append(v)
        if not below:
            return False
        level = below
    return bool(level)


def _search(doc: Any, strings: bool) -> None:
    """Raise for the first value the hooks refused, or (``strings``) string holding a lone
    surrogate, naming where it is. Iterative; the depth was checked first."""
    todo: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    while todo:
        value, at = todo.pop()
        if isinstance(value, _Bad):
            raise _refused(value.why, at)
        if isinstance(value, str):
            bad = _SURROGATE.search(value) if strings else None
            if bad:
                raise _refused(f"a lone surrogate (U+{ord(bad.group()):04X}) in "
                               f"{_shown(value)}: not text", at)
        elif isinstance(value, dict):
            for k, v in value.items():
                todo.append((k, at))
                todo.append((v, (at, k)))
        elif isinstance(value, list):
            todo.extend((v, (at, i)) for i, v in enumerate(value))
