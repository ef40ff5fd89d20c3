"""Pure parsers from Slurm's output (data_parser v0.0.40-45 JSON, sacctmgr -P text) to records.

Every version's shape is read (gpuwarden.slurm.dataparser); where a document names its
version, a field gpuwarden reads that is missing is an error naming the field and version."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from gpuwarden.core.errors import SlurmParseError
from gpuwarden.slurm import dataparser
from gpuwarden.slurm.dataparser import PLACEHOLDER, Source
from gpuwarden.slurm.models import AcctJob, Job, Node, NodeEvent, NodeView

_LENIENT_SACCT = Source("sacct --json")


def load_json(text: str, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmParseError(f"{what}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict):
        raise SlurmParseError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    errors = doc.get("errors") or []
    if errors:
        first = errors[0] if isinstance(errors[0], Mapping) else {}
        desc = first.get("description") or first.get("error") or str(errors[0])
        raise SlurmParseError(f"{what}: Slurm reported an error: {desc}")
    return doc


def _number(value: Any) -> int | None:
    """v0.0.40+ wraps numbers as {"set": bool, "infinite": bool, "number": n}; a plain number
    may be one of Slurm's raw placeholders for unset (v0.0.43+ prints NO_VAL64 times raw)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value < PLACEHOLDER else None
    if isinstance(value, Mapping):
        if not value.get("set", True) or value.get("infinite", False):
            return None
        n = value.get("number")
        return n if isinstance(n, int) and not isinstance(n, bool) else None
    return None


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _strs(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(v for v in value.split(",") if v)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, str))
    return ()


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(doc: Mapping[str, Any], key: str,
          src: Source) -> Iterator[tuple[At, Mapping[str, Any]]]:
    """The objects of the document's ``key`` list, each with where it is (for errors)."""
    items = doc.get(key)
    if not isinstance(items, list):
        raise src.error(f"no '{key}' list in the output")
    return ((At(key, i), item) for i, item in enumerate(items) if isinstance(item, Mapping))


class At:
    """An element's place in the document, "jobs[3]", spelled out only for an error."""

    __slots__ = ("index", "key")

    def __init__(self, key: str, index: int | None = None) -> None:
        self.key = key
        self.index = index

    def __call__(self) -> str:
        return f"{self.key}[{'' if self.index is None else self.index}]"

    def __str__(self) -> str:
        return self()


_AT_NODES, _AT_JOBS = At("nodes"), At("jobs")


def _exit_code(value: Any) -> tuple[int | None, int | None]:
    """(return code, signal) from an exit_code object."""
    if not isinstance(value, Mapping):
        return None, None
    rc = _number(value.get("return_code"))
    sig = value.get("signal")
    signal = _number(sig.get("id")) if isinstance(sig, Mapping) else None
    return rc, signal


# Fields whose misread would change a decision (a drained node read as idle, a reason or a
# health marker read as empty): in a document that names its version, a value of another JSON
# type is an error naming field and version, never a silent default. Slurm prints flag sets
# as lists of strings and these texts as strings in every version v0.0.40-45.
_NODE_TYPES = (("state", list), ("reason", str), ("reason_set_by_user", str), ("extra", str),
               ("comment", str))
_JOB_TYPES = (("job_state", list), ("nodes", str), ("admin_comment", str), ("comment", str))


def _check_types(item: Mapping[str, Any], types: tuple[tuple[str, type], ...], at: At,
                 src: Source) -> None:
    for key, kind in types:
        value = item.get(key)
        if value is not None and not isinstance(value, kind):
            want = "a list of strings" if kind is list else "a string"
            raise src.error(f"{at}.{key}: expected {want}, found "
                            f"{dataparser.json_type(value)} ({value!r:.60})")
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise src.error(f"{at}.{key}: expected a list of strings, found {value!r:.60}")


_NODES = Source("scontrol show nodes --json")


def node_from_json(item: Mapping[str, Any], src: Source = _NODES,
                   at: At = _AT_NODES) -> Node:
    if src.strict:
        dataparser.check(item, dataparser.NODE, at, src)
        _check_types(item, _NODE_TYPES, at, src)
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise src.error(f"{at}: node without a name: {dict(item)!r:.200}")
    return Node(
        name=name,
        state=_strs(item.get("state")),
        reason=_str(item.get("reason")),
        reason_set_by=_str(item.get("reason_set_by_user")),
        reason_changed_at=_number(item.get("reason_changed_at")) or None,
        partitions=_strs(item.get("partitions")),
        gres=_str(item.get("gres")),
        features=_strs(item.get("features")),
        boot_time=_number(item.get("boot_time")) or None,
        comment=_str(item.get("comment")),
        extra=_str(item.get("extra")),
    )


def parse_nodes(text: str) -> list[Node]:
    """`scontrol show nodes --json` or `sinfo --json`'s node list."""
    doc = load_json(text, _NODES.what)
    src = dataparser.source(_NODES.what, doc)
    return [node_from_json(i, src, at) for at, i in _list(doc, "nodes", src)]


def parse_node_view(text: str) -> NodeView:
    """`scontrol show node[s] [LIST] --json`: the nodes (each once) and the controller's
    ``last_update``."""
    what = "scontrol show node --json"
    doc = load_json(text, what)
    src = dataparser.source(what, doc)
    if src.strict and "last_update" not in doc:
        raise src.error("last_update missing")
    seen: dict[str, Node] = {}
    for at, item in _list(doc, "nodes", src):
        node = node_from_json(item, src, at)
        # scontrol prints a node once per mention in the hostlist it was given.
        seen.setdefault(node.name, node)
    return NodeView(tuple(seen.values()), _number(doc.get("last_update")) or None)


def parse_sinfo_node(text: str, name: str) -> Node | None:
    """`sinfo --all -n NAME --json` (one node): the node as its entries show it, one entry per
    partition; None when no entry names it (a node in no partition). Without boot_time, which
    sinfo does not print."""
    what = "sinfo -n --json"
    doc = load_json(text, what)
    src = dataparser.source(what, doc)
    need = dataparser.sinfo_spec(src.version)
    found: Node | None = None
    parts: list[str] = []
    for at, entry in _list(doc, "sinfo", src):
        if src.strict:
            dataparser.check(entry, need, at, src)
        if name not in _strs(_map(entry.get("nodes")).get("nodes")):
            continue
        part = _str(_map(entry.get("partition")).get("name"))
        if part and part not in parts:
            parts.append(part)
        if found is None:
            reason = _map(entry.get("reason"))
            # v0.0.45 moved reason.user to the entry's reason_set_by_user.
            by = entry["reason_set_by_user"] if "reason_set_by_user" in entry \
                else reason.get("user")
            found = Node(
                name=name, state=_strs(_map(entry.get("node")).get("state")),
                reason=_str(reason.get("description")), reason_set_by=_str(by),
                reason_changed_at=_number(reason.get("time")) or None, partitions=(),
                gres=_str(_map(entry.get("gres")).get("total")),
                features=_strs(_map(entry.get("features")).get("total")), boot_time=None,
                comment=_str(entry.get("comment")), extra=_str(entry.get("extra")))
    if found is None:
        return None
    return replace(found, partitions=tuple(parts))


_NODELIST = re.compile(r"^[A-Za-z0-9._\-\[\],]+$")


def parse_nodelists(text: str) -> tuple[str, ...]:
    """`sinfo --noheader --format=%N`: one hostlist expression per line (per partition and
    state group), in order, each once."""
    out: list[str] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if not _NODELIST.match(line):
            raise SlurmParseError(f"sinfo --format=%N line {lineno}: not a node list: {line[:80]!r}")
        if line not in out:
            out.append(line)
    return tuple(out)


def parse_partition_sizes(text: str) -> dict[str, int]:
    """`scontrol show partition --json`: partition name -> number of nodes configured in it."""
    what = "scontrol show partition --json"
    doc = load_json(text, what)
    src = dataparser.source(what, doc)
    sizes: dict[str, int] = {}
    for at, item in _list(doc, "partitions", src):
        name = _str(item.get("name"))
        nodes = _map(item.get("nodes"))
        total = _number(nodes.get("total"))
        if not name or total is None:
            missing = "name" if not name else "nodes.total"
            raise src.error(f"{at}.{missing} missing: partition without a name or node total: "
                            f"{dict(item)!r:.200}")
        sizes[name] = total
    return sizes


def parse_sinfo_partitions(text: str) -> dict[str, tuple[str, ...]]:
    """`sinfo --json`: partition name -> its nodes.

    sinfo groups nodes by state and shows one reason per group, so node reasons come from
    `scontrol show nodes --json`, never from here.
    """
    what = "sinfo --json"
    doc = load_json(text, what)
    src = dataparser.source(what, doc)
    parts: dict[str, list[str]] = {}
    for at, entry in _list(doc, "sinfo", src):
        part = entry.get("partition")
        nodes = entry.get("nodes")
        if not isinstance(part, Mapping) or not isinstance(nodes, Mapping):
            field = "partition" if not isinstance(part, Mapping) else "nodes"
            raise src.error(f"{at}.{field}: entry without partition or nodes")
        if src.strict and "nodes" not in nodes:
            raise src.error(f"{at}.nodes.nodes missing")
        names = parts.setdefault(_str(part.get("name")), [])
        names.extend(n for n in _strs(nodes.get("nodes")) if n not in names)
    return {name: tuple(nodes) for name, nodes in parts.items()}


_JOBS = Source("scontrol show job --json")


def job_from_json(item: Mapping[str, Any], src: Source = _JOBS, at: At = _AT_JOBS) -> Job:
    if src.strict:
        dataparser.check(item, dataparser.JOB, at, src)
        _check_types(item, _JOB_TYPES, at, src)
    job_id = _number(item.get("job_id"))
    if job_id is None:
        raise src.error(f"{at}.job_id missing: job without a job_id: {dict(item)!r:.200}")
    rc, _sig = _exit_code(item.get("exit_code"))
    return Job(
        job_id=job_id,
        name=_str(item.get("name")),
        user=_str(item.get("user_name")),
        state=_strs(item.get("job_state")),
        state_reason=_str(item.get("state_reason")),
        partition=_str(item.get("partition")),
        nodes=_str(item.get("nodes")),
        num_nodes=_number(item.get("node_count")) or 0,
        restart_count=_number(item.get("restart_cnt")) or 0,
        exit_code=rc,
        admin_comment=_str(item.get("admin_comment")),
        comment=_str(item.get("comment")),
        end_time=_number(item.get("end_time")) or None,
        req_switch=_number(item.get("required_switches")) or 0,
        switch_wait_s=_number(item.get("maximum_switch_wait_time")) or 0,
    )


def parse_jobs(text: str) -> list[Job]:
    """`scontrol show job [N] --json`."""
    doc = load_json(text, _JOBS.what)
    src = dataparser.source(_JOBS.what, doc)
    return [job_from_json(i, src, at) for at, i in _list(doc, "jobs", src)]


def _gpus(tres: Any) -> int:
    if not isinstance(tres, Mapping):
        return 0
    total = 0
    for t in tres.get("allocated") or []:
        if isinstance(t, Mapping) and t.get("type") == "gres" and t.get("name") == "gpu":
            total += _number(t.get("count")) or 0
    return total


def acct_job_from_json(item: Mapping[str, Any], src: Source = _LENIENT_SACCT,
                       at: At = _AT_JOBS) -> AcctJob:
    """One sacct record. ``restart_count`` is None where the record has no restart_cnt
    (data_parser v0.0.40 and v0.0.41 do not print it): unknown, not "never requeued"."""
    if src.strict:
        dataparser.check(item, dataparser.sacct_spec(src.version), at, src)
    job_id = _number(item.get("job_id"))
    if job_id is None:
        raise src.error(f"{at}.job_id missing: sacct record without a job_id: "
                        f"{dict(item)!r:.200}")
    state = _map(item.get("state"))
    time = _map(item.get("time"))
    rc, sig = _exit_code(item.get("exit_code"))
    current = _strs(state.get("current"))
    return AcctJob(
        job_id=job_id,
        name=_str(item.get("name")),
        user=_str(item.get("user")),
        # A requeued run is recorded as ["PENDING", "REQUEUED"]; sacct prints REQUEUED.
        state="REQUEUED" if "REQUEUED" in current else (current[0] if current else ""),
        state_reason=_str(state.get("reason")),
        partition=_str(item.get("partition")),
        nodes=_str(item.get("nodes")),
        num_nodes=_number(item.get("allocation_nodes")) or 0,
        gpus=_gpus(item.get("tres")),
        exit_code=rc,
        signal=sig,
        submit_time=_number(time.get("submission")) or None,
        start_time=_number(time.get("start")) or None,
        end_time=_number(time.get("end")) or None,
        restart_count=_number(item.get("restart_cnt")),
        failed_node=_str(item.get("failed_node")),
        submit_line=_str(item.get("submit_line")),
    )


def iter_acct_jobs(text: str) -> Iterator[AcctJob | SlurmParseError]:
    """`sacct --json`: yields records, or the error for a malformed one (never stops the scan)."""
    return acct_records(load_json(text, "sacct --json"))


def acct_records(doc: Mapping[str, Any]) -> Iterator[AcctJob | SlurmParseError]:
    src = dataparser.source("sacct --json", doc)
    for at, item in _list(doc, "jobs", src):
        yield acct_record(item, src, at)


def acct_record(item: Any, src: Source = _LENIENT_SACCT,
                at: At = _AT_JOBS) -> AcctJob | SlurmParseError:
    """One element of "jobs": the record, or why it is not one (never stops the scan)."""
    try:
        if not isinstance(item, Mapping):
            raise src.error(f"{at}: expected an object, found {dataparser.json_type(item)}")
        return acct_job_from_json(item, src, at)
    except SlurmParseError as exc:
        return exc
    except (TypeError, ValueError, AttributeError) as exc:
        # A record of the wrong shape is one bad record, never the end of a scan.
        return src.error(f"{at}: sacct record of an unexpected shape ({exc}): "
                         f"{str(item)[:200]}")


_WINDOW_FLAGS = {"-S": "start", "--starttime": "start", "-E": "end", "--endtime": "end"}


def acct_window(doc: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """The --starttime/--endtime the export was made with, from `meta.command` (times without a
    zone read as UTC: export with TZ=UTC). (None, None) when it does not say; an end of None
    means none is known: not given, or lost (before 26.05.2 Slurm drops argv's last element
    from meta.command, so gpuwarden puts --json last: see dataparser.command_complete)."""
    meta = doc.get("meta")
    argv = meta.get("command") if isinstance(meta, Mapping) else None
    if not isinstance(argv, list):
        return None, None
    found: dict[str, float] = {}
    args = [a for a in argv if isinstance(a, str)]
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in _WINDOW_FLAGS:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        try:
            at = datetime.fromisoformat(value)
        except ValueError:
            continue  # "now", "now-1days", or a value lost with argv's end: no fixed bound
        found[_WINDOW_FLAGS[flag]] = (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()
    return found.get("start"), found.get("end")


EVENT_FIELDS = ("Cluster", "NodeName", "TimeStart", "TimeEnd", "State", "Reason", "User")


def parse_events(text: str) -> list[NodeEvent]:
    """`sacctmgr -P -n show events format=Cluster,NodeName,TimeStart,TimeEnd,State,Reason,User`.

    Also as `-p` prints it (every line ends with one more "|": read with -P's rule, the user
    would stay in the reason, and a health drain's "[health]" tag would be lost) and with the
    header line that `-n` leaves out."""
    lines = [(n, ln) for n, ln in enumerate(text.splitlines(), 1) if ln.strip()]
    # -p: every line ends with "|" after its 7 fields. A -P line with an empty user (Slurm's
    # own events, "Cluster Registered TRES") ends with "|" too, but has only 6.
    if lines and all(ln.endswith("|") and ln.count("|") >= len(EVENT_FIELDS)
                     for _, ln in lines):
        lines = [(n, ln[:-1]) for n, ln in lines]
    if lines and [f.strip().lower() for f in lines[0][1].split("|")] == \
            [f.lower() for f in EVENT_FIELDS]:
        lines = lines[1:]
    events: list[NodeEvent] = []
    for lineno, line in lines:
        # Reason is the only free-text field and may itself contain '|': split around it.
        head = line.split("|", 5)
        if len(head) < 6:
            raise SlurmParseError(f"sacctmgr show events line {lineno}: expected 7 fields: {line!r}")
        reason, sep, user = head[5].rpartition("|")
        if not sep:
            raise SlurmParseError(f"sacctmgr show events line {lineno}: expected 7 fields: {line!r}")
        cluster, node, start, end, state = head[:5]
        # sacctmgr prints the user as "root(0)".
        user = user.split("(", 1)[0]
        events.append(NodeEvent(cluster, node, start, end, state, reason, user))
    return events
