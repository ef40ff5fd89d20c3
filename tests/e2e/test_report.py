"""`gpuwarden report` of the test cluster's own accounting (after the scenarios run before it in
the session), as an operator opens it: the jobs it ran are counted by class, and the page
renders in headless Chromium with its charts drawn and nothing wider than the window."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from devcluster.cluster import VENV_PYTHON
from devcluster.harness import JOBS_DIR, Harness
from gpuwarden.report.render import MAX_PARTITION_CHARTS
from tests.browser import assert_charts_drawn, assert_fits
from tests.e2e.test_foundation import wait_for
from tests.e2e.test_health import nodes

OUT = "/root/gpuwarden-report"  # root's own directory on slurmctld
# A rank's life in one line: restore, or save a first step when there is none.
_SAVE_OR_RESTORE = (
    "import numpy as np; from gpuwarden.ckpt.job import JobCheckpointer as J; "
    "ck = J.from_slurm(); got = ck.restore(); print(\"restored\", got and got.tier); "
    "got or ck.save(1, {\"w\": np.zeros(1 << 20)}); ck.finish(None if got else 1)")


def _measured_failure(h: Harness, exclude: str) -> str:
    """A failure the report can measure: a job saves a step, its node's GPU breaks, the job
    fails and health gating drains the node (so the run is the hardware's), and requeued it
    restores on another node. Returns the node, resumed and healthy again."""
    idle = h.exec("slurmctld", ["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"]).check("sinfo").out
    victim = next(n for n in sorted(idle.split()) if n != exclude)
    job = h.sbatch("-N1", "--gpus-per-node=8", "-w", victim, name="report-fail", wrap=(
        f"srun {VENV_PYTHON} -I -c '{_SAVE_OR_RESTORE}' && "
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then '
        "touch /fsx/jobs/saved-$SLURM_JOB_ID; "
        "for i in $(seq 600); do test -e /fsx/jobs/fail-$SLURM_JOB_ID && exit 1; sleep 0.2; "
        "done; fi"))
    try:
        wait_for(lambda: h.exec(victim, ["test", "-e", f"{JOBS_DIR}/saved-{job}"]).rc == 0, 120,
                 "the job saves its first step")
        h.set_gpu(victim, 2, ecc_uncorrected_volatile=1)
        h.exec(victim, ["touch", f"{JOBS_DIR}/fail-{job}"]).check("fail the job")
        h.wait_job(job, want=("FAILED",), timeout=120)
        wait_for(lambda: nodes(h)[victim].drained, 90, f"health gating drains {victim}")
        # Requeued, it may run anywhere but the drained node (-w would hold it for that one).
        h.exec("slurmctld", ["scontrol", "requeue", str(job)]).check("requeue")
        h.exec("slurmctld", ["scontrol", "update", f"jobid={job}",
                             f"excnodelist={victim}", "reqnodelist="]).check("unpin")
        h.wait_job(job, timeout=240)
        out = h.exec("slurmctld", ["cat", f"{JOBS_DIR}/report-fail-{job}.out"]).check("out").out
        assert re.search(r"restored (memory|peer|shared)", out), out
    finally:
        h.clear_gpu_faults(victim)
        h.sh(victim, "rm -f /var/lib/gpuwarden/*.json")
        if nodes(h)[victim].drained:
            h.exec("slurmctld", ["scontrol", "update", f"nodename={victim}",
                                 "state=resume"]).check("resume")
    return victim


@pytest.mark.versions
@pytest.mark.timeout(600)
def test_the_clusters_report_counts_its_jobs_and_renders(cluster: Harness,
                                                          tmp_path: Path) -> None:
    h = cluster
    # The failed job must be the user's by the report's rules: one node that health gating
    # never drained in the window (earlier tests drain nodes; a health drain of its node after
    # it started would make it the hardware's, rightly). Pick such a node, idle now.
    drained = h.exec("slurmctld", ["sacctmgr", "-n", "-P", "show", "events", "start=now-2days",
                                   "format=NodeName,Reason"]).check("events").out
    touched = {line.split("|")[0] for line in drained.splitlines()
               if "|" in line and line.split("|", 1)[1].startswith("gpuwarden:")}
    idle = h.exec("slurmctld", ["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"]).check("sinfo").out
    clean = sorted(set(idle.split()) - touched)
    assert clean, f"every idle node had a gpuwarden drain this session: {sorted(touched)}"
    # A job that checkpoints, loses its node-memory copy (as a requeue onto a new node does)
    # and restores from the shared tier: its restore time is on the page's filesystem card.
    ck = h.sbatch("-N1", "--gpus-per-node=8", name="report-ckpt", wrap=(
        f"srun {VENV_PYTHON} -I -c '{_SAVE_OR_RESTORE}' && "
        "rm -rf /dev/shm/gpuwarden-ckpt/job-$SLURM_JOB_ID/rank-00000 && "
        f"srun {VENV_PYTHON} -I -c '{_SAVE_OR_RESTORE}'"))
    ok = h.sbatch("-N1", "--gpus-per-node=8", name="report-ok", wrap="true")
    bad = h.sbatch("-N1", "--gpus-per-node=8", "-w", clean[0], name="report-bad",
                   wrap="exit 3")
    assert h.wait_finished([ok, bad, ck], timeout=180) == {ok: "COMPLETED", bad: "FAILED",
                                                            ck: "COMPLETED"}
    said = h.exec("slurmctld", ["cat", f"{JOBS_DIR}/report-ckpt-{ck}.out"]).check("output").out
    assert "restored None" in said and "restored shared" in said, said
    victim = _measured_failure(h, exclude=clean[0])


    h.exec("slurmctld", ["install", "-d", "-m", "700", OUT]).check("report directory")
    # An operator's drain of its own inside the history (after these jobs began, held while
    # the gang job runs), so the drains chart has something whatever ran before.
    held = next((n for n in reversed(clean) if n not in (clean[0], victim)),
                sorted(set(idle.split()) - {victim})[-1])
    h.exec("slurmctld", ["scontrol", "update", f"nodename={held}", "state=drain",
                         "reason=report test: operator"]).check("drain")
    try:
        def recorded() -> bool:
            out = h.exec("slurmctld", ["sacctmgr", "-n", "-P", "show", "events",
                                       "start=now-1hours", f"nodes={held}",
                                       "format=Reason"]).out
            return "report test: operator" in out
        wait_for(recorded, 60, f"slurmdbd records the drain of {held}")
        gang = h.sbatch("-N2", "--gpus-per-node=8", name="report-gang", wrap="true")
        assert h.wait_finished([gang], timeout=180) == {gang: "COMPLETED"}
    finally:
        h.exec("slurmctld", ["scontrol", "update", f"nodename={held}",
                             "state=resume"]).check("resume")
    res = h.gpuwarden("slurmctld", "report", "--since", "1d", "-o", f"{OUT}/report.html",
                      "--json", f"{OUT}/report.json", "--topology", "/etc/slurm/topology.conf",
                      timeout=300).check("gpuwarden report")
    assert f"wrote {OUT}/report.html" in res.out + res.err
    doc = json.loads(h.exec("slurmctld", ["cat", f"{OUT}/report.json"]).check("json").out)
    assert doc["records"] >= 2
    # This session's cluster is younger than --since 1d: read from the first thing slurmdbd
    # recorded (its registration), not as a day old, and the page says so (issue 39).
    assert "but the first thing recorded is" in doc["window_note"], doc["window_note"]
    assert doc["span_days"] < 1.0 and doc["mttf"]["node_days"] < 8.0, doc["window_note"]
    # The failed job is the user's (one node, no health drain), and it is on the page's
    # failures-by-class figures.
    user = sum(p["totals"]["user"] for p in doc["outcomes"]["partitions"])
    assert user >= 1, doc["outcomes"]["partitions"]
    # The placement card reads the cluster's leaves: the 2-node job is a gang run in it.
    card = {t["key"]: {f["label"]: f["value"] for f in t["figures"]} for t in doc["tradeoffs"]}
    store = card["filesystem_vs_object_store"]
    assert store["restore time from the parallel filesystem (median)"] is not None, store
    # The failure the job measured: its lost work and restart come from its restore record;
    # health gating's drain of its node says which check made it.
    measured = card["checkpoint_vs_redundancy"]
    assert measured["failures measured from the jobs' restore records"] >= 1, measured
    assert measured["restart per measured failure, failure to restored (median)"] > 0, measured
    health = card["proactive_vs_reactive"]
    assert health["drains by the epilog (after a job on the node)"] \
        + health["drains by the periodic check"] >= 1, health
    placed = card["central_vs_negotiated"]
    assert placed["gang runs (more than one node)"] >= 1, placed
    assert placed["gang runs on nodes topology.conf does not list"] == 0, placed

    page = tmp_path / "report.html"
    page.write_text(h.exec("slurmctld", ["cat", f"{OUT}/report.html"]).check("html").out)
    charts = 3 + min(len(doc["outcomes"]["partitions"]), MAX_PARTITION_CHARTS)  # + MTTF, ETTR, drains
    assert_fits(page, 1280)
    assert_charts_drawn(page, charts)
