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


def run(h: Harness, say: Say) -> None:
    h.prepare_jobs_dir()
    foundation(h, say)
    say("Demo finished. `make cluster-down` removes the cluster.")
