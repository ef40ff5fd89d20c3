"""The three Slurm entry points (HealthCheckProgram, Prolog, Epilog) and the manual check.

Each returns an exit status. Slurm-facing rules: the prolog exits non-zero only after draining
the node itself (so Slurm requeues the job elsewhere and keeps gpuwarden's reason); the epilog
always exits 0 (it drains by itself, so Slurm never adds "Epilog error" on top).

Never silently off: every failure of gpuwarden itself (state, Slurm, deadline) is logged at
error level (syslog), filed in Env.problems for the node_exporter textfile, and never stops an
action: the node is drained first, state is saved after.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from gpuwarden.config import Config
from gpuwarden.core.errors import GpuwardenError, SlurmError
from gpuwarden.core.safefs import StateDirError
from gpuwarden.health import gate, gatingmetrics, marker
from gpuwarden.health.gather import gather, gating_gaps
from gpuwarden.health.model import CheckResult, Status, Verdict
from gpuwarden.health.probe import GpuProbe
from gpuwarden.health.store import Counters, Store
from gpuwarden.slurm import drain, jobenv, lostnote
from gpuwarden.slurm.client import SlurmClient, check_node_name, gpuwarden_reason
from gpuwarden.slurm.models import Job, Node, same_drain
from gpuwarden.slurm.reasons import health_reason, is_health_drain, origin_of

log = logging.getLogger(__name__)


STORED_CHECKS = ("scratch", "memory", "ib:")


@dataclass
class Env:
    """What an entry point needs from outside; tests pass fakes."""

    config: Config
    client: SlurmClient
    environ: Mapping[str, str]
    probe: GpuProbe | None = None
    clock: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    # One deadline (on `mono`) for the whole run, Slurm calls and settle waits included.
    end: float = math.inf
    mono: Callable[[], float] = time.monotonic
    # gpuwarden's own failures in this run, by reason (store.SELF_REASONS).
    problems: dict[str, str] = field(default_factory=dict)
    # Health gating drained, resumed or was held in this run: its textfile is due.
    gating_changed: bool = False

    def fail(self, reason: str, message: str) -> None:
        """Record a failure of gpuwarden itself: error level (syslog), and the metric."""
        log.error("%s", message)
        self.problems.setdefault(reason, message)

    def left(self) -> float:
        return self.end - self.mono()

    def bounded_sleep(self, seconds: float) -> None:
        # A settle wait never eats the time the drain itself needs.
        self.sleep(max(0.0, min(seconds, self.left() - 2.0)))

    @property
    def node(self) -> str:
        return check_node_name(jobenv.node_name(self.environ, socket.gethostname))

    @property
    def store(self) -> Store:
        h = self.config.health
        return Store(h.state_dir, h.prom_dir)


def job_id(environ: Mapping[str, str]) -> str:
    """SLURM_JOB_ID for log lines and verdicts: digits (and _ for array tasks) only."""
    raw = jobenv.job_id(environ)
    return raw if raw and len(raw) <= 20 and raw.replace("_", "").isdigit() else "?"


def job_gpus(environ: Mapping[str, str]) -> set[int] | None:
    """The job's GPUs from SLURM_JOB_GPUS ("0,1,5"); None (all) when absent or malformed."""
    raw = jobenv.job_gpus(environ).strip()
    if not raw:
        return None
    try:
        return {int(x) for x in raw.split(",") if x.strip()}
    except ValueError:
        log.warning("ignoring malformed SLURM_JOB_GPUS=%r: checking every GPU", raw[:40])
        return None


def _load_counters(env: Env) -> Counters:
    try:
        return env.store.load_counters()
    except (GpuwardenError, OSError) as exc:
        env.fail("state", f"cannot read the pass counters ({exc}): counting from 0")
        return Counters()


def own_reason(counters: Counters, node: Node) -> str:
    """The drain health gating made here: recognised from Slurm's reason alone (its tag), so a
    kill between the drain and saving the counters never strands the node; an older drain is
    still known from the counters."""
    if node.reason and is_health_drain(node.reason):
        return node.reason
    return counters.drained_reason


def _act(env: Env, verdict: Verdict, resume_allowed: bool) -> tuple[drain.Applied, Node]:
    """Decide and apply; returns what was done and the node as Slurm showed it beforehand.

    Acts first, saves after: a state directory that cannot be written never stops a drain."""
    counters = _load_counters(env)
    node = env.client.node(env.node)
    own = own_reason(counters, node)
    # Kept: this very drain was seen within the cap (saved after "drained"/"kept" below).
    kept = bool(counters.drained_reason) and same_drain(node.reason, counters.drained_reason)
    decision = gate.decide(verdict, node, counters.passes, env.config.health.resume_after_passes,
                           own, kept)
    if decision.kind is drain.Kind.RESUME and not resume_allowed:
        decision = replace(decision, kind=drain.Kind.NOTHING)
    if decision.kind is drain.Kind.DRAIN:
        decision = replace(decision, why=health_reason(decision.why, origin_of(verdict.context)))
    if decision.kind is drain.Kind.DRAIN and not env.config.health.drain:
        applied = drain.Applied("held", f"would drain (drain = false): {decision.why}")
    else:
        # The gate bounds its own wait by the time left: a shortened tie wait is no wait.
        applied = drain.apply(decision, node, env.client, env.config.health.blast_radius,
                              env.clock, env.sleep, env.left)
    if applied.action == "drained":
        own = gpuwarden_reason(applied.detail)
    elif applied.action == "resumed":
        own = ""
    log.info("%s %s: %s: %s", verdict.context, env.node, applied.action, applied.detail)
    try:
        env.store.save_counters(Counters(decision.passes, verdict.status.name, own))
    except GpuwardenError as exc:
        env.fail("state", f"{verdict.context} {env.node}: {exc} (the action stands; the drain "
                          "is still recognised from its Slurm reason)")
    count(env, verdict.context, applied, node.reason)
    return applied, node


# What recording the gating metrics may take of a run (a lock, a small file; the textfile's
# render imports prometheus_client, 0.1-0.3 s): never more, and never the time the run's
# own Slurm calls need.
METRICS_S = 2.0


def count(env: Env, context: str, applied: drain.Applied, reason: str) -> None:
    """Add what health gating did to the node's persisted counts (gatingmetrics). Never
    fails the run: a failure is a self error "state", logged; the action stands."""
    hook = origin_of(context)
    if not hook:
        return
    ev = gatingmetrics.event(applied, hook, reason)
    try:
        with bounded(min(METRICS_S, env.left() - drain.CALLS_S)):
            gatingmetrics.record(env.config.health.state_dir, ev, wait_s=METRICS_S / 2)
    except (Exception, DeadlineExceeded) as exc:  # metrics never fail the hook
        env.fail("state", f"{context} {env.node}: gating metrics not counted "
                          f"({type(exc).__name__}: {exc}); the action stands")
        return
    env.gating_changed = True


def report_gating(env: Env, always: bool) -> None:
    """Health gating's textfile (gatingmetrics), from the persisted counts: every periodic
    run, else only after a drain, resume or cap hold. Is gating on: no self error so far in
    this run (the marker's rule, `off_reason`). Never fails the run (a self error "state")."""
    h = env.config.health
    if not h.prom_dir or not (always or env.gating_changed):
        return
    try:
        with bounded(min(METRICS_S, env.left() - drain.CALLS_S)), \
                gatingmetrics.held(h.state_dir, wait_s=METRICS_S / 2) as (counts, reset):
            if reset:
                env.fail("state", f"{env.node}: gating metrics reset: {reset}")
            gatingmetrics.write(h.prom_dir, env.node, counts, enabled=not off_reason(env))
    except (Exception, DeadlineExceeded) as exc:  # metrics never fail the hook
        env.fail("state", f"{env.node}: {gatingmetrics.FILE} not written "
                          f"({type(exc).__name__}: {exc})")


def _act_or_report(env: Env, verdict: Verdict, resume_allowed: bool
                   ) -> tuple[drain.Applied, Node] | None:
    try:
        return _act(env, verdict, resume_allowed)
    except SlurmError as exc:
        env.fail("slurm", f"{verdict.context} {env.node}: cannot act on {verdict.status.name}: "
                          f"{exc}")
        return None


def fake_gpu_fingerprint(env: Env) -> list[int] | None:
    """With the fake GPU probe (test clusters), the file's identity before the checks read it:
    stored with the verdict, so the prolog's fast path sees any change to it since, exactly."""
    h = env.config.health
    if h.gpu_probe != "fake":
        return None
    from gpuwarden.health.fastgate import fingerprint  # noqa: PLC0415

    return fingerprint(h.fake_gpu_file)


def _save(env: Env, verdict: Verdict, started: float, complete: bool = True,
          gpus: set[int] | None = None, fake_fp: list[int] | None = None) -> None:
    """Store ``verdict``, whose checks started at ``started`` (time.monotonic(): one clock
    for every process of this boot), unless a verdict whose checks started later was stored
    meanwhile (see Store.save_verdict)."""
    try:
        env.store.save_verdict(verdict, complete, gpus, fake_fp, started_mono=started)
    except GpuwardenError as exc:
        env.fail("state", f"{verdict.context} {env.node}: {exc}")


def note_gaps(env: Env, verdict: Verdict) -> None:
    """Part of gating off (no GPU probe on a GPU node, no kernel log, a forgeable one): loud,
    a self error with reason "config" and the marker's `off`, never a drain by itself."""
    for gap in gating_gaps(verdict, env.config.health.expected_for(env.node)):
        env.fail("config", f"{verdict.context} {env.node}: {gap}")


def report_self(env: Env, always: bool) -> None:
    """gpuwarden's own health into the textfile: every periodic run, else only on failures
    (the prolog's fast path writes nothing when all is well)."""
    if not (always or env.problems):
        return
    try:
        env.store.save_self(env.problems, env.clock())
    except GpuwardenError as exc:
        log.error("%s", exc)


def checks_budget(env: Env, budget: float) -> float:
    # The checks get at most half of what is left: the Slurm calls need the rest.
    return min(budget, max(0.5, env.left() / 2))


def periodic(env: Env) -> int:
    """HealthCheckProgram: every check; drain or resume; then store the verdict and publish
    the node's health marker in Slurm."""
    h = env.config.health
    fake_fp = fake_gpu_fingerprint(env)
    started = time.monotonic()  # the stored verdicts of all processes are ordered by it
    verdict = gather(h, env.node, "health check", checks_budget(env, h.periodic_budget_s),
                     probe=env.probe, now=env.clock)
    note_gaps(env, verdict)
    acted = _act_or_report(env, verdict, resume_allowed=True)
    _save(env, verdict, started, fake_fp=fake_fp)
    if acted is not None:
        publish_marker(env, acted[1], verdict.status.name, verdict.at)
    report_gating(env, always=True)
    report_ckpt(env)
    report_self(env, always=True)
    return 0


def report_ckpt(env: Env) -> None:
    """Checkpointing's textfile (ckpt.nodemetrics): root's reading of tier 0, in a child killed
    at a deadline, and the prolog's counts. A scan that fails or stops short is logged
    (syslog) and says so in the file (scan_complete 0; a failed one's series left out); a file
    that cannot be written is a self error "state". Never fails the run."""
    h, c = env.config.health, env.config.ckpt
    if not h.prom_dir:
        return
    from gpuwarden.ckpt import nodemetrics  # noqa: PLC0415

    held = None
    try:
        # The run's Slurm calls are behind it: what is left, less the textfile's own time.
        held = nodemetrics.scan_in_child(
            c.memory_root, c.shared_root, h.state_dir,
            max(1.0, min(nodemetrics.SCAN_S, env.left() - 2 * METRICS_S)))
        if not held.complete:
            log.error("%s: checkpoint tier 0 %s: the scan fell short (the shared tier refused "
                      "to root, or its time ran out before every job's owner was reached); "
                      "the series count only what was read", env.node, c.memory_root)
    except (GpuwardenError, OSError) as exc:
        log.error("%s: checkpoint tier 0 %s not read: %s (its series left out of %s)",
                  env.node, c.memory_root, exc, nodemetrics.FILE)
    try:
        with bounded(min(METRICS_S, env.left() - drain.CALLS_S)):
            reset = nodemetrics.write(h.state_dir, h.prom_dir, env.node, held,
                                      wait_s=METRICS_S / 2)
        if reset:
            env.fail("state", f"{env.node}: checkpoint metrics reset: {reset}")
    except (Exception, DeadlineExceeded) as exc:  # metrics never fail the hook
        env.fail("state", f"{env.node}: {nodemetrics.FILE} not written "
                          f"({type(exc).__name__}: {exc})")


def off_reason(env: Env) -> str:
    """Why gating is off or failing on this node now ("" when it works)."""
    if env.problems:
        return ",".join(sorted(env.problems))
    return "" if env.config.health.drain else "drain = false"


def publish_marker(env: Env, node: Node, status: str, at: float) -> None:
    """Keep the node's marker in Slurm's Extra current (rate-limited, see health.marker)."""
    previous = marker.decode(node.extra)
    off = off_reason(env)
    new = marker.Marker(int(at), status, off, marker.carry_since(previous, off, env.clock()))
    if not marker.due(previous, new):
        return
    text = marker.encode_into(node.extra, new)
    if text is None:
        log.warning("%s: the node's Extra holds other text: health marker not published, so "
                    "`gpuwarden nodes` cannot tell if gating works here", env.node)
        return
    try:
        env.client.set_extra(env.node, text)
    except SlurmError as exc:
        env.fail("slurm", f"cannot publish the health marker of {env.node}: {exc}")


def prolog(env: Env) -> int:
    """The fast gate; when it lets the job run, stage in the job's checkpoint (if requeued)."""
    rc = prolog_gate(env)
    if rc == 0:
        # Imported only here: a prolog that fails the job never pays for it.
        from gpuwarden.ckpt import jobdirs, jobkey, stagein  # noqa: PLC0415

        # Root makes the job's tier-0 directories (the job's user's, a squatter's moved aside)
        # before the job can, and its key file when [ckpt] key_file is set; none of these calls
        # ever raises.
        moved = jobdirs.for_prolog(env.config, env.environ)
        jobkey.for_prolog(env.config, env.environ)
        staged = stagein.for_prolog(env.config, env.environ)
        count_ckpt(env, moved, staged)
    return rc


def count_ckpt(env: Env, squatters: int, stagein: str) -> None:
    """What the prolog did for checkpoints, counted for the periodic check's textfile
    (ckpt.nodemetrics). Never fails the hook (a self error "state")."""
    if not env.config.health.prom_dir or not (squatters or stagein):
        return
    from gpuwarden.ckpt import nodemetrics  # noqa: PLC0415

    try:
        with bounded(min(METRICS_S, env.left() - drain.CALLS_S)):
            nodemetrics.count(env.config.health.state_dir, squatters, stagein,
                              wait_s=METRICS_S / 2)
    except (Exception, DeadlineExceeded) as exc:  # metrics never fail the hook
        env.fail("state", f"{env.node}: checkpoint metrics not counted "
                          f"({type(exc).__name__}: {exc})")


def _stored_complete(env: Env, what: str) -> Verdict | None:
    """The stored verdict when it is this node's and complete, else None. A state directory
    that cannot be trusted is a self error and no stored verdict: every check runs."""
    try:
        stored = env.store.load_stored()
    except GpuwardenError as exc:
        env.fail("state", f"{what}: {exc}: running every check")
        return None
    if stored is None or not stored[1] or stored[0].node != env.node:
        return None
    return stored[0]


def prolog_gate(env: Env) -> int:
    """The stored verdict (re-checked when stale) plus the job's GPUs; 0 lets the job run."""
    h = env.config.health
    job = job_id(env.environ)
    gpus = job_gpus(env.environ)
    start = env.clock()
    stored = _stored_complete(env, f"prolog job {job}")
    fresh = stored is not None and 0 <= start - stored.at <= h.verdict_max_age_s
    if fresh and stored is not None:
        quick = gather(h, env.node, f"prolog job {job}", h.prolog_budget_s, gpus=gpus,
                       node_checks="mounts", probe=env.probe, now=env.clock)
        # Only the node checks the fast path does not repeat are taken from the stored verdict;
        # every GPU, XID and mount result is fresh.
        kept = tuple(r for r in stored.results if r.check.startswith(STORED_CHECKS))
        verdict = replace(quick, results=kept + quick.results)
    else:
        fake_fp = fake_gpu_fingerprint(env)
        started = time.monotonic()
        verdict = gather(h, env.node, f"prolog job {job}", h.prolog_budget_s,
                         gpus=gpus, probe=env.probe, now=env.clock)
    note_gaps(env, verdict)
    for r in verdict.results:
        if r.status != Status.OK:
            log.warning("prolog job %s: %s %s: %s", job, r.check, r.status.name, r.message)
    acted = _act_or_report(env, verdict, False) if verdict.status == Status.CRITICAL else None
    if not fresh:
        # A verdict on the job's GPUs only is not the node's: stored marked partial (neither
        # the fast path nor the next prolog trusts it), kept out of the textfile.
        _save(env, verdict, started, complete=gpus is None, gpus=gpus, fake_fp=fake_fp)
    report_gating(env, always=False)
    report_self(env, always=False)
    if acted is None:
        return 0
    applied, _ = acted
    if _fail_the_job(env, applied):
        log.error("prolog job %s: failing the job so Slurm requeues it: %s", job, verdict.reason())
        _requeue_first(env, job)
        return 1
    return 0


def _requeue_first(env: Env, job: str) -> None:
    """Requeue the job before the prolog fails it, so no node starts its batch script.

    After a failed prolog slurmd sends slurmctld two messages: "prolog complete" (with the
    failure, but slurmctld only counts it done: job_mgr.c prolog_complete, 24.11 to 26.05), then
    the requeue. With PrologFlags=Alloc,DeferBatch, when this node's prolog is the last to end
    (a drain takes longer than a pass), the first lets slurmctld send the batch script to the
    job's first node before the second arrives (seen end to end, once in three runs: the script
    ran there). Requeued first, the job is completing when "prolog complete" comes, and nothing
    is launched. A job Slurm will not requeue (--no-requeue, not a batch job) is left to Slurm,
    as before."""
    if not job.isdigit():
        return
    try:
        env.client.requeue(int(job))
    except SlurmError as exc:
        log.warning("prolog job %s: not requeued by the prolog (%s): Slurm requeues or cancels "
                    "it once the prolog exits", job, exc)


def _fail_the_job(env: Env, applied: drain.Applied) -> bool:
    """Exit 1 only with the node drained by gpuwarden within the cap: Slurm then requeues the
    job and keeps that reason. With the node in service, Slurm would drain it itself ("Prolog
    error"), past the cap."""
    if applied.action in ("drained", "kept"):  # ranked within the cap just now
        return True
    if applied.action != "none":  # held at the cap, or drain = false
        return False
    # Nothing done: the node was out already, or another gpuwarden run (the periodic check
    # seeing the same fault, a lemon scan) drained it between the read and the drain.
    return _out_within_cap(env)


def _out_within_cap(env: Env) -> bool:
    """Is the node out with a gpuwarden reason that ranks within the blast-radius cap (the
    controller's order of the drains, gpuwarden.slurm.drain_cap), and still out once the run that
    drained it has made its own decision?"""
    try:
        node = env.client.node(env.node)
        if not ((node.drained or node.down) and node.reason_is_ours):
            return False  # in service, or someone else's drain: never failed on
        ranked = _ranked_within_cap(env, node)
        return ranked is not None and _still_out(env, node, ranked)
    except SlurmError as exc:
        env.fail("slurm", f"prolog {env.node}: cannot rank the drain the node is under: {exc}")
        return False


def _ranked_within_cap(env: Env, node: Node) -> tuple[Node, float] | None:
    """The node as ranked, with the controller's clock then, when its drain (``node``'s)
    ranks within the cap; None otherwise, or when the time left is too short to know."""
    cap = env.config.health.blast_radius
    if env.left() - drain.CALLS_S < drain.TIE_S:
        log.warning("prolog %s: too little time left to rank the drain found: the job runs",
                    env.node)
        return None
    # Every drain stamped no later than that one is visible once the controller's clock has
    # left its second.
    env.sleep(drain.TIE_S)
    view = env.client.out_of_service(also=(env.node,))
    now = view.get(env.node)
    if now is None or not (now.drained or now.down) or not same_drain(now.reason, node.reason):
        return None
    ok, _ = drain.ranks_within(now, view, env.client.partition_sizes(), cap)
    return (now, drain.controller_now(view)) if ok else None


def _still_out(env: Env, node: Node, ranked: tuple[Node, float]) -> bool:
    """The run that drained the node ranks it too once its settle wait is over, and the view
    may change by then (a restamp, an earlier drain resumed): the drain must still be there
    after that run's own decision."""
    now, clock = ranked
    cap = env.config.health.blast_radius
    decided = (now.reason_changed_at or 0) + max(cap.settle_s, drain.TIE_S) + drain.CALLS_S
    wait = decided - clock
    if wait > 0:
        if env.left() - drain.CALLS_S < wait:
            log.warning("prolog %s: too little time left to see the drain found kept: the job "
                        "runs", env.node)
            return False
        env.sleep(wait)
    last = env.client.node(env.node)
    return (last.drained or last.down) and same_drain(last.reason, node.reason)


def _job_failed(environ: Mapping[str, str]) -> bool:
    for code in jobenv.job_exit_codes(environ):
        value = code.split(":")[0].strip()
        if value and value != "0":
            return True
    return False


# A job can fill scratch or leave memory in use, and its leftovers can slow a check past its
# deadline: none of that is evidence about the hardware, so none of it drains in the epilog.
JOB_INFLUENCED = ("scratch", "memory")


def epilog_evidence(verdict: Verdict) -> Verdict:
    """The verdict the epilog may act on: CRITICAL only from the checks' own hardware evidence
    (XID, GPU, mounts, links), never from what the job left behind or from its exit code.

    A result held back is UNKNOWN (not judged), never WARNING (which the prolog's fast path
    takes as good); see needs_full_check."""
    def judged(r: CheckResult) -> CheckResult:
        timed_out = r.message.startswith(f"check {r.check} timed out")
        if r.status != Status.CRITICAL or not (r.check in JOB_INFLUENCED or timed_out):
            return r
        return replace(r, status=Status.UNKNOWN,
                       message=f"{r.message} {HELD_BACK}")
    return replace(verdict, results=tuple(judged(r) for r in verdict.results))


HELD_BACK = ("(not drain evidence after a job: the next prolog runs every check again and "
             "judges it, as does the periodic check)")


def needs_full_check(verdict: Verdict) -> bool:
    return any(r.message.endswith(HELD_BACK) for r in verdict.results)


def epilog(env: Env) -> int:
    """After the job: deeper checks when it failed or the node is suspect. Always exit 0.

    The job's failure only decides whether to look; a drain needs the checks' own evidence."""
    from gpuwarden.ckpt import jobdirs, jobkey  # noqa: PLC0415

    asked = JobOnce(env.client)
    # Node memory a finished job's checkpoints held is freed (kept while Slurm will run the
    # job again), and its key file removed (always); neither call ever raises.
    jobdirs.for_epilog(env.config, env.environ, asked)
    jobkey.for_epilog(env.config, env.environ)
    return epilog_gate(env, asked)


class JobOnce:
    """The job as Slurm shows it at the epilog, asked once for its two readers (tier 0's
    cleanup, the launcher's note): one RPC per node per job, not two."""

    def __init__(self, client: SlurmClient) -> None:
        self.client = client
        self._got: Job | GpuwardenError | None = None

    def job(self, job_id: int) -> Job:
        """The job, or the same GpuwardenError for both readers (whatever went wrong)."""
        if self._got is None:
            try:
                self._got = self.client.job(job_id)
            except GpuwardenError as exc:
                self._got = exc
            except Exception as exc:  # an epilog reader never stops the checks
                self._got = SlurmError(f"scontrol show job {job_id}: {type(exc).__name__}: "
                                       f"{exc}")
        if isinstance(self._got, GpuwardenError):
            raise self._got
        return self._got


def launcher_lost_here(env: Env, source: JobOnce | None) -> str:
    """What the job's launcher wrote about this node when it named it lost ("" when it did
    not, or when the job cannot be read: then the epilog's usual rules apply).

    The job's owner can write that note: it only makes the epilog run every check here."""
    job = job_id(env.environ)
    if source is None or job == "?":
        return ""
    try:
        comment = source.job(int(job)).comment
    except GpuwardenError as exc:
        env.fail("slurm", f"epilog job {job}: cannot read the job ({exc}): a node its "
                          "launcher lost is checked by the next prolog and the periodic check")
        return ""
    return lostnote.lost_in(comment).get(env.node, "")


def epilog_gate(env: Env, source: JobOnce | None = None) -> int:
    """The epilog's health part (the self-test's dry run calls it without ``source``: no
    Slurm job to read)."""
    h = env.config.health
    job = job_id(env.environ)
    try:
        stored = env.store.load_verdict()
    except GpuwardenError as exc:
        env.fail("state", f"epilog job {job}: {exc}")
        stored = None
    suspect = (stored is None or stored.status != Status.OK
               or env.clock() - stored.at > h.verdict_max_age_s)
    lost = launcher_lost_here(env, source)
    if lost:
        log.warning("epilog job %s: the job's launcher lost %s (%s): running every check",
                    job, env.node, lost)
    if not (suspect or lost or _job_failed(env.environ)):
        return 0
    fake_fp = fake_gpu_fingerprint(env)
    started = time.monotonic()
    # The stored verdict says why it ran (`gpuwarden health show`): stderr is discarded.
    context = f"epilog job {job}" + (f" (its launcher lost this node: {lost})" if lost else "")
    verdict = epilog_evidence(gather(h, env.node, context,
                                     checks_budget(env, h.epilog_budget_s), probe=env.probe,
                                     now=env.clock))
    note_gaps(env, verdict)
    if verdict.status == Status.CRITICAL:
        _act_or_report(env, verdict, resume_allowed=False)
    elif lost:
        log.warning("epilog job %s: %s passed every check after its launcher lost it: left in "
                    "service (a job's own report never drains a node)", job, env.node)
    # Results held back are stored as needing a full check: the fast path refuses the verdict
    # and the next prolog runs every check again.
    _save(env, verdict, started, complete=not needs_full_check(verdict), fake_fp=fake_fp)
    report_gating(env, always=False)
    report_self(env, always=False)
    return 0


def check(env: Env, gpus: set[int] | None = None) -> Verdict:
    """By hand: the same checks, nothing stored, nothing drained."""
    h = env.config.health
    return gather(h, env.node, "manual check", h.periodic_budget_s, gpus=gpus, probe=env.probe,
                  now=env.clock)


class DeadlineExceeded(BaseException):
    """The whole run passed its deadline; raised in the main thread by the watchdog."""


@contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Raise DeadlineExceeded after ``seconds``, wherever the run is stuck (a hung write, a
    slow syscall): the hook then ends before Slurm kills it. Main thread only."""
    if not math.isfinite(seconds) or seconds <= 0:
        yield
        return
    with bounded(seconds):
        yield


@contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raise DeadlineExceeded after ``seconds`` in the block (at once when <= 0), inside the
    run's own `watchdog`, which goes on afterwards with what was left of it (or any other
    ITIMER_REAL user's: pytest-timeout's). Main thread only."""
    if seconds <= 0:
        raise DeadlineExceeded("no time left for it in this run")
    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    mine = seconds if not outer else min(seconds, outer)
    start = time.monotonic()

    def fire(signum: int, frame: object) -> None:
        raise DeadlineExceeded(f"still running after {mine:g} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, mine)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            # The outer timer goes on; past its time already, it fires at once.
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer - (time.monotonic() - start)))


def safe(fn: Callable[[], int], what: str, on_error: int) -> int:
    """Slurm entry points never crash with a traceback; an internal error is logged (error
    level: syslog) and answered with ``on_error`` (0 for the prolog and epilog: fail open,
    never fail a job or drain a node on gpuwarden's own bug)."""
    try:
        return fn()
    except GpuwardenError as exc:
        log.error("%s: %s", what, exc)
    except DeadlineExceeded as exc:
        log.error("%s: stopped: %s (Slurm would kill it next)", what, exc)
    except Exception:
        log.exception("%s: internal error", what)
    return on_error


def run(env: Env, fn: Callable[[Env], int], what: str, watchdog_s: float) -> int:
    """A Slurm entry point, start to end: never a traceback, never past the deadline, and
    every failure of gpuwarden itself filed (syslog + self-error metric). Fails open: an
    internal failure answers 0, so no job fails and no node drains on gpuwarden's own bug."""
    try:
        with watchdog(watchdog_s):
            return fn(env)
    except DeadlineExceeded as exc:
        env.fail("deadline", f"{what}: stopped: {exc} (Slurm would kill it next)")
    except StateDirError as exc:
        env.fail("state", f"{what}: {exc}")
    except SlurmError as exc:
        env.fail("slurm", f"{what}: {exc}")
    except GpuwardenError as exc:
        env.fail("internal", f"{what}: {exc}")
    except Exception as exc:
        log.exception("%s: internal error", what)
        env.problems.setdefault("internal", f"{what}: {exc.__class__.__name__}: {exc}")
    try:
        with watchdog(3.0):
            report_self(env, always=True)
    except DeadlineExceeded:
        log.error("%s: cannot write the self-error metric in time", what)
    return 0


def environ() -> Mapping[str, str]:
    return os.environ
