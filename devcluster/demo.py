"""`make demo`: a scenario on the running test cluster for each capability that has landed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from devcluster.harness import JOBS_DIR, TRAIN_SBATCH, Harness
from devcluster.progress import waiting

Say = Callable[[str], None]

# Where scenario 6 writes its simulated month on the slurmctld container: root's own
# directory (the demo runs its commands as root), not a name anyone may take first in /tmp.
FLEET_DIR = "/root/gpuwarden-demo-fleet"


def shown(text: str, limit: int | None = None) -> list[str]:
    """A command's output as the demo prints it: indented, and cut after ``limit`` lines with
    a line saying how many more there were."""
    lines = [f"    {line}" for line in text.rstrip().splitlines()]
    if limit is None or len(lines) <= limit:
        return lines
    return [*lines[:limit], f"    ... ({len(lines) - limit} more lines)"]


def _show(h: Harness, say: Say, title: str, argv: list[str], host: str = "slurmctld",
          limit: int | None = None, wait: tuple[str, float] | None = None,
          timeout: float = 60) -> str:
    """Run a command on ``host`` and print it with its output. ``wait`` (what, usual seconds)
    shows progress while a slow one runs; a non-empty ``title`` ends with a blank line."""
    say(f"$ {' '.join(argv)}")
    if wait is None:
        res = h.exec(host, argv, timeout=timeout)
    else:
        with waiting(wait[0], wait[1]):
            res = h.exec(host, argv, timeout=timeout)
    for line in shown(res.out + res.err, limit):
        say(line)
    if title:
        say("")
    return res.out


def detection(scan_json: str, truth_json: str) -> str:
    """How the scan's verdicts compare with the lemons the simulator planted (truth.json)."""
    flagged = {n["node"] for n in json.loads(scan_json)["nodes"] if n.get("lemon")}
    truth = set(json.loads(truth_json)["lemons"])
    found = len(flagged & truth)
    wrong = sorted(flagged - truth)
    return (f"The simulator planted {len(truth)} lemons (truth.json); the scan flagged "
            f"{len(flagged)}: {found} of the {len(truth)}"
            + (f", and {len(wrong)} ordinary node(s) ({', '.join(wrong[:5])})" if wrong else
               ", and no ordinary node") + ".")


def foundation(h: Harness, say: Say) -> None:
    say("== 1. The cluster: Slurm 24.11, 8 nodes x 8 fake H100s, two leaf switches ==")
    _show(h, say, "", ["sinfo"])
    _show(h, say, "x", ["scontrol", "show", "topology"])

    say("== 2. A 2-node, 16-GPU job runs and is recorded by slurmdbd ==")
    job = h.sbatch("-N2", "--gpus-per-node=8", name="demo-2node",
                   wrap="srun bash -c 'echo $(hostname): $SLURM_GPUS_ON_NODE GPUs'")
    h.wait_job(job, timeout=120)
    h.wait_acct(job, "COMPLETED", timeout=60)
    _show(h, say, "", ["cat", f"{JOBS_DIR}/demo-2node-{job}.out"], host="c1")
    _show(h, say, "x", ["sacct", "-X", "-j", str(job), "-o", "JobID,JobName,State,NodeList,AllocTRES%40"])

    say("== 3. Drains carry a namespaced reason; gpuwarden never touches an operator's drain ==")
    _show(h, say, "", ["gpuwarden", "drain", "c3", "--reason", "demo: xid 79 on GPU 5"])
    _show(h, say, "", ["scontrol", "update", "nodename=c4", "state=drain", "reason=maintenance"])
    _show(h, say, "", ["sinfo", "-R"])
    _show(h, say, "", ["gpuwarden", "nodes"])
    _show(h, say, "", ["gpuwarden", "resume", "c4"])
    _show(h, say, "", ["gpuwarden", "resume", "c3"])
    h.exec("slurmctld", ["scontrol", "update", "nodename=c4", "state=resume"])
    say("(the operator resumes c4 by hand: gpuwarden left it alone)")
    say("")


def health(h: Harness, say: Say) -> None:
    say("== 4. Health gating: a GPU falls off the bus; no second job lands on that node ==")
    blockers = [h.sbatch("-w", n, "--exclusive", name="demo-blocker", wrap="sleep 600")
                for n in ("c1", "c2")]
    for b in blockers:
        h.wait_job(b, want=("RUNNING",), timeout=60)
    say("c1 and c2 are busy, so the next job lands on c3. Injecting XID 79 on c3's GPU 5:")
    h.inject_xid("c3", 5, 79)
    _show(h, say, "", ["tail", "-n1", "/var/lib/gpuwarden-fake/kmsg"], host="c3")
    job = h.sbatch("-N1", "--gpus-per-node=8", name="demo-victim", wrap="hostname")
    say(f"submitted job {job}; its prolog on c3 fails, c3 is drained and Slurm requeues the job "
        "(Slurm holds a requeued job back for cred_expire + 1 s: 31 s here, 121 s by default)")
    with waiting(f"job {job}: drain, requeue, hold, run elsewhere", 45) as w:
        h.wait_job(job, timeout=300, on_poll=w.note)
    h.wait_acct(job, "COMPLETED", timeout=60)
    _show(h, say, "", ["sacct", "-X", "--duplicates", "-j", str(job), "-o",
                       "JobID,JobName,State,NodeList,Restarts"])
    _show(h, say, "", ["sinfo", "-R"])
    _show(h, say, "", ["gpuwarden", "health", "check"], host="c3")
    say("The fault is repaired; after 2 passing health checks c3 returns to service:")
    h.clear_gpu_faults("c3")
    for _ in range(2):
        _show(h, say, "", ["/opt/gpuwarden/prolog/gpuwarden-healthcheck"], host="c3")
    _show(h, say, "x", ["sinfo", "-n", "c3"])
    for b in blockers:
        h.exec("slurmctld", ["scancel", str(b)])


def lemons(h: Harness, say: Say) -> None:
    say("== 5. Lemon nodes: c6 fails jobs now and then while its health checks pass ==")
    nodes = [f"c{i}" for i in range(1, 9)]
    start = h.exec("slurmctld", ["date", "-u", "+%Y-%m-%dT%H:%M:%S"]).check("date").out.strip()
    h.make_flaky("c6", 0.95)
    _show(h, say, "", ["/opt/gpuwarden/prolog/gpuwarden-healthcheck"], host="c6")
    jobs = h.submit_pairs(nodes, rounds=2, name="demo-pair")
    say(f"submitted {len(jobs)} two-node jobs, one for each pair of nodes, twice")
    with waiting(f"{len(jobs)} two-node jobs on 8 nodes", 40) as w:
        states = h.wait_finished(jobs, timeout=600, on_poll=w.note)
    failed = sum(1 for s in states.values() if s != "COMPLETED")
    say(f"{len(jobs) - failed} COMPLETED, {failed} FAILED. Which node is to blame? Slurm's "
        "accounting knows:")
    _show(h, say, "", ["gpuwarden", "lemon", "scan", "--since", start, "--drain"])
    _show(h, say, "", ["sinfo", "-R"])
    _show(h, say, "", ["gpuwarden", "lemon", "list"])
    say("Health gating sees c6 healthy, but leaves the lemon drain alone:")
    h.write_fake("c6", "flaky", "0\n")
    _show(h, say, "", ["/opt/gpuwarden/prolog/gpuwarden-healthcheck"], host="c6")
    _show(h, say, "", ["sinfo", "-n", "c6", "-o", "%N %t %E"])
    _show(h, say, "x", ["gpuwarden", "resume", "c6"])
    say("(A few minutes of demo jobs are no basis for an MTTF: a rate needs months of node "
        "time. Scenario 6 runs `gpuwarden fleet mttf` on a month of a 2,000-node fleet.)")
    say("")


def fleet_history(h: Harness, say: Say) -> None:
    say("== 6. A month of a 2,000-node fleet: lemons found, MTTF by job size beside Meta's "
        "published figures ==")
    say("`gpuwarden simulate` writes a month of a 2,000-node, 16,000-GPU fleet as the exports "
        "a site makes (docs/lemons.md): one `sacct --json` file a day and `sacctmgr show "
        "events`. Its failure rates are solved so that the fleet reproduces Meta's published "
        "figures; 1.2% of its nodes are lemons.")
    sacct, events = f"{FLEET_DIR}/sacct", f"{FLEET_DIR}/events.txt"
    h.exec("slurmctld", ["rm", "-rf", FLEET_DIR]).check("clear the demo's fleet directory")
    _show(h, say, "", ["gpuwarden", "simulate", "--nodes", "2000", "--days", "30", "--out",
                       FLEET_DIR, "--no-compare"],
          wait=("simulating 30 days of 2,000 nodes", 5), timeout=300)
    _show(h, say, "", ["head", "-n", "3", events])
    say("The lemon scan reads it as it reads a site's export (the first lemons, with their "
        "evidence):")
    _show(h, say, "", ["gpuwarden", "lemon", "scan", "--from", sacct, "--events", events],
          limit=18, wait=("scanning 51,000 job records", 5), timeout=300)
    with waiting("the same scan, as JSON, to check it against truth.json", 5):
        scan = h.exec("slurmctld", ["gpuwarden", "lemon", "scan", "--from", sacct, "--events",
                                    events, "--json"], timeout=300).check("lemon scan --json")
    truth = h.exec("slurmctld", ["cat", f"{FLEET_DIR}/truth.json"]).check("truth.json")
    say(detection(scan.out, truth.out))
    say("")
    say("MTTF by job size from the same month, its projection to larger jobs, and the "
        "checkpoint interval, with Meta's published figures beside ours:")
    _show(h, say, "x", ["gpuwarden", "fleet", "mttf", "--from", sacct, "--events", events],
          wait=("reading 30 days of accounting", 4), timeout=300)
    say("(`gpuwarden simulate` without --no-compare also runs a second month with the flagged "
        "lemons drained, and sets the >=512-GPU failure rate beside the paper's 14% -> 4%.)")
    say("")


def placement(h: Harness, say: Say) -> None:
    say("== 7. Placement: gang jobs packed into one leaf switch (job_submit.lua + daemon) ==")
    _show(h, say, "", ["scontrol", "show", "topology"])
    c5 = h.sbatch("-w", "c5", "--exclusive", name="demo-busy", wrap="sleep 600")
    c1 = h.sbatch("-w", "c1", "--exclusive", name="demo-busy", wrap="sleep 600")
    for b in (c5, c1):
        h.wait_job(b, want=("RUNNING",), timeout=60)
    say("c1 and c5 are busy: no leaf has 4 free nodes. Slurm alone would start a 4-node job at "
        "once across both leaves. What the filter will do:")
    _show(h, say, "", ["gpuwarden", "placement", "explain", "-N", "4"])
    job = h.sbatch("-N4", "--gpus-per-node=8", name="demo-gang", wrap="srun hostname")
    time.sleep(4)
    _show(h, say, "", ["squeue", "-j", str(job), "-o", "%i %j %T %r %N"])
    say("It waits for one leaf (up to the policy's 60 s here). c1's job ends:")
    h.exec("slurmctld", ["scancel", str(c1)])
    h.wait_job(job, timeout=120)
    fields = h.job_fields(job)
    say(f"    job {job}: NodeList={fields.get('NodeList')} Switches={fields.get('Switches')}")
    say(f"    AdminComment={fields.get('AdminComment')}")
    h.exec("slurmctld", ["scancel", str(c5)])
    say("")


def checkpointing(h: Harness, say: Say) -> None:
    say("== 8. Tiered checkpointing: a 4-node training job loses a node and loses nothing ==")
    args = ["--steps", "60", "--every", "5", "--mb", "8"]
    expected = h.train_reference(4, args)
    job = h.sbatch("-N4", "--gpus-per-node=8", name="train", script=[TRAIN_SBATCH, *args])
    say(f"$ sbatch -N4 --gpus-per-node=8 ckpt/train.sbatch {' '.join(args)}    # job {job}")
    deadline = time.monotonic() + 180
    with waiting(f"job {job}: starting and checkpointing step 10", None):
        while 10 not in h.shared_steps(job, 3) and time.monotonic() < deadline:
            time.sleep(1)
    first = h.exec("slurmctld", ["scontrol", "show", "hostnames",
                                 h.job_fields(job)["NodeList"]]).out.split()
    say(f"Running on {','.join(first)}; every rank saves to node memory, a partner node's "
        "memory and /fsx:")
    _show(h, say, "", ["gpuwarden", "ckpt", "ls", f"job-{job}", "--rank", "3"], host=first[-1])
    victim = first[-1]
    say(f"$ docker kill {victim}    # the node dies, and its memory with it")
    h.kill(victim)
    try:
        deadline = time.monotonic() + 180
        with waiting(f"Slurm notices {victim} is gone (SlurmdTimeout=30 s) and requeues job "
                     f"{job}", 40) as w:
            while time.monotonic() < deadline:
                fields = h.job_fields(job)
                if fields.get("Restarts", "0") != "0":
                    break
                w.note(f"job {job} {fields.get('JobState', '?')}")
                time.sleep(2)
        say("Slurm requeued the job; the prolog on the new nodes stages the newest step every "
            "rank holds into their memory; the ranks resume:")
        with waiting(f"job {job}: requeue hold, stage-in, restore, train to step 60", 50) as w:
            h.wait_job(job, timeout=400, on_poll=w.note)
    finally:
        h.heal(victim)
    out = h.exec("slurmctld", ["cat", f"{JOBS_DIR}/train-{job}.out"]).out
    for line in out.splitlines():
        if line.startswith(("gpuwarden:", "srun: error")) or (
                "restored step" in line and "rank" in line and "INFO" not in line
                and " gpuwarden." not in line):
            say(f"    {line}")
    finals = h.train_finals(job, 4)
    same = "yes" if finals == expected else f"NO: {finals} vs {expected}"
    say(f"Final state bit-identical to an uninterrupted run: {same}")
    say("")


SPARES_SBATCH = "/opt/gpuwarden/ckpt/train_spares.sbatch"


def spares(h: Harness, say: Say) -> None:
    say("== 9. Hot spares: the same loss, and no requeue ==")
    say("`SPARES=1 sbatch -N4 ckpt/train_spares.sbatch`: `gpuwarden launch` trains on 3 nodes "
        "and keeps the 4th idle; every rank beats once a second. A rank silent for 5 s has "
        "lost its node: the step restarts on the survivors plus the spare, which restores its "
        "rank from the partner's replica.")
    args = ["--steps", "60", "--every", "5", "--mb", "8"]
    expected = h.train_reference(3, args)
    log = f"{JOBS_DIR}/launch-demo-{int(time.time())}.jsonl"
    job = h.sbatch("-N4", "--gpus-per-node=8", name="train", script=[SPARES_SBATCH, *args],
                   env={"SPARES": "1", "LAUNCH_OPTS": f"--deadline-s 5 --events {log}"})
    say(f"$ SPARES=1 sbatch -N4 --gpus-per-node=8 ckpt/train_spares.sbatch {' '.join(args)}"
        f"    # job {job}")
    deadline = time.monotonic() + 180
    with waiting(f"job {job}: starting and checkpointing step 10", None):
        while 10 not in h.shared_steps(job, 2) and time.monotonic() < deadline:
            time.sleep(1)
    nodes = h.exec("slurmctld", ["scontrol", "show", "hostnames",
                                 h.job_fields(job)["NodeList"]]).out.split()
    victim = nodes[1]
    say(f"Training on {','.join(nodes[:3])}, {nodes[3]} idle. $ docker kill {victim}"
        "    # the launcher's events below, timed from the kill")
    killed = time.time()
    h.kill(victim)
    try:
        with waiting(f"job {job}: the launcher notices, relaunches, trains to step 60", 40) as w:
            h.wait_job(job, timeout=400, on_poll=w.note)
    finally:
        h.heal(victim)
    text = h.exec("slurmctld", ["cat", log]).out
    seen = [json.loads(line) for line in text.splitlines() if line.strip()]
    for e in seen:
        if e["event"] in ("lost", "step_started", "training"):
            rest = {k: v for k, v in e.items() if k not in ("t", "mono", "event")}
            say(f"    {float(e['t']) - killed:+6.1f} s  {e['event']}: {json.dumps(rest)[:110]}")
    restarts = h.job_fields(job).get("Restarts", "?")
    finals = h.train_finals(job, 3)
    same = "yes" if finals == expected else f"NO: {finals} vs {expected}"
    say(f"Requeues: {restarts}. Final state bit-identical to an uninterrupted run: {same}")
    say("(benchmarks/spares_recovery.py measures both paths: 8.3 s vs 99.4 s here.)")
    say("")


# Where `make demo` leaves the fleet reports on this machine (the repository's build/).
REPORT_DIR = Path("build/demo")


def reports(h: Harness, say: Say) -> None:
    say("== 10. The fleet report: where the GPU hours went, and what each design choice would "
        "change ==")
    say("`gpuwarden report` turns the accounting into one self-contained HTML page (every "
        "figure also in --json): of this cluster's last day, after the scenarios above, and of "
        "the simulated month of scenario 6.")
    out = "/root/gpuwarden-demo-report"
    h.exec("slurmctld", ["install", "-d", "-m", "700", out]).check("report directory")
    sacct, events = f"{FLEET_DIR}/sacct", f"{FLEET_DIR}/events.txt"
    # The cluster's own leaves for the placement card; the simulated fleet has none.
    runs = {"cluster": ["--since", "1d", "--topology", "/etc/slurm/topology.conf"],
            "fleet-month": ["--from", sacct, "--events", events]}
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    for name, args in runs.items():
        _show(h, say, "", ["gpuwarden", "report", *args, "-o", f"{out}/{name}.html", "--json",
                           f"{out}/{name}.json"],
              wait=(f"the {name} report", 5), timeout=300)
        for ext in ("html", "json"):
            text = h.exec("slurmctld", ["cat", f"{out}/{name}.{ext}"]).check(f"{name}.{ext}").out
            (REPORT_DIR / f"{name}.{ext}").write_text(text, encoding="utf-8")
    say(f"Open them here: {(REPORT_DIR / 'cluster.html').resolve()} and "
        f"{(REPORT_DIR / 'fleet-month.html').resolve()} (docs/report.md says what each figure "
        "is).")
    say("")


def run(h: Harness, say: Say) -> None:
    h.prepare_jobs_dir()
    foundation(h, say)
    health(h, say)
    lemons(h, say)
    fleet_history(h, say)
    placement(h, say)
    checkpointing(h, say)
    spares(h, say)
    reports(h, say)
    say("Demo finished. `make cluster-down` removes the cluster.")
