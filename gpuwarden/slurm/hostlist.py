"""Slurm hostlist expressions (``c[1-4,7]``, ``gpu[01-16]-ib``): expand and compress. Pure."""

from __future__ import annotations

import re
from collections.abc import Iterable

_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_MAX_EXPAND = 1_000_000


class HostlistError(ValueError):
    pass


def _split_top(expr: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise HostlistError(f"unbalanced '[' in hostlist {expr!r}")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(body: str, expr: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise HostlistError(f"bad range {item!r} in hostlist {expr!r}")
        lo_s, hi_s = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise HostlistError(f"range {item!r} goes backwards in hostlist {expr!r}")
        if hi - lo >= _MAX_EXPAND:
            raise HostlistError(f"range {item!r} is too large in hostlist {expr!r}")
        width = len(lo_s) if lo_s.startswith("0") else 0
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def _expand_one(part: str) -> list[str]:
    m = _BRACKET.search(part)
    if not m:
        return [part]
    head, tail = part[: m.start()], part[m.end() :]
    return [head + n + rest for n in _expand_ranges(m.group(1), part) for rest in _expand_one(tail)]


def expand(expr: str) -> list[str]:
    """``c[1-3],d`` -> ``['c1', 'c2', 'c3', 'd']`` (order kept, duplicates kept)."""
    names: list[str] = []
    for part in _split_top(expr):
        names.extend(_expand_one(part))
        if len(names) > _MAX_EXPAND:
            raise HostlistError(f"hostlist {expr!r} expands to too many names")
    return names


_TAIL_NUM = re.compile(r"^(.*?)(\d+)$")


def compress(names: Iterable[str]) -> str:
    """``['c1','c2','c3','c7']`` -> ``c[1-3,7]``; names keep their first-seen prefix order."""
    unique = list(dict.fromkeys(names))
    # Zero-padded names fix their group's width; an unpadded number of that width joins it.
    padded: dict[str, set[int]] = {}
    for name in unique:
        m = _TAIL_NUM.match(name)
        if m and m.group(2).startswith("0") and len(m.group(2)) > 1:
            padded.setdefault(m.group(1), set()).add(len(m.group(2)))
    groups: dict[tuple[str, int], list[int]] = {}
    order: list[tuple[str, int] | str] = []
    for name in unique:
        m = _TAIL_NUM.match(name)
        if not m:
            order.append(name)
            continue
        digits = m.group(2)
        width = len(digits) if len(digits) in padded.get(m.group(1), ()) else 0
        key = (m.group(1), width)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(digits))
    out: list[str] = []
    for item in order:
        if isinstance(item, str):
            out.append(item)
            continue
        prefix, width = item
        key = item
        nums = sorted(set(groups[key]))
        if len(nums) == 1:
            out.append(f"{prefix}{str(nums[0]).zfill(width)}")
            continue
        ranges: list[str] = []
        start = prev = nums[0]
        for n in [*nums[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            lo, hi = str(start).zfill(width), str(prev).zfill(width)
            ranges.append(lo if start == prev else f"{lo}-{hi}")
            if n is not None:
                start = prev = n
        out.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(out)
