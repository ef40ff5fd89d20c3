"""Where the objects of a JSON array begin and end, found without decoding them.

A cut between two records of `sacct --json` cannot be found by looking for "},{": compact
output has that inside every record (the TRES lists), and a string may hold it too. Here
each record is matched whole by one regular expression that skips strings (escapes
included) and balances brackets, so the scan runs in C, once over the text, whatever the
layout. Python's `re` cannot recurse, so the nesting is spelled out to `MAX_DEPTH` levels
(sacct's records nest 5-7): a deeper object is simply not matched, and the caller reads it
the slow way. Possessive quantifiers (Python 3.11+) mean no backtracking: a truncated or
broken object fails after one pass over it, never more.

Opening and closing brackets are not paired by kind ("{" may close with "]"): that keeps
the expression linear in `MAX_DEPTH`. The decoder that reads a span refuses such text, so
a mismatch costs a slower read, never a wrong record.
"""

from __future__ import annotations

import re

MAX_DEPTH = 20

_WS = r"[ \t\n\r]*+"
_STRING = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_OTHER = r'[^"{}\[\]]*+'  # outside strings, anything but brackets: numbers, ":", ",", space


def _body(inner: str) -> str:
    """What lies between an object's or array's brackets, ``inner`` being what may nest in it.
    Written as other (string-or-nested other)*, not (other|string|nested)*: one alternation
    per string or nested value instead of one per token, about 20% faster."""
    return rf"{_OTHER}(?:(?:{_STRING}|{inner}){_OTHER})*+"


def _nested(depth: int) -> str:
    """An object or array nested at most ``depth`` levels."""
    inner = rf"[{{\[]{_OTHER}(?:{_STRING}{_OTHER})*+[}}\]]"
    for _ in range(depth - 1):
        inner = rf"[{{\[]{_body(inner)}[}}\]]"
    return inner


# An object, then the comma that says another element follows.
_ELEMENT = re.compile(rf"{_WS}(\{{{_body(_nested(MAX_DEPTH - 1))}\}}){_WS},", re.DOTALL)


def object_spans(text: str, pos: int) -> tuple[list[tuple[int, int]], int]:
    """The objects of an array from ``pos`` (at an element), each followed by a comma: their
    (start, end) in ``text``, and where the element after the last one begins (``pos`` when
    none was found). Stops before anything else: the array's last element, one that is not
    an object, nests deeper than `MAX_DEPTH`, is not JSON, or is cut off by the end of
    ``text``."""
    spans: list[tuple[int, int]] = []
    match = _ELEMENT.match
    while (m := match(text, pos)) is not None:
        spans.append(m.span(1))
        pos = m.end()
    return spans, pos
