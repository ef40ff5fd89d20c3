"""`make demo`: a scenario on the running test cluster for each capability that has landed."""

from __future__ import annotations

from collections.abc import Callable

from gpuwarden.devcluster.harness import JOBS_DIR, Harness

Say = Callable[[str], None]


def _show(h: Harness, say: Say, title: str, argv: list[str], host: str = "slurmctld") -> str:
    res = h.exec(host, argv, timeout=60)
    say(f"$ {' '.join(argv)}")
    for line in (res.out + res.err).rstrip().splitlines():
        say(f"    {line}")
    if title:
        say("")
    return res.out


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
        "(Slurm holds a requeued job back about 2 minutes)...")
    h.wait_job(job, timeout=300)
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


def run(h: Harness, say: Say) -> None:
    h.prepare_jobs_dir()
    foundation(h, say)
    health(h, say)
    say("Demo finished. `make cluster-down` removes the cluster.")
