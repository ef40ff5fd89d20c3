"""Which data_parser plugin wrote a Slurm JSON document, and what its schema holds.

Slurm's CLIs print JSON through a versioned data_parser plugin (v0.0.40 in 23.11 ...
v0.0.45 in 26.05), named in the document's ``meta``. The parsers read every version; this
module names the version in their errors and lists, per version, the fields gpuwarden reads.
Slurm dumps every field of a parser table, so in a document that names its version a field
missing from that list means the schema changed under us: an error, never a silent default.
The lists follow `src/plugins/data_parser/v0.0.NN/parsers.c` at each release
(tests/fixtures/slurm_versions/README.md).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

from gpuwarden.core.errors import SlurmParseError

# Raw placeholders Slurm prints for "unset" in plain (unwrapped) numbers: NO_VAL and INFINITE
# (32-bit, always printed raw), NO_VAL64 and INFINITE64 (null up to v0.0.42, raw from v0.0.43).
# No field gpuwarden reads has a real value this large (a time would be past 2106), so one
# comparison tells them all.
PLACEHOLDER = 0xFFFFFFFE

_VERSION = re.compile(r"v0\.0\.(\d+)")
# A release's default plugin, for a meta without plugin.data_parser (the default can be
# changed with DataParserParameters, so the plugin's own name wins whenever it is there).
_DEFAULT = {(23, 11): 40, (24, 5): 41, (24, 11): 42, (25, 5): 43, (25, 11): 44, (26, 5): 45,
            (26, 11): 46}
# First release whose meta.command keeps argv's last element (commit fbb587094b).
_FULL_COMMAND = (26, 5, 2)


def _meta(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = doc.get("meta", doc)  # a whole document, or its meta
    return meta if isinstance(meta, Mapping) else {}


def _release(meta: Mapping[str, Any]) -> tuple[int, int, int] | None:
    slurm = meta.get("slurm")
    if not isinstance(slurm, Mapping):
        return None
    ver = slurm.get("version")
    if isinstance(ver, Mapping):
        try:
            return int(ver["major"]), int(ver["minor"]), int(ver["micro"])
        except (KeyError, TypeError, ValueError):
            pass
    rel = slurm.get("release")
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", rel) if isinstance(rel, str) else None
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def version(doc: Mapping[str, Any]) -> str | None:
    """"v0.0.NN" from a document (or its ``meta``): ``plugin.data_parser`` ("data_parser/
    v0.0.42+complex", or in 23.11/24.05 the raw --json argument "v0.0.40"), else the default
    plugin of ``slurm.version``'s release; None when neither says."""
    meta = _meta(doc)
    plugin = meta.get("plugin")
    name = plugin.get("data_parser") if isinstance(plugin, Mapping) else None
    m = _VERSION.search(name) if isinstance(name, str) else None
    if m:
        return f"v0.0.{int(m[1])}"
    rel = _release(meta)
    if rel is not None and rel[:2] in _DEFAULT:
        return f"v0.0.{_DEFAULT[rel[:2]]}"
    return None


def number(ver: str | None) -> int | None:
    """40 for "v0.0.40"."""
    m = _VERSION.fullmatch(ver) if ver else None
    return int(m[1]) if m else None


def command_complete(doc: Mapping[str, Any]) -> bool | None:
    """Whether ``meta.command`` holds the whole argv: before 26.05.2 Slurm dropped its last
    element. None when the meta does not say which release wrote it."""
    rel = _release(_meta(doc))
    return None if rel is None else rel >= _FULL_COMMAND


@dataclass(frozen=True)
class Source:
    """Where parsed values come from: the command (for messages) and the data_parser version
    the document names. Fields are checked against the version's schema only when it is
    known: a hand-made document without ``meta`` is read leniently, as before."""

    what: str
    version: str | None = None

    @property
    def strict(self) -> bool:
        return self.version is not None

    def error(self, detail: str) -> SlurmParseError:
        tag = f" (data_parser {self.version})" if self.version else ""
        return SlurmParseError(f"{self.what}{tag}: {detail}")


def source(what: str, doc: Mapping[str, Any]) -> Source:
    return Source(what, version(doc))


@dataclass(frozen=True)
class Spec:
    """Keys an object must hold, and the objects nested under some of them."""

    keys: tuple[str, ...]
    nested: tuple[tuple[str, Spec], ...]
    all: frozenset[str]


Tree = Mapping[str, Union["Tree", None]]


def spec(tree: Tree) -> Spec:
    return Spec(tuple(tree), tuple((k, spec(v)) for k, v in tree.items() if v is not None),
                frozenset(tree))


def check(item: Mapping[str, Any], need: Spec, path: Callable[[], str], src: Source) -> None:
    """Raise naming the first key of ``need`` that ``item`` lacks; ``path()`` says where the
    item sits in the document (called only then). When nothing is missing this costs a few
    C-level set comparisons: it runs for every record."""
    if not _holds(item, need):
        _explain(item, need, path(), src)


def _holds(item: Mapping[str, Any], need: Spec) -> bool:
    if not item.keys() >= need.all:
        return False
    for key, sub in need.nested:
        value = item[key]
        if not isinstance(value, Mapping) or not _holds(value, sub):
            return False
    return True


def _explain(item: Mapping[str, Any], need: Spec, path: str, src: Source) -> None:
    keys = item.keys()
    for key in need.keys:
        if key not in keys:
            raise src.error(f"{path}.{key} missing")
    for key, sub in need.nested:
        value = item[key]
        if not isinstance(value, Mapping):
            raise src.error(f"{path}.{key}: expected an object, found {json_type(value)}")
        _explain(value, sub, f"{path}.{key}", src)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {str: "a string", bool: "a boolean", int: "a number", float: "a number",
            list: "a list"}.get(type(value), type(value).__name__)


# What gpuwarden reads, per command, as each version dumps it (research tables: JOB, NODE,
# SINFO_DATA, JOB_INFO, PARTITION_INFO).
_SACCT: dict[str, Any] = {
    "job_id": None, "name": None, "user": None, "state": {"current": None, "reason": None},
    # Not tres: only GPU counts come from it (0 without it), and an export trimmed to what the
    # lemon scan reads may leave it out.
    "partition": None, "nodes": None, "allocation_nodes": None,
    "exit_code": {"return_code": None, "signal": {"id": None}},
    "time": {"submission": None, "start": None, "end": None},
    "failed_node": None, "submit_line": None,
}
_NODE: dict[str, Any] = dict.fromkeys((
    "name", "state", "reason", "reason_set_by_user", "reason_changed_at", "partitions", "gres",
    "features", "boot_time", "comment", "extra"))
_SINFO: dict[str, Any] = {
    "nodes": {"nodes": None}, "partition": None, "node": {"state": None},
    "reason": {"description": None, "time": None, "user": None}, "gres": {"total": None},
    "features": {"total": None}, "comment": None, "extra": None,
}
_JOB: dict[str, Any] = {
    "job_id": None, "name": None, "user_name": None, "job_state": None, "state_reason": None,
    "partition": None, "nodes": None, "node_count": None, "restart_cnt": None,
    "exit_code": {"return_code": None}, "admin_comment": None, "comment": None,
    "end_time": None,
    # The placement daemon relaxes a requeued gang job's switch wait (placement/requeue.py).
    "required_switches": None, "maximum_switch_wait_time": None,
}

SACCT_V40 = spec(_SACCT)
SACCT_V42 = spec({**_SACCT, "restart_cnt": None})  # restart_cnt is new in v0.0.42
NODE = spec(_NODE)
SINFO_V40 = spec(_SINFO)
# v0.0.45 moved reason.user to the entry's own reason_set_by_user.
SINFO_V45 = spec({**_SINFO, "reason": {"description": None, "time": None},
                  "reason_set_by_user": None})
JOB = spec(_JOB)


@functools.cache
def sacct_spec(ver: str | None) -> Spec:
    return SACCT_V42 if (number(ver) or 0) >= 42 else SACCT_V40


@functools.cache
def sinfo_spec(ver: str | None) -> Spec:
    return SINFO_V45 if (number(ver) or 0) >= 45 else SINFO_V40
