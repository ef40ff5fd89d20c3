"""docs/admin-guide.md, followed on a plain Slurm site: the wheel installed by the guide's own
blocks, then a drain and a placed gang job.

The site (devcluster/site.py) is Debian's Slurm started from a site's own slurm.conf
(docker-cluster/site/), with none of the test cluster's templates, entrypoint or packages: the
packages the guide installs are removed first, so its `apt-get` lines fetch them from Debian's
archive. Each step runs the guide's marked block as it stands (the docs are parsed, not copied
here), so a guide edit that breaks an install breaks this test.

What the guide leaves to the admin, the test does the way the guide says, and nothing more:
- step 1: the wheel is built on the host by `devcluster.wheel` (pip wheel --no-deps,
  as the guide's block) and mounted at the guide's placeholder `/path/to/dist`;
- step 4's edit: `[cluster]` set to the site's nodes with `gpuwarden config set`, as the guide
  does it; on compute nodes, the `gpuwarden config set` block of testing-without-gpus.md's
  "A test node";
- steps 7 and 8: topology.conf and the merged slurm.conf copied to every host; the merge
  follows step 8's rules (`devcluster.guide.merge_slurm_conf`);
- step 6: the spool is made once, on the site's shared filesystem (every host mounts one
  directory at /fsx), and `shared_root` set on every host with the guide's `config set` block;
  its timer (like step 9's lemon timer) is not installed: `ckpt tidy` is run by hand where the
  test needs it.
These containers have no systemd: `/etc/systemd/system` is created for the unit's copy, and the
daemon is started by the guide's own block for sites without systemd (which must be the
installed unit's `ExecStart=`).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from devcluster import guide
from devcluster.site import HEAD, NODES, NODES_PER_LEAF, PlainSite
from devcluster.spec import Spec
from gpuwarden.slurm import hostlist

# Setting the site up runs apt-get on five hosts (Debian's archive) and the whole guide.
pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "admin-guide.md"
TEST_NODES = ROOT / "docs" / "testing-without-gpus.md"
UNIT = "/etc/systemd/system/gpuwarden-placement.service"
# The guide's step 6: the shared tier's spool.
_SHARED = re.search(r"^gpuwarden config set ckpt\.shared_root=(\S+)", guide.blocks(GUIDE)["ckpt-config"].text,
                    re.MULTILINE)
assert _SHARED, "the guide's ckpt-config block no longer sets ckpt.shared_root"
SHARED_ROOT = _SHARED.group(1)
# A job in any of these states is not over yet (or its epilog still runs).
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"}
CLUSTER = {"name": "site", "node_prefix": "gn", "nodes": len(NODES),
           "nodes_per_leaf": NODES_PER_LEAF, "gpus_per_node": 8, "gpu_type": "h100",
           "gpu_device_dir": "/opt/fakegpu", "cpus_per_node": 16, "real_memory_mb": 64000,
           "partition": "gpu"}


def run_block(site: PlainSite, host: str, block: guide.Block, timeout: float = 300) -> str:
    res = site.sh(host, block.text, timeout=timeout)
    if res.rc != 0:
        pytest.fail(f"the guide's block at {block.where} failed on {host} (exit {res.rc}):\n"
                    f"{block.text}\n--- stdout\n{res.out}\n--- stderr\n{res.err}\n"
                    f"{site.diagnostics()}", pytrace=False)
    return res.out + res.err


def on_hosts(hosts: list[str], step: Callable[[str], object]) -> None:
    """Run ``step`` on every host at once, as an admin's pdsh would; the first failure wins."""
    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        for f in [pool.submit(step, h) for h in hosts]:
            f.result()


def split_systemctl(block: guide.Block) -> tuple[guide.Block, guide.Block]:
    """The block before its `systemctl` line, and after it."""
    lines = block.text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("systemctl "))
    return (guide.Block(block.name, "\n".join(lines[:i]) + "\n", block.where),
            guide.Block(block.name, "\n".join(lines[i + 1:]) + "\n", block.where))


def start_without_systemd(site: PlainSite, host: str, block: guide.Block) -> None:
    """The guide's block for a site without systemd, which runs the installed unit's command."""
    unit = site.read(host, UNIT)
    starts = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStart=")]
    assert len(starts) == 1 and f"do {starts[0]};" in block.text, (unit, block.text)
    run_block(site, host, block)


def show_job(site: PlainSite, job_id: int) -> dict[str, Any]:
    res = site.exec(HEAD, ["scontrol", "show", "job", str(job_id), "--json"], timeout=20)
    jobs = json.loads(res.out)["jobs"] if res.rc == 0 else []
    return dict(jobs[0]) if jobs else {}


def wait_job(site: PlainSite, job_id: int, done: Callable[[dict[str, Any]], bool], what: str,
             timeout: float = 120) -> dict[str, Any]:
    job: dict[str, Any] = {}

    def probe() -> str:
        nonlocal job
        job = show_job(site, job_id)
        return "" if job and done(job) else \
            f"job {job_id} {job.get('job_state')} ({job.get('state_reason', '')})"

    site.wait_for(probe, f"job {job_id} {what}", timeout)
    return job


def sbatch(site: PlainSite, *args: str) -> int:
    res = site.exec(HEAD, ["sbatch", "--parsable", "--chdir=/tmp", "--output=/dev/null", *args],
                    user="alice").check("sbatch")
    return int(res.out.strip().split(";")[0])


def slurmd_started_after(site: PlainSite, since: int) -> str:
    """Empty once every node's slurmd started after ``since`` and the node is idle."""
    res = site.exec(HEAD, ["scontrol", "show", "nodes", "--json"], timeout=20)
    if res.rc != 0:
        return res.err.strip() or f"exit {res.rc}"
    late = [n["name"] for n in json.loads(res.out)["nodes"]
            if n["slurmd_start_time"]["number"] < since or n["state"] != ["IDLE"]]
    return f"slurmd not restarted or not idle on {late}" if late else ""


@pytest.fixture(scope="module")
def site(docker_client: object, cluster_spec: Spec) -> Iterator[PlainSite]:
    with tempfile.TemporaryDirectory(prefix="gwsite-") as work:
        # The site that goes with this session's cluster: sites of clusters side by side
        # have their own names and subnets.
        s = PlainSite(docker_client, ROOT, Path(work),
                      progress=lambda m: print(f"[site] {m}", file=sys.stderr),
                      name=cluster_spec.site_name, subnet=cluster_spec.site_subnet)
        try:
            s.up()
            yield s
        finally:
            s.down()


@pytest.fixture(scope="module")
def installed(site: PlainSite) -> PlainSite:
    """Steps 2 to 8 of the guide, in its order, on every host the step names."""
    steps = guide.blocks(GUIDE)
    test_node = guide.blocks(TEST_NODES)
    on_hosts(site.hosts, lambda host: run_block(site, host, steps["venv"]))
    run_block(site, HEAD, steps["venv-admin"])  # the admin host's lemon extra, from Debian
    for name in ("install-files", "config"):
        on_hosts(site.hosts, lambda host, name=name: run_block(site, host, steps[name]))
    # Step 4's "then set the keys": describe the site, and make the nodes test nodes; step 6's
    # spool once on the shared filesystem, its [ckpt] keys on every host.
    cluster = [f"cluster.{key}={value}" for key, value in CLUSTER.items()]
    for host in site.hosts:
        site.exec(host, ["gpuwarden", "config", "set", *cluster]).check(f"config set on {host}")
    on_hosts(NODES, lambda host: run_block(site, host, test_node["test-node-config"]))
    run_block(site, HEAD, steps["ckpt-spool"])
    on_hosts(site.hosts, lambda host: run_block(site, host, steps["ckpt-config"]))
    for host in site.hosts:
        site.exec(host, ["gpuwarden", "config", "check"]).check(f"config check on {host}")
    for host in NODES:
        run_block(site, host, test_node["test-node"])
        out = run_block(site, host, steps["selftest"])
        assert "fix:" not in out, out
    # Step 7 on the controller; then its topology.conf goes to every host, like slurm.conf.
    before, after = split_systemctl(steps["placement"])
    site.exec(HEAD, ["mkdir", "-p", "/etc/systemd/system"]).check("mkdir")  # no systemd here
    run_block(site, HEAD, before)
    start_without_systemd(site, HEAD, steps["placement-without-systemd"])
    # "run it again" until the daemon's first snapshot is there, as the guide says.
    site.wait_for(lambda: "" if "(fresh)" in run_block(site, HEAD, after) else "not fresh yet",
                  "`placement explain` to see a fresh snapshot", 60)
    topology = site.read(HEAD, "/etc/slurm/topology.conf")
    assert "SwitchName=leaf2 Nodes=gn[3-4]" in topology, topology
    # Step 8: the same merged slurm.conf on every host, checked, then applied.
    merged = guide.merge_slurm_conf(site.read(HEAD, "/etc/slurm/slurm.conf"),
                                    steps["slurm-conf-lines"])
    for host in site.hosts:
        site.write(host, "/etc/slurm/topology.conf", topology)
        site.write(host, "/etc/slurm/slurm.conf", merged)
    since = int(site.exec(HEAD, ["date", "+%s"]).check("date").out)
    run_block(site, HEAD, steps["apply"])

    def applied() -> str:
        conf = site.exec(HEAD, ["scontrol", "show", "config"], timeout=20).out
        if not re.search(r"^JobSubmitPlugins\s*=\s*\S*lua", conf, re.M):
            return "slurmctld runs without the lua job_submit plugin yet"
        return slurmd_started_after(site, since)

    site.wait_for(applied, "slurmctld and every slurmd restarted with the new lines", 180)
    # Step 8's last step: each node's health check once by hand, so that `gpuwarden nodes` has
    # every node's marker now rather than after HealthCheckInterval.
    print(f"[site] gpuwarden nodes before the health check by hand:\n"
          f"{site.exec(HEAD, ['gpuwarden', 'nodes']).out}", file=sys.stderr)
    on_hosts(NODES, lambda host: run_block(site, host, steps["healthcheck-once"]))
    shown = site.exec(HEAD, ["gpuwarden", "nodes"])
    assert shown.rc == 0 and "no health marker" not in shown.out + shown.err, \
        shown.out + shown.err
    return site


def test_the_guide_installs_a_wheel_that_runs_and_passes_its_own_checks(
        installed: PlainSite) -> None:
    site = installed
    for host in site.hosts:
        res = site.exec(host, ["gpuwarden", "--version"])
        assert res.rc == 0 and res.out.startswith("gpuwarden 0.1.0"), res.out + res.err
        # The hooks' interpreter is the venv's, from /etc/default/gpuwarden (step 3).
        defaults = site.read(host, "/etc/default/gpuwarden")
        assert "GPUWARDEN_PYTHON=/opt/gpuwarden/venv/bin/python3" in defaults
    # The admin host's lemon extra came from Debian's packages (step 2's table).
    res = site.exec(HEAD, ["/opt/gpuwarden/venv/bin/python3", "-c", "import msgspec, numpy"])
    assert res.rc == 0, res.err
    check = site.exec(HEAD, ["gpuwarden", "slurm-conf", "--check", "/etc/slurm/slurm.conf"])
    assert check.rc == 0, check.out + check.err
    conf = site.exec(HEAD, ["scontrol", "show", "config"]).out
    assert "/opt/gpuwarden/prolog/gpuwarden-prolog" in conf
    assert "topology/tree" in conf
    # The site's own scheduler option is kept beside gpuwarden's.
    assert re.search(r"SchedulerParameters\s*=\s*bf_continue,nohold_on_prolog_fail", conf), conf


def test_a_gang_job_is_placed_in_one_leaf_by_the_filter(installed: PlainSite) -> None:
    """gn1 is busy: first fit would take gn2 and gn3 across both leaves; the placement filter
    asks for one switch, and topology/tree finds it (gn3, gn4)."""
    site = installed
    busy = sbatch(site, "-w", "gn1", "--exclusive", "--wrap=sleep 600")
    gang = 0
    try:
        wait_job(site, busy, lambda j: j["job_state"] == ["RUNNING"], "running")
        gang = sbatch(site, "-N", "2", "--gpus-per-node=8", "--wrap=sleep 600")
        job = wait_job(site, gang, lambda j: j["job_state"] == ["RUNNING"], "running")
        assert "switches=1" in job["admin_comment"], job["admin_comment"]
        nodes = hostlist.expand(job["nodes"])
        leaves = {(int(n[2:]) - 1) // NODES_PER_LEAF for n in nodes}
        assert nodes == ["gn3", "gn4"] and len(leaves) == 1, job["nodes"]
    finally:
        site.exec(HEAD, ["scancel", str(busy), *([str(gang)] if gang else [])])


def shared_dirs(site: PlainSite) -> list[str]:
    """The job directories in the shared spool, as a node sees them."""
    res = site.exec(NODES[0], ["ls", "-A", SHARED_ROOT]).check(f"ls {SHARED_ROOT}")
    return sorted(res.out.split())


def test_the_shared_spool_drops_a_finished_jobs_empty_dir_and_keeps_a_requeued_ones(
        installed: PlainSite) -> None:
    """The prolog makes job-N in the shared spool for every job. One that never checkpoints
    leaves it empty: gone once the job is finished. A requeued job's stays through its
    requeue (its epilog ran); cancelled while requeued, no epilog runs: `ckpt tidy` (the
    guide's timer) removes it."""
    site = installed
    node = NODES[1]
    plain = sbatch(site, "-w", node, f"--wrap=test -d {SHARED_ROOT}/job-$SLURM_JOB_ID")
    job = wait_job(site, plain, lambda j: not ACTIVE & set(j["job_state"]), "finished")
    assert job["job_state"] == ["COMPLETED"], f"the prolog made no job dir: {job['job_state']}"
    site.wait_for(lambda: f"job-{plain} still there" if f"job-{plain}" in shared_dirs(site)
                  else "", f"the epilog to remove job-{plain} from {SHARED_ROOT}", 60)
    again = sbatch(site, "-w", node, "--requeue", "--wrap=sleep 600")
    try:
        wait_job(site, again, lambda j: j["job_state"] == ["RUNNING"], "running")
        # RUNNING comes while the prologs still run (PrologFlags=Alloc): wait for its dir.
        site.wait_for(lambda: "" if f"job-{again}" in shared_dirs(site) else "no dir yet",
                      f"the prolog to make job-{again} in {SHARED_ROOT}", 60)
        site.exec(HEAD, ["scontrol", "requeuehold", str(again)]).check("requeuehold")
        # Requeued and held, its epilog done (Slurm drops COMPLETING once every epilog ran).
        wait_job(site, again, lambda j: j.get("restart_cnt", 0) >= 1
                 and not {"RUNNING", "COMPLETING"} & set(j["job_state"]),
                 "requeued, epilog done")
        assert f"job-{again}" in shared_dirs(site)
    finally:
        site.exec(HEAD, ["scancel", str(again)])
    wait_job(site, again, lambda j: "CANCELLED" in j["job_state"], "cancelled")
    assert f"job-{again}" in shared_dirs(site)  # a pending job's cancel runs no epilog
    out = site.exec(HEAD, ["gpuwarden", "ckpt", "tidy"]).check("ckpt tidy").out
    assert f"job-{again}" in out and f"job-{again}" not in shared_dirs(site), out


def test_a_bad_node_fails_its_prolog_before_any_job_code_and_the_job_restarts_at_once(
        installed: PlainSite) -> None:
    """Issue 39, on the guide's own slurm.conf lines. A gang job lands on gn3 and gn4 (the one
    leaf with two free nodes: gn1 is busy); gn4's GPU has an Xid 79, so gn4's prolog drains
    it and fails. PrologFlags=Alloc,DeferBatch: every node's prolog runs at allocation and the
    batch script is sent only once all passed, so the script never ran on gn3. Requeued, the
    job has no leaf with two free nodes (gn2, gn3 are left), and the placement daemon has set
    the switch wait the filter gave it (300 s) to 0: it starts at once across both leaves."""
    site = installed
    bad = NODES[-1]
    site.wait_for(lambda: slurmd_started_after(site, 0), "every node idle again", 60)
    res = site.exec(bad, ["gpuwarden", "health", "inject", "xid", "79", "--gpu", "5"])
    assert res.rc == 0, res.out + res.err
    busy = sbatch(site, "-w", NODES[0], "--exclusive", "--wrap=sleep 600")
    job_id = 0
    reason = ""

    def drained() -> str:
        nonlocal reason
        out = site.exec(HEAD, ["sinfo", "-h", "-n", bad, "-o", "%t|%E"]).out.strip()
        state, _, reason = out.partition("|")
        return "" if state.startswith("drain") else f"{bad} {out}"

    def ran_on() -> list[str]:
        """The nodes where the job's batch script has run (it leaves a marker there)."""
        return [n for n in NODES
                if site.exec(n, ["test", "-e", f"/tmp/gw-ran-{job_id}"]).rc == 0]

    try:
        wait_job(site, busy, lambda j: j["job_state"] == ["RUNNING"], "running")
        job_id = sbatch(site, "-N", "2", "--gpus-per-node=8",
                        "--wrap=touch /tmp/gw-ran-$SLURM_JOB_ID; srun hostname")
        # Its prolog on gn4 drained gn4 and failed: Slurm requeued the job.
        job = wait_job(site, job_id, lambda j: j.get("restart_cnt", 0) >= 1, "requeued")
        assert "switches=1 wait=300s" in job["admin_comment"], job["admin_comment"]
        site.wait_for(drained, f"{bad} drained by gpuwarden", 60)
        assert reason.startswith("gpuwarden: prolog: xid 79 on GPU 5"), reason
        shown = site.exec(HEAD, ["gpuwarden", "nodes"]).out
        assert bad in shown and "xid 79" in shown, shown
        assert ran_on() == [], "the batch script ran before every node's prolog had passed"
        # The daemon relaxed the filter's switch wait while Slurm holds the requeued job.
        job = wait_job(site, job_id, lambda j: "switch wait relaxed" in j["admin_comment"],
                       "its switch wait relaxed", timeout=60)
        assert job["maximum_switch_wait_time"] == 0 and job["required_switches"] == 1, job
        assert job["job_state"] == ["PENDING"], job["job_state"]
        # Slurm holds a requeued job for cred_expire + 1 s (121 s here) before it may start;
        # the test lets it go now, as an admin may (the hold is not what is tested).
        site.exec(HEAD, ["scontrol", "update", f"jobid={job_id}", "StartTime=now"]).check(
            "release")
        # Well within what was left of its 300 s switch wait: it did not wait for one leaf.
        wait_job(site, job_id, lambda j: not ACTIVE & set(j["job_state"]), "restarted and done",
                 timeout=120)
        # Where it ran, from accounting: a COMPLETING job's node list shrinks as each node's
        # epilog ends, so scontrol may name one node of the two.
        where = ""

        def accounted() -> str:
            nonlocal where
            where = site.exec(HEAD, ["sacct", "-n", "-X", "-P", "-j", str(job_id),
                                     "-o", "NodeList"]).out.strip()
            return "" if where.startswith("gn") else f"sacct says {where!r}"

        site.wait_for(accounted, f"accounting to record where job {job_id} ran", 60)
        nodes = hostlist.expand(where)
        assert nodes == ["gn2", "gn3"], where
        # RUNNING comes before the script: the prologs run first (reason Prolog), so wait
        # for its marker, then check it ran on the batch host alone.
        site.wait_for(lambda: "" if ran_on() else "no marker yet", "the batch script to run", 60)
        assert ran_on() == ["gn2"]  # once every node's gate had passed: on the batch host
    finally:
        site.exec(HEAD, ["scancel", str(busy), *([str(job_id)] if job_id else [])])
        site.exec(bad, ["gpuwarden", "health", "inject", "clear"])
