"""A node list's names as ranges of numbers, where it has the shape Slurm prints for runs (one
name, or one bracket of ranges with a plain head and tail): what lets a tally add
``n[0100-0163]`` at once instead of name by name (`gpuwarden.accounting.rangetally`). Pure.
"""

from __future__ import annotations

import re
import sys
from functools import lru_cache

from gpuwarden.slurm.hostlist import _MAX_EXPAND

# One name, or one bracket of ranges with a plain head and tail: what Slurm prints for runs.
_ONE = re.compile(r"[A-Za-z0-9._\-]+")
_BRACKETED = re.compile(r"([A-Za-z0-9._\-]*)\[([0-9,\-]+)\]([A-Za-z0-9._\-]*)")

Key = tuple[str, int, str]  # head, zero-padded width (0: none), tail
Range = tuple[Key, int, int]  # key, first, last


def ranges(text: str) -> tuple[Range, ...] | None:
    """``text``'s names as ranges, exactly as `hostlist.expand` would name them; None when
    this shape is not handled here (or is an error, which `expand` reports)."""
    if _ONE.fullmatch(text):
        return (((text, -1, ""), 0, 0),)  # width -1: the name itself, no number
    m = _BRACKETED.fullmatch(text)
    if not m:
        return None
    head, body, tail = m.groups()
    out: list[Range] = []
    for item in body.split(","):
        lo_s, dash, hi_s = item.partition("-")
        if not lo_s.isdigit() or (dash and not hi_s.isdigit()):
            return None
        lo, hi = int(lo_s), int(hi_s or lo_s)
        if hi < lo or hi - lo >= _MAX_EXPAND:
            return None
        out.append(((head, len(lo_s) if lo_s.startswith("0") else 0, tail), lo, hi))
    return tuple(out)


@lru_cache(maxsize=1 << 17)  # a day of a 12,500-node fleet has ~100k distinct node lists
def shape(text: str) -> tuple[tuple[Range, ...], int] | None:
    """`ranges` and how many names they hold."""
    rs = ranges(text)
    return None if rs is None else (rs, sum(hi - lo + 1 for _, lo, hi in rs))


def name(key: Key, i: int) -> str:
    """The name numbered ``i`` in ``key``'s range (the head itself where it has no number:
    width -1), as `hostlist.expand` writes it."""
    head, width, tail = key
    return head if width < 0 else f"{head}{str(i).zfill(width)}{tail}"


def names(rs: tuple[Range, ...]) -> tuple[str, ...]:
    """Every name of ``rs``, in order: `name` for each, by one format per range (a head and
    tail never hold a brace: `_BRACKETED`). Interned: the lists of a fleet's runs name the
    same few thousand nodes over and over (a year's 58k failed lists, 0.8M names)."""
    out: list[str] = []
    for (head, width, tail), lo, hi in rs:
        if width < 0:
            out.append(sys.intern(head))
        else:
            out.extend(map(sys.intern,
                           map(f"{head}{{:0{width}d}}{tail}".format, range(lo, hi + 1))))
    return tuple(out)


@lru_cache(maxsize=1 << 17)
def expanded(text: str) -> tuple[str, ...] | None:
    """``text``'s names in `hostlist.expand`'s order where `shape` reads it and `expand` would
    name them (not too many); None otherwise. One cache for every reader of a run's list: the
    judging of failed runs and the report's tally each named the same lists (46k at 10M)."""
    known = shape(text)
    return None if known is None or known[1] > _MAX_EXPAND else names(known[0])
