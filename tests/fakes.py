"""Hand-written fakes for the Slurm seam (unit tests only; e2e tests use the real cluster)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from gpuwarden.core.errors import NotOurDrainError, SlurmError
from gpuwarden.slurm.client import NodeBusyError, gpuwarden_reason, refuse_unless_ours
from gpuwarden.slurm.models import Job, Node, NodeView
from gpuwarden.slurm.runner import CommandResult, CommandTimeoutError

Handler = Callable[[Sequence[str]], CommandResult]


def ok(argv: Sequence[str], stdout: str = "") -> CommandResult:
    return CommandResult(tuple(argv), 0, stdout, "")


def fail(argv: Sequence[str], stderr: str, rc: int = 1) -> CommandResult:
    return CommandResult(tuple(argv), rc, "", stderr)


@dataclass
class FakeRunner:
    """Answers commands from a queue of scripted results; records every call."""

    script: list[CommandResult | Exception | Handler] = field(default_factory=list)
    calls: list[tuple[str, ...]] = field(default_factory=list)

    def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        self.calls.append(tuple(argv))
        if not self.script:
            raise AssertionError(f"unexpected command {argv}")
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        if callable(step):
            return step(argv)
        return step


def node_json(name: str, state: Sequence[str], reason: str = "", by: str = "") -> str:
    """One node as `scontrol show node --json` prints it, and (key "sinfo") as
    `sinfo -n NAME --json` does: either read of the node parses it."""
    stamp = {"set": True, "infinite": False, "number": 1795945000}
    return json.dumps({"nodes": [{
        "name": name, "state": list(state), "reason": reason, "reason_set_by_user": by,
        "reason_changed_at": stamp, "partitions": ["gpu"], "gres": "gpu:h100:8", "features": [],
    }], "sinfo": [{
        "node": {"state": list(state)}, "nodes": {"nodes": [name], "total": 1},
        "partition": {"name": "gpu"}, "reason": {"description": reason, "user": by,
                                                 "time": 1795945000},
        "gres": {"total": "gpu:h100:8"}, "features": {"total": ""}, "comment": "", "extra": "",
    }]})


def timeout(argv: Sequence[str]) -> CommandTimeoutError:
    return CommandTimeoutError(argv, 30)


@dataclass
class FakeSlurm:
    """A SlurmClient over a table of nodes, with Slurm's drain rules."""

    table: dict[str, Node]
    now: float = 1_800_000_000.0
    log: list[str] = field(default_factory=list)
    job_table: dict[int, Job] = field(default_factory=dict)
    job_reads: int = 0

    def job(self, job_id: int) -> Job:
        self.job_reads += 1
        if job_id not in self.job_table:
            raise SlurmError(f"job {job_id} is not known to slurmctld")
        return self.job_table[job_id]

    def jobs(self) -> list[Job]:
        return list(self.job_table.values())

    def nodes(self) -> list[Node]:
        return list(self.table.values())

    def node(self, name: str) -> Node:
        return self.table[name]

    def out_of_service(self, also: Sequence[str] = ()) -> NodeView:
        return NodeView(tuple(n for n in self.table.values() if n.unavailable or n.name in also),
                        int(self.now))

    def partition_sizes(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for n in self.table.values():
            for p in n.partitions:
                sizes[p] = sizes.get(p, 0) + 1
        return sizes

    def drain(self, name: str, reason: str, *, in_service_only: bool = False) -> None:
        refuse_unless_ours(self.table[name], "drain")
        if in_service_only and (self.table[name].drained or self.table[name].down):
            raise NodeBusyError(f"{name} is already out of service")
        self.table[name] = replace(self.table[name], state=("IDLE", "DRAIN"),
                                   reason=gpuwarden_reason(reason), reason_changed_at=int(self.now))
        self.log.append(f"drain {name}")

    def resume(self, name: str, *, expect_reason: str | None = None) -> bool:
        if expect_reason is not None and self.table[name].reason != expect_reason:
            raise NotOurDrainError(f"reason of {name} is not {expect_reason!r}")
        self.table[name] = replace(self.table[name], state=("IDLE",), reason="")
        self.log.append(f"resume {name}")
        return True

    def set_extra(self, name: str, text: str) -> None:
        self.table[name] = replace(self.table[name], extra=text)

    def set_switch_wait(self, job_id: int, wait_s: int, admin_comment: str,
                        comment: str | None) -> None:
        job = self.job_table[job_id]
        self.job_table[job_id] = replace(job, switch_wait_s=wait_s, admin_comment=admin_comment,
                                         comment=job.comment if comment is None else comment)
        self.log.append(f"switch wait {job_id} {wait_s}")

    def requeue(self, job_id: int) -> None:
        self.log.append(f"requeue {job_id}")

    def set_comment(self, name: str, text: str) -> None:
        current = self.table[name].comment
        if current and not current.startswith("gpuwarden:"):
            raise NotOurDrainError(f"comment of {name} is not ours")
        self.table[name] = replace(self.table[name], comment=gpuwarden_reason(text) if text else "")
