"""Issue 4's proof in the real cluster: a node that fails jobs now and then, while its health
checks pass, is found in Slurm's own accounting and drained with the jobs as evidence."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from devcluster.harness import FAKE_JOB, Harness
from gpuwarden.slurm.hostlist import expand
from tests.e2e.test_foundation import wait_for
from tests.e2e.test_health import NODES, nodes, periodic

pytestmark = pytest.mark.timeout(900)
LEMON = "c6"


def scan(h: Harness, since: str, *extra: str) -> dict[str, object]:
    res = h.gpuwarden("slurmctld", "lemon", "scan", "--since", since, "--json", *extra,
                      timeout=120)
    assert res.rc == 0, res.out + res.err
    return json.loads(res.out)  # type: ignore[no-any-return]


def scan_recorded(h: Harness, since: str, runs: int) -> dict[str, object]:
    """The scan once slurmdbd holds all ``runs`` job records: slurmctld sends a job's end to
    slurmdbd asynchronously, so a scan right after the last job ends can miss it."""
    out: dict[str, object] = {}

    def recorded() -> bool:
        out.update(scan(h, since))
        return out["records"] == runs
    wait_for(recorded, 60, f"slurmdbd to record all {runs} job runs")
    return out


@pytest.fixture
def fleet(cluster: Harness) -> Iterator[Harness]:
    for n in NODES:
        cluster.clear_gpu_faults(n)
    assert not [n for n in nodes(cluster).values() if n.drained or n.down], \
        "the lemon test needs every node in service"
    yield cluster
    for n in NODES:
        cluster.clear_gpu_faults(n)
    if nodes(cluster)[LEMON].drained:
        cluster.gpuwarden("slurmctld", "resume", LEMON).check("resume the lemon")
    for user in USERS:
        cluster.exec("slurmctld", ["scancel", f"--user={user}"])


USERS = ("alice", "bob")
# Two job scripts that run the same thing: no single user or script carries the evidence.
SCRIPTS = (f"srun {FAKE_JOB}", f"srun --label {FAKE_JOB}")
# Nodes left free each round, two per leaf (c1-c4, c5-c8), so that each gang job fits one
# leaf and the flaky c6 runs with a different neighbour from round to round.
FREE = (("c1", "c2", "c5", "c6"), ("c3", "c4", "c6", "c7"), ("c1", "c3", "c6", "c8"))


def busy_rounds(h: Harness, rounds: int) -> list[int]:
    """Two-node jobs the scheduler places (nothing pinned by name), from two users and two
    scripts, on a cluster kept busy: each round pinned filler jobs hold four nodes, then two gang
    jobs are released at once onto the other four. Pinned jobs, and one user's or one script's
    jobs, are evidence the detector discounts by design (a user can aim them at a node)."""
    jobs: list[int] = []
    for r in range(rounds):
        free = FREE[r % len(FREE)]
        fillers = [h.sbatch("-w", n, "--gpus-per-node=8", "--time=2", name="filler",
                            wrap="sleep 600") for n in NODES if n not in free]
        for f in fillers:
            h.wait_job(f, want=("RUNNING",), timeout=60)
        user, script = USERS[r % 2], SCRIPTS[(r // 2) % 2]
        batch = [h.sbatch("--hold", "-N2", "--gpus-per-node=8", "--time=2", name="spread",
                          user=user, wrap=script) for _ in range(2)]
        h.exec("slurmctld", ["scontrol", "release", ",".join(map(str, batch))]).check("release")
        h.wait_finished(batch, timeout=240)
        h.exec("slurmctld", ["scancel", *map(str, fillers)]).check("cancel the fillers")
        h.wait_finished(fillers, timeout=60)
        jobs += batch + fillers
    return jobs


@pytest.mark.versions
def test_a_flaky_node_is_found_in_accounting_and_drained_with_its_jobs_as_evidence(
        fleet: Harness) -> None:
    h = fleet
    # A clean history flags nothing.
    clean_start = datetime.now(UTC).replace(microsecond=0)
    time.sleep(1)
    states = h.wait_finished(h.submit_pairs(NODES, rounds=1), timeout=240)
    assert set(states.values()) == {"COMPLETED"}
    clean = scan_recorded(h, clean_start.strftime("%Y-%m-%dT%H:%M:%S"), 28)
    assert [n["node"] for n in clean["nodes"] if n["lemon"]] == []  # type: ignore[attr-defined]

    # c6 turns flaky: its steps fail 95% of the time; its health checks still pass.
    h.make_flaky(LEMON, 0.95)
    periodic(h, LEMON)
    assert not nodes(h)[LEMON].drained
    # Every verdict must survive losing either user's runs (half the evidence): enough rounds
    # that half of them still convicts c6.
    flaky_jobs = busy_rounds(h, 24)
    states = h.wait_finished(flaky_jobs, timeout=420)
    failed = {j for j, s in states.items() if s == "FAILED"}
    on_lemon = {j for j in flaky_jobs if any(LEMON in expand(r.nodes) for r in h.acct(j))}
    assert failed and failed <= on_lemon, "only jobs that ran on c6 failed"

    scan_recorded(h, clean_start.strftime("%Y-%m-%dT%H:%M:%S"), 28 + len(flaky_jobs))
    result = scan(h, clean_start.strftime("%Y-%m-%dT%H:%M:%S"), "--drain")
    lemons = [n for n in result["nodes"] if n["lemon"]]  # type: ignore[attr-defined]
    assert [n["node"] for n in lemons] == [LEMON], result
    evidence = {e["job_id"] for e in lemons[0]["evidence"]}
    assert evidence and evidence <= failed
    assert result["drain"] == [{"node": LEMON, "action": "drained",  # type: ignore[comparison-overlap]
                                "detail": lemons[0]["summary"]}]

    node = nodes(h)[LEMON]
    assert node.drained
    assert node.reason.startswith(f"gpuwarden: lemon, {lemons[0]['failures']} of "
                                  f"{lemons[0]['jobs']} jobs failed, fleet rate ")
    drained = [n.name for n in nodes(h).values() if n.drained or n.down]
    assert drained == [LEMON], "no other node is drained"
    listed = h.gpuwarden("slurmctld", "lemon", "list", "--json").check("lemon list").out
    assert [e["node"] for e in json.loads(listed)["nodes"]] == [LEMON]

    # Health gating sees a healthy node but never resumes a lemon drain.
    h.write_fake(LEMON, "flaky", "0\n")
    for _ in range(3):
        periodic(h, LEMON)
    assert nodes(h)[LEMON].reason == node.reason

    # Repaired and resumed by the operator: the old evidence no longer counts against it.
    h.gpuwarden("slurmctld", "resume", LEMON).check("resume")
    def closed() -> bool:
        out = h.exec("slurmctld", [
            "sacctmgr", "-n", "-P", "show", "events", f"nodes={LEMON}",
            f"start={clean_start.strftime('%Y-%m-%dT%H:%M:%S')}", "format=Reason,TimeEnd",
        ]).check("events").out
        ends = [line.rpartition("|")[2] for line in out.splitlines()
                if line.startswith("gpuwarden: lemon")]
        return bool(ends) and "Unknown" not in ends
    wait_for(closed, 30, "the lemon drain's event to close")
    again = scan(h, clean_start.strftime("%Y-%m-%dT%H:%M:%S"))
    assert [n["node"] for n in again["nodes"] if n["lemon"]] == []  # type: ignore[attr-defined]
