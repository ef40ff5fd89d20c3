"""Driving the test cluster from tests and the demo: commands, jobs, and fault injection.

Every call has a deadline; nothing here can wait forever.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from devcluster.cluster import FSX_PATH, SRC, VENV_PYTHON, Cluster
from devcluster.exec import ExecResult
from gpuwarden.health.probe import healthy_fake
from gpuwarden.slurm import parse
from gpuwarden.slurm.models import AcctJob, Job

JOBS_DIR = f"{FSX_PATH}/jobs"
FAKE_DIR = "/var/lib/gpuwarden-fake"
CKPT_DIR = "/fsx/gpuwarden-ckpt"
# An objstore site has no shared directory: each host's own (the batch host's holds the output).
LOCAL_JOBS_DIR = "/srv/gpuwarden-jobs"
# A training step on fake GPUs, for jobs to `srun` (see docker-cluster/fake-gpu-job).
FAKE_JOB = f"{SRC}/docker-cluster/fake-gpu-job"
TRAIN_EXAMPLE = "/opt/gpuwarden/ckpt/train_example.py"
TRAIN_SBATCH = "/opt/gpuwarden/ckpt/train.sbatch"

# Run inside a node: edit the fake GPU file or append a kernel-log record in /dev/kmsg format.
_FAULT_SCRIPT = r"""
import json, sys, time
args = json.loads(sys.argv[1])
gpus_path, kmsg_path = args["dir"] + "/gpus.json", args["dir"] + "/kmsg"
if args["op"] == "set":
    doc = json.load(open(gpus_path))
    for g in doc["gpus"]:
        if g["index"] == args["gpu"]:
            g.update(args["fields"])
    if args.get("drop") is not None:
        doc["gpus"] = [g for g in doc["gpus"] if g["index"] != args["drop"]]
    open(gpus_path + ".tmp", "w").write(json.dumps(doc))
    import os; os.replace(gpus_path + ".tmp", gpus_path)
elif args["op"] == "xid":
    doc = json.load(open(gpus_path))
    bus = next(g["pci_bus_id"] for g in doc["gpus"] if g["index"] == args["gpu"])
    dom, b, dev = bus.lower().split(":")
    usec = int(float(open("/proc/uptime").read().split()[0]) * 1e6)
    line = "3,%d,%d,-;NVRM: Xid (PCI:%s:%s:%s): %d, pid=4242, name=python3, %s\n" % (
        usec % 100000, usec, dom[-4:], b, dev.split(".")[0], args["xid"], args["text"])
    open(kmsg_path, "a").write(line)
elif args["op"] == "raw":
    open(args["dir"] + "/" + args["file"], "w").write(args["text"])
"""
TERMINAL = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE",
})


class JobWaitError(AssertionError):
    pass


def wait_until(cond: Callable[[], bool], timeout: float, what: str, poll_s: float = 1.0) -> None:
    """For benchmarks run by hand: poll ``cond``; past ``timeout``, exit naming ``what``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(poll_s)


def job_status(job_id: int, job: Job | None) -> str:
    """A job's state as a progress line shows it: "job 12 PENDING (BeginTime)"."""
    if job is None or not job.state:
        return f"job {job_id}: not known to slurmctld yet"
    reason = job.state_reason if job.state_reason not in ("", "None") else ""
    return f"job {job_id} {','.join(job.state)}" + (f" ({reason})" if reason else "")


class Harness:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    # ---- commands ------------------------------------------------------------------------------
    def exec(self, host: str, argv: list[str], timeout: float = 60.0, user: str = "") -> ExecResult:
        return self.cluster.exec(host, argv, timeout=timeout, user=user)

    def sh(self, host: str, script: str, timeout: float = 60.0, user: str = "") -> ExecResult:
        return self.exec(host, ["bash", "-c", script], timeout=timeout, user=user)

    def gpuwarden(self, host: str, *args: str, timeout: float = 60.0) -> ExecResult:
        return self.exec(host, ["gpuwarden", *args], timeout=timeout)

    # ---- jobs ----------------------------------------------------------------------------------
    @property
    def jobs_dir(self) -> str:
        """Where jobs are submitted from and write their output (`sbatch`)."""
        return JOBS_DIR if self.cluster.spec.site == "fsx" else LOCAL_JOBS_DIR

    def prepare_jobs_dir(self) -> None:
        if self.cluster.spec.site != "fsx":
            for host in ["slurmctld", *self.cluster.spec.node_names]:
                self.exec(host, ["install", "-d", "-m", "1777", LOCAL_JOBS_DIR]).check(
                    f"mkdir jobs dir on {host}")
            return
        self.exec("slurmctld", ["install", "-d", "-m", "1777", JOBS_DIR]).check("mkdir jobs dir")
        # The shared checkpoint tier's spool: sticky, like /tmp; each job's directory is private.
        self.exec("slurmctld", ["install", "-d", "-m", "1777", CKPT_DIR]).check("mkdir ckpt")

    def sbatch(self, *args: str, wrap: str = "", script: Sequence[str] = (), user: str = "alice",
               name: str = "e2e", env: Mapping[str, str] | None = None) -> int:
        """Submit ``--wrap=wrap``, or ``script`` (a batch script's path and its arguments).

        ``env`` goes into sbatch's own environment, which the job inherits: in these containers
        ``--export=ALL,VAR=value`` makes slurmd die (clone() is refused under docker's seccomp
        profile), so variables are never passed that way.
        """
        if bool(wrap) == bool(script):
            raise ValueError("sbatch: give wrap or script, not both")
        tail = [f"--wrap={wrap}"] if wrap else list(script)
        argv = ["env", *(f"{k}={v}" for k, v in (env or {}).items()),
                "sbatch", "--parsable", f"--job-name={name}", f"--chdir={self.jobs_dir}",
                f"--output={self.jobs_dir}/%x-%j.out", *args, *tail]
        res = self.exec("slurmctld", argv, timeout=30, user=user).check("sbatch")
        return int(res.out.strip().split(";")[0])

    def job(self, job_id: int) -> Job | None:
        res = self.exec("slurmctld", ["scontrol", "show", "job", str(job_id), "--json"], timeout=20)
        if res.rc != 0:
            return None
        jobs = parse.parse_jobs(res.out)
        return jobs[0] if jobs else None

    def acct(self, job_id: int) -> list[AcctJob]:
        """Every accounting record of the job, one per run (a requeued job has several)."""
        res = self.exec("slurmctld", ["sacct", "-X", "--duplicates", "-j", str(job_id), "--json"],
                        timeout=20)
        if res.rc != 0:
            return []
        return [r for r in parse.iter_acct_jobs(res.out) if isinstance(r, AcctJob)]

    def wait_job(self, job_id: int, want: Iterable[str] = ("COMPLETED",),
                 timeout: float = 120.0, on_poll: Callable[[str], None] | None = None) -> Job:
        """Wait until the job reaches a terminal state; fail unless it is one of ``want``.
        ``on_poll`` hears the job's state at each look (for progress lines)."""
        wanted = set(want)
        deadline = time.monotonic() + timeout
        last: Job | None = None
        while time.monotonic() < deadline:
            last = self.job(job_id)
            state = last.state[0] if last and last.state else ""
            if on_poll is not None:
                on_poll(job_status(job_id, last))
            if state in wanted:
                return last  # type: ignore[return-value]
            if state in TERMINAL:
                raise JobWaitError(f"job {job_id} ended {state}, wanted {sorted(wanted)}: {last}")
            time.sleep(1.0)
        raise JobWaitError(f"job {job_id} not in {sorted(wanted)} after {timeout:.0f} s: {last}")

    def wait_acct(self, job_id: int, state: str, timeout: float = 60.0) -> AcctJob:
        """Wait until accounting (slurmdbd) has a record of the job in ``state``."""
        deadline = time.monotonic() + timeout
        last: list[AcctJob] = []
        while time.monotonic() < deadline:
            last = self.acct(job_id)
            for rec in last:
                if rec.state == state:
                    return rec
            time.sleep(1.0)
        raise JobWaitError(f"sacct: job {job_id} not {state} after {timeout:.0f} s: {last}")

    def submit_pairs(self, nodes: list[str], rounds: int = 1, name: str = "pair") -> list[int]:
        """Two-node GPU jobs running `fake-gpu-job` over every pair of ``nodes``, so each node
        shares runs with every other (one always paired with the same neighbour could not be
        told apart from it)."""
        jobs = []
        for _ in range(rounds):
            for i, a in enumerate(nodes):
                for b in nodes[i + 1:]:
                    jobs.append(self.sbatch("-N2", f"--nodelist={a},{b}", "--gpus-per-node=8",
                                            "--time=2", name=name, wrap=f"srun {FAKE_JOB}"))
        return jobs

    def wait_finished(self, jobs: list[int], timeout: float = 300.0,
                      on_poll: Callable[[str], None] | None = None) -> dict[int, str]:
        """Wait until accounting shows every job finished; each job's final state.
        ``on_poll`` hears how many have finished at each look (for progress lines)."""
        done: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        ids = ",".join(map(str, jobs))
        while time.monotonic() < deadline:
            out = self.exec("slurmctld", ["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j",
                                          ids], timeout=30).check("sacct").out
            for line in out.splitlines():
                jid, _, state = line.partition("|")
                word = state.split()[0] if state.split() else ""
                if jid.isdigit() and word in TERMINAL:
                    done[int(jid)] = word
            if len(done) == len(jobs):
                return done
            if on_poll is not None:
                on_poll(f"{len(done)} of {len(jobs)} jobs finished")
            time.sleep(3.0)
        raise JobWaitError(f"{len(jobs) - len(done)} of {len(jobs)} jobs not finished after "
                           f"{timeout:.0f} s")

    # ---- checkpointing (ckpt/train_example.py) ----------------------------------------------
    def train_reference(self, world: int, args: Sequence[str]) -> list[str]:
        """Per-rank checksums of an uninterrupted, checkpoint-free run of the same training."""
        res = self.exec("c1", [VENV_PYTHON, TRAIN_EXAMPLE, "--reference", str(world), *args],
                        timeout=120)
        return list(json.loads(res.check("reference run").out.strip().splitlines()[-1]))

    def train_finals(self, job: int, world: int) -> list[str]:
        """Per-rank checksums the job wrote when it finished."""
        return [self.exec("slurmctld", ["cat", f"{CKPT_DIR}/job-{job}/final-rank-{r}.txt"])
                .check("final checksum").out.strip() for r in range(world)]

    def shared_steps(self, job: int, rank: int) -> list[int]:
        """Steps of one rank on the shared tier (committed or being committed: a listing)."""
        out = self.sh("slurmctld", f"ls {CKPT_DIR}/job-{job}/rank-{rank:05d} 2>/dev/null "
                      "|| true").out.split()
        return sorted(int(n[5:]) for n in out if n.startswith("step-"))

    # ---- placement -----------------------------------------------------------------------------
    def job_fields(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as Key=Value pairs (NodeList, ExcNodeList, AdminComment, ...)."""
        out = self.exec("slurmctld", ["scontrol", "-o", "show", "job", str(job_id)],
                        timeout=20).check("scontrol show job").out
        fields: dict[str, str] = {}
        for part in out.strip().split(" "):
            key, eq, value = part.partition("=")
            if eq and key[:1].isupper():
                fields[key] = value
            elif fields:
                fields[list(fields)[-1]] += " " + part  # a value with spaces (AdminComment)
        return fields

    def ctld_log(self, since: float) -> str:
        """slurmctld's log (it runs in the foreground: the container's output) since a time."""
        data: bytes = self.container("slurmctld").logs(since=int(since), stdout=True,
                                                       stderr=True)
        return data.decode(errors="replace")

    def stop_placement_daemon(self) -> None:
        # "[g]": the pattern must not match the command line of this pkill's own parents.
        self.exec("slurmctld", ["pkill", "-f", "[g]puwarden placement daemon"])

    def start_placement_daemon(self) -> None:
        self.container("slurmctld").exec_run(
            ["bash", "-c", "gpuwarden placement daemon >> /var/log/gpuwarden-placement.log 2>&1"],
            detach=True)

    # ---- GPU faults (fake probe and kernel log) -------------------------------------------------
    def _fault(self, host: str, **args: object) -> None:
        payload = json.dumps({"dir": FAKE_DIR, **args})
        self.exec(host, [VENV_PYTHON, "-c", _FAULT_SCRIPT, payload], timeout=20).check("inject fault")

    def set_gpu(self, host: str, gpu: int, **fields: object) -> None:
        self._fault(host, op="set", gpu=gpu, fields=fields)

    def drop_gpu(self, host: str, gpu: int) -> None:
        self._fault(host, op="set", gpu=-1, fields={}, drop=gpu)

    def inject_xid(self, host: str, gpu: int, xid: int, text: str = "GPU has fallen off the bus.") -> None:
        self._fault(host, op="xid", gpu=gpu, xid=xid, text=text)

    def write_fake(self, host: str, file: str, text: str) -> None:
        """Overwrite gpus.json or kmsg with anything, garbage included."""
        self._fault(host, op="raw", file=file, text=text)

    def make_flaky(self, host: str, probability: float) -> None:
        """Steps of `fake-gpu-job` on ``host`` fail this often; health checks see nothing."""
        self.write_fake(host, "flaky", f"{probability}\n")

    def clear_gpu_faults(self, host: str) -> None:
        self.write_fake(host, "gpus.json", healthy_fake(self.cluster.spec.cluster.gpus_per_node))
        self.write_fake(host, "kmsg", "")
        self.write_fake(host, "flaky", "0\n")

    # ---- fault injection -----------------------------------------------------------------------
    def container(self, host: str) -> Any:
        return self.cluster.container(host)

    def stop(self, host: str, timeout: int = 10) -> None:
        self.container(host).stop(timeout=timeout)

    def kill(self, host: str, signal: str = "SIGKILL") -> None:
        self.container(host).kill(signal=signal)

    def start(self, host: str) -> None:
        self.container(host).start()

    def pause(self, host: str) -> None:
        self.container(host).pause()

    def unpause(self, host: str) -> None:
        self.container(host).unpause()

    def disconnect(self, host: str) -> None:
        """Cut the node off the cluster network (its processes keep running)."""
        self.cluster.client.networks.get(self.cluster.spec.network).disconnect(
            self.container(host), force=True)

    def reconnect(self, host: str) -> None:
        ip = self.cluster.spec.addresses()[host]
        self.cluster.client.networks.get(self.cluster.spec.network).connect(
            self.container(host), ipv4_address=ip, aliases=[host])

    def heal(self, host: str) -> None:
        """Undo any fault on ``host`` and hand it back to Slurm.

        slurmctld re-pings a node it marked DOWN only every few minutes; a restarted slurmd
        re-registers at once, so a paused or cut-off node is told to resume, as an operator
        would after fixing it (only Slurm's own "Not responding" reason is cleared).
        """
        c = self.container(host)
        c.reload()
        if c.status == "paused":
            c.unpause()
        elif c.status != "running":
            c.start()
        if self.cluster.spec.network not in c.attrs["NetworkSettings"]["Networks"]:
            self.reconnect(host)
        res = self.exec("slurmctld", ["scontrol", "show", "node", host, "--json"], timeout=20)
        nodes = parse.parse_nodes(res.out) if res.rc == 0 else []
        if nodes and nodes[0].down and nodes[0].reason == "Not responding":
            self.exec("slurmctld", ["scontrol", "update", f"nodename={host}", "state=resume"],
                      timeout=20)
