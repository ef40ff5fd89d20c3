"""The three Slurm entry points (HealthCheckProgram, Prolog, Epilog) and the manual check.

Each returns an exit status. Slurm-facing rules: the prolog exits non-zero only after draining
the node itself (so Slurm requeues the job elsewhere and keeps gpuwarden's reason); the epilog
always exits 0 (it drains by itself, so Slurm never adds "Epilog error" on top).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from gpuwarden.config import Config
from gpuwarden.errors import GpuwardenError
from gpuwarden.health import gate
from gpuwarden.health.gather import gather
from gpuwarden.health.model import Status, Verdict
from gpuwarden.health.probe import GpuProbe
from gpuwarden.health.store import Counters, Store
from gpuwarden.slurm.client import SlurmClient, check_node_name, gpuwarden_reason
from gpuwarden.slurm.models import Node

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

    @property
    def node(self) -> str:
        name = self.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
        return check_node_name(name)

    @property
    def store(self) -> Store:
        h = self.config.health
        return Store(h.state_dir, h.prom_dir)


def job_id(environ: Mapping[str, str]) -> str:
    """SLURM_JOB_ID for log lines and verdicts: digits (and _ for array tasks) only."""
    raw = environ.get("SLURM_JOB_ID", "")
    return raw if raw and len(raw) <= 20 and raw.replace("_", "").isdigit() else "?"


def job_gpus(environ: Mapping[str, str]) -> set[int] | None:
    """The job's GPUs from SLURM_JOB_GPUS ("0,1,5"); None (all) when absent or malformed."""
    raw = environ.get("SLURM_JOB_GPUS", "").strip()
    if not raw:
        return None
    try:
        return {int(x) for x in raw.split(",") if x.strip()}
    except ValueError:
        log.warning("ignoring malformed SLURM_JOB_GPUS=%r: checking every GPU", raw[:40])
        return None


def _act(env: Env, verdict: Verdict, resume_allowed: bool) -> tuple[gate.Applied, Node]:
    """Decide and apply; returns what was done and the node as Slurm showed it beforehand."""
    store = env.store
    counters = store.load_counters()
    node = env.client.node(env.node)
    decision = gate.decide(verdict, node, counters.passes, env.config.health.resume_after_passes,
                           counters.drained_reason)
    if decision.kind is gate.Kind.RESUME and not resume_allowed:
        decision = replace(decision, kind=gate.Kind.NOTHING)
    if decision.kind is gate.Kind.DRAIN and not env.config.health.drain:
        applied = gate.Applied("held", f"would drain (drain = false): {decision.why}")
    else:
        applied = gate.apply(decision, node, env.client, env.config.health.blast_radius,
                             env.clock, env.sleep)
    own = counters.drained_reason
    if applied.action == "drained":
        own = gpuwarden_reason(applied.detail)
    elif applied.action == "resumed":
        own = ""
    store.save_counters(Counters(decision.passes, verdict.status.name, own))
    log.info("%s %s: %s: %s", verdict.context, env.node, applied.action, applied.detail)
    return applied, node


def periodic(env: Env) -> int:
    """HealthCheckProgram: every check, store the verdict, drain or resume."""
    h = env.config.health
    verdict = gather(h, env.node, "health check", h.periodic_budget_s, probe=env.probe,
                     now=env.clock)
    env.store.save_verdict(verdict)
    _act(env, verdict, resume_allowed=True)
    return 0


def prolog(env: Env) -> int:
    """The fast gate; when it lets the job run, stage in the job's checkpoint (if requeued)."""
    rc = _prolog_gate(env)
    if rc == 0:
        # Imported only here: a prolog that fails the job never pays for it.
        from gpuwarden.ckpt import stagein  # noqa: PLC0415

        stagein.for_prolog(env.config, env.environ)
    return rc


def _prolog_gate(env: Env) -> int:
    """The stored verdict (re-checked when stale) plus the job's GPUs; 0 lets the job run."""
    h = env.config.health
    job = job_id(env.environ)
    start = env.clock()
    stored = env.store.load_verdict()
    fresh = stored is not None and 0 <= start - stored.at <= h.verdict_max_age_s
    if fresh and stored is not None:
        quick = gather(h, env.node, f"prolog job {job}", h.prolog_budget_s, gpus=job_gpus(env.environ),
                       node_checks="mounts", probe=env.probe, now=env.clock)
        # Only the node checks the fast path does not repeat are taken from the stored verdict;
        # every GPU, XID and mount result is fresh.
        kept = tuple(r for r in stored.results if r.check.startswith(STORED_CHECKS))
        verdict = replace(quick, results=kept + quick.results)
    else:
        verdict = gather(h, env.node, f"prolog job {job}", h.prolog_budget_s,
                         gpus=job_gpus(env.environ), probe=env.probe, now=env.clock)
        env.store.save_verdict(verdict)
    for r in verdict.results:
        if r.status != Status.OK:
            log.warning("prolog job %s: %s %s: %s", job, r.check, r.status.name, r.message)
    if verdict.status != Status.CRITICAL:
        return 0
    applied, node = _act(env, verdict, resume_allowed=False)
    if applied.action == "drained" or (node.drained and node.reason_is_ours):
        log.error("prolog job %s: failing the job so Slurm requeues it: %s", job, verdict.reason())
        return 1
    return 0


def _job_failed(environ: Mapping[str, str]) -> bool:
    for key in ("SLURM_JOB_EXIT_CODE", "SLURM_JOB_EXIT_CODE2", "SLURM_JOB_DERIVED_EC"):
        value = environ.get(key, "").split(":")[0].strip()
        if value and value != "0":
            return True
    return False


def epilog(env: Env) -> int:
    """After the job: deeper checks when it failed or the node is suspect. Always exit 0."""
    h = env.config.health
    job = job_id(env.environ)
    stored = env.store.load_verdict()
    suspect = (stored is None or stored.status != Status.OK
               or env.clock() - stored.at > h.verdict_max_age_s)
    if not (suspect or _job_failed(env.environ)):
        return 0
    verdict = gather(h, env.node, f"epilog job {job}", h.epilog_budget_s, probe=env.probe,
                     now=env.clock)
    env.store.save_verdict(verdict)
    if verdict.status == Status.CRITICAL:
        _act(env, verdict, resume_allowed=False)
    return 0


def check(env: Env, gpus: set[int] | None = None) -> Verdict:
    """By hand: the same checks, nothing stored, nothing drained."""
    h = env.config.health
    return gather(h, env.node, "manual check", h.periodic_budget_s, gpus=gpus, probe=env.probe,
                  now=env.clock)


def safe(fn: Callable[[], int], what: str, on_error: int) -> int:
    """Slurm entry points never crash with a traceback; an internal error is logged and
    answered with ``on_error`` (0 for the prolog and epilog: fail open, never fail a job or
    drain a node on gpuwarden's own bug)."""
    try:
        return fn()
    except GpuwardenError as exc:
        log.error("%s: %s", what, exc)
    except Exception:
        log.exception("%s: internal error", what)
    return on_error


def environ() -> Mapping[str, str]:
    return os.environ
