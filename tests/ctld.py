"""A stand-in slurmctld behind Slurm's own commands, for the real CliSlurmClient to talk to.

It answers the argument lists gpuwarden runs (`scontrol show node[s]`, `scontrol show
partition`, `sinfo --format=%N`, `scontrol update`) in the JSON shapes captured from the real
24.11 cluster (tests/fixtures/), stamps reasons with ITS clock (`now`, whole seconds, as
slurmctld does), and counts calls and bytes. `before` runs just before a command is answered,
so tests can land someone else's change between two of gpuwarden's calls.

Like slurmctld 24.11 it re-stamps a reason on every update that carries one, and
`slurm_appends` does what set_node_reason() does for "Not responding", "reboot issued" and the
like: appends " : <msg>" to a reason already there and re-stamps it. `table_loads` counts the
reads for which slurmctld packs its whole node table (REQUEST_NODE_INFO: every `scontrol show
node[s]`, every sinfo but `sinfo -n ONE`, which takes the single-node RPC).
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpuwarden.slurm.hostlist import compress, expand
from gpuwarden.slurm.models import Node
from gpuwarden.slurm.runner import CommandResult

FIXTURES = Path(__file__).parent / "fixtures"
_DOC = json.loads((FIXTURES / "scontrol_show_nodes.json").read_text())
_NODE = _DOC["nodes"][0]
_SINFO = json.loads((FIXTURES / "sinfo.json").read_text())
_PART = _SINFO["sinfo"][0]["partition"]


def _num(n: int) -> dict[str, object]:
    return {"set": True, "infinite": False, "number": n}


def node(name: str, parts: tuple[str, ...] = ("gpu",), state: tuple[str, ...] = ("IDLE",),
         reason: str = "", by: str = "", at: int = 0, comment: str = "") -> Node:
    return Node(name, state, reason, by, at or None, parts, "gpu:h100:8", (), None, comment)


@dataclass
class FakeCtld:
    """A CommandRunner answering as slurmctld would, over a table of nodes."""

    table: dict[str, Node]
    now: float = 1_800_000_000.0
    calls: list[tuple[str, ...]] = field(default_factory=list)
    bytes_out: int = 0
    table_loads: int = 0
    before: Callable[[tuple[str, ...]], None] | None = None
    user: str = "root"
    _lock: threading.RLock = field(default_factory=threading.RLock)

    @classmethod
    def cluster(cls, n: int, per_partition: int = 0, **kw: object) -> FakeCtld:
        """``n`` nodes c1..cN, in partitions of ``per_partition`` (all in "gpu" when 0)."""
        table = {}
        for i in range(1, n + 1):
            part = f"p{(i - 1) // per_partition}" if per_partition else "gpu"
            table[f"c{i}"] = node(f"c{i}", (part,))
        return cls(table, **kw)  # type: ignore[arg-type]

    # ---- what operators and other programs do, outside gpuwarden ----
    def set(self, name: str, **changes: object) -> None:
        with self._lock:
            if changes.get("reason"):
                changes.setdefault("reason_changed_at", int(self.now))
                changes.setdefault("reason_set_by", self.user)
            self.table[name] = replace(self.table[name], **changes)  # type: ignore[arg-type]

    def operator_drain(self, name: str, reason: str) -> None:
        self.set(name, state=("IDLE", "DRAIN"), reason=reason)

    def slurm_appends(self, name: str, msg: str, state: tuple[str, ...] | None = None) -> None:
        """slurmctld's own set_node_reason(): " : msg" after the reason there, re-stamped."""
        with self._lock:
            n = self.table[name]
            reason = msg if not n.reason else (n.reason if msg in n.reason
                                               else f"{n.reason} : {msg}")
            self.table[name] = replace(n, reason=reason, reason_changed_at=int(self.now),
                                       reason_set_by="slurm", state=state or n.state)

    @property
    def drained(self) -> list[str]:
        return sorted((n for n, v in self.table.items() if v.unavailable),
                      key=lambda s: int(s[1:]) if s[1:].isdigit() else 0)

    # ---- the CommandRunner seam ----
    def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        args = tuple(argv)
        with self._lock:
            self.calls.append(args)
        if self.before is not None:
            self.before(args)
        with self._lock:
            out = self._answer([a for a in args if a not in ("--json", "--all")])
        self.bytes_out += len(out.stdout)
        return out

    def _answer(self, a: list[str]) -> CommandResult:
        tool = a[0].rsplit("/", 1)[-1]
        if tool == "sinfo" and "-n" in a:
            return self._ok(a, self._sinfo_node(a[a.index("-n") + 1]))
        if tool == "sinfo" or a[1:3] in (["show", "nodes"], ["show", "node"]):
            self.table_loads += 1
        if tool == "sinfo":
            return self._ok(a, self._sinfo(a))
        if a[1:3] == ["show", "nodes"]:
            return self._ok(a, self._nodes_json(list(self.table)))
        if a[1:3] == ["show", "node"]:
            names = [n for n in expand(a[3]) if n in self.table]
            if not names:
                return CommandResult(tuple(a), 1, "", f"Node {a[3]} not found\n")
            return self._ok(a, self._nodes_json(names))
        if a[1:3] == ["show", "partition"]:
            return self._ok(a, self._partitions_json())
        if a[1] == "update":
            return self._update(a)
        raise AssertionError(f"FakeCtld does not know {a}")

    @staticmethod
    def _ok(a: list[str], stdout: str) -> CommandResult:
        return CommandResult(tuple(a), 0, stdout, "")

    def _partitions(self) -> dict[str, list[str]]:
        parts: dict[str, list[str]] = {}
        for n in self.table.values():
            for p in n.partitions:
                parts.setdefault(p, []).append(n.name)
        return parts

    def _sinfo(self, a: list[str]) -> str:
        assert "--format=%N" in a and "--noheader" in a, a
        states = next(x for x in a if x.startswith("--states=")).split("=", 1)[1].upper()
        assert states == "DRAIN,DOWN,FAIL", states
        lines = []
        for members in self._partitions().values():
            out = [m for m in members if self.table[m].unavailable]
            if out:
                lines.append(compress(out))
        return "".join(f"{line}\n" for line in lines)

    def _nodes_json(self, names: list[str]) -> str:
        items = []
        for name in names:
            n = self.table[name]
            item = copy.deepcopy(_NODE)
            item.update(name=n.name, hostname=n.name, address=n.name, state=list(n.state),
                        reason=n.reason, reason_set_by_user=n.reason_set_by,
                        reason_changed_at=_num(n.reason_changed_at or 0),
                        partitions=list(n.partitions), comment=n.comment)
            items.append(item)
        return json.dumps({**_DOC, "nodes": items, "last_update": _num(int(self.now))},
                          indent=2)

    def _sinfo_node(self, name: str) -> str:
        n = self.table.get(name)
        entries = []
        for part in n.partitions if n is not None else ():
            assert n is not None
            entry = copy.deepcopy(_SINFO["sinfo"][0])
            entry["partition"]["name"] = part
            entry["node"] = {"state": list(n.state)}
            entry["nodes"] = {**entry["nodes"], "nodes": [name], "total": 1}
            entry["reason"] = {"description": n.reason, "user": n.reason_set_by,
                               "time": n.reason_changed_at or 0}
            entry["comment"], entry["extra"] = n.comment, n.extra
            entries.append(entry)
        return json.dumps({**_SINFO, "sinfo": entries}, indent=2)

    def _partitions_json(self) -> str:
        items = []
        for name, members in self._partitions().items():
            part = copy.deepcopy(_PART)
            part["name"] = name
            part["nodes"] = {"allowed_allocation": "", "configured": compress(members),
                             "total": len(members)}
            items.append(part)
        return json.dumps({"partitions": items, "last_update": _num(int(self.now)),
                           "meta": _DOC["meta"], "errors": [], "warnings": []}, indent=2)

    def _update(self, a: list[str]) -> CommandResult:
        kv = dict(x.split("=", 1) for x in a[2:])
        name = kv.pop("nodename")
        n = self.table[name]
        state = kv.pop("state", "").upper()
        if "comment" in kv:
            n = replace(n, comment=kv.pop("comment"))
        if state == "DRAIN":
            if not kv.get("reason"):
                return CommandResult(tuple(a), 1, "", "You must specify a reason when DOWNING or "
                                                       "DRAINING a node. Request denied\n")
            base = tuple(s for s in n.state if s != "DRAIN")
            n = replace(n, state=(*base, "DRAIN"))
        elif state == "RESUME":
            if not n.unavailable:
                return CommandResult(tuple(a), 1, "", "Invalid node state specified\n")
            n = replace(n, state=tuple(s for s in n.state if s not in ("DRAIN", "DOWN", "FAIL"))
                        or ("IDLE",), reason="", reason_set_by="", reason_changed_at=None)
        if kv.get("reason"):
            # update_node() stamps the reason again even when it is the same text.
            n = replace(n, reason=kv["reason"], reason_changed_at=int(self.now),
                        reason_set_by=self.user)
        self.table[name] = n
        return self._ok(a, "")
