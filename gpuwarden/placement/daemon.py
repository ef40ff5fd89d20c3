"""`gpuwarden placement daemon`: keep the filter's snapshot current.

Every `interval_s`: read topology.conf, node state (one `scontrol show nodes --json`, one
`sinfo --json`), the running jobs' ends (`scontrol show job --json`, where a policy waits by
them, and only when node states changed) and the lemon list, build the snapshot, and replace
the file atomically. The generation changes only when the content does; the header's time on
every write, which is how the filter knows the daemon is alive. Any failure keeps the last
good snapshot in place (it goes stale, and the filter then lets jobs through unchanged) and is
logged with what to fix.

After each snapshot, a pending gang job that Slurm requeued has the switch wait the filter
gave it set to 0 (requeue.py says which and why), once, logged.

With `[health] prom_dir` set, every round ends by writing `gpuwarden_placement.prom` there
(promfile.py): the snapshot's time, the rounds, the jobs by what the filter did, the nodes by
state. A failure to write it is logged (once until it works again) and changes nothing else.

Settings change without a restart: `reload` (reload.Reloader in production) is asked before
each round after the first. A valid new config runs from the next snapshot; an invalid one is
refused, logged as an error naming the key, and noted in the snapshot's second line, while
the settings that were running go on.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gpuwarden.accounting import lemonlist as listfile
from gpuwarden.config.placement import PlacementConfig
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.placement import promfile, requeue, snapshot
from gpuwarden.placement.reload import Reloaded
from gpuwarden.slurm import topology
from gpuwarden.slurm.client import SlurmClient
from gpuwarden.slurm.models import Job, Node

log = logging.getLogger(__name__)


@dataclass
class State:
    generation: int = 0
    content: str = ""  # the last rendered body, without the header
    lemons: dict[str, str] = field(default_factory=dict)  # node -> what --drain did
    refused: str = ""  # why the config file's last change was refused; "" when it was not
    # The running jobs last read, and the node states they were read with: read again only
    # when those change (a job started or ended) or after JOBS_MAX_AGE_S.
    jobs: list[Job] | None = None
    jobs_nodes: tuple[tuple[str, tuple[str, ...]], ...] = ()
    jobs_at: float = 0.0
    jobs_failed: bool = False
    changed_at: float = -1e18  # when the node states last changed
    # Jobs whose switch wait this daemon relaxed or tried to (requeue.py), pruned to the jobs
    # Slurm still lists.
    relaxed: set[int] = field(default_factory=set)
    # The textfile: where ("" = none), the rounds by outcome, the nodes last read and when.
    prom_dir: str = ""
    rounds: dict[str, int] = field(default_factory=dict)
    nodes: list[Node] | None = None
    nodes_at: float = 0.0
    prom_failed: bool = False


JOBS_MAX_AGE_S = 60.0
# Read again for this long after node states changed: a prolog drains its node and only then
# exits 1, so Slurm requeues the job a moment after the change that prompted the read.
SETTLE_S = 15.0


def running_jobs(client: SlurmClient, nodes: list[Node], state: State,
                 now: float) -> list[Job] | None:
    """The jobs for the fit tables (`scontrol show job --json` lists every job, pending
    ones too: on a large site that is not every 5 s's work), or None when they cannot be read:
    then no fit tables (logged as an error), and every job waits the policy's wait_s."""
    seen = tuple((n.name, n.state) for n in nodes)
    if state.jobs_nodes and seen != state.jobs_nodes:
        state.changed_at = now
    if state.jobs is not None and seen == state.jobs_nodes and \
            0 <= now - state.jobs_at < JOBS_MAX_AGE_S and \
            not 0 <= now - state.changed_at <= SETTLE_S:
        return state.jobs
    try:
        jobs = client.jobs()
    except GpuwardenError as exc:
        if not state.jobs_failed:
            log.error("running jobs not read (%s): gang jobs wait the policy's wait_s, and "
                      "requeued ones keep their switch wait, until they can be (wait_by = "
                      "\"limits\" needs their time limits)", exc)
        state.jobs, state.jobs_failed = None, True
        return None
    if state.jobs_failed:
        log.info("running jobs read again: waits by their time limits from this snapshot")
    state.jobs, state.jobs_nodes, state.jobs_at, state.jobs_failed = jobs, seen, now, False
    return jobs


def build_once(cfg: PlacementConfig, client: SlurmClient, lemon_file: str, state: State,
               now: float) -> snapshot.Snapshot:
    """Raises GpuwardenError (naming the file or command) when an input cannot be read."""
    try:
        with open(cfg.topology_file, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise topology.TopologyError(
            f"{cfg.topology_file}: cannot read ({exc.strerror}): set [placement] topology_file "
            "to slurm.conf's topology.conf (`gpuwarden slurm-conf --part topology.conf` prints "
            "one for [cluster])") from None
    topo = topology.parse(text, cfg.topology_file)
    try:
        state.lemons = {e.node: e.action for e in listfile.read(lemon_file).entries}
    except listfile.LemonListError as exc:
        if "no lemon list yet" in str(exc):
            state.lemons = {}
        else:
            log.warning("%s; keeping the last lemons read (%s)", exc,
                        ",".join(state.lemons) or "none")
    nodes = client.nodes()
    state.nodes, state.nodes_at = nodes, now
    policies = (cfg.default, *cfg.partitions.values())
    # The jobs where a "preferred" policy waits: for their ends (wait_by = "limits") and for
    # the requeued ones (requeue.py); and for the textfile's jobs by outcome.
    preferred = any(p.mode == "preferred" for p in policies)
    by_limits = any(p.mode == "preferred" and p.wait_by == "limits" for p in policies)
    jobs = running_jobs(client, nodes, state, now) if preferred or state.prom_dir else []
    return snapshot.build(cfg, topo, nodes, client.partitions(), state.lemons,
                          state.generation, now, jobs if by_limits else [])


def relax_requeued(client: SlurmClient, state: State) -> None:
    """Set the switch wait of requeued gang jobs to 0 (requeue.py), each job once; a failure
    is logged and not retried (the job then waits what Slurm has left of its wait)."""
    if state.jobs is None:
        return
    state.relaxed &= {j.job_id for j in state.jobs}
    for r in requeue.to_relax(state.jobs, state.relaxed):
        state.relaxed.add(r.job_id)
        try:
            client.set_switch_wait(r.job_id, 0, r.admin_comment, r.comment)
        except GpuwardenError as exc:
            log.error("job %d was requeued (restart %d) but its switch wait (%d s for %d "
                      "leaf switch(es)) was not relaxed: %s; it waits what Slurm has left of "
                      "it", r.job_id, r.restarts, r.was_s, r.switches, exc)
            continue
        log.info("job %d was requeued (restart %d): its switch wait (%d s for %d leaf "
                 "switch(es), set by the filter) is now 0: it starts wherever it fits",
                 r.job_id, r.restarts, r.was_s, r.switches)


_NOTE_CHARS = 300
REFUSED = " CONFIG CHANGE REFUSED, the previous settings run:"


def with_note(text: str, refused: str) -> str:
    """A rendered snapshot with the refusal added to its second line, a comment the filter
    skips (`head -2` of the snapshot shows it): one printable line, capped."""
    if not refused:
        return text
    note = "".join(c if " " <= c <= "~" else "?" for c in " ".join(refused.split()))
    if len(note) > _NOTE_CHARS:
        note = note[:_NOTE_CHARS - 3] + "..."
    first, second, rest = text.split("\n", 2)
    second += f"{REFUSED} {note}"
    if len(text) + len(second) > snapshot.MAX_BYTES:
        return text  # the filter would refuse the whole file
    return f"{first}\n{second}\n{rest}"


def step(cfg: PlacementConfig, client: SlurmClient, lemon_file: str, state: State,
         now: float) -> snapshot.Snapshot | None:
    try:
        snap = build_once(cfg, client, lemon_file, state, now)
        blank = replace(snap, generation=0, generated_at=0)
        body = with_note(snapshot.render(blank), state.refused).split("\n", 1)[1]
    except GpuwardenError as exc:
        log.error("placement snapshot not updated: %s (the last good one stays, and goes stale "
                  "after %d s)", exc, cfg.stale_after_s)
        return None
    if body != state.content:
        state.generation = max(state.generation + 1, int(now * 1000))
        state.content = body
    snap = replace(snap, generation=state.generation)
    try:
        snapshot.write(cfg.snapshot_file, with_note(snapshot.render(snap), state.refused))
    except snapshot.SnapshotError as exc:
        log.error("placement snapshot not written: %s (the filter lets jobs through unchanged "
                  "once the last one goes stale)", exc)
        return None
    relax_requeued(client, state)
    return snap


def _starting(cfg: PlacementConfig) -> None:
    log.info("placement daemon: %s -> %s every %g s", cfg.topology_file, cfg.snapshot_file,
             cfg.interval_s)
    beside = os.path.join(os.path.dirname(cfg.snapshot_file), "job_submit.lua")
    if not os.path.exists(beside):
        log.warning("no %s: job_submit.lua reads the snapshot only from the directory of the "
                    "job_submit.lua slurmctld loads (slurm.conf's, which it already trusts for "
                    "the code it runs)", beside)


def apply_reload(r: Reloaded, cfg: PlacementConfig, lemon_file: str,
                 state: State) -> tuple[PlacementConfig, str]:
    """The settings to run after ``r``, logged (the refusal as an error: it goes to syslog)."""
    if r.placement is None:
        log.error("config change refused (%s): %s; the placement daemon keeps its previous "
                  "settings until the file is fixed", r.cause, r.refused)
        state.refused = r.refused
        return cfg, lemon_file
    if state.refused:
        log.info("config %s: valid again", r.cause)
    state.refused = ""
    if r.changed:
        log.info("config reloaded (%s), from the next snapshot: %s", r.cause,
                 "; ".join(r.changed))
    elif not r.elsewhere:
        log.info("config reloaded (%s): nothing the placement daemon uses changed", r.cause)
    if r.elsewhere:
        log.info("config keys changed that the placement daemon does not use (their own "
                 "commands read them): %s", ", ".join(r.elsewhere))
    if r.placement.snapshot_file != cfg.snapshot_file:
        _starting(r.placement)
        log.warning("the snapshot is now written to %s; %s is no longer updated and goes "
                    "stale", r.placement.snapshot_file, cfg.snapshot_file)
    return r.placement, r.lemon_file


def publish(cfg: PlacementConfig, state: State, ok: bool, now: float) -> None:
    """Count the round and write the textfile (with `[health] prom_dir`). Never raises: a
    failure is logged once, and again only after the file was written in between."""
    outcome = "ok" if ok else "failed"
    state.rounds[outcome] = state.rounds.get(outcome, 0) + 1
    if not state.prom_dir:
        return
    # Nodes read too long ago are left out rather than shown as they were.
    nodes = state.nodes if 0 <= now - state.nodes_at <= cfg.stale_after_s else None
    # So are jobs (kept up to JOBS_MAX_AGE_S between reads): Slurm unreachable, not frozen.
    fresh = 0 <= now - state.jobs_at <= max(cfg.stale_after_s, JOBS_MAX_AGE_S)
    jobs = state.jobs if fresh else None
    try:
        promfile.write(state.prom_dir, promfile.samples(
            snapshot.written_at(cfg.snapshot_file), state.rounds, jobs, nodes, cfg))
    except Exception as exc:  # the metrics never stop the daemon
        if not state.prom_failed:
            log.error("%s/%s not written: %s (the snapshot is not affected; said once until "
                      "it is written again)", state.prom_dir, promfile.FILE, exc)
        state.prom_failed = True
        return
    if state.prom_failed:
        log.info("%s/%s written again", state.prom_dir, promfile.FILE)
    state.prom_failed = False


def run(cfg: PlacementConfig, client_factory: Callable[[], SlurmClient], lemon_file: str,
        once: bool = False, clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        reload: Callable[[], Reloaded | None] | None = None, prom_dir: str = "") -> int:
    state = State(prom_dir=prom_dir)
    _starting(cfg)
    while True:
        try:
            snap = step(cfg, client_factory(), lemon_file, state, clock())
        except Exception:  # a daemon outlives any one bad round (disk full, odd output, ...)
            log.exception("placement snapshot not updated; the last good one stays, and goes "
                          "stale after %d s", cfg.stale_after_s)
            snap = None
        publish(cfg, state, snap is not None, clock())
        if once:
            return 0 if snap is not None else 1
        sleep(cfg.interval_s)
        if reload is not None:
            try:
                r = reload()
            except Exception:  # a re-read must not stop the daemon that runs the old settings
                log.exception("config not re-read; the previous settings stay")
                r = None
            if r is not None:
                cfg, lemon_file = apply_reload(r, cfg, lemon_file, state)
                if r.placement is not None and r.prom_dir != state.prom_dir:
                    log.info("metrics now written to %s", r.prom_dir or "nowhere "
                             "([health] prom_dir unset)")
                    state.prom_dir, state.prom_failed = r.prom_dir, False
