"""One typed client over Slurm's JSON CLIs, with retries, and gpuwarden's drain rules.

`SlurmClient` is the seam: the CLI backend here is the default; a pyslurm backend could
implement the same Protocol on sites whose pyslurm major version equals their Slurm's.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from gpuwarden.core.errors import NotOurDrainError, SlurmError, SlurmUnavailableError
from gpuwarden.slurm import parse
from gpuwarden.slurm.models import (
    REASON_PREFIX,
    SLURM_APPENDS,
    AcctJob,
    Job,
    Node,
    NodeEvent,
    NodeView,
    same_drain,
)
from gpuwarden.slurm.runner import CommandResult, CommandRunner, CommandTimeoutError
from gpuwarden.slurm.settings import SlurmConfig

log = logging.getLogger(__name__)

# stderr of a failed command that means "try again later", not "you asked for something wrong".
_TRANSIENT = re.compile(
    r"Unable to contact slurm controller|Socket timed out|Connection refused|"
    r"Resource temporarily unavailable|Zero Bytes were transmitted|"
    r"Communication connection failure|backup controller in standby|"
    r"Unable to establish a connection|slurmdbd: Connection|Problem talking to the database|"
    r"Transport endpoint is not connected",
    re.IGNORECASE,
)
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_MAX_REASON = 200
# Past this a hostlist argument risks the kernel's 128 KiB limit on one argument.
_MAX_NODELIST_ARG = 100_000
# sinfo's names for every state in which a node is out of service (DRAIN covers DRAINING too).
OUT_STATES = "drain,down,fail"


class SlurmClient(Protocol):
    """What gpuwarden needs from Slurm. Implemented by CliSlurmClient (and fakes in tests)."""

    def nodes(self) -> list[Node]: ...
    def node(self, name: str) -> Node: ...
    def partitions(self) -> dict[str, tuple[str, ...]]: ...
    def jobs(self) -> list[Job]: ...
    def job(self, job_id: int) -> Job: ...
    def acct_jobs(self, start: str, end: str) -> Iterator[AcctJob | SlurmError]: ...
    def events(self, start: str, end: str) -> list[NodeEvent]: ...
    def out_of_service(self, also: Sequence[str] = ()) -> NodeView: ...
    def partition_sizes(self) -> dict[str, int]: ...
    def drain(self, name: str, reason: str, *, in_service_only: bool = False) -> None: ...
    def set_comment(self, name: str, text: str) -> None: ...
    def resume(self, name: str, *, expect_reason: str | None = None) -> bool: ...
    def set_extra(self, name: str, text: str) -> None: ...
    def set_switch_wait(self, job_id: int, wait_s: int, admin_comment: str,
                        comment: str | None) -> None: ...
    def requeue(self, job_id: int) -> None: ...


def gpuwarden_reason(text: str) -> str:
    """Namespace a reason so that gpuwarden can recognise its own drains later."""
    text = " ".join(text.split())
    if not text:
        raise ValueError("a drain reason must say why")
    if text.startswith(REASON_PREFIX):
        text = text[len(REASON_PREFIX) :].lstrip()
    # Keep Slurm's separator for Slurm: what follows the first one is never ours.
    text = text.replace(SLURM_APPENDS, " - ")
    full = f"{REASON_PREFIX} {text}"
    return full if len(full) <= _MAX_REASON else full[: _MAX_REASON - 3] + "..."


class NodeBusyError(NotOurDrainError):
    """A drain refused because the node is already out of service, whoever put it there."""


def check_node_name(name: str) -> str:
    if not _NODE_NAME.match(name):
        raise SlurmError(f"not a valid node name: {name!r} (a Slurm node name: letters, digits, "
                         "'.', '_' and '-', up to 64; `gpuwarden nodes` lists them)")
    return name


def refuse_unless_ours(node: Node, action: str) -> None:
    """Refuse to touch a drain/down whose reason someone else set (an operator's, Slurm's)."""
    if (node.drained or node.down) and node.reason and not node.reason_is_ours:
        by = f" by {node.reason_set_by}" if node.reason_set_by else ""
        raise NotOurDrainError(
            f"refusing to {action} {node.name}: it is {node.state_text} with reason "
            f"{node.reason!r} set{by}, not by gpuwarden; gpuwarden only changes its own drains "
            f"(use scontrol yourself if this is intended)"
        )


class CliSlurmClient:
    def __init__(
        self,
        config: SlurmConfig,
        runner: CommandRunner,
        sleep: Callable[[float], None] = time.sleep,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._cfg = config
        self._runner = runner
        self._sleep = sleep
        self._jitter = jitter

    def _argv(self, tool: str, *args: str) -> list[str]:
        exe = str(Path(self._cfg.bin_dir) / tool) if self._cfg.bin_dir else tool
        return [exe, *args]

    def _call(self, argv: Sequence[str]) -> CommandResult:
        """Run with retries and jittered exponential backoff on transient controller errors."""
        delay = self._cfg.backoff_initial_s
        attempts = self._cfg.retries + 1
        last = ""
        for attempt in range(1, attempts + 1):
            try:
                res = self._runner.run(argv, self._cfg.command_timeout_s)
            except CommandTimeoutError as exc:
                last = str(exc)
            else:
                if res.returncode == 0:
                    return res
                err = (res.stderr or res.stdout).strip()
                if not _TRANSIENT.search(err):
                    raise SlurmError(f"`{' '.join(argv)}` failed (exit {res.returncode}): {err}")
                last = err
            if attempt < attempts:
                wait = min(delay, self._cfg.backoff_max_s) * (0.5 + self._jitter() / 2)
                log.warning("%s: %s; retry %d/%d in %.1f s", argv[0], last, attempt,
                            attempts - 1, wait)
                self._sleep(wait)
                delay *= 2
        raise SlurmUnavailableError(
            f"`{' '.join(argv)}` failed after {attempts} attempts: {last}; "
            "is slurmctld up? (check `scontrol ping`)"
        )

    def nodes(self) -> list[Node]:
        return parse.parse_nodes(self._call(self._argv(
            "scontrol", "--all", "show", "nodes", "--json")).stdout)

    def node(self, name: str) -> Node:
        """One node, every field (boot time included). slurmctld answers `scontrol show node`
        with its whole node table (scontrol filters it): see _peek for the cheap read."""
        out = self._call(self._argv("scontrol", "--all", "show", "node", check_node_name(name),
                                    "--json"))
        found = [n for n in parse.parse_nodes(out.stdout) if n.name == name]
        if not found:
            raise SlurmError(f"node {name} is not known to slurmctld")
        return found[0]

    def partitions(self) -> dict[str, tuple[str, ...]]:
        return parse.parse_sinfo_partitions(self._call(self._argv("sinfo", "--json")).stdout)

    def jobs(self) -> list[Job]:
        return parse.parse_jobs(self._call(self._argv("scontrol", "show", "job", "--json")).stdout)

    def job(self, job_id: int) -> Job:
        out = self._call(self._argv("scontrol", "show", "job", str(int(job_id)), "--json"))
        # An array's or a heterogeneous job's id answers with every member: take its own.
        jobs = [j for j in parse.parse_jobs(out.stdout) if j.job_id == int(job_id)]
        if not jobs:
            raise SlurmError(f"job {job_id} is not known to slurmctld")
        return jobs[0]

    def acct_jobs(self, start: str, end: str) -> Iterator[AcctJob | SlurmError]:
        """Jobs that ran in [start, end): one window per call, so a scan never floods slurmdbd."""
        # --json last: before 26.05.2 meta.command lacks argv's last element, and the window
        # must survive in it (parse.acct_window).
        out = self._call(self._argv(
            "sacct", "--allusers", "--allocations", "--duplicates",
            f"--starttime={start}", f"--endtime={end}", "--json",
        ))
        return parse.iter_acct_jobs(out.stdout)

    def events(self, start: str, end: str) -> list[NodeEvent]:
        out = self._call(self._argv(
            "sacctmgr", "--parsable2", "--noheader", "show", "events",
            f"start={start}", f"end={end}",
            "format=" + ",".join(parse.EVENT_FIELDS),
        ))
        return parse.parse_events(out.stdout)

    def out_of_service(self, also: Sequence[str] = ()) -> NodeView:
        """Every node out of service (drained, draining, down, failed), plus the nodes in
        ``also`` whatever their state, with the controller's clock.

        Two calls whatever the cluster's size: sinfo names the nodes out of service as compact
        hostlists, then scontrol prints only those. What comes back grows with the nodes out of
        service, not with the cluster; slurmctld still packs its whole node table for each of
        the two (REQUEST_NODE_INFO: both tools filter client-side)."""
        names = [check_node_name(n) for n in also]
        lists = parse.parse_nodelists(self._call(self._argv(
            "sinfo", "--all", "--noheader", f"--states={OUT_STATES}", "--format=%N")).stdout)
        expr = ",".join([*lists, *names])
        if not expr:
            return NodeView((), None)
        if len(expr) > _MAX_NODELIST_ARG:
            # Thousands of scattered nodes out at once: one whole-cluster read beats no read.
            log.warning("%d bytes of node lists out of service: reading every node", len(expr))
            argv = self._argv("scontrol", "--all", "show", "nodes", "--json")
        else:
            argv = self._argv("scontrol", "--all", "show", "node", expr, "--json")
        view = parse.parse_node_view(self._call(argv).stdout)
        wanted = set(names)
        return NodeView(tuple(n for n in view.nodes if n.unavailable or n.name in wanted),
                        view.ctld_time)

    def partition_sizes(self) -> dict[str, int]:
        """Partition name -> its node count, hidden partitions included: one call, whose size
        grows with the number of partitions, not of nodes."""
        out = self._call(self._argv("scontrol", "--all", "show", "partition", "--json"))
        return parse.parse_partition_sizes(out.stdout)

    def _peek(self, name: str) -> Node:
        """The node's state, reason, stamp and comment, read with slurmctld's single-node RPC
        (`sinfo -n ONE` calls slurm_load_node_single; `scontrol show node` always loads the
        whole table), so the re-read right before an update is quick on any cluster size.
        No boot time. A node in no partition (sinfo shows none) is read with scontrol."""
        out = self._call(self._argv("sinfo", "--all", "-n", check_node_name(name), "--json"))
        found = parse.parse_sinfo_node(out.stdout, name)
        return found if found is not None else self.node(name)

    def _update(self, name: str, *fields: str) -> None:
        self._call(self._argv("scontrol", "update", f"nodename={name}", *fields))

    def drain(self, name: str, reason: str, *, in_service_only: bool = False) -> None:
        """Drain with a `gpuwarden:` reason; never over a reason someone else set.

        The node is re-read right before the update (Slurm has no compare-and-swap: this keeps
        the window in which someone else's drain can be replaced to one round trip). With
        ``in_service_only`` a node that is out of service for any reason, gpuwarden's own
        included (a lemon drain, a drain by hand), is refused with NodeBusyError: the health
        and lemon drains never take over each other's drains."""
        full = gpuwarden_reason(reason)
        node = self._peek(check_node_name(name))
        refuse_unless_ours(node, "drain")
        if in_service_only and (node.drained or node.down):
            raise NodeBusyError(
                f"not draining {name}: it is already {node.state_text} with reason "
                f"{node.reason!r} ({node.owner or 'no owner'}); leaving that drain as it is")
        log.info("draining %s: %s", name, full)
        self._update(name, "state=drain", f"reason={full}")

    def set_comment(self, name: str, text: str) -> None:
        """Set (or clear, with "") a `gpuwarden:` node comment; never over someone else's."""
        node = self._peek(check_node_name(name))
        if node.comment and not node.comment.startswith(REASON_PREFIX):
            raise NotOurDrainError(
                f"refusing to change the comment of {name}: {node.comment!r} was not set by "
                "gpuwarden")
        full = gpuwarden_reason(text) if text else ""
        if full == node.comment:
            return
        self._update(name, f"comment={full}")

    def resume(self, name: str, *, expect_reason: str | None = None) -> bool:
        """Resume a node gpuwarden drained. False when there was nothing to resume.

        The node is re-read right before the update, with the single-node RPC (the quickest
        read there is); with ``expect_reason`` it is resumed only if its reason is still that
        one (the drain the caller made, with or without what slurmctld appended to it), so a
        drain someone made since (an operator's, a lemon drain, one by hand) is never resumed.
        Slurm has no compare-and-swap: a drain landing between that read and the update (one
        round trip) is resumed with ours; see docs/health.md."""
        node = self._peek(check_node_name(name))
        if not (node.drained or node.down):
            return False
        refuse_unless_ours(node, "resume")
        if not node.reason:
            raise NotOurDrainError(
                f"refusing to resume {name}: it is {node.state_text} without a reason, so "
                "gpuwarden cannot tell who set it"
            )
        if expect_reason is not None and not same_drain(node.reason, expect_reason):
            raise NotOurDrainError(
                f"refusing to resume {name}: its reason is now {node.reason!r}, not "
                f"{expect_reason!r}: it was drained again since, and that drain is not ours "
                "to undo")
        self._update(name, "state=resume")  # nothing between the read and this: a narrow window
        log.info("resumed %s (was: %s)", name, node.reason)
        return True

    def set_extra(self, name: str, text: str) -> None:
        """Set the node's `Extra` field (health gating's marker; see gpuwarden.health.marker)."""
        self._update(check_node_name(name), f"extra={text}")

    def set_switch_wait(self, job_id: int, wait_s: int, admin_comment: str,
                        comment: str | None) -> None:
        """A pending job's wait for its switch count (seconds), with its admin comment (and
        its comment, unless None) in the same update."""
        fields = [f"jobid={int(job_id)}", f"wait-for-switch={int(wait_s)}",
                  f"admincomment={_one_line(admin_comment)}"]
        if comment is not None:
            fields.append(f"comment={_one_line(comment)}")
        self._call(self._argv("scontrol", "update", *fields))

    def requeue(self, job_id: int) -> None:
        """Requeue a batch job (`scontrol requeue`): Slurm refuses a job submitted with
        --no-requeue (or under JobRequeue=0 without --requeue) and a job that is not a batch
        job; both raise SlurmError."""
        self._call(self._argv("scontrol", "requeue", str(int(job_id))))


def _one_line(text: str) -> str:
    return " ".join(text.split())
