"""Issue 2's proof in the real cluster: GPU jobs, accounting, and drains with ownership."""

from __future__ import annotations

import time

import pytest

from devcluster.cluster import SRC, VENV_PYTHON
from devcluster.harness import JOBS_DIR, Harness

# Every test here but the fault one runs on every Slurm release (`versions`): killing, pausing
# and cutting off containers is Docker's, and a killed node's NODE_FAIL and return are
# covered on each release by test_ckpt_requeue's killed-node test.
pytestmark = pytest.mark.timeout(300)


def sinfo_reasons(h: Harness) -> dict[str, str]:
    out = h.exec("slurmctld", ["sinfo", "-R", "-h", "-N", "-o", "%N|%E"]).check("sinfo -R").out
    return dict(line.split("|", 1) for line in out.splitlines() if line)


def node_state(h: Harness, node: str) -> str:
    return h.exec("slurmctld", ["sinfo", "-h", "-n", node, "-o", "%T"]).check("sinfo").out.strip()


def wait_for(predicate, timeout: float, what: str, interval: float = 1.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting until {what}")


@pytest.mark.versions
def test_two_node_gpu_job_runs_and_is_completed_in_accounting(cluster: Harness) -> None:
    job = cluster.sbatch("-N2", "--gpus-per-node=8", name="two-node",
                         wrap="srun bash -c 'echo $(hostname) $SLURM_GPUS_ON_NODE'")
    cluster.wait_job(job, timeout=120)
    rec = cluster.wait_acct(job, "COMPLETED", timeout=60)
    assert rec.num_nodes == 2 and rec.gpus == 16 and rec.user == "alice"
    out = cluster.exec("c1", ["cat", f"{JOBS_DIR}/two-node-{job}.out"]).check("read output").out
    lines = sorted(out.split("\n"))[1:] if out.endswith("\n") else sorted(out.split("\n"))
    hosts = {line.split()[0] for line in lines if line}
    assert len(hosts) == 2 and all(line.split()[1] == "8" for line in lines if line)


@pytest.mark.versions
def test_drain_through_the_client_shows_in_sinfo_and_resumes(cluster: Harness) -> None:
    res = cluster.gpuwarden("slurmctld", "drain", "c3", "--reason", "e2e xid 79 on GPU 5")
    assert res.rc == 0, res.err
    assert sinfo_reasons(cluster)["c3"] == "gpuwarden: e2e xid 79 on GPU 5"
    listing = cluster.gpuwarden("slurmctld", "nodes").check("gpuwarden nodes").out
    (c3,) = [ln for ln in listing.splitlines() if ln.startswith("c3 ")]
    assert "DRAIN" in c3 and "gpuwarden" in c3.split()[2]
    res = cluster.gpuwarden("slurmctld", "resume", "c3")
    assert res.rc == 0 and "resumed" in res.out
    assert "c3" not in sinfo_reasons(cluster)
    # Slurm marks a resumed node not-responding ("idle*") until its next ping answers.
    wait_for(lambda: node_state(cluster, "c3") == "idle", 30, "c3 is idle")


@pytest.mark.versions
def test_an_operators_drain_is_refused_by_resume_and_drain(cluster: Harness) -> None:
    cluster.exec("slurmctld", ["scontrol", "update", "nodename=c4", "state=drain",
                               "reason=maintenance"]).check("scontrol drain")
    try:
        res = cluster.gpuwarden("slurmctld", "resume", "c4")
        assert res.rc == 3
        assert "refusing to resume c4" in res.err and "maintenance" in res.err
        res = cluster.gpuwarden("slurmctld", "drain", "c4", "--reason", "lemon")
        assert res.rc == 3 and "refusing to drain c4" in res.err
        assert sinfo_reasons(cluster)["c4"] == "maintenance"
        assert node_state(cluster, "c4") == "drained"
    finally:
        cluster.exec("slurmctld", ["scontrol", "update", "nodename=c4", "state=resume"])


@pytest.mark.versions
def test_cluster_is_rendered_from_one_description(cluster: Harness) -> None:
    topo = cluster.exec("slurmctld", ["scontrol", "show", "topology"]).check("topology").out
    assert "SwitchName=leaf1" in topo and "Nodes=c[1-4]" in topo
    assert "SwitchName=leaf2" in topo and "Nodes=c[5-8]" in topo
    assert "SwitchName=spine" in topo
    mine = cluster.gpuwarden("slurmctld", "slurm-conf", "--part", "topology.conf").check("gen").out
    assert "SwitchName=leaf2 Nodes=c[5-8]" in mine


@pytest.mark.versions
def test_shared_filesystem_is_the_same_on_every_node(cluster: Harness) -> None:
    token = f"fsx-{time.time_ns()}"
    cluster.exec("c1", ["sh", "-c", f"echo {token} > {JOBS_DIR}/{token}"]).check("write")
    assert cluster.exec("c8", ["cat", f"{JOBS_DIR}/{token}"]).check("read").out.strip() == token


@pytest.mark.versions
def test_s3_server_round_trips_an_object(cluster: Harness) -> None:
    cluster.exec("c5", [VENV_PYTHON, f"{SRC}/devcluster/s3probe.py"], timeout=30).check("s3")


@pytest.mark.versions
def test_bad_config_is_refused_with_exit_2_inside_the_cluster(cluster: Harness) -> None:
    res = cluster.sh("slurmctld", "printf '[slurm]\\nretries = \"x\"\\n' > /tmp/bad.toml && "
                     "GPUWARDEN_CONFIG=/tmp/bad.toml gpuwarden drain c2 --reason x")
    assert res.rc == 2 and "slurm.retries" in res.err
    assert "c2" not in sinfo_reasons(cluster)


def is_down(h: Harness, node: str) -> bool:
    state = node_state(h, node)
    return state.startswith("down") or "not_responding" in state


@pytest.mark.timeout(420)
def test_faults_kill_pause_and_cut_take_nodes_down_and_heal_brings_them_back(
    cluster: Harness,
) -> None:
    job = cluster.sbatch("-w", "c7", "--requeue", name="victim", wrap="sleep 600")
    cluster.wait_job(job, want=("RUNNING",), timeout=60)
    cluster.kill("c7")
    cluster.pause("c6")
    cluster.disconnect("c8")
    try:
        wait_for(lambda: all(is_down(cluster, n) for n in ("c6", "c7", "c8")), 150,
                 "c6 (paused), c7 (killed) and c8 (cut off) are marked down", interval=3)
        rec = cluster.wait_acct(job, "NODE_FAIL", timeout=60)
        assert rec.nodes == "c7"
    finally:
        for node in ("c6", "c7", "c8"):
            cluster.heal(node)
        cluster.exec("slurmctld", ["scancel", str(job)])
    wait_for(lambda: all(node_state(cluster, n) == "idle" for n in ("c6", "c7", "c8")), 150,
             "c6, c7 and c8 are idle again", interval=3)


@pytest.mark.versions
def test_the_clusters_slurm_conf_passes_gpuwardens_check(cluster: Harness) -> None:
    """What the admin guide tells a site to run, on this cluster's own slurm.conf (with Slurm
    as SlurmUser=slurm and the hooks installed from the wheel): nothing missing for any feature."""
    res = cluster.gpuwarden("slurmctld", "slurm-conf", "--check", "/etc/slurm/slurm.conf")
    assert res.rc == 0, res.out + res.err
    findings = [line.split()[0] for line in res.out.splitlines()[1:-1] if line.strip()]
    assert findings and set(findings) == {"ok"}, res.out
    owner = cluster.exec("slurmctld", ["ps", "-o", "user=", "-C", "slurmctld"]).check("ps").out
    assert owner.split() == ["slurm"]
