"""Text from the data (partition names, node names, reasons, paths) made safe to write: a lone
surrogate (a JSON escape or an undecodable file name) cannot be encoded as UTF-8, and would
stop the page being written."""

from __future__ import annotations

from typing import Any


def clean(s: str) -> str:
    """``s`` with each lone surrogate replaced by U+FFFD."""
    if s.isascii():
        return s
    return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def cleaned(v: Any) -> Any:
    """Every string in a JSON-ready tree (dicts, lists), cleaned; keys too."""
    if isinstance(v, str):
        return clean(v)
    if isinstance(v, dict):
        return {cleaned(k): cleaned(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [cleaned(x) for x in v]
    return v
