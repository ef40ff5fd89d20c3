"""`gpuwarden config set KEY=VALUE`: change keys of the configuration file in place.

`config show` writes every table, so a table pasted below it (`[health]` again) is refused by
TOML ("Cannot declare ('health',) twice"). This edits the key's own line instead, or adds the
line to its table, and leaves every other line (comments included) as it was. Pure: text in,
text out. The result is checked twice before anyone writes it: parsed, it must equal the old
file with only these keys changed (an edit this module cannot make in place is refused, never
guessed), and it must load as a valid configuration.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import tomllib
import typing
from dataclasses import dataclass
from typing import Any

from gpuwarden.config import Config, parse, toml_value
from gpuwarden.core.errors import ConfigError

_PART = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HEADER = re.compile(r"^\s*\[\s*([A-Za-z0-9_.\s-]+?)\s*\]\s*(#.*)?$")
_KEYLINE = re.compile(r"^(\s*)([A-Za-z0-9_.\s-]+?)\s*=")
MAX_VALUE_CHARS = 4096


@dataclass(frozen=True)
class Change:
    path: tuple[str, ...]
    before: Any  # None when the file did not set it
    after: Any

    @property
    def key(self) -> str:
        return ".".join(self.path)


def assignment(arg: str) -> tuple[tuple[str, ...], Any]:
    """``health.gpu_probe=fake`` -> (("health", "gpu_probe"), "fake"). The value is read as the
    key's type asks: a string as written (or a quoted TOML string), anything else as a TOML
    value (``3``, ``true``, ``["a", "b"]``, ``{gpu_count = 4}``)."""
    key, sep, raw = arg.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"{arg!r}: expected KEY=VALUE, e.g. health.gpu_probe=fake")
    path = tuple(key.split("."))
    bad = [p for p in path if not _PART.match(p)]
    if bad:
        raise ValueError(f"{key}: each part of a key is letters, digits, _ or - "
                         "(e.g. health.expected.gpu_count)")
    if len(path) < 2:
        raise ValueError(f"{key}: name a key inside the table, e.g. {key}.KEY=VALUE "
                         "(`gpuwarden config show` lists them)")
    if len(raw) > MAX_VALUE_CHARS:
        raise ValueError(f"{key}: the value is longer than {MAX_VALUE_CHARS} characters")
    return path, _value(path, raw)


def _value(path: tuple[str, ...], raw: str) -> Any:
    parsed = _toml(raw)
    wanted = _leaf_type(path)
    if wanted is str or (wanted is None and parsed is None):
        # A key the schema lacks is left to the check, which names the keys it knows.
        return parsed if isinstance(parsed, str) else raw
    if parsed is None:
        syntax = {"a list": ' (TOML: ["a", "b"])', "a table": " (TOML: {key = 1})"}
        what = _describe(wanted)
        raise ValueError(f"{'.'.join(path)}: expected {what}, got {raw!r}{syntax.get(what, '')}")
    return parsed


def _toml(raw: str) -> Any:
    """``raw`` as one TOML value, or None."""
    try:
        doc = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        return None
    return doc["v"] if list(doc) == ["v"] else None


def _leaf_type(path: tuple[str, ...]) -> Any:
    """The declared type of the key at ``path``, or None when the schema has no such key."""
    tp: Any = Config
    for part in path:
        if dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp).get(part)
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return None
        if tp is None:
            return None
    return tp


def _describe(tp: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number"}
    return names.get(tp, "a list" if typing.get_origin(tp) is tuple else "a table")


def apply(text: str, source: str, sets: list[tuple[tuple[str, ...], Any]]
          ) -> tuple[str, list[Change]]:
    """``text`` with each key set, and what changed. ConfigError (naming ``source``) when the
    file is not TOML, a key cannot be edited in place, or the result is not a valid config."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"not valid TOML ({exc}): fix it by hand first "
                          "(`gpuwarden config check` names the line)") from None
    changes: list[Change] = []
    for path, value in sets:
        want = copy.deepcopy(doc)
        before = _put(want, path, value, source)
        text = _edit(text.splitlines(), path, want)
        try:
            got = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            got = None
        if got != want:
            raise ConfigError(source, ".".join(path), "cannot be set in place: the file "
                              "writes it in a form `config set` does not edit (a multi-line "
                              "value, a quoted key, an array of tables); edit that line by "
                              "hand")
        doc = want
        changes.append(Change(path, before, value))
    parse(text, source)  # the whole file, as every command will load it
    return text, changes


def _put(doc: dict[str, Any], path: tuple[str, ...], value: Any, source: str) -> Any:
    node = doc
    for i, part in enumerate(path[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(source, ".".join(path[:i + 1]), "is a value, not a table: "
                              f"{'.'.join(path)} cannot be set in it")
        node = nxt
    before = node.get(path[-1])
    node[path[-1]] = value
    return before


def _get(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = doc
    for part in path:
        node = node[part]
    return node


def _edit(lines: list[str], path: tuple[str, ...], want: dict[str, Any]) -> str:
    """Set ``path`` on its own line: the line of the key (or of the inline table holding it)
    in its table is rewritten; else a line is added at the end of the nearest table; else the
    table is appended. Which of these fits is for apply's check to confirm."""
    headers = [(i, _dotted(m.group(1))) for i, line in enumerate(lines)
               if (m := _HEADER.match(line)) and not line.lstrip().startswith("[[")]

    def block(table: tuple[str, ...]) -> tuple[int, int] | None:
        for n, (i, name) in enumerate(headers):
            if name == table:
                end = headers[n + 1][0] if n + 1 < len(headers) else len(lines)
                return i + 1, end
        return None

    for k in range(len(path) - 1, 0, -1):
        rng = block(path[:k])
        for j in range(*rng) if rng else ():
            m = _KEYLINE.match(lines[j])
            key = _dotted(m.group(2)) if m else ()
            if key and path[k:k + len(key)] == key:
                full = path[:k + len(key)]
                lines[j] = (f"{m.group(1) if m else ''}{'.'.join(key)} = "
                            f"{toml_value(_get(want, full))}{_comment(lines[j])}")
                return "\n".join(lines) + "\n"
    line = ""
    for k in range(len(path) - 1, 0, -1):
        rng = block(path[:k])
        if rng:
            line = f"{'.'.join(path[k:])} = {toml_value(_get(want, path))}"
            at = rng[1]
            while at > rng[0] and not lines[at - 1].strip():
                at -= 1
            lines.insert(at, line)
            return "\n".join(lines) + "\n"
    tail = ["", f"[{path[0]}]", f"{'.'.join(path[1:])} = {toml_value(_get(want, path))}"]
    return "\n".join([*lines, *tail]) + "\n"


def _dotted(name: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in name.split("."))


def _comment(line: str) -> str:
    """A trailing ``  # ...`` of a key line, kept when the line is rewritten."""
    for m in re.finditer("#", line):
        try:
            tomllib.loads(line[:m.start()])
        except tomllib.TOMLDecodeError:
            continue
        return "  " + line[m.start():].strip()
    return ""
