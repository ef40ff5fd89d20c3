"""Issue 3's proof in the real cluster: health gating through Slurm's prolog, epilog and
HealthCheckProgram, with fake GPUs whose faults the tests inject."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import pytest

from devcluster.harness import FAKE_DIR, Harness
from gpuwarden.slurm import parse
from gpuwarden.slurm.models import Node
from tests.e2e.test_foundation import node_state, sinfo_reasons, wait_for

pytestmark = pytest.mark.timeout(420)
NODES = [f"c{i}" for i in range(1, 9)]


def nodes(h: Harness) -> dict[str, Node]:
    out = h.exec("slurmctld", ["scontrol", "show", "nodes", "--json"]).check("nodes").out
    return {n.name: n for n in parse.parse_nodes(out)}


def periodic(h: Harness, node: str) -> None:
    h.exec(node, ["/opt/gpuwarden/prolog/gpuwarden-healthcheck"], timeout=60).check("healthcheck")


@pytest.fixture
def clean(cluster: Harness) -> Iterator[Harness]:
    yield cluster
    for node in NODES:
        cluster.clear_gpu_faults(node)
        # rm first: the hung-mount test leaves a FIFO there, and writing to it would block.
        cluster.sh(node, "rm -f /var/lib/gpuwarden/*.json /fsx/.canary/$(hostname) && "
                   "echo ok > /fsx/.canary/$(hostname)").check("reset node")
    for n in nodes(cluster).values():
        if n.drained or n.down:
            cluster.exec("slurmctld", ["scontrol", "update", f"nodename={n.name}", "state=resume"])
        if n.comment:
            cluster.exec("slurmctld", ["scontrol", "update", f"nodename={n.name}", "comment="])
    cluster.exec("slurmctld", ["scancel", "--user=alice"])


@pytest.mark.versions
def test_xid79_drains_requeues_elsewhere_and_returns_after_passing_checks(clean: Harness) -> None:
    h = clean
    h.exec("slurmctld", ["scontrol", "update", "nodename=c4", "state=drain",
                         "reason=maintenance"]).check("operator drain")
    blockers = [h.sbatch("-w", n, "--exclusive", name="blocker", wrap="sleep 300")
                for n in ("c1", "c2")]
    for b in blockers:
        h.wait_job(b, want=("RUNNING",), timeout=60)
    h.inject_xid("c3", 5, 79)

    # Lowest free node is c3: the victim lands there, its prolog fails, Slurm requeues it.
    victim = h.sbatch("-N1", "--gpus-per-node=8", name="victim", wrap="hostname")
    h.wait_job(victim, timeout=300)
    h.wait_acct(victim, "COMPLETED", timeout=60)
    runs = h.acct(victim)
    # Slurm's own periodic check is off in the tests' clusters (conftest): it would drain c3
    # if it saw the Xid before the victim's prolog did.
    assert (runs[0].state, runs[0].nodes) == ("REQUEUED", "c3"), (runs, sinfo_reasons(h))
    assert runs[-1].state == "COMPLETED" and runs[-1].nodes not in ("c3", "c4")
    # Each run's own restart count, as the report's requeue waits read them.
    assert [r.restart_count for r in runs] == list(range(len(runs)))
    reason = sinfo_reasons(h)["c3"]
    assert reason.startswith("gpuwarden: prolog: xid 79 on GPU 5 at ")

    # No second job on c3: a burst of jobs all goes elsewhere.
    later = [h.sbatch("-N1", name="after", wrap="true") for _ in range(4)]
    for j in later:
        h.wait_job(j, timeout=120)
    assert all(r.nodes != "c3" for j in later for r in h.acct(j))

    # Still faulty: the health check keeps the drain and its evidence.
    periodic(h, "c3")
    assert sinfo_reasons(h)["c3"] == reason
    # Fault cleared: back in service after resume_after_passes (2) passing checks.
    h.clear_gpu_faults("c3")
    periodic(h, "c3")
    assert "DRAIN" in nodes(h)["c3"].state
    periodic(h, "c3")
    wait_for(lambda: node_state(h, "c3") == "idle", 30, "c3 is back in service")

    # The operator's drain on c4 was never touched, even by its own health checks.
    periodic(h, "c4")
    periodic(h, "c4")
    assert sinfo_reasons(h)["c4"] == "maintenance"
    assert node_state(h, "c4") == "drained"
    for b in blockers:
        h.exec("slurmctld", ["scancel", str(b)])


def test_blast_radius_cap_holds_back_drains_past_25_percent(clean: Harness) -> None:
    h = clean
    faulty = ["c1", "c2", "c5", "c6", "c7"]
    for n in faulty:
        h.set_gpu(n, 0, ecc_uncorrected_volatile=3)
    threads = [threading.Thread(target=periodic, args=(h, n)) for n in faulty]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    state = nodes(h)
    drained = [n for n in faulty if state[n].drained]
    held = [n for n in faulty if state[n].comment.startswith("gpuwarden: would drain")]
    assert len(drained) == 2, {n: (state[n].state, state[n].comment) for n in faulty}
    assert sorted(drained + held) == faulty
    for n in drained:
        # The periodic check's drain, or an epilog's (a job of an earlier test ending there).
        assert re.match(r"gpuwarden: (periodic|epilog): 3 uncorrectable ECC errors on GPU 0",
                        state[n].reason), state[n].reason
    listing = h.gpuwarden("slurmctld", "nodes").check("gpuwarden nodes").out
    for n in held:
        (line,) = [ln for ln in listing.splitlines() if ln.startswith(f"{n} ")]
        assert "would drain" in line and "blast-radius cap" in line and "IDLE" in line


def test_hung_mount_times_out_within_the_prolog_budget(clean: Harness) -> None:
    h = clean
    # A FIFO as the canary: opening it blocks forever, as a read on a dead NFS server does.
    h.sh("c2", "rm -f /fsx/.canary/c2 && mkfifo /fsx/.canary/c2").check("mkfifo")
    res = h.sh("c2", "SLURMD_NODENAME=c2 SLURM_JOB_ID=4242 /opt/gpuwarden/prolog/gpuwarden-prolog",
               timeout=60)
    # The check's own 3 s deadline ended it: it answered, refused the job and named the check,
    # well inside the hook's limit (270 s), and the wrapper's watchdog never had to stop it.
    # (An absolute bound on the wall time, 10 s, failed on a loaded host at 11.8 s: the drain's
    # calls to slurmctld wait on the host, not on the check.)
    assert res.rc == 1, res.err
    assert "check mount:/fsx timed out after 3 s" in res.err
    assert "did not finish within" not in res.err
    assert sinfo_reasons(h)["c2"] == \
        "gpuwarden: prolog: check mount:/fsx timed out after 3 s [health]"


def test_garbage_inputs_give_clear_errors_and_never_drain(clean: Harness) -> None:
    h = clean
    h.write_fake("c6", "gpus.json", '{"gpus": [{"index": "zero"}]')
    res = h.gpuwarden("c6", "health", "check")
    assert res.rc == 3 and f"{FAKE_DIR}/gpus.json: not JSON" in res.out
    h.write_fake("c7", "kmsg", "garbage that is not a record\n"
                 "3,1,100,-;NVRM: Xid (PCI:zz:zz): seventy-nine\n")
    res = h.gpuwarden("c7", "health", "check")
    assert res.rc == 3 and "kernel log: 1 malformed line(s), not acted on (line 1:" in res.out
    h.sh("c8", "cp /etc/gpuwarden/gpuwarden.toml /tmp/good.toml && "
               "printf '[health]\\ndrian = true\\n' > /etc/gpuwarden/gpuwarden.toml").check("bad cfg")
    try:
        res = h.gpuwarden("c8", "health", "check")
        assert res.rc == 3 and "health.drian: unknown key" in res.err
        res = h.sh("c8", "SLURMD_NODENAME=c8 SLURM_JOB_ID=1 /opt/gpuwarden/prolog/gpuwarden-prolog")
        assert res.rc == 0 and "health.drian: unknown key" in res.err and "skipped" in res.err
    finally:
        h.sh("c8", "cp /tmp/good.toml /etc/gpuwarden/gpuwarden.toml")
    for n in ("c6", "c7", "c8"):
        periodic(h, n)
    assert not any(n in sinfo_reasons(h) for n in ("c6", "c7", "c8"))


def test_epilog_checks_a_node_after_a_failed_job_and_drains_it(clean: Harness) -> None:
    h = clean
    periodic(h, "c5")  # a fresh OK verdict: only the job's failure makes the epilog look
    job = h.sbatch("-w", "c5", name="fails",
                   wrap="touch /fsx/jobs/started-$SLURM_JOB_ID; sleep 5; exit 1")
    # RUNNING already shows while the prolog runs: wait until the job script itself has begun.
    wait_for(lambda: h.exec("c5", ["test", "-e", f"/fsx/jobs/started-{job}"]).rc == 0, 60,
             "the job script starts")
    h.set_gpu("c5", 2, ecc_uncorrected_volatile=1)  # the GPU breaks during the job
    h.wait_job(job, want=("FAILED",), timeout=60)
    wait_for(lambda: "c5" in sinfo_reasons(h), 30, "the epilog drains c5")
    # Slurm's own periodic check is off in the tests' clusters (conftest): on its timer it
    # could drain c5 in the seconds between the fault and the epilog.
    assert sinfo_reasons(h)["c5"] == \
        "gpuwarden: epilog: 1 uncorrectable ECC errors on GPU 2 [health]"
    # The drain comes first and the verdict is stored after it (a full disk never stops a
    # drain): wait for the stored verdict, do not race it.
    wait_for(lambda: f"epilog job {job}" in h.gpuwarden("c5", "health", "show").out, 30,
             "the epilog's verdict to be stored")
    shown = h.gpuwarden("c5", "health", "show").out
    assert f"c5: CRITICAL (epilog job {job})" in shown
    assert "GPU 2: 1 uncorrectable ECC errors" in shown


def test_an_admin_rehearses_a_drain_with_health_inject_and_undoes_it(clean: Harness) -> None:
    """docs/testing-without-gpus.md on a real node: the command writes the driver's record, the
    periodic check drains on it, `inject clear` and two passing checks bring the node back."""
    h = clean
    h.gpuwarden("c7", "health", "inject", "xid", "79", "--gpu", "5").check("inject")
    periodic(h, "c7")
    wait_for(lambda: "xid 79" in sinfo_reasons(h).get("c7", ""), 60, "c7 drained for xid 79")
    h.gpuwarden("c7", "health", "inject", "clear").check("clear")
    for _ in range(2):
        periodic(h, "c7")
    wait_for(lambda: "drain" not in node_state(h, "c7"), 60, "c7 back in service")
    # A non-root user cannot rehearse anything.
    res = h.sh("c7", "runuser -u alice -- /usr/local/bin/gpuwarden health inject xid 79 --gpu 1")
    assert res.rc != 0 and "root" in (res.out + res.err)
